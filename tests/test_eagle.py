"""EAGLE heads: the published layouts (EAGLE-1/2 and EAGLE-3) load (bad ones are refused by
name), the engine's paged head computes what a plain PyTorch head does, and drafting from it
never changes the output."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_drafts_keep_the_distribution, generate_tokens, plain_outputs, run_concurrently, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.cache.kv import kv_bytes_per_head
from lmserve.config import EngineConfig
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.loader import read_model_args
from lmserve.plan import make_plan
from lmserve.request import Request, Sequence
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative import eagle
from lmserve.speculative.draft_vocab import read_draft_vocab, write_draft_vocab
from lmserve.speculative.dynamic_tree import CandidateTree
from lmserve.speculative.eagle import EagleDrafter
from lmserve.speculative.eagle_heads import eagle_layer_args, read_eagle_heads
from lmserve.speculative.head_nets import EagleNet
from lmserve.step import SeqStep, StepInput
from tiny_models import make_hf_llama

HIDDEN, LAYERS, DRAFT_VOCAB = 64, 6, 512
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def eagle_net(args, version: int, seed: int = 0) -> EagleNet:
    """A random head that mostly passes the target's feature through (so that it drafts tokens
    the model likes): ``fc`` near the identity on the feature, small attention and MLP."""
    layer_args = eagle_layer_args({}, args)
    g = torch.Generator().manual_seed(seed)
    net = EagleNet(layer_args, version, draft_vocab_size=DRAFT_VOCAB if version == 3 else 0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
        d = HIDDEN
        net.fc.weight[:, -d:] += torch.eye(d)  # the feature (EAGLE-3: the last aux layer's)
    return net


def write_head(directory, net: EagleNet, target_args, aux=None, fmt="safetensors", extra=None) -> str:
    """``net`` as SafeAILab publishes it: a one-layer Llama config.json and the weights."""
    directory.mkdir(parents=True, exist_ok=True)
    a = net.args
    config = {"architectures": ["LlamaForCausalLMEagle3" if net.version == 3 else "LlamaForCausalLM"],
              "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
              "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
              "vocab_size": target_args.vocab_size}
    tensors = {n: t.detach().clone().contiguous() for n, t in net.state_dict().items()}
    if net.version == 3:
        config["draft_vocab_size"] = DRAFT_VOCAB
        if aux is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        # The draft vocabulary: every fourth token of the target's, as d2t offsets.
        ids = torch.arange(DRAFT_VOCAB) * 4
        tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB)
        t2d = torch.zeros(target_args.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    tensors |= extra or {}
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, str(directory / "pytorch_model.bin"))
    return str(directory)


@pytest.fixture(autouse=True)
def every_path_expanded(monkeypatch):
    """Random heads' paths are far less likely than the drafter's cut (``MIN_PATH_LOG_PROB``),
    which would stop every chain and tree at its first depth: here the drafter expands them all,
    so that deep chains and trees run end to end (a test of the cut sets its own)."""
    monkeypatch.setattr(eagle, "MIN_PATH_LOG_PROB", -math.inf)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama model and EAGLE heads for it in each layout."""
    root = tmp_path_factory.mktemp("eagle")
    model_dir = make_hf_llama(str(root / "model"), hidden_size=HIDDEN, num_layers=LAYERS, seed=5)
    args = read_model_args(model_dir)
    nets = {1: eagle_net(args, 1), 3: eagle_net(args, 3, seed=1)}
    heads = {"eagle1": write_head(root / "eagle1", nets[1], args),
             "eagle1_bin": write_head(root / "eagle1_bin", nets[1], args, fmt="bin"),
             "eagle3": write_head(root / "eagle3", nets[3], args),
             "eagle3_aux": write_head(root / "eagle3_aux", nets[3], args, aux=[0, 2, 4]),
             "eagle1_vocab": write_head(root / "eagle1_vocab", nets[1], args)}
    write_draft_vocab(heads["eagle1_vocab"], torch.arange(0, args.vocab_size, 2))
    return model_dir, args, nets, heads


