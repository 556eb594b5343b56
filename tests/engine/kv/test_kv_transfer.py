import inspect
import math

import pytest
import torch

from pdserve.engine.kv.codec import Frame, KvCodecError, KvLimits, KvPayload, ModelFingerprint, pack_kv, unpack_kv
from pdserve.engine.kv.transfer import InProcessKvTransfer, KvReceiver, KvSender, KvTransferError

FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 16, "bfloat16", 16, "ff" * 32)


def make_frame(num_tokens: int = 50) -> tuple[KvPayload, bytes]:
    kv = torch.randn(FP.num_layers, 2, num_tokens, FP.num_kv_heads, FP.head_dim).to(torch.bfloat16)
    payload = KvPayload("req-1", FP, list(range(num_tokens)), 7, {"temperature": 0.0}, kv)
    return payload, pack_kv(payload)


class DecodeStub:
    def __init__(self, expected: ModelFingerprint = FP):
        self.expected = expected
        self.received: list[KvPayload] = []

    async def receive_kv(self, frame: Frame) -> None:
        self.received.append(unpack_kv(frame, self.expected))


def protocol_methods(proto) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v))


def sig(fn) -> inspect.Signature:
    return inspect.signature(fn, eval_str=True)  # compare resolved annotations, not their spelling


def test_in_process_transfer_satisfies_sender_protocol():
    assert protocol_methods(KvSender) == ["send_kv"]
    for name in protocol_methods(KvSender):
        impl = getattr(InProcessKvTransfer, name)
        assert sig(impl) == sig(getattr(KvSender, name))
        assert inspect.iscoroutinefunction(impl)
    assert isinstance(InProcessKvTransfer(), KvSender)
    stub = DecodeStub()
    assert isinstance(stub, KvReceiver)
    assert sig(DecodeStub.receive_kv) == sig(KvReceiver.receive_kv)


async def test_multi_chunk_frame_delivered_intact():
    payload, frame = make_frame()
    transfer = InProcessKvTransfer(chunk_bytes=256)
    stub = DecodeStub()
    transfer.register("decode-0:50051", stub)
    await transfer.send_kv("decode-0:50051", "req-1", frame)

    assert transfer.chunks_sent == math.ceil(len(frame) / 256) > 10
    [got] = stub.received
    assert torch.equal(got.kv, payload.kv)
    assert (got.request_id, got.token_ids, got.first_token) == ("req-1", payload.token_ids, 7)


async def test_unknown_target():
    transfer = InProcessKvTransfer()
    transfer.register("decode-0:1", DecodeStub())
    with pytest.raises(KvTransferError, match="unknown kv target 'decode-9:1'"):
        await transfer.send_kv("decode-9:1", "req-1", make_frame()[1])
    assert transfer.chunks_sent == 0


async def test_receiver_errors_are_wrapped():
    _, frame = make_frame()
    transfer = InProcessKvTransfer(chunk_bytes=1000)
    transfer.register("a:1", DecodeStub(ModelFingerprint("LlamaForCausalLM", 3, 2, 16, "bfloat16", 16, "ff" * 32)))
    with pytest.raises(KvTransferError, match="num_layers 2 != 3") as ei:
        await transfer.send_kv("a:1", "req-1", frame)
    assert isinstance(ei.value.__cause__, KvCodecError)

    class UnknownRequest:
        async def receive_kv(self, frame: bytes) -> None:
            raise KeyError("req-1")

    transfer.register("b:1", UnknownRequest())
    with pytest.raises(KvTransferError, match="b:1 rejected kv for request 'req-1': KeyError") as ei:
        await transfer.send_kv("b:1", "req-1", frame)
    assert isinstance(ei.value.__cause__, KeyError)


async def test_transit_limits_apply_before_receiver():
    _, frame = make_frame()
    stub = DecodeStub()
    transfer = InProcessKvTransfer(chunk_bytes=512, limits=KvLimits(max_header_bytes=1024, max_tensor_bytes=2048))
    transfer.register("a:1", stub)
    with pytest.raises(KvTransferError, match="refused in transit: frame too large") as ei:
        await transfer.send_kv("a:1", "req-1", frame)
    assert isinstance(ei.value.__cause__, KvCodecError)
    assert stub.received == []


def test_rejects_non_positive_chunk_size():
    with pytest.raises(ValueError):
        InProcessKvTransfer(chunk_bytes=0)


@pytest.mark.parametrize(
    "rid,size", [("req-1", 0), ("", 5), ("r" * 200, 127), ("é", 128), ("x", 16384), ("y", (1 << 20) + 3)]
)
def test_grpc_sender_encodes_kv_chunks_like_protobuf(rid, size):
    from pdserve.prefill_worker.kv_sender import encode_kv_chunk
    from pdserve.v1 import worker_pb2

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = encode_kv_chunk((rid, memoryview(data)))
    assert wire == worker_pb2.KvChunk(request_id=rid, data=data).SerializeToString()
    msg = worker_pb2.KvChunk.FromString(wire)
    assert (msg.request_id, msg.data) == (rid, data)
