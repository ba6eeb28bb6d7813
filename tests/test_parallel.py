"""Tensor parallelism end to end: ranks as real processes over gloo and shared memory, against
one process on the same weights; the server with the official openai client, two "hosts" on
loopback, hosts that disagree, and ranks that die or hang."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch.distributed

from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.parallel.group import ParallelFailure
from lmserve.sampling_params import SamplingParams
from server_process import ServerProcess, free_port
from tiny_models import make_gguf_llama, make_hf_llama

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    return make_hf_llama(str(tmp_path_factory.mktemp("tp_hf") / "model"), num_layers=2, seed=3)


@pytest.fixture(scope="module")
def tiny_q41(tmp_path_factory) -> str:
    return make_gguf_llama(str(tmp_path_factory.mktemp("tp_q41") / "m.gguf"), "Q4_1",
                           num_layers=2, seed=3)


def run(core: EngineCore, prompts, max_tokens=12, abort_after=None):
    """Each request's tokens and their logprobs, all requests in one batch (greedy);
    ``abort_after``: steps after which every request still running is aborted."""
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    steps = 0
    while core.has_work():
        if steps == abort_after:
            for request_id in list(core.requests):
                core.abort_request(request_id)
            abort_after = None  # (batches in flight still finish)
            continue
        for out in core.step():
            for d in out.deltas:
                tokens[out.request_id] += d.token_ids
                logprobs[out.request_id] += [lp.logprob for lp in d.logprobs or []]
        steps += 1
    return [tokens[k] for k in sorted(tokens)], [logprobs[k] for k in sorted(logprobs)]


def both(config: EngineConfig, fn):
    """``fn(core)`` on one process and on the parallel engine ``config`` asks for."""
    one = EngineCore(dataclasses.replace(config, tensor_parallel_shards=None,
                                         pipeline_parallel_stages=None))
    expected = fn(one)
    parallel = EngineCore(config)
    try:
        return expected, fn(parallel)
    finally:
        parallel.close()


def assert_same_greedy(expected, got, tolerance: float, length: int = 12) -> None:
    (tokens, logprobs), (tp_tokens, tp_logprobs) = expected, got
    assert tp_tokens == tokens and all(len(t) == length for t in tokens)
    for a, b in zip(logprobs, tp_logprobs):
        assert a == pytest.approx(b, abs=tolerance)


def test_tensor_parallel_greedy_matches_one_process_at_O0_with_draft_trees(tiny_hf):
    """float32 partial sums added in another order: logprobs within 1e-4; the parallel engine
    verifies n-gram draft trees and accepts some (every rank runs the tree steps)."""
    config = EngineConfig(model=tiny_hf, opt="O0", verbose=False)
    expected = run(EngineCore(config), PROMPTS, max_tokens=40)  # long enough to repeat itself
    parallel = EngineCore(dataclasses.replace(config, tensor_parallel_shards=2,
                                              speculative_mode="ngram", spec_draft_length=3,
                                              spec_tree_width=2))
    try:
        assert_same_greedy(expected, run(parallel, PROMPTS, max_tokens=40), 1e-4, length=40)
        assert parallel.stats().spec_num_accepted_tokens > 0
    finally:
        parallel.close()


def top2(core: EngineCore, prompts, max_tokens=12) -> list[list[tuple[int, dict[int, float]]]]:
    """Per request, per token: the greedy token and the two best tokens' logprobs."""
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2))
    out: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while core.has_work():
        for o in core.step():
            for d in o.deltas:
                out[o.request_id] += [(lp.token_id, dict(lp.top)) for lp in d.logprobs]
    return [out[k] for k in sorted(out)]


def assert_parted_only_at_near_ties(expected, got) -> None:
    """Each continuation (``top2``'s) is one process's, or parts from it where one process's two
    best tokens are within 0.1 (and not in its first 3 tokens, which are no near-ties)."""
    for one, tp in zip(expected, got):
        parted = next((i for i, (a, b) in enumerate(zip(one, tp)) if a[0] != b[0]), len(one))
        assert parted >= 3
        if parted < len(one):
            best = one[parted][1]
            assert tp[parted][0] in best and abs(best[one[parted][0]] - best[tp[parted][0]]) < 0.1


