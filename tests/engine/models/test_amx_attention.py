"""bfloat16 paged attention on AMX tiles (engine/models/csrc/amx_attention.cpp), which
``pdserve_paged_attention_bf16`` runs where the CPU has AMX: against float64 arithmetic for decode
and prefill rows (grouped-query, sliding windows, head_dim 64, 128 and 256, block sizes 16 and 32), a row
alone giving the same bits as beside others, and the calls it leaves to paged_attention.cpp. Skips
on CPUs without AMX.

Tolerance: 2e-2, as tests/engine/models/test_attention.py's for bfloat16 (p is rounded to bfloat16
before its product with V, and the output once).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels

CASES = [  # (query rows per sequence, sequence lengths, heads, kv heads, head_dim, block_size, window)
    ([1, 1, 1, 1], [1, 16, 17, 100], 12, 4, 64, 16, 0),
    ([1, 17, 5, 64], [1, 17, 100, 64], 12, 4, 64, 16, 0),
    ([3, 1, 40], [40, 33, 70], 9, 3, 64, 32, 0),
    ([8, 1, 30], [8, 50, 90], 8, 2, 128, 16, 0),
    ([20, 1, 9], [20, 77, 60], 12, 4, 64, 16, 24),
    ([16, 1], [16, 40], 16, 1, 64, 16, 0),
    ([7, 1], [7, 35], 4, 4, 64, 16, 0),
    ([12, 1], [12, 45], 4, 1, 256, 16, 20),  # Gemma 3's shape, a sliding-window layer
    # prompts whose K and V are packed (at least 4 items a KV head) in two rounds of about 1 MB a
    # thread, beside a decode row and a short chunk that are not
    ([300, 1, 200, 20, 260, 280], [300, 60, 230, 100, 260, 280], 8, 4, 128, 16, 0),
    # a chunk of a long context: its packed tiles (34 MB) outgrow the buffer a thread keeps between calls
    ([64], [8192], 8, 8, 128, 16, 0),
]


def _lib():
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"no CPU kernels here: {exc}")
    if not lib.pdserve_bf16_amx_linear_supported():
        pytest.skip("no AMX bfloat16 tiles on this CPU")
    return lib


def _batch(nqs, lens, heads, kv_heads, head_dim, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    qsl = torch.tensor([0, *torch.tensor(nqs).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).bfloat16()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), qsl


def _run(lib, q, k, v, tables, lens, qsl, kv_heads, window=0, softcap=0.0, amx=True):
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    lib.pdserve_set_amx_attention(int(amx))
    try:
        lib.pdserve_paged_attention_bf16(
            out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            qsl.data_ptr(), len(lens), heads, kv_heads, head_dim, k.shape[1], tables.shape[1], heads * head_dim,
            head_dim**-0.5, window, softcap, 2,
        )  # fmt: skip
    finally:
        lib.pdserve_set_amx_attention(1)
    return out


def _reference(q, k, v, tables, lens, qsl, kv_heads, window):
    out = torch.empty(q.shape, dtype=torch.float64)
    groups, bs = q.shape[1] // kv_heads, k.shape[1]
    for b, n in enumerate(lens.tolist()):
        slots = torch.tensor([int(tables[b, t // bs]) * bs + t % bs for t in range(n)])
        keys, vals = k.flatten(0, 1)[slots].double(), v.flatten(0, 1)[slots].double()
        nq = int(qsl[b + 1] - qsl[b])
        for r in range(nq):
            hi = n - nq + r + 1
            lo = max(0, hi - window) if window else 0
            for h in range(q.shape[1]):
                s = keys[lo:hi, h // groups] @ q[qsl[b] + r, h].double() * q.shape[2] ** -0.5
                out[qsl[b] + r, h] = torch.softmax(s, 0) @ vals[lo:hi, h // groups]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[2]}kv{c[3]}d{c[4]}bs{c[5]}w{c[6]}-{c[0]}")
def test_tiles_match_exact_arithmetic_and_take_the_call(case):
    lib = _lib()
    nqs, lens, heads, kv_heads, head_dim, block_size, window = case
    q, k, v, tables, sl, qsl = _batch(nqs, lens, heads, kv_heads, head_dim, block_size)
    tiles = _run(lib, q, k, v, tables, sl, qsl, kv_heads, window)
    err = (tiles.double() - _reference(q, k, v, tables, sl, qsl, kv_heads, window)).abs().max().item()
    assert err < 2e-2, err
    # the other path sums in another order: some outputs differ in their last bits
    assert not torch.equal(tiles, _run(lib, q, k, v, tables, sl, qsl, kv_heads, window, amx=False))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[2]}kv{c[3]}d{c[4]}bs{c[5]}w{c[6]}-{c[0]}")
def test_a_row_alone_is_the_same_bits_as_beside_other_rows(case):
    lib = _lib()
    nqs, lens, heads, kv_heads, head_dim, block_size, window = case
    q, k, v, tables, sl, qsl = _batch(nqs, lens, heads, kv_heads, head_dim, block_size, seed=1)
    batch = _run(lib, q, k, v, tables, sl, qsl, kv_heads, window)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for b, nq in enumerate(nqs):
        for r in {0, nq // 2, nq - 1}:  # as a decode step at that position would run it
            row = int(qsl[b]) + r
            alone = _run(lib, q[row : row + 1].contiguous(), k, v, tables[b : b + 1].contiguous(),
                         torch.tensor([lens[b] - nq + r + 1], dtype=torch.int32), one, kv_heads, window)  # fmt: skip
            assert torch.equal(alone[0], batch[row]), (b, r)


@pytest.mark.parametrize(
    "head_dim, block_size, softcap",
    [(32, 16, 0.0), (96, 16, 0.0), (64, 8, 0.0), (64, 16, 30.0)],
    ids=["d32", "d96", "bs8", "softcap"],
)
def test_calls_the_tiles_do_not_take_run_the_other_path(head_dim, block_size, softcap):
    lib = _lib()
    q, k, v, tables, sl, qsl = _batch([1, 9], [30, 9], 8, 2, head_dim, block_size)
    on = _run(lib, q, k, v, tables, sl, qsl, 2, softcap=softcap)
    assert torch.equal(on, _run(lib, q, k, v, tables, sl, qsl, 2, softcap=softcap, amx=False))
