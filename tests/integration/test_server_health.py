"""Health and reflection on every server, and a router that tells the truth about workers that went away."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline


async def test_health_and_reflection_on_every_server(embedded_dir):
    """Reflection v1 (what grpcurl asks first) and v1alpha list exactly what each server serves."""
    from google.protobuf import descriptor_pb2

    common = {
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    expected = [
        {"pdserve.v1.GenerateService"},
        {"pdserve.v1.PrefillService", "pdserve.v1.WorkerService"},
        {"pdserve.v1.DecodeService", "pdserve.v1.ColocatedService", "pdserve.v1.WorkerService"},
    ]
    async with local_pipeline(embedded_dir, "split") as pipe:
        for address, services in zip([pipe.address] + [w.address for w in pipe.workers], expected):
            async with grpc.aio.insecure_channel(address) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                v1 = ch.stream_stream(
                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                v1alpha = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo
                for call in (v1, v1alpha):
                    replies = [
                        r
                        async for r in call(
                            iter(
                                [
                                    reflection_pb2.ServerReflectionRequest(list_services=""),
                                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=sorted(services)[0]),
                                ]
                            )
                        )
                    ]
                    assert {s.name for s in replies[0].list_services_response.service} == services | common
                    files = [
                        descriptor_pb2.FileDescriptorProto.FromString(b)
                        for b in replies[1].file_descriptor_response.file_descriptor_proto
                    ]
                    assert files[0].package == "pdserve.v1" and files[0].name.startswith("pdserve/v1/")
                described = [
                    r
                    async for r in v1(
                        iter(
                            [
                                reflection_pb2.ServerReflectionRequest(
                                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                                )
                            ]
                        )
                    )
                ]
                assert described[0].file_descriptor_response.file_descriptor_proto


async def test_router_health_says_not_serving_while_a_pool_has_no_worker(embedded_dir):
    """Readiness tells the truth: a split router with no live prefill worker is NOT_SERVING."""
    async with local_pipeline(embedded_dir, "split") as pipe, grpc.aio.insecure_channel(pipe.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status(service: str) -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status("") == await status("pdserve.v1.GenerateService") == health_pb2.HealthCheckResponse.SERVING
        await pipe.workers[0].stop()  # the prefill worker
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while await status("") == health_pb2.HealthCheckResponse.SERVING and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("pdserve.v1.GenerateService") == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_a_failed_call_takes_the_worker_out_of_routing_at_once(embedded_dir, placement):
    """No waiting for three failed stats polls: the UNAVAILABLE call itself marks the worker down."""
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        dead = pipe.workers[0]  # the prefill worker, or the only colocated one
        handle = next(w for w in pipe.router.core.pool.workers if w.address == dead.address)
        await dead.stop()
        request = asyncio.create_task(client.generate(make_request("hi", max_tokens=2)))
        for _ in range(50):  # split placement then waits (up to 4 s) for a live worker to migrate to
            if request.done() or not handle.healthy:
                break
            await asyncio.sleep(0.005)
        assert not handle.healthy and handle.failed_polls < 3
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await request
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
