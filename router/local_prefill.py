"""Conditional disaggregation: when the decode worker chosen for a request prefills it itself.

Moving a KV cache from a prefill worker costs a hand-off (serialise, stream, admit); computing a
short uncached part on the decode worker costs one step there. And when every prefill worker is
behind, a prompt waits in its queue while the decode worker may have room. Two policies
(``LOCAL_PREFILL_POLICIES``), both pure functions of the router's view of its workers:

- ``prefix``: prefill locally when at most ``tokens`` of the prompt are not in the decode worker's
  prefix cache (Dynamo's and llm-d's rule; NVIDIA Dynamo also requires under 0.7 of the prompt,
  which a threshold this small implies);
- ``load-aware`` (the default): ``prefix``, or the prefill pool is busy (its least-loaded worker
  holds at least ``busy_prefill_tokens`` prompt tokens not yet answered, Dynamo's "active tokens
  over a threshold of the batch budget" rule) and the decode worker has room: its own local
  prefills under way plus this one stay within ``decode_prefill_tokens``, and at least
  ``min_free_kv`` of its KV blocks stay free after the request's (Dynamo's veto when the decode
  worker's KV is nearly full).

With switchable workers (``pdserve serve --placement auto``) the prefill role may be empty: every
decode worker then prefills its own requests, which is colocated placement.

Each decision names its reason (``LOCAL_PREFILL_REASONS``), counted in
``pdserve:local_prefills_total{reason}``.
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_PREFILL_POLICIES = ("prefix", "load-aware")
LOCAL_PREFILL_REASONS = ("short", "prefill_busy", "no_prefill_worker")
DEFAULT_LOCAL_PREFILL_POLICY = "load-aware"
# Sized for W2's 256-token prompts: a prefill worker 4 prompts behind is busy; a decode worker takes at
# most 2 local prompts at a time. benchmarks/local_prefill_policy.py compares thresholds in the
# simulator (docs/measurements.md, "Load-aware local prefill"): from 1,024 up, none loses goodput to
# the prefix policy on W2 up to 32 req/s; 256 does at 32 req/s.
BUSY_PREFILL_TOKENS = 1024
DECODE_PREFILL_TOKENS = 512
MIN_FREE_KV = 0.25


@dataclass(frozen=True)
class LocalPrefill:
    """The local-prefill rule of a split router (module docstring). Token counts are prompt tokens;
    ``min_free_kv`` is a share (0..1) of the decode worker's KV blocks. ValueError for an unknown
    policy or a negative or out-of-range value."""

    tokens: int = 32
    policy: str = DEFAULT_LOCAL_PREFILL_POLICY
    busy_prefill_tokens: int = BUSY_PREFILL_TOKENS
    decode_prefill_tokens: int = DECODE_PREFILL_TOKENS
    min_free_kv: float = MIN_FREE_KV

    def __post_init__(self) -> None:
        if self.policy not in LOCAL_PREFILL_POLICIES:
            raise ValueError(
                f"unknown local-prefill policy {self.policy!r}; choose {' or '.join(LOCAL_PREFILL_POLICIES)}"
            )
        for name in ("tokens", "busy_prefill_tokens", "decode_prefill_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"local prefill: {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_free_kv <= 1.0:
            raise ValueError(f"local prefill: min_free_kv must be within [0, 1], got {self.min_free_kv}")


def local_prefill_reason(pool, decode_w, n: int, hashes: list, rule: LocalPrefill) -> str | None:
    """Why ``decode_w`` should prefill an ``n``-token prompt (full blocks named ``hashes``) itself,
    one of ``LOCAL_PREFILL_REASONS``; None when a prefill worker should. Pure: reads the
    ``WorkerPool`` ``pool`` and its ``WorkerHandle`` ``decode_w``, changes nothing."""
    uncached = n - pool.cached_tokens(decode_w, n, hashes)
    if uncached <= rule.tokens:
        return "short"
    prefill = pool.routable("prefill")
    if not prefill:
        return "no_prefill_worker" if pool.placement == "auto" else None
    if rule.policy != "load-aware" or min(w.outstanding_prefill_tokens for w in prefill) < rule.busy_prefill_tokens:
        return None
    if decode_w.outstanding_prefill_tokens + uncached > rule.decode_prefill_tokens:
        return None
    blocks = -(-(n + 1) // max(decode_w.block_size, 1))
    free_after = decode_w.free_kv_blocks - decode_w.routed_blocks_since_poll - blocks
    if decode_w.total_kv_blocks and free_after < rule.min_free_kv * decode_w.total_kv_blocks:
        return None
    return "prefill_busy"
