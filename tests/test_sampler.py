"""Behaviour of the batched sampler: each stage, reproducibility, distributions and logprobs."""

from typing import Optional

import numpy as np
import pytest
import torch

from lmserve import sampler
from lmserve.sampler import SamplingBatch, sample
from lmserve.sampling_params import SamplingParams

V = 32


def build(
    params: list[SamplingParams],
    generators: Optional[list[Optional[torch.Generator]]] = None,
    prompts: Optional[list[list[int]]] = None,
    outputs: Optional[list[list[int]]] = None,
    vocab_size: int = V,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.build(
        params,
        generators if generators is not None else [None] * rows,
        prompts if prompts is not None else [[] for _ in range(rows)],
        outputs if outputs is not None else [[] for _ in range(rows)],
        vocab_size,
        "cpu",
        eos_token_ids=eos_token_ids,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw_counts(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical token frequencies of ``draws`` independent draws from one row's settings."""
    generator = seeded(1234)
    batch = build([params] * draws, [generator] * draws, vocab_size=logits_row.numel())
    tokens = sample(logits_row.expand(draws, -1), batch).token_ids  # (draws,)
    return torch.bincount(tokens, minlength=logits_row.numel()).float() / draws


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, V, generator=seeded(0)) * 3  # (B, V)


def test_greedy_is_argmax_and_takes_the_fast_path(logits, monkeypatch):
    batch = build([SamplingParams(temperature=0)] * logits.shape[0])
    assert batch.greedy_fast_path

    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy fast path must be a single argmax")

    monkeypatch.setattr(sampler, "_apply_bias_and_penalties", forbidden)
    monkeypatch.setattr(sampler, "_filtered_probs", forbidden)
    monkeypatch.setattr(sampler, "_draw", forbidden)
    result = sample(logits, batch)
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert result.logprobs is None and result.top_ids is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.5),
        dict(logit_bias={1: 1.0}),
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=0.1),
        dict(presence_penalty=-0.1),
        dict(logprobs=0),
        dict(min_tokens=2, stop_token_ids=[3]),
    ],
)
def test_anything_beyond_plain_greedy_leaves_the_fast_path(kwargs):
    params = [SamplingParams(temperature=0), SamplingParams(**{"temperature": 0, **kwargs})]
    assert not build(params).greedy_fast_path


def test_stages_nobody_uses_are_not_built():
    batch = build([SamplingParams(), SamplingParams(temperature=0, top_k=3, top_p=0.5)])
    assert batch.seen is None and batch.output_counts is None and batch.bias_index is None
    # Filters on a greedy row cannot change its argmax, so they are not built either.
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None


def test_penalty_tensors_are_built_only_for_penalties_in_use():
    rep = build([SamplingParams(repetition_penalty=1.3)], prompts=[[1]], outputs=[[2]])
    assert rep.seen is not None and rep.frequency_penalties is None
    freq = build([SamplingParams(frequency_penalty=1.0)], prompts=[[1]], outputs=[[2]])
    assert freq.seen is None and freq.output_counts is not None


def test_greedy_rows_in_a_mixed_batch_take_the_argmax(logits):
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5)] * 3
    result = sample(logits, build(params))
    assert torch.equal(result.token_ids[0::2], logits[0::2].argmax(dim=-1))


def test_logits_are_not_modified(logits):
    before = logits.clone()
    params = [
        SamplingParams(top_k=3, top_p=0.5, min_p=0.1, temperature=0.7, logit_bias={0: 5}),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1, presence_penalty=1),
    ] * 3
    sample(logits, build(params, prompts=[[1, 2]] * 6, outputs=[[3]] * 6))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_keeping_only_the_top_token_equals_greedy(logits, kwargs):
    rows = logits.shape[0]
    params = [SamplingParams(temperature=1.3, **kwargs)] * rows
    for step in range(5):
        generators = [seeded(step * 100 + row) for row in range(rows)]
        assert torch.equal(sample(logits, build(params, generators)).token_ids, logits.argmax(-1))


