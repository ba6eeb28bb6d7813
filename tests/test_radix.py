"""Radix prefix cache without a model: exact page ids, reference counts, splits, LRU eviction."""

from lmserve.cache.pages import PagePool
from lmserve.cache.radix import RadixCache
from lmserve.util import cdiv

PS = 4  # tokens per page


def make(num_pages=16, max_recycled=None):
    pool = PagePool(num_pages)
    return pool, RadixCache(pool, PS, max_recycled)


def seq_pages(pool, tokens):
    """Pages a sequence of ``tokens`` would hold after computing them all."""
    return pool.alloc(cdiv(len(tokens), PS))


def test_match_is_page_aligned_and_takes_no_reference():
    pool, cache = make()
    toks = list(range(10))  # 2 full pages + 2 tokens
    pages = seq_pages(pool, toks)  # [0, 1, 2]
    cache.insert(toks, pages)
    assert cache.num_pages == 2  # the partly filled page 2 is not cached
    assert [pool.refcount(p) for p in pages] == [2, 2, 1]
    assert cache.match(list(range(12))) == [0, 1]
    assert cache.match(list(range(7))) == [0]  # only whole pages match
    assert cache.match([0, 1, 2, 99, 4]) == []
    assert [pool.refcount(p) for p in pages] == [2, 2, 1]


def test_insert_of_a_diverging_sequence_splits_the_edge_and_shares_the_common_pages():
    pool, cache = make()
    a = list(range(12))
    pa = seq_pages(pool, a)  # [0, 1, 2]
    cache.insert(a, pa)
    # b shares the first page of a, then diverges; it reused page 0 from the cache.
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57]
    shared = cache.match(b)
    assert shared == [0]
    pool.share(shared)
    pb = shared + pool.alloc(2)  # [0, 3, 4]
    cache.insert(b, pb)
    assert cache.num_pages == 5
    assert cache.match(a) == [0, 1, 2] and cache.match(b) == [0, 3, 4]
    assert [pool.refcount(p) for p in range(5)] == [3, 2, 2, 2, 2]
    # The root has one child (the shared first page); it has two children.
    (top,) = cache.root.children.values()
    assert top.pages == [0] and sorted(c.pages[0] for c in top.children.values()) == [1, 3]


def test_pages_already_cached_stay_with_their_owner():
    pool, cache = make()
    toks = list(range(8))
    first = seq_pages(pool, toks)  # [0, 1]
    second = seq_pages(pool, toks)  # [2, 3]: computed again by a concurrent sequence
    cache.insert(toks, first)
    cache.insert(toks, second)
    assert cache.match(toks) == [0, 1]
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    pool.release(second)
    assert pool.num_free == 16 - 2


def test_evict_frees_least_recently_used_unshared_leaves_first():
    pool, cache = make(num_pages=8)
    for base in (0, 100, 200):
        toks = list(range(base, base + 8))
        pages = seq_pages(pool, toks)
        cache.insert(toks, pages)
        pool.release(pages)  # the sequence finished: only the cache holds its pages
    assert pool.num_free == 2 and cache.evictable_pages() == 6
    cache.match(list(range(0, 8)))  # touch the first: now the second is the oldest
    assert cache.evict(1) == 2  # whole leaves are evicted
    assert cache.match(list(range(100, 108))) == []
    assert cache.match(list(range(0, 8))) == [0, 1]
    assert pool.num_free == 4


def test_pages_in_use_by_a_sequence_are_never_evicted():
    pool, cache = make(num_pages=4)
    toks = list(range(8))
    pages = seq_pages(pool, toks)
    cache.insert(toks, pages)  # still held by the running sequence
    assert cache.evict(4) == 0 and cache.evictable_pages() == 0
    pool.release(pages)
    assert cache.evict(4) == 2 and pool.num_free == 4


def test_recycling_limit_keeps_only_the_newest_finished_sequences():
    pool, cache = make(max_recycled=2)
    for base in (0, 100, 200):
        toks = list(range(base, base + 4))
        pages = seq_pages(pool, toks)
        cache.recycle(toks, pages)
        pool.release(pages)
    assert cache.match(list(range(4))) == []  # the oldest was dropped
    assert cache.match(list(range(100, 104))) != [] and cache.match(list(range(200, 204))) != []
    assert cache.num_pages == 2 and pool.num_free == 14


def test_recycling_limit_zero_keeps_nothing_and_clear_frees_everything():
    pool, cache = make(max_recycled=0)
    pages = seq_pages(pool, list(range(8)))
    cache.recycle(list(range(8)), pages)
    assert cache.num_pages == 0
    pool.release(pages)
    pool2, cache2 = make()
    pages = seq_pages(pool2, list(range(8)))
    cache2.insert(list(range(8)), pages)
    pool2.release(pages)
    cache2.clear()
    assert pool2.num_free == 16 and cache2.num_pages == 0


def test_a_partial_match_splits_the_edge_so_the_unmatched_tail_stays_evictable():
    pool, cache = make(num_pages=10)
    toks = list(range(24))  # one 6-page edge
    pages = seq_pages(pool, toks)
    cache.insert(toks, pages)
    pool.release(pages)
    shared = cache.match(toks[:4] + [99] * 23)
    assert shared == [pages[0]]
    pool.share(shared)  # a new sequence now holds the first page
    # The other five pages are a leaf of their own that nobody else uses.
    assert cache.evictable_pages() == 5 and cache.evict(5) == 5
    assert pool.num_free == 9
