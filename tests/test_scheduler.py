"""Scheduler without a model: exact chunks, page ids, preemption order (vLLM-style cache tests)."""

from lmserve.cache.manager import KVCacheManager
from lmserve.cache.pages import PagePool
from lmserve.request import Request, SeqStatus, Sequence
from lmserve.sampling_params import SamplingParams
from lmserve.scheduler import SCORED_ROWS_PER_STEP, Scheduler


def seq(name: str, prompt_len: int, params: SamplingParams = SamplingParams()) -> Sequence:
    req = Request(name, list(range(prompt_len)), params=params)
    s = Sequence(req, 0, list(range(prompt_len)), seed=None)
    req.seqs.append(s)
    return s


def run(sched: Scheduler):
    """One step as the engine does it; returns [(name, tokens, samples)] and appends a token."""
    batch = sched.schedule()
    if batch is None:
        return []
    for c in batch.chunks:
        if c.samples:
            c.seq.token_ids.append(0)
    sched.update(batch)
    return [(c.seq.request.request_id, c.num_tokens, c.samples) for c in batch.chunks]


def make(num_pages=16, page_size=4, max_seqs=4, chunk=16, mode="hybrid"):
    pool = PagePool(num_pages)
    return pool, Scheduler(KVCacheManager(pool, page_size), max_seqs, chunk, mode)


def test_long_prompt_is_prefilled_in_chunks_and_decodes_join_the_next_prompt():
    pool, s = make(chunk=16)
    a, b = seq("a", 20), seq("b", 10)
    s.add(a)
    s.add(b)
    assert run(s) == [("a", 16, False)]
    assert a.pages == [0, 1, 2, 3]
    # a's last 4 prompt tokens, then b gets the 12 tokens left of the budget (needs only 10).
    assert run(s) == [("a", 4, True), ("b", 10, True)]
    assert a.pages == [0, 1, 2, 3, 4] and b.pages == [5, 6, 7]
    # Both decode together from now on.
    assert run(s) == [("a", 1, True), ("b", 1, True)]
    assert pool.num_used == 9


def test_hybrid_rides_decodes_along_a_prefill_and_chunked_alternates():
    for mode, expected in [
        ("hybrid", [[("a", 1, True), ("b", 8, True)]]),
        # After a's prefill step comes a decode step, then b's prefill step.
        ("chunked", [[("a", 1, True)], [("b", 8, True)]]),
    ]:
        _, s = make(chunk=16, mode=mode)
        a, b = seq("a", 4), seq("b", 8)
        s.add(a)
        assert run(s) == [("a", 4, True)]
        s.add(b)
        assert [run(s) for _ in expected] == expected, mode
        assert run(s) == [("a", 1, True), ("b", 1, True)]


def test_chunked_decodes_are_not_starved_by_a_stream_of_new_prompts():
    _, s = make(chunk=16, max_seqs=8, mode="chunked")
    a = seq("a", 4)
    s.add(a)
    run(s)
    steps = []
    for i in range(6):
        s.add(seq(f"p{i}", 8))  # a new prompt before every step
        steps.append(run(s))
    # a decodes in every other step; the steps between are prompts only (8 tokens each).
    assert [any(name == "a" for name, _, _ in step) for step in steps] == [True, False] * 3
    assert all(n == 8 for step in steps[1::2] for _, n, _ in step)
    assert a.num_output_tokens == 4


def test_decodes_count_against_the_step_budget():
    _, s = make(chunk=4, max_seqs=8)
    firsts = [seq(f"s{i}", 1) for i in range(3)]
    for x in firsts:
        s.add(x)
    run(s)  # the three one-token prompts
    big = seq("big", 10)
    s.add(big)
    # 3 decode tokens leave one token of the budget for the new prompt.
    assert run(s) == [("s0", 1, True), ("s1", 1, True), ("s2", 1, True), ("big", 1, False)]


def test_max_num_sequence_bounds_the_running_set():
    _, s = make(max_seqs=2)
    seqs = [seq(f"s{i}", 2) for i in range(3)]
    for x in seqs:
        s.add(x)
    assert [n for n, _, _ in run(s)] == ["s0", "s1"]
    assert list(s.waiting) == [seqs[2]]
    s.finish(seqs[0])
    assert [n for n, _, _ in run(s)] == ["s1", "s2"]


def test_newest_running_sequence_is_preempted_when_pages_run_out():
    pool, s = make(num_pages=4, page_size=4)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    assert run(s) == [("a", 8, True), ("b", 8, True)]
    assert pool.num_free == 0
    # a's 9th token needs a third page: b (newest) gives its pages back and waits at the head.
    assert run(s) == [("a", 1, True)]
    assert a.pages == [0, 1, 3] and b.pages == []  # the page b freed last
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1
    # b's 9 tokens (prompt + its sampled token) come back once a finishes.
    s.finish(a)
    assert pool.num_free == 4
    assert run(s) == [("b", 9, True)]


