"""When a request was sent and when each of its output tokens arrived, and the latency metrics
defined on those times: the one definition of TTFT, TPOT, ITL and E2E latency that the client
(:class:`pdserve.router.client.GenerationResult`), the load generator
(:class:`pdserve.loadgen.metrics.RequestRecord`) and the benchmark scripts all use.

Every time is in seconds on one clock (``time.perf_counter``, or an offset from one instant of it),
and every metric is in seconds. The definitions are those of vLLM's ``benchmark_serving`` (and
SGLang's ``bench_serving``):

* TTFT (time to first token): request sent -> first output token received.
* E2E latency: request sent -> last output token received.
* TPOT (time per output token): ``(E2E - TTFT) / (output tokens - 1)``; the first token is
  excluded, and a request with fewer than two output tokens has none (nan).
* ITL (inter-token latency): the gaps between consecutive token arrivals, ``output tokens - 1`` of
  them; tokens delivered in one stream message share an arrival time and so give 0-second gaps.

Standard library only: the router's client imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NAN = float("nan")


@dataclass(kw_only=True)
class RequestTiming:
    """A request's send time and its output tokens' arrival times, in seconds on one clock; the
    latency metrics (seconds, nan where undefined) are derived from them."""

    sent_s: float = 0.0  # when the request was sent
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each output token

    @property
    def output_tokens(self) -> int:
        """Output tokens received (one arrival time each)."""
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        """Time to first token, s: first token arrival - ``sent_s``; nan when no token arrived."""
        return self.token_times_s[0] - self.sent_s if self.token_times_s else NAN

    @property
    def e2e_s(self) -> float:
        """End-to-end latency, s: last token arrival - ``sent_s``; nan when no token arrived."""
        return self.token_times_s[-1] - self.sent_s if self.token_times_s else NAN

    @property
    def tpot_s(self) -> float:
        """Time per output token, s: ``(E2E - TTFT) / (output tokens - 1)`` (vLLM's
        ``benchmark_serving``), the first token excluded; nan below two output tokens."""
        n = self.output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n >= 2 else NAN

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies, s: the gaps between consecutive token arrivals (``output_tokens - 1``
        entries; 0 between tokens that arrived in one stream message)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]