@pytest.mark.parametrize("opt", ["O1", "O3"])
def test_the_other_levels_run_sharded(tiny_q41, opt):
    """bf16 weights and activations (O1); one int8 digit and an int8 KV cache (O3). Partial sums
    rounded to bf16 (O1) or added in another order may flip a near-tie, so a continuation may
    part from one process's at one."""
    config = EngineConfig(model=tiny_q41, opt=opt, tensor_parallel_shards=2, verbose=False)
    assert_parted_only_at_near_ties(*both(config, lambda c: top2(c, PROMPTS)))


@pytest.fixture(scope="module")
def q41_engines(tiny_q41):
    """One process and two ranks on the Q4_1 model at the default level, with a small KV cache
    (preemption) and a short collective timeout (the hung rank, last)."""
    config = EngineConfig(model=tiny_q41, max_num_sequence=4, max_total_sequence_length=96,
                          prefill_chunk_size=32, verbose=False)
    os.environ["LMSERVE_COLLECTIVE_TIMEOUT_S"] = "5"
    try:
        parallel = EngineCore(dataclasses.replace(config, tensor_parallel_shards=2))
    finally:
        del os.environ["LMSERVE_COLLECTIVE_TIMEOUT_S"]
    yield EngineCore(config), parallel
    parallel.close(kill=True)


def test_tensor_parallel_greedy_matches_one_process_at_the_default_level(q41_engines):
    """bf16 partial sums, each rounded before the all-reduce adds them: logprobs within 0.05."""
    one, parallel = q41_engines
    assert_same_greedy(run(one, PROMPTS), run(parallel, PROMPTS), tolerance=0.05)


def preemption_prefix_and_aborts(core: EngineCore):
    """A run with preemptions (a small KV cache), one with prefix-cache hits, one aborted
    mid-run (no page held after it), then one more: their tokens, and whether any preempted."""
    shared = list(range(100, 134))  # two pages of prefix, cached by the first round
    prompts = [shared + [i] for i in range(4)]
    preempted = core.scheduler.num_preemptions
    first = run(core, prompts, max_tokens=20)[0]
    hits = core.scheduler.prefix_hit_tokens
    second = run(core, prompts[:2], max_tokens=20)[0]
    assert core.scheduler.prefix_hit_tokens > hits
    run(core, PROMPTS, max_tokens=20, abort_after=3)
    assert core.pages_held_by_requests() == 0
    return first, second, run(core, PROMPTS[:1])[0], core.scheduler.num_preemptions > preempted


def test_tensor_parallel_preemption_prefix_cache_and_aborts(q41_engines):
    """Preempted and prefix-cached sequences come out as in one process; aborts mid-run leave no
    page held, and the ranks keep serving in step."""
    expected, got = (preemption_prefix_and_aborts(core) for core in q41_engines)
    assert got == expected and got[3]


def test_a_hung_rank_fails_the_engine_within_the_collective_timeout(q41_engines):
    parallel = q41_engines[1]
    (rank,) = rank_pids(os.getpid())
    # In a session of its own: a terminal's Ctrl-C reaches only rank 0, which drains first.
    assert os.getsid(rank) == rank != os.getsid(0)
    os.kill(rank, signal.SIGSTOP)
    stopped = time.monotonic()
    with pytest.raises(ParallelFailure, match=r"rank 1 did not (reach an all-reduce|answer) within 5 s"):
        run(parallel, PROMPTS[:1])
    assert time.monotonic() - stopped < 5 + 3
    parallel.close(kill=True)
    assert gone(rank), "the hung rank outlived the engine"


