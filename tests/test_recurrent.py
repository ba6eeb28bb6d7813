"""Recurrent-state models (Mamba, Mamba2, and Bamba, a hybrid of Mamba2 and attention layers):
small random configs saved as Hugging Face directories, against transformers' own models."""

import dataclasses

import pytest
import torch

from conftest import churn_with_aborts, generate_tokens, run_concurrently, wait_idle
from lmserve import AsyncEngine, Engine, SamplingParams
from lmserve.cache.free_list import FreeList
from lmserve.cache.snapshots import StateSnapshots
from lmserve.cache.state_manager import StateManager
from lmserve.config import EngineConfig
from lmserve.layers.ssm_kernels import SSMKernels
from lmserve.models.builtin import builtin_model_path
from lmserve.models.loader import read_model_args
from lmserve.plan import make_plan
from lmserve.request import Request, Sequence
from lmserve.speculative.tree import DraftTree
from lmserve.tokenizer import Tokenizer
from test_reference import assert_matches_transformers, hf_greedy_uncached
from tiny_models import make_hf_llama, make_hf_recurrent, random_recurrent_model

ARCHS = ["mamba", "mamba2", "bamba"]
CHUNK = 16  # the prefill chunk of the engines here: prompts shorter and longer than it
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values`")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: make_hf_recurrent(str(tmp_path_factory.mktemp(arch)), arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    return {arch: random_recurrent_model(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def engines(model_dirs):
    """The torch path (O0 with torch attention: layers/ssm.py's decode), the reference."""
    engines = {arch: Engine(model=d, opt="O0;attention=torch_native", max_num_sequence=4, prefill_chunk_size=CHUNK,
                            verbose=False) for arch, d in model_dirs.items()}
    yield engines
    for engine in engines.values():
        engine.shutdown()


def reference(hf_model, prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
    return hf_greedy_uncached(hf_model, prompt, n)


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_greedy_tokens_and_logprobs_match_transformers(arch, engines, hf_models):
    """Prompts within one chunk and over three (scanned chunk by chunk, the state carried)."""
    assert_matches_transformers(engines[arch], hf_models[arch],
                                [list(range(100, 110)), list(range(500, 550))], 16)


@torch.inference_mode()
def test_partial_rotary_with_attention_biases(tmp_path):
    """Bamba rotates half of each head: q/k rows (and their biases) are reordered at load."""
    hf = random_recurrent_model("bamba", seed=3, attention_bias=True)
    hf.save_pretrained(tmp_path)
    Tokenizer.from_model(builtin_model_path()).hf.save_pretrained(tmp_path)
    engine = Engine(model=str(tmp_path), opt="O0", verbose=False)
    try:
        assert_matches_transformers(engine, hf, [list(range(600, 630))], 8)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@torch.inference_mode()
def test_batch_company_staggered_arrivals_and_n_choices(arch, engines, hf_models):
    prompts = [list(range(1000 + 40 * i, 1000 + 40 * i + n)) for i, n in enumerate((5, 23, 40, 12, 31))]
    expected = [reference(hf_models[arch], p) for p in prompts]
    engine = engines[arch]
    assert run_concurrently(engine, prompts, GREEDY, delays=[0, 0.02, 0.05, 0.1, 0.12]) == expected
    outputs = engine.generate(prompts[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    choices = {i: [] for i in range(2)}
    for out in outputs:
        for d in out.deltas:
            choices[d.index] += d.token_ids
    assert choices == {0: expected[2], 1: expected[2]}
    wait_idle(engine)
    assert engine.state_slots_in_use() == 0 and engine.kv_pages_in_use() == 0


@pytest.mark.skipif(SSMKernels.create() is None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_cpp_decode_kernels_match_the_torch_path(arch, model_dirs, engines):
    """The C++ path (O0's, attention=cpu_paged) updates decode states in place with the kernels: the
    same tokens and log-probs as the torch reference, in batch company."""
    prompts = [list(range(7000 + 50 * i, 7000 + 50 * i + n)) for i, n in enumerate((9, 33, 20))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    engine = Engine(model=model_dirs[arch], opt="O0", max_num_sequence=4,
                    prefill_chunk_size=CHUNK, verbose=False)
    try:
        assert engine._core.runner.ssm_kernels is not None
        fast = run_concurrently(engine, prompts, params)
        fast_lps = [lp for o in engine.generate(prompts[1], params) for d in o.deltas for lp in d.logprobs]
    finally:
        engine.shutdown()
    reference = [[lp for o in engines[arch].generate(p, params) for d in o.deltas for lp in d.logprobs]
                 for p in prompts]
    assert fast == [[lp.token_id for lp in lps] for lps in reference]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(fast_lps, reference[1])) < 1e-4


@torch.inference_mode()
def test_hybrid_preemption_recomputes_state(model_dirs, hf_models):
    """Bamba's attention layers run out of KV pages: sequences are preempted, their state slots
    freed, and they are recomputed from the prompt with the same output."""
    prompts = [list(range(2000 + 50 * i, 2030 + 50 * i)) for i in range(4)]
    expected = [reference(hf_models["bamba"], p, 20) for p in prompts]
    engine = Engine(model=model_dirs["bamba"], opt="O0", max_num_sequence=4, prefill_chunk_size=CHUNK,
                    kv_cache_page_size=8, max_total_sequence_length=96, prefix_cache_mode="disable",
                    verbose=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        assert run_concurrently(engine, prompts, params) == expected
        assert engine._core.scheduler.num_preemptions > 0
        wait_idle(engine)
        assert engine.state_slots_in_use() == 0 and engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


class WrongAtDepth:
    """A drafter that drafts ``k`` tokens of the known greedy continuation ``expected`` with the
    one at depth ``step % (k + 1)`` wrong (none when that is k): every number of accepted drafts
    in turn, so each history slot is rolled back to."""

    def __init__(self, prompt_len: int, expected: list[int], k: int) -> None:
        self.prompt_len, self.expected, self.k, self.steps = prompt_len, expected, k, 0

    def offer(self, seq, cap: int) -> int:
        return min(cap, self.k)

    def num_nodes(self, seq, depth: int) -> int:
        return depth

    def propose(self, batch, depths) -> None:
        for c, depth in depths.items():
            done = len(c.seq.token_ids) - self.prompt_len
            draft = (self.expected[done : done + min(depth, c.num_lookahead)] + [0] * depth)[:depth]
            wrong = self.steps % (self.k + 1)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % 1000
            c.draft = DraftTree.chain(draft)
            self.steps += 1


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_speculation_rolls_the_state_back_to_each_depth(arch, model_dirs, hf_models):
    """Rejected drafts are undone by restoring the state after the last accepted token (from
    the history slots): greedy output equals transformers' at every acceptance length."""
    prompt = list(range(3000, 3020))
    expected = reference(hf_models[arch], prompt, 24)
    engine = Engine(model=model_dirs[arch], opt="O0", max_num_sequence=2, prefill_chunk_size=CHUNK,
                    speculative_mode="ngram", spec_draft_length=3, verbose=False)
    try:
        engine._core.speculator.drafter = WrongAtDepth(len(prompt), expected, 3)
        assert generate_tokens(engine, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                              ignore_eos=True)) == expected
        stats = engine.stats()
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        assert all(n > 0 for n in stats.spec_accepted_per_pos)  # every depth was accepted at times
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_ngram_speculation_on_mamba2_keeps_greedy_output(model_dirs, hf_models):
    P = list(range(300, 312))
    R = reference(hf_models["mamba2"], P, 20)
    prompt = P + R + P + R[:3]  # a repeat: the n-gram lookup drafts the rest of R
    expected = reference(hf_models["mamba2"], prompt, 24)
    engine = Engine(model=model_dirs["mamba2"], opt="O0", max_num_sequence=2, prefill_chunk_size=CHUNK,
                    speculative_mode="ngram", spec_draft_length=3, verbose=False)
    try:
        assert generate_tokens(engine, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                              ignore_eos=True)) == expected
        assert engine.stats().spec_num_draft_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@torch.inference_mode()
def test_second_chat_turn_scans_only_the_new_tokens(arch, model_dirs, hf_models):
    """A finished sequence leaves its state as a snapshot (a hybrid's where its KV pages end
    too: page-aligned); the next turn, which repeats the conversation so far, starts from it."""
    engine = Engine(model=model_dirs[arch], opt="O0", max_num_sequence=2, prefill_chunk_size=64,
                    kv_cache_page_size=8, verbose=False)
    try:
        first = list(range(4000, 4030))
        # 30 prompt + 11 output tokens: 40 computed (the last sampled token is not), 5 pages
        reply = generate_tokens(engine, first, SamplingParams(temperature=0, max_tokens=11,
                                                              ignore_eos=True))
        second = first + reply + list(range(4100, 4107))
        before = engine.stats()
        assert generate_tokens(engine, second, GREEDY) == reference(hf_models[arch], second)
        after = engine.stats()
        assert after.prefill_tokens - before.prefill_tokens == len(second) - 40
        assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 40
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@torch.inference_mode()
def test_n_choices_fork_from_the_first_choice_state(arch, model_dirs):
    """The later choices copy the first's state after the prompt but its last token (a hybrid's
    at its last whole page) and scan only the rest; seeded choices are what they are unforked."""
    prompt = list(range(8000, 8029))  # fork at 28 tokens (Mamba2), at 24 (Bamba, pages of 8)
    fork = 28 if arch == "mamba2" else 24
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, n=3, ignore_eos=True)
    choices = []
    for cache in ("radix", "disable"):
        engine = Engine(model=model_dirs[arch], opt="O0", max_num_sequence=4, prefill_chunk_size=64,
                        kv_cache_page_size=8, prefix_cache_mode=cache, verbose=False)
        try:
            by_index = {i: [] for i in range(3)}
            for out in engine.generate(prompt, params):
                for d in out.deltas:
                    by_index[d.index] += d.token_ids
            choices.append(by_index)
            scanned = len(prompt) + 2 * (len(prompt) - fork) if cache == "radix" else 3 * len(prompt)
            assert engine.stats().prefill_tokens == scanned
        finally:
            engine.shutdown()
    assert choices[0] == choices[1] and len({tuple(c) for c in choices[0].values()}) > 1


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
@torch.inference_mode()
def test_a_shared_long_prefix_resumes_at_the_last_chunk_boundary(arch, engines, hf_models):
    engine = engines[arch]
    shared = list(range(6000, 6040))  # chunks of 16 end at 16 and 32: snapshots there
    generate_tokens(engine, shared + [1, 2, 3], GREEDY)
    before = engine.stats()
    prompt = shared + [7, 8, 9, 10]
    assert generate_tokens(engine, prompt, GREEDY) == reference(hf_models[arch], prompt)
    assert engine.stats().prefill_tokens - before.prefill_tokens == len(prompt) - 32


def test_no_slot_or_page_leaks_after_many_finished_and_aborted_requests(model_dirs):
    """The hybrid: slots and pages at once (n=2 choices forking among them)."""
    engine = AsyncEngine(model_dirs["bamba"], opt="O0", max_num_sequence=16, prefill_chunk_size=64,
                         kv_cache_page_size=8, verbose=False)
    try:
        churn_with_aborts(engine, 200)
        assert engine.state_slots_in_use() == 0
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


# -- the plan and refusals ----------------------------------------------------------------------

def test_plan_sizes_state_slots_and_shows_them(model_dirs):
    args = read_model_args(model_dirs["mamba2"])
    plan = make_plan(EngineConfig(max_num_sequence=6, speculative_mode="ngram", spec_draft_length=3),
                     args, device_memory=8 << 30)
    state = plan.state
    assert (state.max_num_sequence, state.history, state.snapshots) == (6, 3, 6)
    # 2 layers x (conv: (128 + 2 * 2 * 16) channels x 3 taps + scan: 8 heads x 16 x 16) float32
    assert state.bytes_per_slot == 2 * ((128 + 64) * 3 + 8 * 16 * 16) * 4
    assert state.num_slots == 6 * 4 + 6 and plan.memory.state == state.num_slots * state.bytes_per_slot
    assert plan.num_pages == 0 and plan.memory.kv == 0
    assert "recurrent_state" in plan.describe() and "6 sequences x (1 + 3 history)" in plan.describe()
    # Server mode sizes the batch from memory: with room for 10 sequences' slots (each its state
    # and a snapshot), 10 sequences.
    server = EngineConfig(mode="server", gpu_memory_utilization=1.0)
    m = make_plan(server, args, device_memory=8 << 30).memory
    fixed, per_sequence = m.weights + m.workspace + m.margin, 2 * state.bytes_per_slot
    small = make_plan(server, args, device_memory=fixed + 10 * per_sequence + per_sequence // 2)
    assert small.max_num_sequence == 10 and small.memory.total <= small.memory.budget
    # A fixed number of snapshots comes off first (5 of the room's 21 slots); each sequence then
    # needs its one slot.
    fixed_snapshots = dataclasses.replace(server, prefix_cache_max_num_recycling_seqs=5)
    small = make_plan(fixed_snapshots, args, device_memory=fixed + 10 * per_sequence + per_sequence // 2)
    assert small.max_num_sequence == 21 - 5 and small.state.snapshots == 5
    # A pure recurrent model has no positions: a sequence may be longer than the default context.
    assert make_plan(EngineConfig(max_single_sequence_length=32768), args).max_single_sequence_length == 32768


@pytest.mark.parametrize("config, message", [
    (dict(kv_state_kind="kv_cache"), "kv_state_kind='kv_cache', but model architecture 'mamba2' has recurrent"),
    (dict(speculative_mode="ngram", spec_draft_length=4, max_history_size=2),
     "max_history_size=2 is less than the deepest draft (4 tokens)"),
    (dict(speculative_mode="ngram", spec_tree_width=2), "draft trees are not supported"),
    (dict(sliding_window_size=64), "sliding_window_size is not supported"),
])
def test_recurrent_refusals(model_dirs, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_plan(EngineConfig(**config), read_model_args(model_dirs["mamba2"]))


def test_attention_model_refuses_recurrent_settings(tmp_path):
    args = read_model_args(make_hf_llama(str(tmp_path / "llama")))
    with pytest.raises(ValueError, match="max_history_size=2 applies to recurrent-state models"):
        make_plan(EngineConfig(max_history_size=2), args)
    with pytest.raises(ValueError, match="kv_state_kind='rnn_state', but model architecture 'llama'"):
        make_plan(EngineConfig(kv_state_kind="rnn_state"), args)
    with pytest.raises(ValueError, match="max_history_size must be"):
        EngineConfig(max_history_size=-1)


# -- the state manager and snapshots, exactly ----------------------------------------------------

def _seq(tokens: list[int]) -> Sequence:
    return Sequence(Request("r", list(tokens), SamplingParams()), 0, list(tokens), None)


def test_snapshots_match_the_longest_prefix_and_evict_the_least_recent():
    snaps = StateSnapshots(capacity=2)
    assert snaps.insert([1, 2, 3, 4], 10) == [] and snaps.insert([1, 2], 11) == []
    assert snaps.match([1, 2, 3, 4, 5]) == (4, 10)
    assert snaps.match([1, 2, 3, 4, 5], multiple=2) == (4, 10)
    assert snaps.match([1, 2, 3, 4, 5], multiple=3) == (0, -1)
    assert snaps.match([1, 2, 9]) == (2, 11)  # now the most recent
    assert snaps.insert([1, 2], 12) == [12]  # already held
    assert snaps.insert([7], 13) == [10]  # over capacity: [1, 2, 3, 4] was least recent
    assert snaps.match([1, 2, 3, 4]) == (2, 11)


def test_state_manager_slots_rollback_and_snapshots():
    slots = FreeList(2 * 3 + 1, "state slots")
    states = StateManager(slots, history=2, snapshots=StateSnapshots(1), snapshot_every=4)
    a = _seq(list(range(10)))
    states.ensure(a)
    assert (a.state_slot, a.history_slots) == (0, [1, 2])
    a.num_computed = 4
    states.at_boundary(a)  # a snapshot of the state after 4 tokens, in the free slot
    assert states.take_copies() == [(0, 3)] and slots.num_free == 3
    a.num_computed = 6  # a step ran 3 tokens from 5 and kept 1 (both drafts rejected)
    states.keep(a, start=5, ran=3)
    a.num_computed = 8  # ... then all 3 from 5 (nothing to restore), then 2 of 3 from 6
    states.keep(a, start=5, ran=3)
    states.keep(a, start=6, ran=3)
    assert states.take_copies() == [(1, 0), (2, 0)]
    b = _seq(list(range(4)) + [99, 98])
    assert states.match(b, limit=5) == 4 and b.state_slot == 4
    assert states.take_copies() == [(3, 4)]
    states.free(a, snapshot=True)  # its state replaces the older snapshot (capacity 1)
    assert states.snapshots.match(list(range(10))) == (8, 0)
    assert states.held_by_sequences() == 3 and slots.num_free == 3
    states.free(b, snapshot=False)
    assert states.held_by_sequences() == 0


def test_prompt_chunks_end_at_snapshot_points_and_choices_wait_for_the_fork():
    states = StateManager(FreeList(20, "state slots"), history=0, snapshots=StateSnapshots(4), snapshot_every=16,
                          align=8)
    request = Request("r", list(range(30)), SamplingParams(n=2))
    first, second = (Sequence(request, i, list(range(30)), None) for i in range(2))
    request.seqs = [first, second]
    # Chunks stop at the fork point (29 prompt tokens but the last, down to whole pages of 8 =
    # 24; only the first choice stops there), and at multiples of 16 unless they end the prompt.
    assert states.fork_point(first) == 24
    assert states.chunk_end(first, 30) == 16 and states.chunk_end(second, 30) == 30
    assert states.chunk_end(second, 20) == 16
    first.num_computed = second.num_computed = 16
    assert states.chunk_end(first, 14) == 8 and states.chunk_end(second, 14) == 14
    assert states.chunk_end(first, 5) == 5  # before the fork point: nothing to cut
    second.num_computed = 0
    assert not states.ready(second) and states.ready(first)
    states.ensure(first)
    first.num_computed = 24
    states.at_boundary(first)  # the fork point's snapshot, which the second choice starts from
    assert states.ready(second)
    assert states.match(second, 29) == 24 and len(states.take_copies()) == 2


def test_the_server_serves_a_mamba2_model_to_concurrent_openai_clients(model_dirs, tmp_path):
    """No KV pages: the server still admits several requests at once (its in-flight token
    bound comes from what the sequences may hold), through the official openai client."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from server_process import ServerProcess

    with ServerProcess(["--model", model_dirs["mamba2"], "--opt", "O0", "--max-num-sequence", "4",
                        "--served-model-name", "m"],
                       str(tmp_path / "server.log")) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")

        def ask(i: int):
            return client.completions.create(model="m", prompt=f"count {i}:", max_tokens=8, temperature=0)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
    assert [a.usage.completion_tokens for a in answers] == [8] * 4


@torch.inference_mode()
def test_a_request_failing_mid_step_leaves_no_snapshot(model_dirs, monkeypatch):
    """A request whose output fails inside a step is aborted after the forward pass, before its
    computed tokens are counted: its state (already past them) must not enter the prefix cache."""
    engine = Engine(model=model_dirs["mamba2"], opt="O0", max_num_sequence=2, verbose=False)
    core = engine._core
    try:
        real_append = core.outputs.append

        def failing(seq, token_ids, logprobs):
            if seq.num_output_tokens >= 3:
                raise RuntimeError("detokenizer failed")
            return real_append(seq, token_ids, logprobs)

        monkeypatch.setattr(core.outputs, "append", failing)
        with pytest.raises(RuntimeError, match="detokenizer failed"):
            list(engine.generate(list(range(9000, 9020)), GREEDY))
        wait_idle(engine)
        assert len(core.kv_manager.states.snapshots) == 0
        assert engine.state_slots_in_use() == 0
    finally:
        engine.shutdown()
