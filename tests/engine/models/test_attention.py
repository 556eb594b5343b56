"""Attention backends against a dense per-sequence SDPA reference on random paged caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import kernels
from pdserve.engine.models.attention import AttentionMetadata, CpuPagedAttention, TorchAttention, select_backend

BACKENDS = {"torch": TorchAttention, "cpu-paged": CpuPagedAttention}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_backend(name: str, dtype: torch.dtype, head_dim: int, window: int | None):
    if name == "torch":
        return TorchAttention(head_dim**-0.5, window)
    return CpuPagedAttention(head_dim**-0.5, window, dtype)


def dense_reference(q, keys, vals, window):
    """q [H, D] attends over keys/vals [n, Hkv, D] (all positions up to its own), masked SDPA in float64."""
    n, heads = keys.shape[0], q.shape[0]
    groups = heads // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, n, D]
    v = vals.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    pos = torch.arange(n)
    mask = pos >= n - window if window else torch.ones(n, dtype=torch.bool)
    o = F.scaled_dot_product_attention(
        q.double()[:, None, :], k, v, attn_mask=mask[None, None, :], scale=q.shape[-1] ** -0.5
    )
    return o[:, 0, :]


def random_paged_batch(lens, block_size, num_kv_heads, head_dim, dtype, gen):
    """K/V caches [num_blocks, block_size, Hkv, D] with each sequence's blocks scattered at random."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for b in need:
        tables.append(perm[at : at + b])
        at += b
    width = max(need)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, tables, table_tensor


def decode_metadata(lens, table_tensor) -> AttentionMetadata:
    """A decode step's metadata: one query row per sequence, at the last of its ``lens`` positions."""
    return AttentionMetadata(
        False,
        torch.zeros(len(lens), dtype=torch.int64),
        table_tensor,
        torch.tensor(lens, dtype=torch.int32),
        torch.arange(len(lens) + 1, dtype=torch.int32),
    )


def contiguous_kv(cache, table, n, block_size):
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
    return cache.flatten(0, 1)[slots]


CASES = [  # (lens, block_size, heads, kv_heads, head_dim, window)
    ([1], 16, 4, 4, 64, None),
    ([15, 16, 17, 1, 33], 16, 12, 4, 64, None),
    ([1, 2, 3, 40], 1, 8, 2, 32, None),
    ([31, 32, 33, 64, 65, 7], 32, 6, 2, 128, None),
    ([100, 5, 50, 17], 16, 4, 1, 16, 17),
    ([9, 300], 32, 12, 4, 64, 64),
    ([3, 70, 129], 16, 16, 16, 48, None),
    ([5, 47, 16], 16, 16, 2, 64, None),  # 8 query heads per KV head: two passes over V at head_dim 64
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_dense_reference(case, backend, dtype):
    lens, block_size, heads, kv_heads, head_dim, window = case
    gen = torch.Generator().manual_seed(sum(lens) + block_size)
    k_cache, v_cache, tables, table_tensor = random_paged_batch(lens, block_size, kv_heads, head_dim, dtype, gen)
    # q as a row-strided view, like the decoder's q|k slice of the fused projection
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :heads]
    meta = decode_metadata(lens, table_tensor)
    out = make_backend(backend, dtype, head_dim, window).decode(q, k_cache, v_cache, meta)
    assert out.shape == (len(lens), heads * head_dim) and out.dtype == dtype
    for i, n in enumerate(lens):
        want = dense_reference(
            q[i],
            contiguous_kv(k_cache, tables[i], n, block_size),
            contiguous_kv(v_cache, tables[i], n, block_size),
            window,
        )
        torch.testing.assert_close(out[i].view(heads, head_dim).double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_dense_reference(backend, window, block_size, dtype):
    lens, heads, kv_heads, head_dim = [1, 17, 6, 40], 6, 2, 64
    gen = torch.Generator().manual_seed(7 + block_size)
    k_cache, v_cache, tables, table_tensor = random_paged_batch(lens, block_size, kv_heads, head_dim, dtype, gen)
    T = sum(lens)
    q = torch.randn(T, heads, head_dim, generator=gen).to(dtype)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    # the decoder writes the step's K/V into the cache before attention: k/v are those slots
    slots = torch.cat(
        [
            torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(n)])
            for t, n in zip(tables, lens)
        ]
    )
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    meta = AttentionMetadata(
        True,
        slots,
        table_tensor,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        cu_seqlens=cu,
    )
    out = make_backend(backend, dtype, head_dim, window).prefill(q, k, v, k_cache, v_cache, meta)
    for s in range(len(lens)):
        for i in range(cu[s], cu[s + 1]):  # each query sees its own sequence up to itself
            want = dense_reference(q[i], k[cu[s] : i + 1], v[cu[s] : i + 1], window)
            torch.testing.assert_close(out[i].view(heads, head_dim).double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window", [None, 9])
def test_paged_kernel_takes_the_last_rows_of_longer_sequences(window):
    """Query rows that are the tail of a longer cached sequence (a prefill chunk after cached
    blocks, or decode): row r of a sequence with n KV positions and m rows sees positions
    0 .. n - m + r."""
    lens, rows, heads, kv_heads, head_dim, block_size = [40, 5, 33, 16], [7, 5, 1, 16], 8, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, table_tensor = random_paged_batch(
        lens, block_size, kv_heads, head_dim, torch.float32, gen
    )
    starts = [0]
    for m in rows:
        starts.append(starts[-1] + m)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        True,
        torch.zeros(starts[-1], dtype=torch.int64),
        table_tensor,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )
    out = make_backend("cpu-paged", torch.float32, head_dim, window).decode(q, k_cache, v_cache, meta)
    for s, (n, m) in enumerate(zip(lens, rows)):
        keys = contiguous_kv(k_cache, tables[s], n, block_size)
        vals = contiguous_kv(v_cache, tables[s], n, block_size)
        for r in range(m):
            seen = n - m + r + 1
            want = dense_reference(q[starts[s] + r], keys[:seen], vals[:seen], window)
            torch.testing.assert_close(out[starts[s] + r].view(heads, head_dim).double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [1, 9, 1, 3, 16, 1, 2, 1]], ids=["decode", "mixed"])
