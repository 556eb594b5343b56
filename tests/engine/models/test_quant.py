"""Weight-only quantization (``--quantization int8|int4``, engine/models/quant.py): the quantizers'
error bounds, the linears against a float32 reference over their own dequantized weight (both the
kernel path of decode-sized calls and the dequantized GEMM of prefill-sized ones), which linears
``make_linear`` quantizes, and a quantized model's greedy output through the engine.

Tolerances: float32 activations compute with the same weight values as the reference, so outputs
agree to float32 accumulation order (1e-4 of the output's scale). bfloat16 activations round the
input, the weight's scales and the output to 8 significant bits, so outputs agree to 2% of the
output's largest magnitude (bfloat16's relative step is 2**-8 = 0.4%, and K products accumulate).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.models.linear import make_linear
from pdserve.engine.models.quant import (
    INT4_GROUP_SIZE,
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    current_scheme,
    dequantize_int4,
    quantization,
    quantize_int4,
    quantize_int8,
)
from tests.engine.models._layout_cases import NEEDS_TOKENIZER
from tests.engine.models.test_vnni_kernels import activation_bound

SHAPES = [(64, 32), (96, 576), (208, 1536)]  # [out_features, in_features]; out % 16 == 0 for int4
ROWS = [1, 5, max(KERNEL_MAX_ROWS.values()) + 8]  # decode-sized calls run the kernels, the last a dense GEMM
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weight(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0] *= 20  # one channel far larger: per-channel scales must keep the others fine
    return w


def test_int8_error_is_at_most_half_a_step_per_channel():
    w = _weight((96, 576))
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (96,)
    assert q.abs().max() == 127  # each channel's largest weight maps to the edge
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    assert err[1:].max() < err[0].max() / 5  # the large channel's scale does not leak into the others


def test_int4_error_is_at_most_half_a_step_per_group():
    w = _weight((64, 576))
    q, sz = quantize_int4(w)
    assert q.min() >= 0 and q.max() <= 15 and sz.shape == (576 // INT4_GROUP_SIZE, 64, 2)
    err = (dequantize_int4(q, sz) - w).abs().view(64, -1, INT4_GROUP_SIZE)
    step = sz[..., 0].transpose(0, 1)[..., None]  # [N, G, 1]
    assert (err <= step / 2 + 1e-6).all()
    # a group that spans a 4-bit grid (both ends present: GGUF's Q4_1 blocks) is kept exactly
    levels = torch.randint(0, 16, (64, 576 // INT4_GROUP_SIZE, INT4_GROUP_SIZE))
    levels[..., 0], levels[..., 1] = 0, 15
    grid = (levels.float() * 0.01 - 0.08).view(64, 576)
    q2, sz2 = quantize_int4(grid)
    assert torch.allclose(dequantize_int4(q2, sz2), grid, atol=1e-6)
    # so is one that does not reach both ends (GGUF's Q4_0: d * (q - 8); Q4_K's optimised ranges)
    d = torch.rand(64, 576 // INT4_GROUP_SIZE, 1) * 0.01 + 0.001
    sparse = (d * (torch.randint(2, 13, levels.shape) - 8).float()).view(64, 576)
    q3, sz3 = quantize_int4(sparse)
    assert torch.allclose(dequantize_int4(q3, sz3), sparse, atol=1e-6)
    # and from those weights rounded to bfloat16 (--dtype bfloat16), to within bfloat16's rounding
    q4, sz4 = quantize_int4(sparse.bfloat16(), dtype=torch.bfloat16)
    err = (dequantize_int4(q4, sz4) - sparse).abs().view(d.shape[:2] + (-1,)).amax(dim=-1, keepdim=True)
    magnitude = sparse.abs().view(d.shape[:2] + (-1,)).amax(dim=-1, keepdim=True)
    assert (err <= 2**-6 * magnitude).all() and (err < d / 10).all()  # min-max would be off by steps


def test_int4_refuses_inputs_off_the_group_size():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 32"):
        quantize_int4(torch.randn(16, 48))


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear], ids=["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_its_dequantized_weight(cls, dtype, shape, bias):
    w = _weight(shape).to(dtype)
    b = (torch.randn(shape[0]) * 0.5).to(dtype) if bias else None
    lin = cls(w, b)
    deq = lin.dequantized()
    assert deq.shape == shape
    assert (deq - w.float()).abs().max() > 0  # it is quantized, not the weight itself
    for rows in ROWS:
        x = torch.randn(rows, shape[1]).to(dtype)
        y = lin(x)
        assert y.dtype == dtype and y.shape == (rows, shape[0])
        ref = x.float() @ deq.T + (b.float() if bias else 0)
        err = (y.float() - ref).abs()
        if rows <= lin.vnni_rows and dtype == torch.bfloat16:  # x quantized too: its bound
            assert (err - activation_bound(x, deq) - TOLERANCE[dtype] * ref.abs()).max() <= 0, rows
        else:
            assert err.max().item() <= TOLERANCE[dtype] * ref.abs().max().item(), (rows, err.max().item())


def test_linear_keeps_leading_dims():
    lin = Int8Linear(_weight((32, 64)), None)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(lin(x), lin(x.view(6, 64)).view(2, 3, 32))


def test_make_linear_quantizes_only_what_is_marked_inside_a_scheme():
    w = _weight((64, 64))
    assert type(make_linear(w, quantizable=True)).__name__ in ("DenseLinear", "PackedLinear", "PlainLinear")
    with quantization("int8"):
        assert current_scheme() == "int8"
        assert isinstance(make_linear(w, quantizable=True), Int8Linear)
        assert not isinstance(make_linear(w), Int8Linear)  # lm_head, the MoE router
    with quantization("int4"):
        assert isinstance(make_linear(w, quantizable=True), Int4Linear)
        # shapes the int4 kernel cannot take stay in the model dtype
        assert not isinstance(make_linear(_weight((40, 64)), quantizable=True), Int4Linear)
        assert not isinstance(make_linear(_weight((64, 48)), quantizable=True), Int4Linear)
    assert current_scheme() == "none"


def test_unknown_schemes_are_refused():
    with (
        pytest.raises(ValueError, match="quantization must be one of none, int8, int4, got 'int3'"),
        quantization("int3"),
    ):
        pass
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, got 'fp8'"):
        EngineConfig(model="embedded", quantization="fp8")


# -- a quantized model through the engine ---------------------------------------------------------


def _linears(engine):
    for layer in engine.runner.model.layers:
        yield layer.attn.qkv
        yield layer.attn.o
        yield layer.mlp.gate_up
        yield layer.mlp.down


def _dequantized_folder(engine, src, dst):
    """A copy of ``src`` whose q/k/v/o and MLP weights are ``engine``'s dequantized ones."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    cfg = engine.model_cfg
    for i, layer in enumerate(engine.runner.model.layers):
        p = f"model.layers.{i}."
        sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        parts = {"self_attn.": (layer.attn.qkv, ("q_proj", "k_proj", "v_proj"), sizes)}
        parts["mlp."] = (layer.mlp.gate_up, ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2)
        for prefix, (lin, names, rows) in parts.items():
            if hasattr(lin, "dequantized"):
                for name, t in zip(names, lin.dequantized().split(rows)):
                    w[f"{p}{prefix}{name}.weight"] = t.contiguous()
        for prefix, lin in (("self_attn.o_proj", layer.attn.o), ("mlp.down_proj", layer.mlp.down)):
            if hasattr(lin, "dequantized"):
                w[f"{p}{prefix}.weight"] = lin.dequantized().contiguous()
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_decodes_as_its_dequantized_weights_do(stories_dir, tmp_path, scheme, monkeypatch):
    """stories260K (a trained 5-layer Llama) quantized, in float32: its greedy tokens, through
    prefills both under and over ``KERNEL_MAX_ROWS`` tokens and paged decode steps, equal those of
    the unquantized engine over a checkpoint holding the quantized engine's dequantized weights;
    its logits differ from the original model's (the weights were quantized) but only a little."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = dict(dtype="float32", num_kv_blocks=64, torch_threads=1)
    quant = LLMEngine(EngineConfig(model=str(stories_dir), quantization=scheme, **cfg))
    kinds = [type(lin).__name__ for lin in _linears(quant)]
    expect = "Int8Linear" if scheme == "int8" else "Int4Linear"
    # int4 needs out_features % 16 and in_features % 32: stories' MLP (intermediate 172) stays float32
    assert kinds.count(expect) == (len(kinds) if scheme == "int8" else len(kinds) // 2)
    dense = LLMEngine(EngineConfig(model=str(_dequantized_folder(quant, stories_dir, tmp_path / "deq")), **cfg))
    plain = LLMEngine(EngineConfig(model=str(stories_dir), **cfg))
    tok = plain.tokenizer
    prompts = [tok.encode("Once upon a time"), tok.encode("Lily and Tom went to the park. " * 8)]
    assert len(prompts[0]) <= KERNEL_MAX_ROWS[scheme] < len(prompts[1])
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = quant.generate(prompts, sampling)
    assert got == dense.generate(prompts, sampling)
    assert all(len(out) == 24 for out in got)

    from tests.engine.models._tiny_models import engine_logits

    for prompt in prompts:
        q_prefill, q_decode = engine_logits(quant, prompt)
        d_prefill, d_decode = engine_logits(dense, prompt)
        p_prefill, _ = engine_logits(plain, prompt)
        assert torch.allclose(q_prefill, d_prefill, atol=1e-3) and torch.allclose(q_decode, d_decode, atol=1e-3)
        change = (q_prefill - p_prefill).abs().max().item()
        assert 1e-3 < change < 0.25 * p_prefill.abs().max().item()


@NEEDS_TOKENIZER
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_moe_experts_are_quantized_and_the_router_is_not(tmp_path, scheme, monkeypatch):
    """A tiny Mixtral (4 experts, top-2): every expert's gate|up and down linears are quantized, the
    router keeps float32, and the model computes as a float32 checkpoint of its dequantized weights
    does (same greedy tokens, logits to 1e-3)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams
    from tests.engine.models._layout_cases import _spec
    from tests.engine.models._tiny_models import build_model, engine_logits

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_cls, config, kwargs = _spec("mixtral")
    folder = build_model(tmp_path / "mixtral", model_cls, config, **kwargs)
    cfg = dict(dtype="float32", num_kv_blocks=32, torch_threads=1)
    quant = LLMEngine(EngineConfig(model=str(folder), quantization=scheme, **cfg))
    expect = Int8Linear if scheme == "int8" else Int4Linear
    deq = Path(shutil.copytree(folder, tmp_path / "deq"))
    w = load_file(str(deq / "model.safetensors"))
    mc = quant.model_cfg
    rows = [mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim]
    for i, layer in enumerate(quant.runner.model.layers):
        p = f"model.layers.{i}."
        assert isinstance(layer.attn.qkv, expect) and isinstance(layer.attn.o, expect)
        for name, t in zip(("q", "k", "v"), layer.attn.qkv.dequantized().split(rows)):
            w[f"{p}self_attn.{name}_proj.weight"] = t.contiguous()
        w[f"{p}self_attn.o_proj.weight"] = layer.attn.o.dequantized()
        assert not isinstance(layer.mlp.router, (Int8Linear, Int4Linear)) and len(layer.mlp.experts) == 4
        for e, expert in enumerate(layer.mlp.experts):
            assert isinstance(expert.gate_up, expect) and isinstance(expert.down, expect)
            gate, up = expert.gate_up.dequantized().chunk(2)
            x = f"{p}block_sparse_moe.experts.{e}."
            w[x + "w1.weight"], w[x + "w3.weight"] = gate.contiguous(), up.contiguous()
            w[x + "w2.weight"] = expert.down.dequantized()
    save_file(w, str(deq / "model.safetensors"), metadata={"format": "pt"})
    dense = LLMEngine(EngineConfig(model=str(deq), **cfg))
    prompts = [list(range(3, 12)), list(range(3, 3 + max(KERNEL_MAX_ROWS.values()) + 8))]
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert quant.generate(prompts, sampling) == dense.generate(prompts, sampling)
    for prompt in prompts:
        (qp, qd), (dp, dd) = engine_logits(quant, prompt), engine_logits(dense, prompt)
        assert torch.allclose(qp, dp, atol=1e-3) and torch.allclose(qd, dd, atol=1e-3)
