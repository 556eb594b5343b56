"""Token channels: one stream a router holds open on a worker for the middle tokens of its requests.

Every gRPC message costs tens of microseconds of CPU at each end (``benchmarks/grpc_stream_cost.py``),
so a step sends one message for all of a router's requests rather than one per request. A request
that names a channel (``token_channel`` in DecodeRequest and ColocatedRequest) has its first and
last TokenBatch on its own call (the first carries the phases known then, the last the finish
reason and timings; errors end the call); the batches in between go on the channel, every request
of a step in one ChannelBatch. Each batch gives the index of its
first token among the call's tokens, so the router puts the two paths back in order
(``router/token_channel.py``). This is the shape of vLLM's and SGLang's engine outputs: one message
a step for all requests, split per request by the front end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pdserve.v1 import worker_pb2


class TokenChannel:
    """One open channel: entries sent by the requests' relays between two of its messages."""

    def __init__(self, channel_id: str) -> None:
        self.channel_id = channel_id
        self.closed = False
        self._entries: list[worker_pb2.ChannelTokens] = []
        self._ready = asyncio.Event()

    def send(self, request_id: str, first_index: int, token_ids: list[int]) -> None:
        """Queue a request's tokens for the next message (event loop thread)."""
        self._entries.append(
            worker_pb2.ChannelTokens(request_id=request_id, first_index=first_index, token_ids=token_ids)
        )
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def batches(self) -> AsyncIterator[worker_pb2.ChannelBatch]:
        """An empty first message (the channel is open), then one message for everything sent
        since the last one, until :meth:`close`. Relays woken by the same step all run before this
        one, so a step's tokens leave together."""
        yield worker_pb2.ChannelBatch()
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self.closed:
                return
            entries, self._entries = self._entries, []
            if entries:
                yield worker_pb2.ChannelBatch(requests=entries)


class TokenChannels:
    """The channels open on one worker, by id (shared by every service of an EngineHost)."""

    def __init__(self) -> None:
        self._open: dict[str, TokenChannel] = {}
        self.tokens_sent = 0  # tokens that went on a channel, all channels together

    def open(self, channel_id: str) -> TokenChannel:
        """A new channel of that id; an earlier one of the same id is closed."""
        old = self._open.get(channel_id)
        if old is not None:
            old.close()
        channel = self._open[channel_id] = TokenChannel(channel_id)
        return channel

    def close(self, channel: TokenChannel) -> None:
        channel.close()
        if self._open.get(channel.channel_id) is channel:
            del self._open[channel.channel_id]

    def sender(self, channel_id: str, request_id: str) -> Callable[[int, list[int]], bool] | None:
        """For a request naming ``channel_id`` (None when empty): ``send(first_index, token_ids)``
        puts the tokens on that channel and says True, or says False when no channel of that id is
        open (the relay then sends them on the request's call)."""
        if not channel_id:
            return None

        def send(first_index: int, token_ids: list[int]) -> bool:
            channel = self._open.get(channel_id)
            if channel is None:
                return False
            channel.send(request_id, first_index, token_ids)
            self.tokens_sent += len(token_ids)
            return True

        return send
