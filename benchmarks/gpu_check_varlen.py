"""Part of ``gpu_check.py``: CUDA's varlen FlashAttention prefill (``CudaVarlenAttention``) against
per-sequence SDPA, both against float32, on random inputs."""

from __future__ import annotations

import torch


@torch.inference_mode()
def check_varlen(device: str = "cuda") -> bool:
    """``CudaVarlenAttention``'s bfloat16 prefill against float32 ``TorchAttention`` on random inputs
    (whole sequences, chunks after cached positions, a sliding window): its error at most 1.5x
    that of bfloat16 ``TorchAttention`` (per-sequence SDPA), or 0.01 std."""
    from pdserve.engine.models.attention import AttentionMetadata, TorchAttention
    from pdserve.engine.models.attention_cuda import CudaVarlenAttention, varlen_available

    if why := varlen_available(torch.device(device), torch.bfloat16, None):
        print(f"varlen prefill: not run ({why})")
        return True
    gen, ok = torch.Generator(device=device).manual_seed(1), True
    H, Hkv, D, bs, new = 12, 4, 64, 16, (37, 100, 5)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    for cached, window in (((0, 0, 0), None), ((0, 40, 300), None), ((0, 40, 300), 64)):
        lens = [c + n for c, n in zip(cached, new)]
        tables, at = [], 0
        for n in lens:
            tables.append(list(range(at, at - (-n // bs))))
            at = tables[-1][-1] + 1
        width = max(map(len, tables))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        k_cache, v_cache, q = randn(at, bs, Hkv, D), randn(at, bs, Hkv, D), randn(sum(new), H, D)
        k, v = (
            torch.cat([c[bt[s, : len(tables[s])].long()].flatten(0, 1)[cached[s] : lens[s]] for s in range(3)])
            for c in (k_cache, v_cache)
        )
        cu = [0, *torch.tensor(new).cumsum(0).tolist()]
        slots = torch.zeros(sum(new), dtype=torch.int64, device=device)  # not read by prefill
        meta = AttentionMetadata(
            True,
            slots,
            bt,
            torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(cu, dtype=torch.int32, device=device),
            cu_seqlens=cu,
            context_lens_host=lens,
        )
        f32 = [t.float() for t in (q, k, v, k_cache, v_cache)]
        ref = TorchAttention(D**-0.5, window).prefill(*f32, meta)
        errs = [
            ((kind(D**-0.5, window).prefill(q, k, v, k_cache, v_cache, meta).float() - ref).abs().max() / ref.std())
            for kind in (TorchAttention, CudaVarlenAttention)
        ]
        good = bool(errs[1] <= max(1.5 * errs[0], 0.01))
        ok &= good
        print(
            f"varlen prefill, bf16, cached {cached}, window {window}: error vs float32 {errs[1]:.4f} std, "
            f"per-sequence SDPA's {errs[0]:.4f} {'PASS' if good else 'FAIL'}"
        )
    return ok
