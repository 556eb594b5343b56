"""The ColocatedService servicer: a whole request (prefill, then decode) on one engine, every token
streamed. A colocated worker serves it alone; a decode worker serves it beside DecodeService, for
the prompts the router has it prefill itself (conditional disaggregation)."""

from __future__ import annotations

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.host import EngineHost, abort_quietly, admit_prompt, relay_tokens


class ColocatedWorker(worker_pb2_grpc.ColocatedServiceServicer):
    """Composes an EngineHost (engine + its thread); streams every token of a request, the first included."""

    role = "colocated"

    def __init__(self, engine: LLMEngine, host: EngineHost | None = None) -> None:
        self.engine = engine
        self.host = host or EngineHost(engine)  # a decode worker shares its own (conditional disaggregation)

    @staticmethod
    def _timings(seq: Sequence, end_ns: int) -> generate_pb2.Timings:
        return generate_pb2.Timings(
            queue_ns=seq.prefill_start_ns - seq.arrival_ns,
            prefill_ns=seq.prefill_end_ns - seq.prefill_start_ns,
            decode_ns=end_ns - seq.prefill_end_ns,
            cached_prompt_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            preempted_ns=seq.preempted_ns,
        )

    async def Generate(self, request: worker_pb2.ColocatedRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        q = await admit_prompt(self.host, request, context)
        finished = False
        try:
            side = self.host.channels.sender(request.token_channel, rid)
            async for batch in relay_tokens(q, context, self._timings, side):
                finished = batch.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                yield batch
        finally:
            self.host.streams.close(rid)
            if not finished:
                await abort_quietly(self.host.loop, rid)


def colocated_service(worker: ColocatedWorker) -> tuple:
    """ColocatedService on ``worker``, as ``serve_worker`` takes services."""
    return (worker_pb2_grpc.add_ColocatedServiceServicer_to_server, worker, "pdserve.v1.ColocatedService")