def test_an_older_sequence_takes_the_pages_of_a_newer_one():
    pool, s = make(num_pages=3, page_size=4)
    a, b = seq("a", 4), seq("b", 8)
    s.add(a)
    s.add(b)
    run(s)  # a: 1 page, b: 2 pages, every page used
    # a needs a second page first (it is older): b is preempted for it.
    assert run(s) == [("a", 1, True)]
    assert b.status is SeqStatus.WAITING
    assert pool.num_free == 1


def test_the_newest_sequence_preempts_itself_rather_than_an_older_one():
    pool, s = make(num_pages=3, page_size=4)
    a, b = seq("a", 3), seq("b", 8)
    s.add(a)
    s.add(b)
    run(s)  # a: 1 page (room for its 4th token), b: 2 pages full; every page used
    assert run(s) == [("a", 1, True)]  # b needs a third page and is itself the newest
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.WAITING
    assert a.pages == [0] and pool.num_free == 2


def test_head_of_queue_that_does_not_fit_blocks_later_arrivals():
    pool, s = make(num_pages=4, page_size=4, chunk=64)
    a, big, small = seq("a", 8), seq("big", 12), seq("small", 2)
    s.add(a)
    run(s)
    s.add(big)
    s.add(small)
    assert run(s) == [("a", 1, True)]  # big needs 3 pages, 1 is free; small must wait behind it
    assert list(s.waiting) == [big, small]


def test_finish_frees_every_page_of_running_and_waiting_sequences():
    pool, s = make(num_pages=8)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    run(s)
    c = seq("c", 3)
    s.add(c)
    for x in (a, b, c):
        s.finish(x)
    assert pool.num_free == 8
    assert not s.has_work()


def test_a_prefill_that_preempts_itself_is_not_readmitted_in_the_same_step():
    # Chunked mode, 6 one-token pages: a decodes; b's prefill keeps running out of pages.
    pool, s = make(num_pages=6, page_size=1, max_seqs=2, chunk=1, mode="chunked")
    a = seq("a", 3)
    s.add(a)
    for _ in range(3):
        run(s)
    b = seq("b", 4)
    s.add(b)
    for _ in range(40):
        run(s)
        if a.num_output_tokens >= 3:
            break
    assert a.num_output_tokens >= 3  # a keeps decoding instead of b livelocking the engine


def test_one_prefill_or_decode_state_a_lone_last_prompt_token_is_prefill():
    # "Is this a decode?" had three answers; a prompt's last token left alone counted as a
    # decode in the scheduler (out of the prefill budget, ahead of prefills) and was never
    # offered to the prefix cache.
    _, s = make(chunk=8, mode="chunked")
    a, b = seq("a", 9), seq("b", 3)
    s.add(a)
    assert run(s) == [("a", 8, False)]
    assert not a.is_decoding and a.num_pending == 1
    s.add(b)
    batch = s.schedule()  # a prefill step: a's last prompt token and b share the budget
    assert [(c.seq.request.request_id, c.num_tokens, c.decode) for c in batch.chunks] == [
        ("a", 1, False), ("b", 3, False)]
    a.token_ids.append(0)
    b.token_ids.append(0)
    s.update(batch)
    assert a.is_decoding and b.is_decoding
    batch = s.schedule()
    assert [(c.seq.request.request_id, c.num_tokens, c.decode) for c in batch.chunks] == [
        ("a", 1, True), ("b", 1, True)]
    s._preempt(b)  # recomputing after a preemption is a prefill again
    assert not b.is_decoding


def test_prompts_scored_in_one_step_share_its_scored_rows():
    """Each scored prompt token is a logit row of the whole vocabulary: the step's sequences
    together score at most SCORED_ROWS_PER_STEP (what the memory plan holds); others prefill,
    and tokens scored before a preemption run again without counting."""
    n = SCORED_ROWS_PER_STEP
    _, s = make(num_pages=4 * n, chunk=4 * n, max_seqs=4)
    scoring = SamplingParams(prompt_logprobs=1)
    a, b, c = seq("a", 200, scoring), seq("b", 100, scoring), seq("c", 300)
    for x in (a, b, c):
        s.add(x)
    # a scores 199 rows (its last token's row samples); b gets the n - 199 left; c, not
    # scoring, takes the rest of the budget.
    assert run(s) == [("a", 200, True), ("b", n - 199, False), ("c", 300, True)]
    assert run(s) == [("a", 1, True), ("b", 100 - (n - 199), True), ("c", 1, True)]
    # d scored 150 tokens before it was preempted: those and n more rows fit one step.
    d = seq("d", 600, scoring)
    d.request.prompt_logprobs.extend([None] * 150)
    s.add(d)
    assert run(s)[-1] == ("d", 150 + n, False)
