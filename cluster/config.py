"""What a pdserve cluster is made of."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.router.local_prefill import DEFAULT_LOCAL_PREFILL_POLICY, LOCAL_PREFILL_POLICIES
from pdserve.worker.cpus import cpu_shares

PLACEMENTS = ("split", "colocated", "auto")


# Split placement prefills on the decode worker when at most this many prompt tokens are not in
# its prefix cache (benchmarks/local_prefill.py: up to 32, a decode-side prefill adds less than a
# decode step to its neighbours' inter-token gaps).
DEFAULT_LOCAL_PREFILL_TOKENS = 32
DEFAULT_SLO_TTFT_MS = 400.0  # auto placement's latency targets: W2's SLO (docs/benchmarking.md)
DEFAULT_SLO_TPOT_MS = 40.0  # auto placement's inter-token latency target: W2's TPOT SLO (docs/benchmarking.md)


@dataclass(frozen=True)
class ClusterConfig:
    """A router plus workers on Ray.

    split: ``num_prefill`` prefill workers + ``num_decode`` decode workers, each on its own device
    (one GPU each when GPUs exist; otherwise ``cpus_per_worker`` CPUs and as many torch threads).
    colocated: ``num_prefill + num_decode`` workers of role "colocated" with the same per-worker resources,
    so both placements use the same total hardware.
    auto: ``num_prefill + num_decode`` switchable workers starting in those roles (``num_prefill`` may
    be 0: every worker then prefills its own requests), whose roles the router switches at run time
    (router/role_switch.py) against ``slo_ttft_ms`` and ``slo_tpot_ms``, its latency targets.
    ``local_prefill_tokens`` and ``local_prefill_policy``: when split or auto placement prefills on
    the decode worker (router/local_prefill.py).
    ``device`` None picks GPUs when the Ray cluster has one per worker, else CPUs; "cuda" or "cpu"
    forces it (``start_cluster`` refuses "cuda" without enough GPUs).
    ``ray_address`` None starts a local Ray instance; otherwise joins that cluster.
    ``http_port``: the router's OpenAI-compatible HTTP port (0: any free port; None: no HTTP), on
    ``router_host``. ``model_name``: the model id clients see and send (default: ``served_model_name``).
    ``api_keys``: the keys clients must present (``authorization: Bearer``); empty: none. Internal
    calls always carry the cluster's secret ($PDSERVE_CLUSTER_SECRET, else one made at start).
    ``max_requests_per_worker``: the router refuses new requests (RESOURCE_EXHAUSTED) when every
    decode worker holds that many; 0: no bound.
    """

    engine: EngineConfig
    placement: str = "split"
    num_prefill: int = 1
    num_decode: int = 1
    cpus_per_worker: int = 1
    # split placement: a custom Ray resource that each prefill (decode) worker asks one unit of, so that
    # role runs only on the nodes offering it (``ray start --resources '{"NAME": N}'``: N such workers there)
    prefill_resource: str | None = None
    decode_resource: str | None = None
    routing: str = "prefix-aware"  # or "least-loaded" (router/pool.py)
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS  # split: prefill on decode at most this many uncached
    local_prefill_policy: str = DEFAULT_LOCAL_PREFILL_POLICY
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    router_host: str = "127.0.0.1"
    router_port: int = 50051
    http_port: int | None = None
    model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_requests_per_worker: int = 0
    stream_interval: int = 1  # tokens per streamed message to a client (the first and the last go at once)
    tls: tuple[str, str] | None = None  # (certificate chain, private key) PEM files for the client-facing APIs
    ray_address: str | None = None
    device: str | None = None

    @property
    def served_model_name(self) -> str:
        """The model id clients see and send: ``model_name``, else the ``--model`` spec as given
        ("embedded", a hub id owner/name, ...), or for a local folder or file only its name (never
        a path)."""
        if self.model_name:
            return self.model_name
        path = Path(self.engine.model).expanduser()
        return path.name if path.exists() or self.engine.model.startswith((".", "/", "~")) else self.engine.model

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "colocated":
            if self.num_prefill < 0 or self.num_decode < 0 or self.num_prefill + self.num_decode < 1:
                raise ValueError("colocated needs at least one worker (--prefill + --decode of them)")
        elif self.num_decode < 1 or self.num_prefill < (0 if self.placement == "auto" else 1):
            raise ValueError(
                "need at least one prefill and one decode worker (colocated uses their sum; auto may start "
                "with no prefill worker)"
            )
        if self.local_prefill_policy not in LOCAL_PREFILL_POLICIES:
            raise ValueError(
                f"local_prefill_policy must be one of {LOCAL_PREFILL_POLICIES}, got {self.local_prefill_policy!r}"
            )
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ValueError(f"slo_ttft_ms and slo_tpot_ms must be > 0, got {self.slo_ttft_ms}, {self.slo_tpot_ms}")
        if self.cpus_per_worker < 1:
            raise ValueError("cpus_per_worker must be >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or None (auto), got {self.device!r}")
        if self.routing not in ("prefix-aware", "least-loaded"):
            raise ValueError(f"routing must be prefix-aware or least-loaded, got {self.routing!r}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if self.placement == "colocated" and (self.prefill_resource or self.decode_resource):
            raise ValueError("--prefill-resource/--decode-resource place split roles; colocated workers have neither")

    @property
    def roles(self) -> list[str]:
        """Role of each worker to start, in order."""
        if self.placement == "colocated":
            return ["colocated"] * (self.num_prefill + self.num_decode)
        return ["prefill"] * self.num_prefill + ["decode"] * self.num_decode

    def use_gpus(self, available_gpus: float) -> bool:
        """Whether workers get one GPU each; ValueError when cuda is forced without enough GPUs."""
        needed = len(self.roles)
        if self.device == "cuda" and available_gpus < needed:
            raise ValueError(
                f"--device cuda needs {needed} GPUs (one per worker); the Ray cluster has {available_gpus:g}"
            )
        return self.device == "cuda" or (self.device is None and available_gpus >= needed)

    def cpu_sets(self, num_cpus: int) -> list[list[int]] | None:
        """Disjoint CPU ids for each CPU worker, ``cpus_per_worker`` apiece in role order, when they
        all fit in ``num_cpus``; else None (workers then share cores as the OS schedules them).

        Pinning keeps all of a worker's threads (torch's, the engine's, its event loop's, gRPC's
        and Ray's, ``worker.cpus.pin_process``) on its own share, so they neither spin-wait on a
        core another worker's matmul holds nor take time from it.
        """
        return cpu_shares(len(self.roles), self.cpus_per_worker, num_cpus)

    def worker_engine(self, use_gpu: bool) -> EngineConfig:
        """Engine settings for one worker: its device and, on CPU, its thread count."""
        if use_gpu:
            return replace(self.engine, device="cuda")
        return replace(self.engine, device="cpu", torch_threads=self.engine.torch_threads or self.cpus_per_worker)

    def role_resources(self, role: str) -> dict[str, float]:
        """Custom Ray resources one worker of ``role`` asks for: one unit of ``prefill_resource`` or
        ``decode_resource`` when set, else none."""
        name = {"prefill": self.prefill_resource, "decode": self.decode_resource}.get(role)
        return {name: 1.0} if name else {}
