"""The simulator's parts (``planner/simulate.py``): a worker (a real ``LLMEngine`` on a virtual runner
and clock, with the router's handle) and a request's state as it moves through the cluster."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig, for_role
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.host_cpu import ServingModel
from pdserve.planner.step_model import StepModel
from pdserve.planner.virtual_runner import VirtualClock, VirtualRunner
from pdserve.router.worker_handle import WorkerHandle


class SimWorker:
    """One simulated worker: its engine on a virtual runner and clock, and the router's handle."""

    def __init__(
        self, role: str, index: int, cfg: EngineConfig, model: StepModel, dtype: str, switchable: bool = False
    ) -> None:
        self.role, self.clock = role, VirtualClock()
        self.engine = LLMEngine(
            for_role(cfg, "decode" if switchable else role),
            lambda c, d: VirtualRunner(c, d, model, dtype, self.clock),
            self.clock.ns,
        )
        eos = self.engine.eos_token_ids
        self.engine.runner.token = next(t for t in itertools.count() if t not in eos)
        self.handle = WorkerHandle(role, f"{role}-{index}", None, switchable=switchable)
        self.busy = False
        self.outputs: list[StepOutput] = []  # of the step under way, handled when it ends
        self.awaiting_kv = 0  # requests routed here whose KV has not been admitted
        self.sending_until = 0.0  # when the KV hand-offs it started stop taking its core (a prefill worker)
        self.path = ServingModel()  # its role's serving path (Simulator.set_role)

    def send_kv(self, t: float, seconds: float) -> float:
        """A KV hand-off of ``seconds`` starts at ``t``; its sending takes this worker's core after
        the hand-offs still running (a loaded prefill worker's steps measured 1.18-1.23x the
        profile's engine with whole frames, 1.10x one request at a time; docs/measurements.md).
        Returns ``seconds``."""
        self.sending_until = max(self.sending_until, t) + seconds
        return seconds

    def sending_left(self, t: float) -> float:
        """Seconds of KV sends still to run at ``t``, taken into a step that starts then (a step
        sharing the core with them takes that much longer)."""
        left, self.sending_until = max(0.0, self.sending_until - t), t
        return left


@dataclass
class SimRequest:
    """A request in the simulated cluster: its spec and record, its workers, the prefix its decode
    worker holds for the KV, and the tokens produced so far."""

    spec: RequestSpec
    rec: RequestRecord
    worker: SimWorker | None = None  # prefill (split) or colocated / prefilling decode worker
    decode: SimWorker | None = None
    held: int = 0  # prompt tokens the decode worker held for the KV (pin_prefix)
    prefill_end_s: float = 0.0
    kv_first_try_s: float = math.nan
    output: list[int] = field(default_factory=list)