def test_builtin_model_over_three_ranks_matches_one_process():
    """The built-in model (9 heads, 3 KV heads) split three ways, at the default level, whose
    one int8 digit into gate/up turns o's partial sums added in another order into logprobs up
    to about 0.07 apart: a continuation may part at a near-tie (the second prompt's does, at a
    gap of 0.02, 8 tokens in), and the first stays one process's for all 24 tokens."""
    config = EngineConfig(tensor_parallel_shards=3, verbose=False)
    prompts = [[504, 3458, 282, 4649, 314], [1, 563, 7407, 1081, 28, 94]]
    expected, got = both(config, lambda c: top2(c, prompts, max_tokens=24))
    assert [t for t, _ in got[0]] == [t for t, _ in expected[0]] and len(got[0]) == 24
    assert_parted_only_at_near_ties(expected, got)


def test_a_split_the_model_cannot_take_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_shards=2 must divide the model's "
                                         r"num_heads \(9\); values that fit: \[1, 3\]"):
        EngineCore(EngineConfig(tensor_parallel_shards=2, verbose=False))
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(opt="O0;compile=1", tensor_parallel_shards=2)


# -- the server ------------------------------------------------------------------------------


def rank_pids(parent: int) -> list[int]:
    """The rank processes ``parent`` started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"lmserve.parallel.rank_main" in cmdline:
            pids.append(int(entry))
    return pids


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def one_process_text(model: str, prompt: str) -> str:
    from lmserve import Engine

    with Engine(model, verbose=False) as engine:
        return engine.completions.create(prompt=prompt, max_tokens=16, temperature=0).choices[0].text


PROMPT = "The quick brown fox"


def test_openai_client_against_a_tensor_parallel_server_then_a_rank_dies(tiny_q41, tmp_path):
    expected = one_process_text(tiny_q41, PROMPT)
    server = ServerProcess(["--model", tiny_q41, "--tensor-parallel-shards", "2"],
                           str(tmp_path / "server.log")).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        got = client.completions.create(model="m.gguf", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == expected
        (rank,) = rank_pids(server.proc.pid)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        assert server.wait(timeout=10) == 1, server.log()
        assert time.monotonic() - killed < 5
        assert "rank 1 (pid %d) exited with code -9" % rank in server.log()
    finally:
        server.stop()


def _node(model: str, node: int, port: int, log, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmserve.cli", "serve", "--model", model, "--tensor-parallel-shards",
         "2", "--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), *extra],
        stdout=log, stderr=subprocess.STDOUT)


def test_two_hosts_on_loopback_serve_what_one_process_serves(tiny_q41, tmp_path):
    expected = one_process_text(tiny_q41, PROMPT)
    port = free_port()
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = _node(tiny_q41, 1, port, log)
    server = ServerProcess(["--model", tiny_q41, "--tensor-parallel-shards", "2", "--nnodes", "2",
                            "--node-rank", "0", "--master-port", str(port)],
                           str(tmp_path / "node0.log"))
    try:
        server.start()
        assert rank_pids(server.proc.pid) == []  # one rank per host: node 0 starts none
        got = httpx.post(server.base_url + "/v1/completions", timeout=60,
                         json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).json()
        assert got["choices"][0]["text"] == expected
        assert server.stop() == 0
        assert node1.wait(timeout=15) == 0  # told to stop by rank 0
    finally:
        server.stop()
        node1.kill()


def test_hosts_that_disagree_are_refused_before_serving(tiny_q41, tmp_path, monkeypatch):
    """Node 0 in this process (through the variables the CLI sets), node 1 launched with
    another opt level: both refuse, naming the difference."""
    port = free_port()
    for name, value in (("LMSERVE_NNODES", "2"), ("LMSERVE_NODE_RANK", "0"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = _node(tiny_q41, 1, port, log, "--opt", "O0")
    try:
        with pytest.raises(ValueError, match=r"the ranks do not agree on what to serve: rank 1 "
                                             r"has opt=OptFlags\(weight_dtype='float32'"):
            EngineCore(EngineConfig(model=tiny_q41, tensor_parallel_shards=2, verbose=False))
        assert node1.wait(timeout=30) != 0
    finally:
        node1.kill()
    assert "the ranks do not agree" in (tmp_path / "node1.log").read_text()
    assert not torch.distributed.is_initialized()  # the refusal leaves room for another engine
