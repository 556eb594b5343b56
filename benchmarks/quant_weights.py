"""``benchmarks/quant.py --weight-error``: how far pdserve's int8 and int4 weights are from a GGUF
file's own (dequantized) weights.

pdserve reads a GGUF file as the float32 folder ``transformers`` dequantizes it into
(engine/models/gguf.py) and quantizes from there, so this is the whole error a GGUF's quantization
type adds: zero where int4's group-wise grid can hold the file's blocks exactly (Q4_1 blocks of 32
that reach both ends of their range), more where it cannot (Q8_0's 8-bit blocks in int8's
per-channel grid, Q4_0's symmetric blocks).
"""

from __future__ import annotations

from pathlib import Path


def weight_error(specs: list[str]) -> None:
    """For each GGUF (or model spec): relative error ||w_q - w|| / ||w|| of pdserve's int8 and int4
    weights against the file's own dequantized weights ``w``, over every decoder linear, with the
    scales in float32 and in bfloat16 (what bf16 activations use); bf16 rounding alone beside them."""
    import torch
    from safetensors import safe_open

    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.engine.models.quant import dequantize_int4, quantize_int4, quantize_int8

    for spec in specs:
        folder = resolve_model_dir(spec)
        keys = ("int8", "int8 from bf16", "int4 fp32 scales", "int4 bf16 scales", "int4 from bf16", "bf16")
        sums = {key: [0.0, 0.0] for key in keys}
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safetensors file is not iterable)
                if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
                    continue
                w = f.get_tensor(name).float()
                q, scales = quantize_int8(w)
                approx = {"int8": q.float() * scales[:, None], "bf16": w.bfloat16().float()}
                for label, dtype in (("int4 fp32 scales", torch.float32), ("int4 bf16 scales", torch.bfloat16)):
                    approx[label] = dequantize_int4(*quantize_int4(w, dtype=dtype))
                # what --dtype bfloat16 quantizes: the weights rounded to bf16 first
                approx["int4 from bf16"] = dequantize_int4(*quantize_int4(w.bfloat16(), dtype=torch.bfloat16))
                q, scales = quantize_int8(w.bfloat16())
                approx["int8 from bf16"] = q.float() * scales.bfloat16().float()[:, None]
                for key, a in approx.items():
                    sums[key][0] += (a - w).pow(2).sum().item()
                    sums[key][1] += w.pow(2).sum().item()
        errors = "  ".join(f"{key} {(num / den) ** 0.5:.2e}" for key, (num, den) in sums.items())
        print(f"{Path(spec).name}: relative weight error  {errors}")
