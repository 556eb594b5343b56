"""gRPC server reflection v1 (``grpc.reflection.v1.ServerReflection``), which grpcurl and Postman
ask for first, served beside v1alpha.

grpcio-reflection ships only v1alpha. The v1 protocol is v1alpha under a new package name: the
same messages field for field, hence the same bytes on the wire (grpc/grpc-proto,
``grpc/reflection/v1/reflection.proto``). So v1 is served by grpcio-reflection's own v1alpha
servicer, under the v1 method name, with the v1alpha message classes as (de)serializers. The v1
file descriptor (v1alpha's, renamed) is added to the default pool, so that clients can describe
the v1 service itself.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(alpha.DESCRIPTOR.serialized_pb)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    for service in proto.service:
        for m in service.method:
            m.input_type = m.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
            m.output_type = m.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    proto.ClearField("options")
    pool.Add(proto)


def enable(service_names: list[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` (add both
    reflection services' names to it)."""
    _register_v1_descriptor()
    reflection.enable_server_reflection(service_names, server)
    servicer = reflection.aio.ReflectionServicer(service_names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha.ServerReflectionRequest.FromString,
        response_serializer=alpha.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
