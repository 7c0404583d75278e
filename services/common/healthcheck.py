"""A container healthcheck (docker-compose.yml): exit 0 when the service on this host answers, 1 otherwise.

    python -m services.common.healthcheck grpc 50051                  the gRPC health service reports SERVING
    python -m services.common.healthcheck http 9100 /metrics          an HTTP GET answers 200
"""
from __future__ import annotations

import argparse
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel


def grpc_serving(port: int, timeout_s: float) -> bool:
    with open_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return status.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(port: int, path: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("grpc", "http"))
    parser.add_argument("port", type=int)
    parser.add_argument("path", nargs="?", default="/", help="http only: the path to GET")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    ok = grpc_serving(args.port, args.timeout) if args.kind == "grpc" else http_ok(args.port, args.path, args.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
