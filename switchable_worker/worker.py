"""Switchable role: one engine serves PrefillService, DecodeService and ColocatedService, and its
role (what the router sends it) changes in place with SetRole, keeping its weights and KV pool.

SGLang (``POST /pd_role_switch``) and a vLLM RFC switch a worker's role the same way; here the
router owns the policy (router/role_balancer.py) and drains the worker first (router/role_switch.py).
Whatever the role, every call it has accepted runs to its end: a prefill call's first token and KV
push, a decode stream, a local prefill. So a switch never strands a request, and a Ray restart of
this process brings it back in its first role.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.decode_worker.worker import DecodeWorker, decode_service
from pdserve.engine.config import for_role
from pdserve.engine.kv.transfer import KvSender
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.prefill_worker.worker import PrefillWorker, prefill_service
from pdserve.worker.colocated_service import ColocatedWorker, colocated_service
from pdserve.worker.host import EngineHost

SWITCHABLE_ROLES = ("prefill", "decode")
log = logging.getLogger(__name__)


class SwitchableWorker:
    """The three services on one EngineHost. ``role`` is ``prefill`` or ``decode``; ``set_role``
    changes it (ValueError for another value). A step's outputs go to the prefill service for the
    requests it prefills (their KV leaves the engine at once) and to the token streams otherwise."""

    def __init__(self, engine: LLMEngine, kv_sender: KvSender, role: str = "decode", kv_timeout_s: float = 30.0):
        self._check(role)
        self.role = role
        self.engine = engine
        self.host = EngineHost(engine, self._on_outputs, self._extra_stats)
        self.prefill = PrefillWorker(engine, kv_sender, self.host)
        self.decode = DecodeWorker(engine, kv_timeout_s, host=self.host)
        self.colocated = ColocatedWorker(engine, self.host)

    @staticmethod
    def _check(role: str) -> None:
        if role not in SWITCHABLE_ROLES:
            raise ValueError(f"unknown role {role!r}; a switchable worker is {' or '.join(SWITCHABLE_ROLES)}")

    def set_role(self, role: str) -> str:
        """Serve ``role`` from now on; returns the previous role."""
        self._check(role)
        previous, self.role = self.role, role
        if previous != role:
            log.info("role switched: %s -> %s", previous, role)
        return previous

    def _extra_stats(self) -> dict:
        return {"num_awaiting_kv": self.decode.num_awaiting_kv(), "switchable": True}

    def _on_outputs(self, outputs: list[StepOutput]) -> None:  # engine thread
        prefilling = self.prefill.request_ids
        handed_off = [o for o in outputs if o.seq.request_id in prefilling]
        if handed_off:
            self.prefill.on_outputs(handed_off)
        if len(handed_off) < len(outputs):
            self.host.publish([o for o in outputs if o.seq.request_id not in prefilling])


async def serve(cfg, host: str = "127.0.0.1", port: int = 0, role: str = "decode", kv_chunk_bytes: int = 1 << 20):
    """Build the engine (off the event loop) and serve the three role services + WorkerService.

    Returns a ``pdserve.worker.host.RunningWorker``; ``port=0`` picks a free port. ValueError for
    an unknown ``role``."""
    from pdserve.decode_worker.kv_tcp import KvTcpServer
    from pdserve.prefill_worker.worker import kv_sender_for
    from pdserve.worker.host import serve_worker

    SwitchableWorker._check(role)
    engine = await asyncio.to_thread(LLMEngine, for_role(cfg, "decode"))
    w = SwitchableWorker(engine, kv_sender_for(cfg, kv_chunk_bytes), role)
    services = [prefill_service(w.prefill), decode_service(w.decode), colocated_service(w.colocated)]
    return await serve_worker(w, services, host, port, KvTcpServer(w.decode))
