"""Page pool: exact ids, reference counts and errors; the KV tensors the pages index."""


import pytest
import torch

from lmserve.cache.kv import KVCache
from lmserve.cache.pages import OutOfPages, PagePool, pages_needed


def test_alloc_hands_out_lowest_ids_first_then_the_most_recently_freed():
    pool = PagePool(4)
    assert pool.alloc(2) == [0, 1]
    assert pool.alloc(1) == [2]
    pool.release([1, 0])
    assert pool.num_free == 3
    assert pool.alloc(3) == [0, 1, 3]  # warm pages before one never used
    assert pool.num_free == 0


def test_short_requests_one_after_another_reuse_the_same_pages():
    """Resident memory follows the pages ever handed out: sequential traffic must stay on a few."""
    pool = PagePool(1000)
    seen = set()
    for i in range(500):
        pages = pool.alloc(1 + i % 3)
        seen.update(pages)
        pool.release(pages)
    assert seen == {0, 1, 2}


def test_idle_pages_are_the_used_ones_free_long_enough_each_reported_once(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("lmserve.cache.pages.time.monotonic", lambda: clock[0])
    pool = PagePool(8)
    a = pool.alloc(3)
    pool.release(a[:2])
    clock[0] += 10
    b = pool.alloc(1)  # takes a[1] back: no longer idle
    pool.release(a[2:])
    assert pool.idle_pages(5.0) == [a[0]]  # a[2] was freed just now; never-used pages never count
    assert pool.idle_pages(5.0) == []
    clock[0] += 10
    assert pool.idle_pages(5.0) == [a[2]]
    pool.release(b)
    assert pool.idle_pages(0.0) == b


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


def _memory_mib(t: torch.Tensor) -> float:
    """Memory taken by the mapping holding ``t`` (its anonymous pages in /proc/self/smaps:
    reading untouched memory maps the shared zero page, which is not counted; nor is the rest
    of the process, freeing and allocating meanwhile)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Anonymous:":
                return int(line.split()[1]) / 1024
    raise AssertionError("no mapping holds the tensor")


def test_kv_cache_reads_as_zeros_and_takes_memory_only_where_written():
    """A server-sized cache must not cost its full size (or the time to zero it) up front."""
    kv = KVCache(num_layers=2, num_pages=16384, page_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.bfloat16)  # 2 x 2 x 128 MiB
    k = kv.k[1]
    assert k.shape == (16384 * 16, 4, 64) and k.dtype == torch.bfloat16 and k.is_contiguous()
    assert _memory_mib(k) < 1
    k[100:116] = 1.5  # one page written
    assert k[100:116].eq(1.5).all() and k[:100].eq(0).all() and k[116:5000].eq(0).all()
    assert _memory_mib(k) < 1
    k[:] = 1  # now every byte of one layer's keys
    assert _memory_mib(k) > 100


def test_discarded_pages_read_as_zeros_and_give_their_memory_back():
    kv = KVCache(num_layers=2, num_pages=4096, page_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.bfloat16, keys_transposed=True)  # 8 KiB a page and buffer
    for t in kv.k + kv.v:
        t.view(-1)[:] = 1
    assert all(_memory_mib(t) > 30 for t in kv.k + kv.v)
    kv.discard([*range(0, 4000), 4001])
    for t in kv.k + kv.v:
        # What is left: 95 pages of each of the 4 buffers (3 MiB; adjacent maps may show as one).
        assert _memory_mib(t) < 4
        pages = t.view(4096, -1)
        assert pages[:4000].eq(0).all() and pages[4001].eq(0).all()
        assert pages[4000].eq(1).all() and pages[4002:].eq(1).all()  # kept: not discarded
    kv.k[0].view(4096, -1)[7] = 2  # discarded memory is ordinary memory again when written
    assert kv.k[0].view(4096, -1)[7].eq(2).all()


def test_kv_cache_transposed_keys_hold_each_pages_keys_by_dimension():
    kv = KVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=2, head_dim=32,
                 keys_transposed=True)
    assert kv.k[0].shape == (8, 2, 32, 16) and kv.v[0].shape == (8 * 16, 2, 32)


def test_int8_kv_cache_keeps_scales_after_each_heads_codes():
    kv = KVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=2, head_dim=32,
                 dtype=torch.int8, keys_transposed=True)
    assert kv.k[0].shape == (8, 2, 32 + 8, 16) and kv.v[0].shape == (8, 2, 32 + 4, 16)
    with pytest.raises(ValueError, match="keys transposed"):
        KVCache(1, 8, 16, 2, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of 4 tokens, got kv_cache_page_size=2"):
        KVCache(1, 8, 2, 2, 32, dtype=torch.int8, keys_transposed=True)
