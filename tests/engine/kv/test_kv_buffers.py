import torch

from pdserve.engine.kv.buffers import HostBuffers
from pdserve.engine.kv.codec import KvDecoder, encode_kv, pack_kv
from tests.engine.kv._kv_payloads import make_fp, make_payload


def test_take_reuses_the_smallest_cached_buffer_that_fits():
    pool = HostBuffers(max_bytes=100 << 10, max_buffers=3, min_bytes=1 << 10)
    a, b = pool.take(30 << 10), pool.take(10 << 10)
    assert a.dtype == torch.uint8 and a.numel() == 30 << 10 and pool.reused == 0
    pool.give(a.view(torch.float32).view(2, -1))  # any view gives back the whole storage
    pool.give(b[:5])
    assert pool.cached_bytes == 40 << 10
    c = pool.take(8 << 10)
    assert c.numel() == 8 << 10 and c.data_ptr() == b.data_ptr() and pool.reused == 1
    d = pool.take(20 << 10)
    assert d.data_ptr() == a.data_ptr() and pool.cached_bytes == 0
    assert pool.take(20 << 10).data_ptr() not in (a.data_ptr(), b.data_ptr())  # nothing cached: new memory


def test_bounds():
    pool = HostBuffers(max_bytes=100 << 10, max_buffers=2, min_bytes=1 << 10)
    small = pool.take(100)
    pool.give(small)
    assert pool.cached_bytes == 0  # under min_bytes: not cached
    pool.give(torch.empty(200 << 10, dtype=torch.uint8))
    assert pool.cached_bytes == 0  # over max_bytes
    bufs = [pool.take(n << 10) for n in (10, 20, 30)]
    for buf in bufs:
        pool.give(buf)
    pool.give(bufs[0])  # twice: cached once
    assert pool.cached_bytes == 30 << 10  # at most 2 buffers: the largest was dropped
    for n in (40, 50):
        pool.give(torch.empty(n << 10, dtype=torch.uint8))
    assert pool.cached_bytes <= 100 << 10


def test_decoder_decodes_into_the_given_memory():
    fp = make_fp()
    src = make_payload(fp, 30)
    pool = HostBuffers(min_bytes=1)
    first = KvDecoder(fp, alloc=pool.take)
    first.add(pack_kv(src))
    kv = first.finish().kv
    pool.give(kv)
    second = KvDecoder(fp, alloc=pool.take)
    for part in encode_kv(src):
        second.add(part)
    again = second.finish().kv
    assert again.data_ptr() == kv.data_ptr() and pool.reused == 1
    assert torch.equal(again, src.kv)