def test_paged_kernel_gives_the_same_bits_on_any_number_of_threads(rows, dtype):
    """Each thread takes a contiguous run of work items of about equal cost, and a decode item asks
    for its successor's first rows: whatever the split, every row is computed once, in the same
    order, and right (lengths on both sides of the 64-position chunks, one far longer than the rest)."""
    lens, heads, kv_heads, head_dim, block_size = [1, 700, 3, 64, 65, 129, 2, 300], 12, 4, 64, 16
    rows = rows or [1] * len(lens)
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables, table_tensor = random_paged_batch(lens, block_size, kv_heads, head_dim, dtype, gen)
    starts = [0]
    for m in rows:
        starts.append(starts[-1] + m)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        any(m > 1 for m in rows),
        torch.zeros(starts[-1], dtype=torch.int64),
        table_tensor,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )
    backend, before, outs = make_backend("cpu-paged", dtype, head_dim, None), torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            outs.append(backend.decode(q, k_cache, v_cache, meta))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for s, (n, m) in enumerate(zip(lens, rows)):
        keys = contiguous_kv(k_cache, tables[s], n, block_size)
        vals = contiguous_kv(v_cache, tables[s], n, block_size)
        for r in range(m):
            want = dense_reference(q[starts[s] + r], keys[: n - m + r + 1], vals[: n - m + r + 1], None)
            got = outs[0][starts[s] + r].view(heads, head_dim).double()
            torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    kernels.load_cpu_kernels.cache_clear()
    try:
        backend = select_backend("auto", torch.device("cpu"), torch.float32, 4, 2, 64, None)
        assert backend.name == "torch"
        with pytest.raises(kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
            select_backend("cpu-paged", torch.device("cpu"), torch.float32, 4, 2, 64, None)
    finally:
        kernels.load_cpu_kernels.cache_clear()


def test_auto_picks_the_paged_kernel_on_cpu():
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16, 12, 4, 64, None).name == "cpu-paged"
    # more query heads per KV head than the kernel holds: the reference path, not a wrong answer
    assert select_backend("auto", torch.device("cpu"), torch.float32, 64, 2, 64, None).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", torch.device("cpu"), torch.float32, 4, 4, 64, None)


def test_kernel_is_built_once_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    kernels.load_cpu_kernels.cache_clear()
    try:
        kernels.load_cpu_kernels()
        built = list((tmp_path / "kernels").glob("*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        kernels.load_cpu_kernels.cache_clear()
        kernels.load_cpu_kernels()
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [mtime]
    finally:
        kernels.load_cpu_kernels.cache_clear()