def test_the_published_layouts_load_and_are_checked(target, tmp_path):
    model_dir, args, nets, heads = target
    one, bin_, three = (read_eagle_heads(heads[k], args) for k in ("eagle1", "eagle1_bin", "eagle3"))
    assert (one.version, one.aux_layers, three.version) == (1, (), 3)
    assert one.tensors.keys() == bin_.tensors.keys() and "fc.bias" in one.tensors
    # A draft vocabulary beside an EAGLE-1 head (lmserve's draft_vocab.json); never for EAGLE-3.
    vocab = read_eagle_heads(heads["eagle1_vocab"], args).draft_to_target
    assert vocab.tolist() == list(range(0, args.vocab_size, 2))
    write_draft_vocab(str(tmp_path), torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="'token_ids' must be distinct ids"):
        read_draft_vocab(str(tmp_path), args.vocab_size)
    write_head(tmp_path / "eagle3_vocab", nets[3], args)
    write_draft_vocab(str(tmp_path / "eagle3_vocab"), torch.arange(4))
    with pytest.raises(ValueError, match="has its own draft vocabulary"):
        read_eagle_heads(str(tmp_path / "eagle3_vocab"), args)
    prefixed = tmp_path / "prefixed"
    write_head(prefixed, nets[1], args)
    save_file({"model." + n: t.contiguous() for n, t in nets[1].state_dict().items()},
              str(prefixed / "model.safetensors"))
    assert read_eagle_heads(str(prefixed), args).tensors.keys() == one.tensors.keys()
    assert three.aux_layers == (2, LAYERS // 2, LAYERS - 3)  # vLLM's choice without a config
    assert read_eagle_heads(heads["eagle3_aux"], args).aux_layers == (0, 2, 4)
    assert three.draft_to_target.tolist() == list(range(0, 4 * DRAFT_VOCAB, 4))
    # The plan counts the head's tensors (at the draft level: int8 blocks at the default O3,
    # float32 at O0) and its layer's KV beside the target's.
    size = sum(t.numel() for t in nets[1].state_dict().values())
    for level, kv_dtype, per_weight in (("O3", "int8", 1.25), ("O0", "float32", 4)):
        plan = make_plan(EngineConfig(speculative_mode="eagle", additional_models=[heads["eagle1"]],
                                      opt=f"O2;draft_opt={level}"), args, draft_args=one.args)
        assert plan.draft_kv_dtype == kv_dtype
        kv = plan.num_pages * plan.page_size * one.args.num_kv_heads * kv_bytes_per_head(
            one.args.head_dim, kv_dtype)
        assert plan.memory.draft == int(size * per_weight) + kv
        assert "eagle_head" in plan.describe() and f"at {level}" in plan.speculative
    state = {n: t.detach().clone() for n, t in nets[1].state_dict().items()}
    cases = [
        (dict(state, **{"fc.weight": torch.zeros(HIDDEN, HIDDEN)}), r"'fc.weight' is \(64, 64\)"),
        ({n: t for n, t in state.items() if "k_proj" not in n}, "lacks the EAGLE-1 tensors layer.self_attn.k_proj"),
        (dict(state, **{"layers.0.extra.weight": torch.zeros(1)}), "'layer.extra.weight'"),
    ]
    for i, (tensors, message) in enumerate(cases):
        directory = tmp_path / str(i)
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "num_attention_heads": 4,
                                                            "num_key_value_heads": 2, "intermediate_size": 128}))
        save_file(tensors, str(directory / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            read_eagle_heads(str(directory), args)
    with pytest.raises(ValueError, match="hidden size is 32, the model's 64"):
        (tmp_path / "0" / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4}))
        read_eagle_heads(str(tmp_path / "0"), args)
    with pytest.raises(FileNotFoundError, match=r"additional_models\[0\]"):
        Engine(model=model_dir, speculative_mode="eagle", additional_models=[str(tmp_path)], verbose=False)


