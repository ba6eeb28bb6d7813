"""Page pool: exact ids, reference counts and errors; the KV tensors the pages index."""

import ctypes
import mmap

import pytest
import torch

from lmserve.cache.free_list import OutOfIds
from lmserve.cache.kv import KVCache
from lmserve.cache.pages import PagePool
from lmserve.util import cdiv


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
    with pytest.raises(OutOfIds, match="asked for 2 pages, 1 free"):
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
    with pytest.raises(ValueError, match="number of pages must be >= 0"):
        PagePool(-1)


@pytest.mark.parametrize("tokens,expected", [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2)])
def test_cdiv_gives_the_pages_for_tokens(tokens, expected):
    assert cdiv(tokens, 16) == expected


def _pfn(pagemap, address: int) -> int:
    """The physical frame of the system page at ``address``; -1 where none is mapped."""
    pagemap.seek(address // mmap.PAGESIZE * 8)
    entry = int.from_bytes(pagemap.read(8), "little")
    return entry & ((1 << 55) - 1) if entry >> 63 else -1


def _memory_mib(t: torch.Tensor) -> float:
    """Memory the bytes of ``t`` take: its system pages mapped to a frame of their own (from
    /proc/self/pagemap; reading untouched memory maps the shared zero page, which is not
    counted; nor is anything else of the process, whatever shares the tensor's mapping)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    probe[0]  # maps the zero page
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    with open("/proc/self/pagemap", "rb") as pagemap:
        zero = _pfn(pagemap, address)
        assert zero > 0, "page frame numbers need root (CAP_SYS_ADMIN)"
        first, end = t.data_ptr(), t.data_ptr() + t.nbytes
        frames = [_pfn(pagemap, a) for a in range(first // mmap.PAGESIZE * mmap.PAGESIZE, end, mmap.PAGESIZE)]
    del address
    probe.close()
    return sum(f not in (-1, zero) for f in frames) * mmap.PAGESIZE / 2**20


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
    free = {*range(0, 4000), 4001}
    kv.discard(sorted(free), free.__contains__)
    for t in kv.k + kv.v:
        assert 0.7 < _memory_mib(t) < 0.8  # what is left: 95 pages of 8 KiB
        pages = t.view(4096, -1)
        assert pages[:4000].eq(0).all() and pages[4001].eq(0).all()
        assert pages[4000].eq(1).all() and pages[4002:].eq(1).all()  # kept: not discarded
    kv.k[0].view(4096, -1)[7] = 2  # discarded memory is ordinary memory again when written
    assert kv.k[0].view(4096, -1)[7].eq(2).all()


def test_pages_discarded_one_at_a_time_give_back_the_system_pages_they_share():
    # 4352-byte pages (16 tokens x 68 float32): most system pages straddle two KV pages.
    kv = KVCache(num_layers=1, num_pages=1024, page_size=16, num_kv_heads=1, head_dim=68)
    buffers = kv.k + kv.v
    for t in buffers:
        t.view(-1)[:] = 1
    used = set(range(1024))
    for p in range(0, 1024, 2):  # every other page, one by one, with its neighbours still used
        used.discard(p)
        kv.discard([p], lambda q: q not in used)
    assert all(t.view(1024, -1)[1::2].eq(1).all() for t in buffers)  # pages in use keep every byte
    for p in range(1, 1024, 2):
        used.discard(p)
        kv.discard([p], lambda q: q not in used)
    assert all(_memory_mib(t) == 0 for t in buffers)  # nothing left behind at the edges
    assert all(t.eq(0).all() for t in buffers)


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