def test_top_k_support_is_the_k_most_likely():
    logits_row = torch.tensor([2.0, 0.0, 1.5, -1.0, 1.0, 0.5])
    frequencies = draw_counts(logits_row, SamplingParams(top_k=3), 4000)
    assert set(frequencies.nonzero().flatten().tolist()) == {0, 2, 4}


def test_top_p_support_is_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # Mass before token 1 is 0.5 < 0.7, so it stays; before token 2 it is 0.8 >= 0.7.
    frequencies = draw_counts(probs.log(), SamplingParams(top_p=0.7), 4000)
    assert set(frequencies.nonzero().flatten().tolist()) == {0, 1}
    # Renormalised over the nucleus: 0.5 / 0.8 and 0.3 / 0.8.
    assert frequencies[0].item() == pytest.approx(0.625, abs=0.03)
    # A top_p that rounds to 0 in float32 (the fuzzer sent 5e-324) keeps the most likely token.
    assert draw_counts(probs.log(), SamplingParams(top_p=5e-324), 50)[0].item() == 1.0


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999, 1.0])
def test_top_p_keeps_the_nucleus_however_wide(top_p):
    """Against a plain full sort: rows whose nucleus lies within the most likely 1,024 tokens
    (peaked) and rows where it does not (flat), in one batch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5000, generator=g) * torch.tensor([[8.0], [0.1], [3.0], [0.5]])
    x = logits.clone()
    sampler._top_p_(x, torch.full((4,), top_p))
    for row in range(4):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        nucleus = order[(before < top_p) | (top_p >= 1.0)]
        assert set(x[row].isfinite().nonzero().flatten().tolist()) == set(nucleus.tolist())


def test_min_p_excludes_tokens_below_the_threshold():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    # Threshold 0.15 * 0.5 = 0.075: tokens 3 and 4 are out.
    frequencies = draw_counts(probs.log(), SamplingParams(min_p=0.15), 6000)
    assert set(frequencies.nonzero().flatten().tolist()) == {0, 1, 2}
    expected = torch.tensor([0.5, 0.3, 0.1, 0.0, 0.0]) / 0.9
    assert torch.allclose(frequencies, expected, atol=0.03)


def test_filters_compose_in_order():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    # top_k=4 drops token 4; top_p=0.8 over the renormalised rest keeps 0, 1, 2 (mass before
    # token 3 is 0.85/0.95 = 0.89); min_p=0.55 then drops token 2 (0.2 < 0.55 * 0.4).
    params = SamplingParams(top_k=4, top_p=0.8, min_p=0.55)
    frequencies = draw_counts(probs.log(), params, 4000)
    assert set(frequencies.nonzero().flatten().tolist()) == {0, 1}


def test_temperature_applies_before_filtering():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # At temperature 4 the distribution is about [0.32, 0.28, 0.23, 0.18]: the 0.7 nucleus
    # grows to three tokens (it would be {0, 1} if filtering came first).
    frequencies = draw_counts(probs.log(), SamplingParams(temperature=4.0, top_p=0.7), 4000)
    assert set(frequencies.nonzero().flatten().tolist()) == {0, 1, 2}


def test_empirical_frequencies_match_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    frequencies = draw_counts(probs.log() + 7.0, SamplingParams(), 20000)
    # The standard error of each frequency is at most 0.0035 here.
    assert torch.allclose(frequencies, probs, atol=0.015)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_rescales_the_distribution(temperature):
    logits_row = torch.tensor([1.0, 0.0, -0.5, -1.0])
    frequencies = draw_counts(logits_row, SamplingParams(temperature=temperature), 20000)
    expected = (logits_row / temperature).softmax(dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.015)


def test_lower_temperature_concentrates_on_the_argmax():
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5])
    top_share = [
        draw_counts(logits_row, SamplingParams(temperature=t), 4000)[0].item()
        for t in (3.0, 1.0, 0.3, 0.05)
    ]
    assert top_share == sorted(top_share)
    assert top_share[0] < 0.4 and top_share[-1] > 0.99


def test_shared_default_generator_rows_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = 20000
    torch.manual_seed(0)
    tokens = sample(probs.log().expand(draws, -1), build([SamplingParams()] * draws, vocab_size=3))
    frequencies = torch.bincount(tokens.token_ids, minlength=3).float() / draws
    assert torch.allclose(frequencies, probs, atol=0.015)


def test_penalties_match_a_hand_computation():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    params = [
        SamplingParams(
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logit_bias={"5": 1.5},
        ),
        SamplingParams(),  # shares the batch, must stay untouched
    ]
    batch = build(params, prompts=[[0, 1], [0, 1]], outputs=[[3, 3, 4], [3, 3, 4]], vocab_size=6)
    processed = sampler._apply_bias_and_penalties(logits, batch)
    # Bias first: token 5 -> 2.5. Repetition over prompt+output {0, 1, 3, 4}: positive logits
    # are halved, negative ones doubled. Then output counts {3: 2, 4: 1}:
    # token 3: 1.5 - 0.5 * 2 - 0.25 = 0.25; token 4: -4 - 0.5 * 1 - 0.25 = -4.75.
    expected = torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 2.5])
    assert torch.allclose(processed[0], expected)
    assert torch.equal(processed[1], logits[1])


def test_penalties_steer_a_greedy_row():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])

    def greedy_token(**kwargs) -> int:
        params = [SamplingParams(temperature=0, **kwargs)]
        batch = build(params, prompts=[[0]], outputs=[[]], vocab_size=4)
        return sample(logits, batch).token_ids.item()

    assert greedy_token() == 0
    assert greedy_token(repetition_penalty=1.2) == 1
    # Frequency and presence penalties look at the output only, not at the prompt.
    assert greedy_token(presence_penalty=2.0, frequency_penalty=2.0) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_forbids_tokens(logits, temperature):
    rows = logits.shape[0]
    weakest = logits.argmin(dim=-1)  # (B,)
    forced = [
        SamplingParams(temperature=temperature, logit_bias={int(weakest[row]): 100})
        for row in range(rows)
    ]
    result = sample(logits / 10, build(forced, [seeded(row) for row in range(rows)]))
    assert torch.equal(result.token_ids, weakest)

    strongest = logits.argmax(dim=-1)  # (B,)
    forbidden = [
        SamplingParams(temperature=0, logit_bias={str(int(strongest[row])): -100})
        for row in range(rows)
    ]
    chosen = sample(logits, build(forbidden)).token_ids
    assert not torch.any(chosen == strongest)


def test_min_tokens_bans_stop_and_eos_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0  # eos
    logits[0, 6] = 9.0  # a stop token
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])]
    early = build(params, outputs=[[1]], eos_token_ids=(5,))
    token = sample(logits, early).token_ids.item()
    assert token not in (5, 6)
    reached = build(params, outputs=[[1, 2]], eos_token_ids=(5,))
    assert sample(logits, reached).token_ids.item() == 5


def _run_seeded(position: int, others: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    """Ten steps of one seeded row placed at ``position`` among ``others``."""
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    params = others[:position] + [target] + others[position:]
    own = seeded(7)
    other_generators: list[Optional[torch.Generator]] = [
        None if row % 2 else seeded(1000 + row) for row in range(len(others))
    ]
    generators = other_generators[:position] + [own] + other_generators[position:]
    rows = logits.shape[0]
    tokens = []
    for _ in range(10):
        step_logits = logits[[position % rows] * len(params)].clone()  # (B, V)
        step_logits[position] = logits[0]
        result = sample(step_logits, build(params, generators))
        tokens.append(result.token_ids[position].item())
    return tokens


def test_seeded_row_is_independent_of_its_batch(logits):
    alone = _run_seeded(0, [], logits)
    mixed = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, min_p=0.05),
        SamplingParams(top_k=3, seed=99, logprobs=2),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(temperature=0.3),
    ]
    assert len(set(alone)) > 1  # the row does draw, so equality below means something
    assert _run_seeded(3, mixed, logits) == alone
    assert _run_seeded(0, mixed[::-1], logits) == alone
    assert _run_seeded(1, mixed[:2], logits) == alone
    assert _run_seeded(5, mixed, logits) == alone


def test_logprobs_are_those_of_the_raw_logits(logits):
    rows = logits.shape[0]
    counts = [5, 0, 2, None, 20, 1]
    params = [
        SamplingParams(
            temperature=0.0 if row % 2 else 0.7,
            repetition_penalty=1.5,
            logit_bias={3: 2.0},
            logprobs=counts[row],
        )
        for row in range(rows)
    ]
    batch = build(params, [seeded(row) for row in range(rows)], prompts=[[1, 2]] * rows)
    result = sample(logits, batch)
    raw = logits.log_softmax(dim=-1)  # (B, V)

    assert result.top_ids.shape == result.top_logprobs.shape == (rows, 20)
    assert torch.allclose(result.logprobs, raw.gather(1, result.token_ids[:, None]).squeeze(1))
    for row, count in enumerate(counts):
        asked = count or 0
        top_ids = result.top_ids[row, :asked]
        top_logprobs = result.top_logprobs[row, :asked]
        assert torch.allclose(top_logprobs, raw[row, top_ids])
        assert torch.equal(top_logprobs, top_logprobs.sort(descending=True).values)
        assert torch.equal(top_ids, raw[row].topk(asked).indices)
        assert torch.all(result.top_ids[row, asked:] == -1)
        assert torch.all(result.top_logprobs[row, asked:] == float("-inf"))


def test_greedy_token_is_first_among_its_top_logprobs(logits):
    rows = logits.shape[0]
    result = sample(logits, build([SamplingParams(temperature=0, logprobs=3)] * rows))
    assert torch.equal(result.top_ids[:, 0], result.token_ids)
    assert torch.allclose(result.top_logprobs[:, 0], result.logprobs)


def test_zero_logprobs_gives_only_the_chosen_token(logits):
    result = sample(logits, build([SamplingParams(logprobs=0)] * logits.shape[0]))
    assert result.top_ids.shape == (logits.shape[0], 0)
    assert result.logprobs.shape == (logits.shape[0],)


def test_sample_refuses_logits_of_another_shape():
    batch = build([SamplingParams(temperature=0)] * 2)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.zeros(2, V + 1), batch)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.zeros(3, V), batch)


def test_build_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SamplingParams()], [], [[]], [[]], V, "cpu")
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingBatch.build([SamplingParams()], [None], [[]], [], V, "cpu")


@pytest.mark.parametrize("vocab_size", [3, 700])
def test_a_draws_margin_is_its_quantiles_distance_to_the_nearer_edge_of_its_tokens_share(vocab_size):
    """``sample(..., margins=True)`` (what a drafter's draw near an edge is judged by): three
    tokens hold 0.2, 0.5 and 0.3 of the mass (spread over two-level blocks when the vocabulary
    is wider), and the quantile 0.25 falls in the second's share [0.2, 0.7), 0.05 from its edge;
    0.68 falls 0.02 from the other edge; greedy rows have no edge (inf)."""
    probs = torch.zeros(2, vocab_size)
    ids = [0, vocab_size // 2, vocab_size - 1]
    probs[:, ids] = torch.tensor([0.2, 0.5, 0.3]) * 7  # (unnormalised)
    tokens, margins = sampler._inverse_cdf(probs, np.array([0.25, 0.68]))
    assert tokens.tolist() == [ids[1], ids[1]]
    assert margins.tolist() == pytest.approx([0.05, 0.02], abs=1e-6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    batch = SamplingBatch.build(params, [None, None], [[1], [1]], [[], []], vocab_size, "cpu")
    result = sample(probs.log(), batch, margins=True)
    assert result.margins[0] == float("inf") and 0 <= result.margins[1] <= 0.35


def test_a_row_without_mass_draws_the_last_token_of_the_vocabulary():
    """A row whose every token is masked (a grammar no token can continue: NaN probabilities)
    draws the vocabulary's last token, which the grammar then refuses; with a vocabulary that
    is not a whole number of blocks, that is still inside it (it once came out past the end)."""
    probs = torch.full((2, 700), float("nan"))
    probs[1] = 0.0
    tokens, margins = sampler._inverse_cdf(probs, np.array([0.3, 0.6]))
    assert tokens.tolist() == [699, 699] and margins.tolist() == [0.0, 0.0]
