"""One client must never kill, stall or bloat ``lmserve serve``: each body a hostile probe sent to
the real server process gets its 4xx naming the limit, while another client's ordinary request
is answered within a stated time; resident memory follows the KV in use."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time

import httpx
import pytest

from server_process import ServerProcess, metric, wait_until_idle
from tiny_models import make_hf_llama

MODEL = "tiny"
CONTEXT = 1024
PAGE = 64
STOP_LIMIT = 1024
TIMEOUT_S = 2.0  # --header-timeout and --body-timeout
ORDINARY_S = 5.0  # an ordinary request of another client is answered within this


@pytest.fixture(scope="module")
def kv_heavy_model_dir(tmp_path_factory) -> str:
    """A random model whose KV pages are big (128 KiB: 2 layers x 4 KV heads x 64 dims x 64
    tokens, keys and values in bfloat16), so that the memory they take shows in the RSS."""
    return make_hf_llama(str(tmp_path_factory.mktemp("kv_heavy") / "model"), num_layers=2,
                         hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=4, seed=5)


@pytest.fixture(scope="module")
def server(kv_heavy_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", kv_heavy_model_dir, "--served-model-name", MODEL, "--mode", "server",
                        "--max-total-sequence-length", "400000", "--max-single-sequence-length",
                        str(CONTEXT), "--kv-cache-page-size", str(PAGE), "--max-num-sequence", "128",
                        "--max-waiting", "512", "--max-seqs-per-request", "64",
                        "--prefix-cache-max-num-recycling-seqs", "4",
                        "--header-timeout", str(TIMEOUT_S),
                        "--body-timeout", str(TIMEOUT_S), "--keep-alive-timeout", str(TIMEOUT_S)],
                       log) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


def rss_mib(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def assert_error(r: httpx.Response, status: int, param=None, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def ordinary_request_time(base_url: str) -> float:
    start = time.monotonic()
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60.0)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


async def _with_ordinary_request(base_url: str, hostile) -> tuple[list, float]:
    """Run the hostile coroutines; meanwhile, once they are under way, time an ordinary request."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0,
                                 limits=httpx.Limits(max_connections=64)) as client:
        tasks = [asyncio.ensure_future(h(client)) for h in hostile]
        await asyncio.sleep(0.3)
        elapsed = await asyncio.to_thread(ordinary_request_time, base_url)
        return await asyncio.gather(*tasks), elapsed


# -- 1. stop strings ---------------------------------------------------------------------------

def test_a_stop_string_over_the_limit_is_a_400_naming_it(server, http):
    before = rss_mib(server)
    start = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stop": "x" * 500_000})
    assert_error(r, 400, "stop", "500000 characters", str(STOP_LIMIT))
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stop": ["y" * 600] * 2})
    assert_error(r, 400, "stop", "1200 characters", str(STOP_LIMIT))  # the limit is on all of them
    assert time.monotonic() - start < 5.0
    assert rss_mib(server) - before < 50


