"""Page pool: exact ids, reference counts and errors; the KV tensors the pages index."""

import os

import pytest
import torch

from lmserve.cache.kv import KVCache
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


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_kv_cache_reads_as_zeros_and_takes_memory_only_where_written():
    """A server-sized cache must not cost its full size (or the time to zero it) up front."""
    before = _resident_mib()
    kv = KVCache(num_layers=2, num_pages=16384, page_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.bfloat16)  # 2 x 2 x 128 MiB
    assert _resident_mib() - before < 64
    k = kv.k[1]
    assert k.shape == (16384 * 16, 4, 64) and k.dtype == torch.bfloat16 and k.is_contiguous()
    k[100:116] = 1.5  # one page written
    assert k[100:116].eq(1.5).all() and k[:100].eq(0).all() and k[116:5000].eq(0).all()
    assert _resident_mib() - before < 64
    k[:] = 1  # now every byte of one layer's keys
    assert _resident_mib() - before > 100
