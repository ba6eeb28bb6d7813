"""The KV-cache manager: the scheduler's only door to KV memory.

It keeps each sequence's page table (``Sequence.pages``) in step with what the sequence has
computed: reuse a cached prefix, allocate (with lookahead for drafts), offer verified tokens to
the prefix cache, roll back rejected drafts, give back pages past a window, free. Only full
pages of verified tokens enter the prefix cache, complete in every cache that shares the pages
(a drafter's KV, recurrent-state snapshots). docs/architecture.md tells the rules.
"""

from __future__ import annotations

from typing import Optional

from lmserve.attention.base import RELEASED
from lmserve.attention.window import AttentionWindow
from lmserve.cache.pages import PagePool
from lmserve.cache.radix import RadixCache
from lmserve.cache.state_manager import StateManager
from lmserve.request import Sequence
from lmserve.util import cdiv


class KVCacheManager:
    """Full-attention paged KV: a sequence holds the pages of positions ``[0, len)`` in order."""

    def __init__(self, pool: PagePool, page_size: int,
                 prefix_cache: Optional[RadixCache] = None, with_draft: bool = False,
                 window: Optional[AttentionWindow] = None,
                 states: Optional[StateManager] = None, paged: bool = True,
                 lazy_draft: bool = False) -> None:
        self.pool = pool
        self.states = states
        self.paged = paged
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.with_draft = with_draft
        self.lazy_draft = lazy_draft
        self._draft_pages: set[int] = set()  # lazy_draft: pages that hold the draft's KV too
        self.window = window
        self._sink_pages = cdiv(window.sinks, page_size) if window else 0

    def match_prefix(self, seq: Sequence) -> bool:
        """Start a sequence without KV from the cached pages of its longest cached prefix
        (``seq.num_computed`` becomes the tokens reused); returns whether the cache was consulted.

        The last token is never matched: its forward pass gives the logits to sample from. Nor
        is a prompt being scored (``prompt_logprobs``): each of its tokens needs its logits.
        """
        if seq.num_computed or seq.pages or seq.scores_prompt:
            return False
        if self.states is not None:
            return self._match_state(seq, self.states)
        if self.prefix_cache is None:
            return False
        pages = self.prefix_cache.match(seq.token_ids[:-1])
        self.pool.share(pages)
        seq.pages = pages
        seq.num_computed = len(pages) * self.page_size
        seq.num_draft_computed = seq.num_computed if self.with_draft else 0
        if self.lazy_draft:
            with_draft = next((i for i, p in enumerate(pages) if p not in self._draft_pages), len(pages))
            seq.num_draft_computed = with_draft * self.page_size
        self.release_past_window(seq)
        return True

    def _match_state(self, seq: Sequence, states: StateManager) -> bool:
        """``match_prefix`` with recurrent layers: the longest snapshot within the cached pages
        (a hybrid's) or the prompt (all recurrent)."""
        if states.snapshots is None:
            return False
        pages = self.prefix_cache.match(seq.token_ids[:-1]) if self.prefix_cache else []
        limit = len(pages) * self.page_size if self.paged else len(seq.token_ids) - 1
        n = states.match(seq, limit)
        seq.pages = pages[: n // self.page_size] if self.paged else []
        self.pool.share(seq.pages)
        seq.num_computed = n
        return True

    def pages_to_allocate(self, seq: Sequence, num_tokens: int, lookahead: int = 0) -> int:
        """New pages ``allocate(seq, num_tokens, lookahead)`` would take."""
        if not self.paged:
            return 0
        return max(0, cdiv(seq.num_computed + num_tokens + lookahead, self.page_size)
                   - len(seq.pages))

    def allocate(self, seq: Sequence, num_tokens: int, lookahead: int = 0,
                 evict: bool = True) -> bool:
        """Give ``seq`` pages for ``num_tokens`` more tokens plus ``lookahead`` draft slots,
        evicting unused cached prefixes if needed (and ``evict``); all or nothing, and nothing
        is evicted when even the whole cache could not make room. False: not enough memory."""
        need = self.pages_to_allocate(seq, num_tokens, lookahead)
        if need > self.pool.num_free:
            cache = self.prefix_cache if evict else None
            if cache is None or need > self.pool.num_free + cache.evictable_pages():
                return False
            cache.evict(need - self.pool.num_free)
            # evictable_pages counts a cache-only page under a leaf still in use, which evict
            # cannot take: check what it freed.
            if need > self.pool.num_free:
                return False
        new = self.pool.alloc(need)
        self._draft_pages.difference_update(new)  # (what a page held before is gone)
        seq.pages += new
        if self.states is not None:
            self.states.ensure(seq)
        return True

    def cache(self, seq: Sequence) -> None:
        """Offer the sequence's verified tokens (those with KV) to the prefix cache now, so that
        requests arriving meanwhile can share them."""
        if self.prefix_cache is not None:
            self._note_draft_pages(seq)
            self.prefix_cache.insert(seq.token_ids[: self._num_cacheable(seq)], seq.pages)
        if self.states is not None:
            self.states.at_boundary(seq)

    def chunk_limit(self, seq: Sequence, num_tokens: int) -> int:
        """``num_tokens`` of ``seq``'s pending prompt, cut where a recurrent model keeps a state
        snapshot (``StateManager.chunk_end``)."""
        return self.states.chunk_end(seq, num_tokens) if self.states is not None else num_tokens

    def ready(self, seq: Sequence) -> bool:
        """Whether a waiting ``seq`` may be admitted now (``StateManager.ready``: the later
        choices of a request wait for the first's state to fork from)."""
        return self.states is None or self.states.ready(seq)

    def rollback(self, seq: Sequence) -> None:
        """Release the pages past the sequence's verified tokens (those reserved for drafts
        that were rejected), and forget a draft model's KV of rejected tokens. Stale KV is never
        read: attention stops at the context, and the next write replaces it."""
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)
        keep = cdiv(seq.num_computed, self.page_size)
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]

    def keep_state(self, seq: Sequence, start: int, ran: int) -> None:
        """A step ran ``ran`` tokens of ``seq`` from ``start`` and kept ``seq.num_computed - start``
        of them: roll a recurrent state back past rejected drafts (KV needs nothing: see
        ``rollback``)."""
        if self.states is not None:
            self.states.keep(seq, start, ran)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The recurrent-state copies decided since the last step, for the next one to make."""
        return self.states.take_copies() if self.states is not None else []

    def release_past_window(self, seq: Sequence) -> None:
        """Give back the pages of ``seq`` that no query from its next token on can see (under a
        window on every layer; else nothing). Pages a rejected draft could roll back into lie
        past ``num_computed`` and are never among them."""
        if self.window is None:
            return
        oldest = min(seq.num_computed, seq.num_draft_computed) if self.with_draft else seq.num_computed
        end = min(self.window.first_needed(oldest) // self.page_size, len(seq.pages))
        first = self._sink_pages + seq.num_released_pages
        if end > first:
            self.pool.release(seq.pages[first:end])
            seq.pages[first:end] = [RELEASED] * (end - first)
            seq.num_released_pages += end - first

    def pages_held(self, seq: Sequence) -> int:
        """Pages of ``seq``'s table that it still holds."""
        return len(seq.pages) - seq.num_released_pages

    def free(self, seq: Sequence, recycle: bool = False) -> None:
        """Release every page of ``seq`` (offering its verified tokens to the prefix cache first
        when ``recycle``); the sequence then has no KV (``num_computed`` is 0)."""
        if recycle and self.prefix_cache is not None:
            self._note_draft_pages(seq)
            self.prefix_cache.recycle(seq.token_ids[: self._num_cacheable(seq)], seq.pages)
        if self.states is not None:
            self.states.free(seq, snapshot=recycle)
        self.pool.release([p for p in seq.pages if p != RELEASED])
        seq.pages = []
        seq.num_computed = seq.num_draft_computed = seq.num_released_pages = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The KV cache slot of ``seq``'s token at ``position`` (it must have a page)."""
        return seq.pages[position // self.page_size] * self.page_size + position % self.page_size

    def pages_held_by_sequences(self) -> int:
        """Pages some sequence holds (pages only the prefix cache holds do not count)."""
        cache_only = self.prefix_cache.evictable_pages() if self.prefix_cache else 0
        return self.pool.num_used - cache_only

    def _note_draft_pages(self, seq: Sequence) -> None:
        """Remember the pages of ``seq`` that its draft's KV fills (``lazy_draft``)."""
        if self.lazy_draft:
            self._draft_pages.update(seq.pages[: min(seq.num_draft_computed, seq.num_computed)
                                               // self.page_size])

    def _num_cacheable(self, seq: Sequence) -> int:
        """Leading tokens whose KV every cache holds (a lazy draft's aside), before any page the
        window released."""
        n = min(seq.num_computed, seq.num_draft_computed) \
            if self.with_draft and not self.lazy_draft else seq.num_computed
        if seq.num_released_pages:
            n = min(n, self._sink_pages * self.page_size)
        return n
