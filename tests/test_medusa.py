"""Medusa heads: the published layouts load (and bad ones are refused by name), and drafting
from them never changes the output."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_drafts_keep_the_distribution, generate_tokens, plain_outputs, run_concurrently, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.config import EngineConfig, parse_opt
from lmserve.models.loader import read_model_args
from lmserve.plan import make_plan
from lmserve.request import Request, Sequence
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative import medusa
from lmserve.speculative.draft_vocab import write_draft_vocab
from lmserve.speculative.medusa import MedusaDrafter, read_medusa_heads
from tiny_models import make_hf_llama, random_model

HIDDEN, HEADS, LAYERS = 64, 3, 1
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def medusa_tensors(lm_head: torch.Tensor, layout: str = "medusa", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Medusa heads whose projections are near the model's own head (so that they draft
    tokens the model likes), in FasterDecoding's names or vLLM's."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(HEADS):
        for j in range(LAYERS):
            w, b = 0.05 * torch.randn(HIDDEN, HIDDEN, generator=g), 0.05 * torch.randn(HIDDEN, generator=g)
            names = (f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias") if layout == "medusa" else \
                (f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias")
            out |= dict(zip(names, (w, b)))
        head = lm_head + 0.01 * torch.randn(lm_head.shape, generator=g)
        out[f"{i}.{LAYERS}.weight" if layout == "medusa" else f"lm_heads.{i}.weight"] = head
    return out


def write_heads(directory, tensors, choices=None, fmt: str = "safetensors") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": HEADS, "medusa_num_layers": LAYERS}
    if choices is not None:
        config["medusa_choices"] = choices
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(directory / "medusa_lm_head.safetensors"))
    else:
        torch.save(tensors, str(directory / "medusa_lm_head.pt"))
    return str(directory)


@pytest.fixture(autouse=True)
def every_path_drafted(monkeypatch):
    """Random heads' paths are far less likely than the drafter's cut (``MIN_PATH_LOG_PROB``),
    which would end every chain and tree at its first depth: here they are drafted whole, so
    that deep chains and trees run end to end (the test of the cut sets its own)."""
    monkeypatch.setattr(medusa, "MIN_PATH_LOG_PROB", -math.inf)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama model and Medusa heads for it in each layout."""
    root = tmp_path_factory.mktemp("medusa")
    model_dir = make_hf_llama(str(root / "model"), hidden_size=HIDDEN, seed=4)
    lm_head = random_model(hidden_size=HIDDEN, seed=4).lm_head.weight.detach()
    heads = {layout: write_heads(root / layout, medusa_tensors(lm_head, layout))
             for layout in ("medusa", "vllm")}
    heads["pt"] = write_heads(root / "pt", medusa_tensors(lm_head), fmt="pt")
    heads["choices"] = write_heads(root / "choices", medusa_tensors(lm_head),  # (0,) implied
                                   choices=[[1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    # ... drafting among the even token ids only (lmserve's draft_vocab.json)
    write_draft_vocab(heads["choices"], torch.arange(0, lm_head.shape[0], 2))
    return model_dir, heads


def test_the_published_layouts_load_alike(target):
    model_dir, heads = target
    args = read_model_args(model_dir)
    loaded = {layout: read_medusa_heads(heads[layout], args) for layout in ("medusa", "vllm", "pt")}
    hidden = torch.randn(2, HIDDEN)
    drafters = {layout: MedusaDrafter(h, parse_opt("O0")) for layout, h in loaded.items()}
    reference = drafters["medusa"].logits(hidden)
    assert reference.shape == (HEADS, 2, args.vocab_size)
    for layout in ("vllm", "pt"):
        assert torch.equal(drafters[layout].logits(hidden), reference)
    assert torch.equal(drafters["medusa"].logits(hidden, 2), reference[:2])
    # At the default draft level (O3: int8 weights and activations), within its rounding.
    quantized = MedusaDrafter(loaded["medusa"], parse_opt("O3")).logits(hidden)
    assert 0 < (quantized - reference).abs().max() < 0.05 * reference.abs().max()
    with_choices = read_medusa_heads(heads["choices"], args)
    assert with_choices.choices[:3] == [(0,), (1,), (0, 0)]
    assert with_choices.vocab.tolist() == list(range(0, args.vocab_size, 2))
    assert with_choices.heads[0].shape == (args.vocab_size // 2, HIDDEN)
    # The plan counts the heads with the weights, from the file's header, at the draft level
    # (int8 blocks at the default O3, float32 at O0).
    size = HEADS * (LAYERS * (HIDDEN * HIDDEN + HIDDEN) + args.vocab_size * HIDDEN)
    for opt, per_weight in (("O2", 1.25), ("O2;draft_opt=O0", 4)):
        config = EngineConfig(speculative_mode="medusa", additional_models=[heads["medusa"]], opt=opt)
        plan = make_plan(config, args)
        assert plan.memory.draft == int(size * per_weight)
        assert "medusa_heads" in plan.describe() and plan.speculative.startswith("medusa")


def test_bad_heads_are_refused_naming_the_tensor(target, tmp_path):
    model_dir, heads = target
    args = read_model_args(model_dir)
    good = medusa_tensors(torch.zeros(args.vocab_size, HIDDEN))
    wrong_shape = dict(good, **{"1.0.linear.weight": torch.zeros(HIDDEN, HIDDEN + 1)})
    with pytest.raises(ValueError, match=r"head 1 block 0 is \(64, 65\)"):
        read_medusa_heads(write_heads(tmp_path / "a", wrong_shape), args)
    unknown = dict(good, **{"medusa.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="tensor 'medusa.extra'"):
        read_medusa_heads(write_heads(tmp_path / "b", unknown), args)
    small_vocab = dict(good, **{"2.1.weight": torch.zeros(100, HIDDEN)})
    with pytest.raises(ValueError, match=r"head 2's vocabulary projection is \(100, 64\)"):
        read_medusa_heads(write_heads(tmp_path / "c", small_vocab), args)
    stray = dict(good, **{"3.0.linear.weight": torch.zeros(HIDDEN, HIDDEN)})
    with pytest.raises(ValueError, match=r"blocks for \[0, 1, 2, 3\]"):
        read_medusa_heads(write_heads(tmp_path / "d", stray), args)
    with pytest.raises(ValueError, match="medusa_choices makes a tree of 72 tokens"):
        read_medusa_heads(write_heads(tmp_path / "e", good, choices=[[i] for i in range(72)]), args)
    # vLLM's blocks may come without a bias (its medusa_fc_bias=False): zeros.
    no_bias = {n: t for n, t in medusa_tensors(torch.zeros(args.vocab_size, HIDDEN), "vllm").items()
               if not n.endswith("bias")}
    assert not read_medusa_heads(write_heads(tmp_path / "f", no_bias), args).blocks[0][0][1].any()
    with pytest.raises(FileNotFoundError, match="additional_models\\[0\\] \\(the Medusa heads\\)"):
        Engine(model=model_dir, speculative_mode="medusa", additional_models=[str(tmp_path)], verbose=False)


@pytest.mark.parametrize("heads_kind, width", [("medusa", 1), ("medusa", 2), ("choices", 1)])
@torch.inference_mode()
def test_medusa_keeps_greedy_and_seeded_output_in_company(target, heads_kind, width):
    """Chains, trees of the heads' top candidates, and Medusa's choices: the same tokens as
    speculation off, alone and in batch company, greedy and seeded."""
    model_dir, heads = target
    prompts = [list(range(200 + 30 * i, 200 + 30 * i + n)) for i, n in enumerate((7, 25, 16, 40))]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    *expected, expected_seeded = plain_outputs(
        model_dir, [(p, GREEDY) for p in prompts] + [(prompts[1], seeded)], opt="O0")
    engine = Engine(model=model_dir, opt="O0", max_num_sequence=4, speculative_mode="medusa",
                    additional_models=[heads[heads_kind]], spec_draft_length=3, spec_tree_width=width,
                    verbose=False)
    try:
        core = engine._core
        assert isinstance(core.speculator.drafter, MedusaDrafter)
        # The hidden state each sequence drafts from is the one its newest token was sampled
        # from (greedy: that row's argmax), also when the accepted path of a tree moved.
        sampled_from, append = {}, core._append

        def observe(seq, start, hidden):
            sampled_from[seq] = int(core.runner.model.logits(hidden[-1:]).argmax())
            MedusaDrafter.observe(seq, start, hidden)

        def checked_append(new_tokens):
            for seq, token_ids, _ in new_tokens:
                assert token_ids[-1] == sampled_from.pop(seq)
            return append(new_tokens)

        core.speculator.drafter.observe = observe
        core._append = checked_append
        assert run_concurrently(engine, prompts, GREEDY, delays=[0, 0.01, 0.03, 0.05]) == expected
        core._append = append  # the check holds for greedy rows only
        del core.speculator.drafter.observe
        assert generate_tokens(engine, prompts[1], seeded) == expected_seeded
        stats = engine.stats()
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_medusa_under_preemption_and_prefix_reuse(target):
    model_dir, heads = target
    shared = list(range(900, 940))
    prompts = [shared + list(range(1000 + 10 * i, 1000 + 10 * i + 5)) for i in range(4)]
    expected = plain_outputs(model_dir, [(p, GREEDY) for p in prompts], opt="O0")
    engine = Engine(model=model_dir, opt="O0", max_num_sequence=4, speculative_mode="medusa",
                    additional_models=[heads["medusa"]], kv_cache_page_size=8,
                    max_total_sequence_length=160, verbose=False)
    try:
        assert run_concurrently(engine, prompts, GREEDY) == expected
        assert engine._core.scheduler.num_preemptions > 0
        assert engine.stats().prefix_cache_hit_tokens > 0
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def test_unseeded_sampling_with_medusa_follows_the_models_distribution(target):
    model_dir, heads = target
    assert_drafts_keep_the_distribution(model_dir, speculative_mode="medusa",
                                        additional_models=[heads["medusa"]], spec_draft_length=3)


@pytest.mark.parametrize("heads_kind, width", [("medusa", 1), ("medusa", 2), ("choices", 1)])
@pytest.mark.parametrize("cut", [None, 1, 2])
@torch.inference_mode()
def test_a_path_goes_on_only_while_the_heads_find_it_likely(target, monkeypatch, heads_kind,
                                                             width, cut):
    """The drafter's tree against one built by brute force from the heads' log-probabilities:
    a node's children are drafted only while its path (the sum of its tokens' log-probabilities,
    each from its depth's head) is at least ``MIN_PATH_LOG_PROB``; ``cut``: that of the best
    first draft's path (1) or the best second-depth path (2), so the chain ends there."""
    model_dir, heads = target
    drafter = MedusaDrafter(read_medusa_heads(heads[heads_kind], read_model_args(model_dir)),
                            parse_opt("O0"), width)
    hidden = 3 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7))
    best = drafter.logits(hidden[None])[:, 0].log_softmax(-1).topk(2)  # (depth, rank)
    vocab = drafter.vocab if drafter.vocab is not None else torch.arange(best.indices.max() + 1)
    token = vocab[best.indices].tolist()
    log_prob = best.values.tolist()
    chain = [log_prob[0][0], log_prob[0][0] + log_prob[1][0]]
    min_log_prob = -math.inf if cut is None else chain[cut - 1]
    monkeypatch.setattr(medusa, "MIN_PATH_LOG_PROB", min_log_prob)

    def value(ranks: tuple[int, ...]) -> float:
        return sum(log_prob[d][r] for d, r in enumerate(ranks))

    if drafter.choices is not None:
        paths = {p[:n] for p in drafter.choices for n in range(1, len(p) + 1)}
    else:
        paths = {(0,) * d + (r,) for d in range(HEADS) for r in range(width)}
    expected = {tuple(token[d][r] for d, r in enumerate(p)) for p in paths
                if value(p[:-1]) >= min_log_prob}
    seq = Sequence(Request("r", [1, 2, 3], SamplingParams()), 0, [1, 2, 3], None)
    seq.draft_state = hidden
    chunk = ScheduledChunk(seq, 1, samples=True, decode=True, num_lookahead=16)
    drafter.propose(Batch([chunk]), {chunk: HEADS})
    draft = chunk.draft
    got = {tuple(draft.token_ids[i] for i in draft.path(n)) for n in range(len(draft))}
    assert got == expected and len(draft) == len(expected)  # (no node twice)
    assert all(parent < i for i, parent in enumerate(draft.parents))
    assert max(map(len, got)) == (HEADS if cut is None else cut + 1)
