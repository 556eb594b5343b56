"""What ``ModelConfig.from_dict`` reads from a config.json beyond a Llama's, per family (no torch).

Every family but Gemma: the MLP's activation (``hidden_act``, SiLU only). Gemma 2 and Gemma 3, as
transformers' ``Gemma2Config`` / ``Gemma3TextConfig`` read them: the activation from
``hidden_activation`` (GeLU, tanh approximation); the attention scale ``query_pre_attn_scalar ** -0.5``;
the final logits' soft-cap (not in ``Gemma3ForConditionalGeneration``, as transformers computes it);
the attention scores' soft-cap (Gemma 2 only: transformers' Gemma 3 does not apply it); sliding and
global layers from ``layer_types`` or, without them, every ``sliding_window_pattern``-th layer global
(2 in Gemma 2, 6 in Gemma 3); and in Gemma 3 a RoPE base of the sliding layers' own
(``rope_parameters`` keyed by layer type, or ``rope_local_base_freq``) while the global layers take
``rope_theta`` and the scaling.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.models.registry import Family

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers' Gemma3TextConfig.default_theta
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0


def family_fields(cfg: dict[str, Any], fam: Family) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config to read the common fields from, the family's own ``ModelConfig`` fields).

    Raises ValueError for an activation the family's forward pass does not compute, for Gemma 3's
    bidirectional attention and for RoPE scaling on Gemma 3's sliding layers."""
    if not fam.gemma:
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the forward pass hard-codes SiLU (swish is its other name)
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        return cfg, {}
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r}; supported: {', '.join(GEMMA_ACTIVATIONS)}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention: pdserve runs causal decoders only")
    out = dict(cfg)
    if not cfg.get("layer_types"):
        default = 2 if fam.gemma == 2 else 6
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default)
        n = int(cfg["num_hidden_layers"])
        out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    local_theta = None
    if fam.gemma >= 3:
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            sliding = params.get("sliding_attention") or {}
            if sliding.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope scaling {sliding['rope_type']!r} on sliding-window layers")
            out["rope_parameters"] = params["full_attention"] or {}
            local_theta = sliding.get("rope_theta")
        else:
            local_theta = cfg.get("rope_local_base_freq")
        if out.get("rope_theta") is None and "rope_theta" not in (out.get("rope_parameters") or {}):
            out["rope_theta"] = GEMMA3_GLOBAL_THETA
        local_theta = float(local_theta if local_theta is not None else GEMMA3_LOCAL_THETA)
    attn_cap = cfg.get("attn_logit_softcapping") if fam.gemma == 2 else None
    # transformers' Gemma3ForConditionalGeneration leaves its text model's final soft-cap unapplied
    multimodal = (cfg.get("architectures") or [""])[0].endswith("ForConditionalGeneration")
    final_cap = None if multimodal else cfg.get("final_logit_softcapping")
    fields = {
        "hidden_act": act,
        "attention_scale": float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
        "final_logit_softcapping": float(final_cap) if final_cap else None,
        "local_rope_theta": local_theta,
    }
    return out, fields
