"""Stream one completion from a pdserve router, with nothing of pdserve but stubs generated from
its .proto files (docs/api.md: "Calling pdserve from your own program").

    python -m grpc_tools.protoc -I PROTO_ROOT --python_out=. --grpc_python_out=. \
        PROTO_ROOT/pdserve/v1/generate.proto
    python grpc_client.py "Once upon a time" --address 127.0.0.1:50051 --max-tokens 32 [--api-key KEY]

Exit status: 0 when the stream completed, 1 on an in-band error, 2 when the router refused or
the deadline passed, 130 on Ctrl-C (the call is cancelled, which frees the request's KV blocks).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0, help="deadline for the whole stream, s")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY; for serve --api-key)",
    )
    args = p.parse_args()
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None

    request = generate_pb2.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=generate_pb2.SamplingParams(temperature=args.temperature),
    )
    with grpc.insecure_channel(args.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        try:
            for message in call:
                kind = message.WhichOneof("kind")
                if kind == "chunk":
                    print(message.chunk.text, end="", flush=True)
                elif kind == "complete":  # the text held back for stop strings comes last
                    done = message.complete
                    print(done.text)
                    reason = generate_pb2.FinishReason.Name(done.finish_reason)
                    print(
                        f"[{reason}: {done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} "
                        f"completion tokens, {done.timings.total_ns / 1e6:.0f} ms]",
                        file=sys.stderr,
                    )
                    return 0
                else:  # a failure after tokens were streamed
                    print(f"\n[error {message.error.code}: {message.error.message}]", file=sys.stderr)
                    return 1
        except KeyboardInterrupt:
            call.cancel()
            return 130
        except grpc.RpcError as exc:  # refused before any token, or the deadline passed
            print(f"[{exc.code().name}: {exc.details()}]", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