@pytest.mark.parametrize("version, draft_opt", [(1, "O0"), (3, "O0"), (1, "O3"), (3, "O2")])
@torch.inference_mode()
def test_the_paged_head_computes_what_the_plain_one_does(target, version, draft_opt):
    """The engine's head over paged KV, in two passes, against ``EagleNet`` on the whole
    sequence: the same logits at the O0 draft level (float32); at a quantized draft level
    (int8 weights and activations, int8 or bfloat16 KV) within the quantization's error."""
    model_dir, args, nets, heads = target
    engine = Engine(model=model_dir, opt=f"O0;draft_opt={draft_opt}", verbose=False,
                    speculative_mode="eagle", additional_models=[heads[f"eagle{version}"]],
                    kv_cache_page_size=16)
    try:
        core = engine._core
        runner = core.draft_runner
        tokens = list(range(300, 340))
        n = len(tokens) - 1
        # Seeded: from the global generator the draws depended on the tests run before, and the
        # quantized levels' top-1 agreement moves about 0.9-1 from draw to draw (near-ties; 0.897 once).
        features = torch.randn(n, (3 if version == 3 else 1) * HIDDEN, generator=torch.Generator().manual_seed(version))
        pages = list(range(3))
        first = runner.execute(StepInput([SeqStep(0, tokens[1:25], pages, 24)]), features[:24])
        second = runner.execute(StepInput([SeqStep(24, tokens[25:], pages, n - 24)]), features[24:])
        net = nets[version]
        rotary = RotaryEmbedding(net.args.head_dim, 64, net.args.rope_theta)
        embed = core.runner.model.embed[torch.tensor(tokens[1:])].float()
        hidden = net(embed, features, rotary)
        # EAGLE-3's logits are over its draft vocabulary.
        expected = net.lm_head(net.norm(hidden)) if version == 3 else core.runner.model.logits(hidden)
        logits = torch.cat([first, second])
        # As the head catches up: rows whose output nobody reads only write their KV, and the
        # logits of the rows read (after a pass of them, 24 on from it) are the same.
        other, down, mlp_rows = list(range(3, 6)), runner.model.down, []
        runner.model.down = lambda x: mlp_rows.append(len(x)) or down(x)
        caught_up = runner.execute(StepInput([SeqStep(0, tokens[1:25], other, 1)]), features[:24])
        runner.model.down = down
        assert mlp_rows == [1]
        last = runner.execute(StepInput([SeqStep(24, tokens[25:], other, 2)]), features[24:])
        assert torch.equal(caught_up, first[-1:]) and torch.equal(last, second[-2:])
        if draft_opt == "O0":
            assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4)
        else:
            error = (logits - expected).abs().max() / expected.abs().max()
            assert 0 < error < 0.05
            assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_draft_passes_are_the_chains_the_head_drafts(target):
    """``EagleNet.draft_passes`` (what ``train-heads`` trains on) against chains run one draft
    at a time: row ``r`` of pass ``s`` is the head over the target's features up to ``r - s``
    followed by its own predictions, at its last row."""
    net = copy.deepcopy(target[2][1])
    with torch.no_grad():  # scores of order 1 (the test heads' are near 0: uniform attention)
        for proj in (net.layers[0].self_attn.q_proj, net.layers[0].self_attn.k_proj):
            proj.weight.mul_(30)
    rotary = RotaryEmbedding(net.args.head_dim, 64, net.args.rope_theta)
    g = torch.Generator().manual_seed(5)
    n, steps = 12, 3
    embeddings, features = torch.randn(2, n, HIDDEN, generator=g)
    passes = net.draft_passes(embeddings, features, rotary, steps)
    assert len(passes) == steps
    for s in range(1, steps):
        for r in range(s, n):
            chain = list(features[: r - s + 1])
            for j in range(s + 1):  # draft j reads the head's prediction before it
                chain.append(net(embeddings[: r - s + 1 + j], torch.stack(chain), rotary)[-1])
            assert torch.allclose(passes[s][r], chain[-1], atol=1e-5), (s, r)
    with pytest.raises(ValueError, match="EAGLE-1"):
        target[2][3].draft_passes(embeddings, torch.randn(n, 3 * HIDDEN), rotary, 2)


def test_the_dynamic_tree_keeps_the_most_likely_paths():
    """Hand-made values: the ``max_nodes`` most likely nodes, the most likely child chain first,
    parents before children, ties to the shallower node."""
    tree = CandidateTree()
    ln = torch.tensor([0.6, 0.3, 0.1, 0.9, 0.5, 0.5]).log().tolist()
    tree.add_children(-1, [10, 11, 12], ln[:3])  # nodes 0-2: 0.6, 0.3, 0.1
    tree.add_children(1, [20], ln[3:4])  # node 3 under 11: 0.27
    tree.add_children(0, [30, 31], ln[4:])  # nodes 4, 5 under 10: 0.3 each
    assert tree.frontier(1, 2) == [0, 1] and tree.frontier(2, 1) == [4]
    draft = tree.select(4)  # 0.6, then 0.3 three times: node 1 (shallower), nodes 4, 5
    assert (draft.token_ids, draft.parents) == ([10, 30, 11, 31], [-1, 0, -1, 0])
    draft = tree.select(6)
    assert (draft.token_ids, draft.parents) == ([10, 30, 11, 12, 20, 31], [-1, 0, -1, -1, 2, 0])