def test_long_stop_strings_within_the_limit_do_not_stall_other_clients(server):
    quarter = STOP_LIMIT // 4
    stops = ["ab" * (quarter // 2), "a" * quarter, "b" * quarter, "ba" * (quarter // 2)]

    async def long_stops(client):
        body = {"prompt": "a b a b", "max_tokens": 300, "ignore_eos": True, "n": 4, "stop": stops}
        return (await client.post("/v1/completions", json=body)).status_code

    statuses, elapsed = asyncio.run(_with_ordinary_request(server.base_url, [long_stops] * 4))
    assert statuses == [200] * 4
    assert elapsed < ORDINARY_S


# -- 2. resident memory --------------------------------------------------------------------------

def kv_rss_mib(server: ServerProcess) -> tuple[float, float]:
    """Resident and mapped MiB of the KV pool: the anonymous mappings of at least 128 MiB.

    The pool is one anonymous map per layer's keys and values (4 of 195 MiB here: 400000 tokens
    x 4 KV heads x 64 dims in bfloat16), which the kernel may merge into one; nothing else this
    process maps is that large (glibc's thread arenas reserve 64 MiB each)."""
    rss = size = 0.0
    with open(f"/proc/{server.proc.pid}/smaps") as f:
        mapping = None
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                anonymous = len(fields) == 5
                mapping = (hi - lo) / 2**20 if anonymous and hi - lo >= 128 * 2**20 else None
                if mapping:
                    size += mapping
            elif fields[0] == "Rss:" and mapping:
                rss += int(fields[1]) / 1024
    return rss, size


def test_resident_memory_follows_the_kv_in_use(server):
    async def many_short(client, offset):
        for i in range(50):
            body = {"prompt": [offset + i, 5, 6, 7], "max_tokens": 4}
            assert (await client.post("/v1/completions", json=body)).status_code == 200

    async def burst(client, offset):  # 128 sequences of 9 pages, each its own: 144 MiB of KV
        prompts = [[offset + i] + [9] * 399 for i in range(128)]
        requests = [client.post("/v1/completions", json={"prompt": prompts[k::8], "max_tokens": PAGE * 2,
                                                         "ignore_eos": True}) for k in range(8)]
        return [r.status_code for r in await asyncio.gather(*requests)]

    async def run(*jobs):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300.0,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(job(client) for job in jobs))

    async def sampled_burst(client, offset) -> float:
        """The burst, returning the most KV resident while it ran (sampled every 0.1 s): the
        first sequences to finish may give their pages back before the last one does."""
        task, peak = asyncio.ensure_future(burst(client, offset)), 0.0
        while not task.done():
            peak = max(peak, kv_rss_mib(server)[0])
            await asyncio.sleep(0.1)
        assert task.result() == [200] * 8
        return peak

    def kv_settled(before: float, timeout: float = 30.0) -> float:
        """KV resident once back within 16 MiB of ``before`` (pages free for 5 s go back)."""
        deadline = time.monotonic() + timeout
        while kv_rss_mib(server)[0] - before > 16 and time.monotonic() < deadline:
            time.sleep(0.5)
        return kv_rss_mib(server)[0]

    def short_requests(offset: int) -> None:  # 800 of one page each, 16 at a time
        asyncio.run(run(*(lambda c, k=k: many_short(c, offset + 50 * k) for k in range(16))))

    assert kv_rss_mib(server)[1] >= 4 * 195, "the KV pool's mappings were not found"
    # A first burst and wave of short requests bring the rest of the process to its high-water
    # marks (activations of a 128-sequence step, the prefix cache's recycled sequences, the
    # malloc arenas of the threads that serve 16 connections), so that the loose whole-process
    # bound at the end measures what traffic leaves behind.
    assert asyncio.run(run(lambda c: burst(c, 1000))) == [[200] * 8]
    short_requests(2000)
    wait_until_idle(server.base_url)
    time.sleep(8)
    before_kv, before = kv_rss_mib(server)[0], rss_mib(server)

    # The free-page list handed out the oldest free page, so each of many short requests touched
    # a new page: these 800 one-page requests walked 56 MiB of KV into the RSS (1 MiB now).
    short_requests(3000)
    wait_until_idle(server.base_url)
    assert kv_rss_mib(server)[0] - before_kv < 16, "sequential short requests must reuse warm pages"

    [peak_kv] = asyncio.run(run(lambda c: sampled_burst(c, 5000)))
    wait_until_idle(server.base_url)
    # some 70 MiB at once: the first sequences finish before the last ones are prefilled
    assert peak_kv - before_kv > 32, "the burst's KV should have shown in the RSS"
    after_kv = kv_settled(before_kv)
    assert after_kv - before_kv < 16, f"KV resident {before_kv:.0f} -> {peak_kv:.0f} -> {after_kv:.0f} MiB"
    # glibc keeps up to some 40 MiB of its thread arenas for a while after a burst
    after = rss_mib(server)
    assert after - before < 64, f"RSS {before:.0f} -> {after:.0f} MiB with the KV given back"


# -- 3. amplification ----------------------------------------------------------------------------

def test_a_request_is_weighed_by_prompts_times_n(server, http):
    r = http.post("/v1/completions", json={"prompt": ["tell me"] * 64, "n": 16, "max_tokens": 256})
    assert_error(r, 400, "n", "1024 sequences", "64 prompt(s) x n=16", "at most 64")
    start = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": ["x"] * 20_000, "max_tokens": 1})
    assert_error(r, 400, "prompt", "20000 sequences")
    assert time.monotonic() - start < 5.0
    assert http.post("/v1/completions", json={"prompt": ["x"] * 8, "n": 8, "max_tokens": 1}).status_code == 200
    assert_error(http.post("/v1/completions", json={"prompt": ["x"] * 8, "n": 9, "max_tokens": 1}), 400, "n")


def test_the_largest_request_leaves_room_for_other_clients(server):
    # The largest request one client may send here takes half the batch (64 of 128 sequences).
    async def one_full_batch(client):
        body = {"prompt": ["go"] * 8, "n": 8, "max_tokens": 64, "ignore_eos": True}
        return (await client.post("/v1/completions", json=body)).status_code

    statuses, elapsed = asyncio.run(_with_ordinary_request(server.base_url, [one_full_batch]))
    assert statuses == [200]
    assert elapsed < ORDINARY_S


# -- 4. tokenizing off the event loop --------------------------------------------------------------

def test_huge_prompts_are_refused_without_stalling_health(server):
    async def huge(client, chars):
        r = await client.post("/v1/completions", json={"prompt": "word " * (chars // 5), "max_tokens": 1})
        return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0,
                                     limits=httpx.Limits(max_connections=64)) as client:
            # 1 MB texts cannot fit whatever their tokens: refused before tokenizing. 300 KB ones
            # might, so they are tokenized (in worker threads) and then refused.
            jobs = [asyncio.ensure_future(huge(client, n)) for n in [1_000_000] * 8 + [300_000] * 8]
            gaps = []
            while not all(j.done() for j in jobs):
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                gaps.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            return [j.result() for j in jobs], gaps

    statuses, health = asyncio.run(main())
    assert statuses == [400] * 16
    assert statistics.median(health) < 0.25 and max(health) < 2.0, health


def test_a_text_longer_than_the_context_can_hold_names_both_numbers(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 900_000}]})
    assert_error(r, 400, "messages", "900000 characters", str(CONTEXT))
    assert_error(http.post("/tokenize", json={"prompt": "y" * 900_000}), 400, "prompt", str(CONTEXT))


