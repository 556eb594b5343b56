"""The router's handle on one worker: its channel, its stubs and what the router knows of its load."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import grpc

from pdserve.router.token_channel import TokenChannelClient
from pdserve.rpc.auth import internal_channel
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class WorkerHandle:
    """One worker: address, stubs and what the router knows of its load.

    ``outstanding_prefill_tokens``: prompt tokens sent to it and not yet answered (router-side count).
    ``free_kv_blocks``: from the last GetStats poll, minus blocks routed to it since; ``num_running``,
    ``num_waiting`` (waiting for prefill or for KV) and ``used_kv_blocks``: from the last poll.
    """

    role: str
    address: str
    channel: grpc.aio.Channel = field(repr=False)
    healthy: bool = True
    failed_polls: int = 0
    outstanding_prefill_tokens: int = 0
    active_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    block_size: int = 16
    routed_blocks_since_poll: int = 0
    num_running: int = 0
    num_waiting: int = 0
    used_kv_blocks: int = 0
    fingerprint: str = ""  # of the model it serves (WorkerStats.model_fingerprint)
    cached_kv_blocks: int = -1  # from the last poll; 0 on a worker without prefix caching (-1: not polled yet)
    prefill_busy_ns: int = 0  # step time since its start, from the last poll (WorkerStats)
    decode_busy_ns: int = 0
    switchable: bool = False  # serves every role and takes SetRole (--placement auto; router/role_switch.py)
    draining: bool = False  # being switched to another role: no new request is routed to it

    @classmethod
    def connect(cls, role: str, address: str) -> WorkerHandle:
        return cls(role, address, internal_channel(address, GRPC_OPTIONS))

    @cached_property
    def prefill(self) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self.channel)

    @cached_property
    def decode(self) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self.channel)

    @cached_property
    def colocated(self) -> worker_pb2_grpc.ColocatedServiceStub:
        return worker_pb2_grpc.ColocatedServiceStub(self.channel)

    @cached_property
    def admin(self) -> worker_pb2_grpc.WorkerServiceStub:
        return worker_pb2_grpc.WorkerServiceStub(self.channel)

    @cached_property
    def tokens(self) -> TokenChannelClient:
        """This router's token channel on the worker (router/token_channel.py)."""
        return TokenChannelClient(self.admin, self.address)

    async def close(self) -> None:
        """Close its token channel (when opened) and its gRPC channel."""
        if "tokens" in self.__dict__:
            await self.tokens.close()
        await self.channel.close()

    def routed(self, tokens: int) -> None:
        """A request whose KV will take ``tokens`` slots here was routed to this worker: its blocks
        count against ``free_kv_blocks`` until the next stats poll sees them."""
        self.routed_blocks_since_poll += -(-tokens // max(self.block_size, 1))

    def apply_stats(self, s: worker_pb2.WorkerStats) -> None:
        """Take an answered GetStats poll: healthy again, and its load as the worker reports it."""
        self.healthy, self.failed_polls = True, 0
        self.free_kv_blocks, self.block_size, self.routed_blocks_since_poll = s.free_kv_blocks, s.block_size, 0
        self.total_kv_blocks = s.free_kv_blocks + s.used_kv_blocks
        self.num_running, self.num_waiting = s.num_running, s.num_waiting + s.num_awaiting_kv
        self.used_kv_blocks, self.fingerprint, self.cached_kv_blocks = (
            s.used_kv_blocks,
            s.model_fingerprint,
            s.cached_kv_blocks,
        )
        self.prefill_busy_ns, self.decode_busy_ns, self.switchable = s.prefill_busy_ns, s.decode_busy_ns, s.switchable
