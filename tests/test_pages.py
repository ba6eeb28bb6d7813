"""Page pool: exact ids, reference counts and errors."""

import pytest

from lmserve.cache.pages import OutOfPages, PagePool, pages_needed


def test_alloc_hands_out_lowest_ids_first_and_recycles_in_release_order():
    pool = PagePool(4)
    assert pool.alloc(2) == [0, 1]
    assert pool.alloc(1) == [2]
    pool.release([1, 0])
    assert pool.num_free == 3
    assert pool.alloc(3) == [3, 1, 0]
    assert pool.num_free == 0


def test_alloc_is_all_or_nothing():
    pool = PagePool(3)
    pool.alloc(2)
    with pytest.raises(OutOfPages, match="asked for 2 pages, 1 free"):
        pool.alloc(2)
    assert pool.num_free == 1


def test_shared_page_is_freed_by_its_last_owner_only():
    pool = PagePool(2)
    [p] = pool.alloc(1)
    pool.share([p])
    assert pool.refcount(p) == 2
    pool.release([p])
    assert pool.num_free == 1 and pool.refcount(p) == 1
    pool.release([p])
    assert pool.num_free == 2 and pool.refcount(p) == 0


def test_misuse_is_refused():
    pool = PagePool(2)
    with pytest.raises(ValueError, match="page 0 released more often"):
        pool.release([0])
    with pytest.raises(ValueError, match="page 1 is free"):
        pool.share([1])
    with pytest.raises(ValueError, match="num_pages must be positive"):
        PagePool(0)


@pytest.mark.parametrize("tokens,expected", [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2)])
def test_pages_needed(tokens, expected):
    assert pages_needed(tokens, 16) == expected