@pytest.mark.parametrize("width, depth, budget", [(3, 3, 7), (1, 4, 4)])
@pytest.mark.parametrize("cut", [None, 1, 2])
@torch.inference_mode()
def test_the_drafter_grows_eagle2s_tree_on_what_the_plain_head_predicts(target, monkeypatch, width,
                                                                        depth, budget, cut):
    """One sequence's EAGLE-2 tree from the engine's drafter (paged, batched, a pass per depth)
    against the same tree grown by brute force on ``EagleNet``: each node's head state from
    running the head over the context and the node's own path. Width 1: a chain, whose earlier
    nodes' KV the head keeps between passes. ``cut``: only nodes at least as likely as the
    best (1) or the second best (2) node of the second depth are expanded
    (``MIN_PATH_LOG_PROB``): one or two of that depth's nodes, none deeper."""
    model_dir, args, nets, heads = target
    net = nets[1]
    tokens = list(range(400, 430))
    features = torch.randn(len(tokens) - 1, HIDDEN, generator=torch.Generator().manual_seed(3))
    rotary = RotaryEmbedding(net.args.head_dim, 64, net.args.rope_theta)
    values, states = {}, {}  # per path of tokens: its log-probability, the head's state after it
    engine = Engine(model=model_dir, opt="O0;draft_opt=O0", verbose=False, speculative_mode="eagle",
                    additional_models=[heads["eagle1"]], kv_cache_page_size=16)
    try:
        model = engine._core.runner.model

        def expand(path: tuple[int, ...]) -> None:
            """The plain head over the context then ``path`` (each token read with the head's
            state after the tokens before it): its state after ``path``, its ``width`` best
            tokens."""
            ids = torch.tensor(tokens[1:] + list(path))
            inputs = torch.cat([features, *(states[path[:i]][None] for i in range(len(path)))])
            states[path] = net(model.embed[ids].float(), inputs, rotary)[-1]
            best = model.logits(states[path][None])[0].log_softmax(-1).topk(width)
            for token, log_prob in zip(best.indices.tolist(), best.values.tolist()):
                values[path + (token,)] = values.get(path, 0.0) + log_prob

        def grow(min_log_prob: float) -> list[tuple[int, ...]]:
            """``values`` of the tree grown by brute force; returns the last paths expanded."""
            values.clear()
            frontier, last = [()], []
            for d in range(depth):
                for path in frontier:
                    expand(path)
                last = frontier
                frontier = [p for p in sorted([p for p in values if len(p) == d + 1],
                                              key=lambda p: -values[p])[:width]
                            if values[p] >= min_log_prob]
                if not frontier:
                    break
            return last

        grow(-math.inf)
        whole = len(values)
        second_depth = sorted((v for p, v in values.items() if len(p) == 2), reverse=True)
        min_log_prob = -math.inf if cut is None else second_depth[min(cut, len(second_depth)) - 1]
        monkeypatch.setattr(eagle, "MIN_PATH_LOG_PROB", min_log_prob)
        drafter = EagleDrafter(engine._core.draft_runner, (), 64, width)
        seq = Sequence(Request("r", tokens, SamplingParams()), 0, list(tokens), None)
        seq.pages, seq.num_computed = [0, 1, 2], len(tokens) - 1
        EagleDrafter.observe(seq, 0, features)
        chunk = ScheduledChunk(seq, 1, samples=True, decode=True, num_lookahead=budget)
        runner, passes = engine._core.draft_runner, []
        execute = runner.execute
        runner.execute = lambda *a: passes.append(execute(*a)) or passes[-1]
        drafter.propose(Batch([chunk]), {chunk: depth})
        last = grow(min_log_prob)
        # The drafter's last pass: the logits of the last nodes it expanded.
        expected_logits = model.logits(torch.stack([states[p] for p in last]))
    finally:
        engine.shutdown()
    assert passes[-1].shape == expected_logits.shape
    assert torch.allclose(passes[-1], expected_logits, atol=1e-4, rtol=1e-4)
    assert len(passes) == 1 + max(map(len, last))  # (the catch-up, then a pass per depth)
    assert (cut is not None) == (len(values) < whole)
    expected = set(sorted(values, key=lambda p: (-values[p], len(p)))[:budget])
    draft = chunk.draft
    got = {tuple(draft.token_ids[i] for i in draft.path(n)) for n in range(len(draft))}
    assert got == expected
    greedy, path = [], ()
    while kids := [p for p in expected if p[:-1] == path and len(p) == len(path) + 1]:
        path = max(kids, key=lambda p: values[p])
        greedy.append(path[-1])
    assert draft.token_ids[: len(greedy)] == greedy and draft.parents[: len(greedy)] == list(range(-1, len(greedy) - 1))


