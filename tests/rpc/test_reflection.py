"""A server from ``start_server`` lists exactly its services over reflection v1 and v1alpha,
describes them (the v1 reflection service included), and reports health SERVING."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as alpha
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.rpc import reflection_v1
from pdserve.rpc.server import start_server
from pdserve.v1 import worker_pb2_grpc

V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
OURS = ["pdserve.v1.WorkerService", "pdserve.v1.PrefillService"]
EXPECTED = {
    *OURS,
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}
WAIT_S = 10


@pytest.fixture
async def served():
    """(address, health servicer) of a server with WorkerService and PrefillService."""
    health_servicer = health.aio.HealthServicer()
    server, port = await start_server(
        [
            (worker_pb2_grpc.add_WorkerServiceServicer_to_server, worker_pb2_grpc.WorkerServiceServicer(), OURS[0]),
            (worker_pb2_grpc.add_PrefillServiceServicer_to_server, worker_pb2_grpc.PrefillServiceServicer(), OURS[1]),
        ],
        health_servicer=health_servicer,
    )
    yield f"127.0.0.1:{port}", health_servicer
    await server.stop(0)


async def reflect(address: str, path: str, *requests: alpha.ServerReflectionRequest) -> list:
    """Raw ServerReflectionInfo calls; v1 messages are v1alpha's field for field, so v1alpha's
    classes encode them (as a v1 client's bytes would be)."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(
            path,
            request_serializer=alpha.ServerReflectionRequest.SerializeToString,
            response_deserializer=alpha.ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(requests), timeout=WAIT_S)]


def file_protos(response) -> list[descriptor_pb2.FileDescriptorProto]:
    return [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in response.file_descriptor_response.file_descriptor_proto
    ]


@pytest.mark.parametrize("path", [V1, V1ALPHA])
async def test_both_versions_list_exactly_the_served_services(served, path):
    address, _ = served
    (resp,) = await reflect(address, path, alpha.ServerReflectionRequest(list_services=""))
    assert {s.name for s in resp.list_services_response.service} == EXPECTED


@pytest.mark.parametrize("path", [V1, V1ALPHA])
async def test_both_versions_describe_a_served_service(served, path):
    address, _ = served
    (resp,) = await reflect(
        address, path, alpha.ServerReflectionRequest(file_containing_symbol="pdserve.v1.WorkerService")
    )
    files = {f.name: f for f in file_protos(resp)}
    (worker,) = [f for f in files.values() if any(s.name == "WorkerService" for s in f.service)]
    assert worker.package == "pdserve.v1"
    service = next(s for s in worker.service if s.name == "WorkerService")
    assert {m.name: m.input_type for m in service.method} == {
        "GetStats": ".pdserve.v1.GetStatsRequest",
        "Abort": ".pdserve.v1.WorkerAbortRequest",
        "SetRole": ".pdserve.v1.SetRoleRequest",
        "TokenChannel": ".pdserve.v1.TokenChannelRequest",
    }


async def test_several_requests_on_one_v1_stream_are_each_answered(served):
    address, _ = served
    responses = await reflect(
        address,
        V1,
        alpha.ServerReflectionRequest(list_services=""),
        alpha.ServerReflectionRequest(file_containing_symbol="no.such.Service"),
        alpha.ServerReflectionRequest(file_containing_symbol="pdserve.v1.PrefillService"),
    )
    assert len(responses) == 3
    assert responses[0].WhichOneof("message_response") == "list_services_response"
    assert responses[1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert any(s.name == "PrefillService" for f in file_protos(responses[2]) for s in f.service)


async def test_v1_describes_the_v1_reflection_service_itself(served):
    """grpcurl and Postman describe the reflection service before they use it: the v1 file must be
    v1alpha's renamed, every reference pointing into the v1 package, fields numbered alike."""
    address, _ = served
    (resp,) = await reflect(
        address, V1, alpha.ServerReflectionRequest(file_containing_symbol=reflection_v1.SERVICE_NAME)
    )
    (v1,) = [f for f in file_protos(resp) if f.name == reflection_v1.V1_FILE]
    assert v1.package == "grpc.reflection.v1"
    (method,) = v1.service[0].method
    assert (v1.service[0].name, method.name) == ("ServerReflection", "ServerReflectionInfo")
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.output_type == ".grpc.reflection.v1.ServerReflectionResponse"
    assert method.client_streaming and method.server_streaming
    refs = [f.type_name for m in v1.message_type for f in m.field if f.type_name]
    assert refs and all(r.startswith(".grpc.reflection.v1.") for r in refs)
    original = descriptor_pb2.FileDescriptorProto.FromString(alpha.DESCRIPTOR.serialized_pb)
    assert [m.name for m in v1.message_type] == [m.name for m in original.message_type]
    for new, old in zip(v1.message_type, original.message_type):
        assert [(f.name, f.number, f.type, f.label) for f in new.field] == [
            (f.name, f.number, f.type, f.label) for f in old.field
        ]
    # and it resolves: a pool built from what the server sent finds the v1 messages
    pool = descriptor_pool.DescriptorPool()
    for f in file_protos(resp):
        pool.Add(f)
    request = pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest")
    assert (
        request.fields_by_name["list_services"].number
        == alpha.ServerReflectionRequest.DESCRIPTOR.fields_by_name["list_services"].number
    )


async def test_grpcio_reflection_client_reads_the_services_and_their_methods(served):
    address, _ = served

    def read() -> tuple[set[str], dict[str, list[str]]]:
        with grpc.insecure_channel(address) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            pool = descriptor_pool.DescriptorPool(db)
            methods = {name: [m.name for m in pool.FindServiceByName(name).methods] for name in OURS}
            return set(db.get_services()), methods

    services, methods = await asyncio.wait_for(asyncio.to_thread(read), WAIT_S)
    assert services == EXPECTED
    assert methods == {
        "pdserve.v1.WorkerService": ["GetStats", "Abort", "SetRole", "TokenChannel"],
        "pdserve.v1.PrefillService": ["Prefill"],
    }


async def test_health_reports_every_service_serving_and_follows_its_servicer(served):
    address, health_servicer = served
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ["", *EXPECTED]:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Nothing"), timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_second_server_in_the_process_serves_v1_too(served):
    """The v1 descriptor is added to the default pool once; later servers reuse it."""
    other, port = await start_server([])
    try:
        assert descriptor_pool.Default().FindFileByName(reflection_v1.V1_FILE).package == "grpc.reflection.v1"
        (resp,) = await reflect(f"127.0.0.1:{port}", V1, alpha.ServerReflectionRequest(list_services=""))
        assert {s.name for s in resp.list_services_response.service} == {
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }
    finally:
        await other.stop(0)


async def test_a_port_another_socket_holds_is_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(RuntimeError):
            await start_server([], port=sock.getsockname()[1])


async def test_a_port_another_grpc_server_serves_is_refused(served):
    """Two servers on one port would split its connections between them without a word."""
    address, _ = served
    with pytest.raises(RuntimeError, match="(?i)bind"):
        await start_server([], port=int(address.rsplit(":", 1)[1]))
