"""RequestRecord on synthetic timestamps, for the metric tests."""

from __future__ import annotations

from pdserve.loadgen.metrics import RequestRecord


def rec(tokens, sent=0.0, *, finish="stop", error="", prompt=10, index=0, **kw) -> RequestRecord:
    return RequestRecord(
        index=index,
        request_id=f"r{index}",
        scheduled_s=sent,
        sent_s=sent,
        prompt_tokens=prompt,
        max_tokens=max(len(tokens), 1),
        token_times_s=list(tokens),
        finish_reason=finish,
        error=error,
        **kw,
    )