# -- 5. the client's mistakes are 400s, not 500s --------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(http, path, body, param):
    assert_error(http.post(path, content=body), 400, param, "surrogate")


def test_deep_nesting_is_a_400(http):
    # A tool's parameter schema 900 levels deep: valid JSON, then a RecursionError (a 500).
    schema = '{"type": "object", "properties": {"a": ' * 450 + '{"type": "string"}' + "}}" * 450
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]"
    messages = '[{"role": "user", "content": "hi"}]'
    body = '{"messages": ' + messages + ', "tools": ' + tools + "}"
    assert_error(http.post("/v1/chat/completions", content=body.encode()), 400, "tools", "nested deeper")
    assert_error(http.post("/tokenize", content=body.encode()), 400, "tools", "nested deeper")


@pytest.mark.parametrize("change, param", [({"stream": "yes"}, "stream"), ({"max_tokens": True}, "max_tokens"),
                                           ({"n": "2"}, "n"), ({"temperature": "0.5"}, "temperature"),
                                           ({"echo": 1}, "echo")])
def test_values_of_the_wrong_type_are_refused_not_coerced(http, change, param):
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **change}), 400, param)


def test_a_multi_prompt_request_with_one_bad_prompt_starts_nothing(server, http):
    wait_until_idle(server.base_url)
    before = http.get("/metrics").text
    r = http.post("/v1/completions", json={"prompt": [[1, 2, 3], [10**7]], "max_tokens": 200})
    assert_error(r, 400, "prompt", "vocabulary")
    after = wait_until_idle(server.base_url)
    for name in ("lmserve:request_success_total", "lmserve:prompt_tokens_total"):
        assert metric(after, name) == metric(before, name), name


# -- 6. connections and small things -------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends before closing ``sock``; fails if it stays open ``seconds``."""
    sock.settimeout(seconds)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_that_sends_no_whole_request_is_closed(server, sent):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        assert _closed_within(sock, TIMEOUT_S + 5) == b""
        assert TIMEOUT_S - 0.5 < time.monotonic() - start < TIMEOUT_S + 3


def test_a_body_that_does_not_arrive_in_time_is_a_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = _closed_within(sock, TIMEOUT_S + 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        assert _closed_within(sock, TIMEOUT_S + 5).startswith(b"HTTP/1.1 200")
        assert time.monotonic() - start < TIMEOUT_S + 3


def test_head_health(http):
    r = http.head("/health")
    assert r.status_code == 200 and r.content == b""
