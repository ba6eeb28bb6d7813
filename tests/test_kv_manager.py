"""The KV-cache manager without a model: exact page ids for prefix reuse, lookahead, rollback."""

from lmserve.cache.manager import KVCacheManager
from lmserve.cache.pages import PagePool
from lmserve.cache.radix import RadixCache
from lmserve.request import Request, Sequence
from lmserve.sampling_params import SamplingParams

PS = 4  # tokens per page


def make(num_pages=8, cache=True):
    pool = PagePool(num_pages)
    return pool, KVCacheManager(pool, PS, RadixCache(pool, PS) if cache else None)


def seq(tokens: list[int]) -> Sequence:
    return Sequence(Request("r", list(tokens), SamplingParams()), 0, list(tokens), None)


def test_lookahead_pages_for_drafts_are_rolled_back_to_the_verified_tokens():
    pool, kv = make()
    s = seq(list(range(6)))
    assert kv.allocate(s, 6) and s.pages == [0, 1]
    s.num_computed = 6
    s.token_ids.append(6)
    # The newest token plus 4 draft slots: positions 6..10 need a third page.
    assert kv.pages_to_allocate(s, 1, lookahead=4) == 1
    assert kv.allocate(s, 1, lookahead=4) and s.pages == [0, 1, 2]
    s.num_computed = 8  # the newest token and one draft verified: positions 0..7
    kv.rollback(s)
    assert s.pages == [0, 1] and pool.num_free == 6
    kv.rollback(s)  # nothing past the verified tokens: a no-op
    assert s.pages == [0, 1]


def test_allocation_is_all_or_nothing_and_evicts_cached_prefixes_first():
    pool, kv = make(num_pages=4)
    a = seq(list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed = 8
    kv.free(a, recycle=True)  # its two full pages stay in the prefix cache
    assert pool.num_free == 2 and a.pages == [] and a.num_computed == 0
    b = seq(list(range(100, 120)))
    assert not kv.allocate(b, 20)  # 5 pages: more than the pool has, nothing taken
    assert b.pages == [] and pool.num_free == 2
    assert kv.allocate(b, 16)  # 4 pages: the cache gives up a's two
    assert sorted(b.pages) == [0, 1, 2, 3] and kv.prefix_cache.num_pages == 0


def test_a_matched_prefix_is_shared_and_given_back_on_free():
    pool, kv = make()
    a = seq(list(range(10)))
    assert kv.allocate(a, 10)
    a.num_computed = 10
    kv.cache(a)  # pages 0 and 1 are full and verified
    b = seq(list(range(9)) + [77])
    assert kv.match_prefix(b)
    assert b.pages == [0, 1] and b.num_computed == 8
    assert [pool.refcount(p) for p in (0, 1, 2)] == [3, 3, 1]  # a, b and the cache
    assert not kv.match_prefix(b)  # a sequence with KV is not matched again
    kv.free(b)
    assert [pool.refcount(p) for p in (0, 1, 2)] == [2, 2, 1]
    assert kv.pages_held_by_sequences() == 3  # a's three; the cache alone holds none


def test_the_last_token_is_never_matched_and_no_cache_matches_nothing():
    _, kv = make()
    a = seq(list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed = 8
    kv.cache(a)
    b = seq(list(range(8)))  # the same 8 tokens: the 8th must run to give logits
    kv.match_prefix(b)
    assert b.num_computed == 4
    _, off = make(cache=False)
    c = seq(list(range(8)))
    assert not off.match_prefix(c) and c.pages == []


def test_a_cache_only_page_that_eviction_cannot_take_fails_the_allocation_cleanly():
    # x and y start together (nothing cached yet) with the same first page. x's page goes in
    # the cache, y's second page becomes a child node that y still holds. Once x is gone its
    # page is cache-only (counted evictable), but it is not a leaf, so eviction cannot free it.
    pool, kv = make(num_pages=5)
    x, y = seq(list(range(4))), seq(list(range(8)))
    assert kv.allocate(x, 4) and kv.allocate(y, 8)
    x.num_computed, y.num_computed = 4, 8
    kv.cache(x)
    kv.cache(y)
    kv.free(x)
    assert pool.num_free == 2 and kv.prefix_cache.evictable_pages() == 1
    z = seq(list(range(100, 112)))
    assert not kv.allocate(z, 12)  # 3 pages: 2 free + 1 "evictable" that is not
    assert z.pages == [] and pool.num_free == 2