@pytest.mark.parametrize("head, width", [("eagle1", 1), ("eagle1_vocab", 2), ("eagle3", 1)])
@torch.inference_mode()
def test_eagle_keeps_greedy_and_seeded_output_in_company(target, head, width):
    model_dir, _, _, heads = target
    prompts = [list(range(200 + 30 * i, 200 + 30 * i + n)) for i, n in enumerate((7, 25, 16, 40))]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    *expected, expected_seeded = plain_outputs(
        model_dir, [(p, GREEDY) for p in prompts] + [(prompts[1], seeded)], opt="O0")
    engine = Engine(model=model_dir, opt="O0", max_num_sequence=4, speculative_mode="eagle",
                    additional_models=[heads[head]], spec_draft_length=3, spec_tree_width=width,
                    verbose=False)
    try:
        assert isinstance(engine._core.speculator.drafter, EagleDrafter)
        assert run_concurrently(engine, prompts, GREEDY, delays=[0, 0.01, 0.03, 0.05]) == expected
        assert generate_tokens(engine, prompts[1], seeded) == expected_seeded
        stats = engine.stats()
        assert stats.spec_num_draft_tokens > 0
        if head != "eagle3":  # near the model's own head (EAGLE-3's drafts from inner layers)
            assert stats.spec_num_accepted_tokens > 0
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_eagle_under_preemption_and_prefix_reuse(target):
    model_dir, _, _, heads = target
    shared = list(range(900, 940))
    prompts = [shared + list(range(1000 + 10 * i, 1000 + 10 * i + 5)) for i in range(4)]
    # At the default level (the C++ kernels), against the same level without speculation.
    engine = Engine(model=model_dir, max_num_sequence=4, speculative_mode="eagle",
                    additional_models=[heads["eagle1"]], kv_cache_page_size=8,
                    max_total_sequence_length=160, verbose=False)
    try:
        got = run_concurrently(engine, prompts, GREEDY)
        assert engine._core.scheduler.num_preemptions > 0
        assert engine.stats().prefix_cache_hit_tokens > 0
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()
    assert got == plain_outputs(model_dir, [(p, GREEDY) for p in prompts])


def test_unseeded_sampling_with_eagle_follows_the_models_distribution(target):
    model_dir, _, _, heads = target
    assert_drafts_keep_the_distribution(model_dir, speculative_mode="eagle",
                                        additional_models=[heads["eagle1"]], spec_draft_length=3)


def test_the_plan_command_counts_the_head_as_the_engine_does(target, capsys):
    """``lmserve plan`` (the head's config only, no weights read) plans the head's layer and
    its KV at the draft level exactly as the engine does."""
    from lmserve import cli

    model_dir, args, nets, heads = target
    flags = dict(model=model_dir, speculative_mode="eagle", additional_models=[heads["eagle1"]],
                 opt="O2;draft_opt=O3", verbose=False)
    assert cli.main(["plan", "--model", model_dir, "--speculative-mode", "eagle", "--additional-models",
                     heads["eagle1"], "--opt", flags["opt"]]) == 0
    printed = capsys.readouterr().out
    engine = Engine(**flags)
    try:
        plan = engine._core.plan
        assert plan.draft_kv_dtype == "int8" and plan.describe() in printed
    finally:
        engine.shutdown()


def test_a_sequences_pending_features_grow_and_drop_as_a_plain_list_does():
    """The drafter's per-sequence feature buffer (appended in place, shrunk after a prefill
    chunk) against a plain list of rows, over random appends and drops."""
    from lmserve.speculative.eagle import _Pending

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(10000, 8, generator=gen)
    pending, reference, start, used = _Pending(5, rows[:3]), list(rows[:3]), 5, 3
    for n in torch.randint(0, 40, (200,), generator=gen).tolist() + [1500, 0, 1, 2]:
        pending.append(rows[used : used + n])
        reference += list(rows[used : used + n])
        used += n
        drop = min(len(reference), n // 2 + 1)
        pending.drop(drop)
        reference, start = reference[drop:], start + drop
        assert pending.start == start and pending.end == start + len(reference)
        assert torch.equal(pending.features, torch.stack(reference) if reference else rows[:0])
    pending.append(rows[used : used + 1000])  # a prefill chunk's rows, then run by the head
    pending.drop(len(pending.features) - 3)
    assert torch.equal(pending.features, rows[used + 997 : used + 1000])
    assert len(pending._buffer) <= 64  # the room it took is given back
