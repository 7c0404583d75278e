"""Every RPC of every Trainyard service, read from the proto descriptors, and one way to call any of them.

The suite never lists RPCs by hand: a new RPC in protos/trainyard/v1 is swept and fuzzed as soon as its stubs are
regenerated. The process serving a service is the proto file's name (scheduler.proto -> the scheduler).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, MethodDescriptor

import trainyard.v1

# What a client may be told for a request it got wrong or an object it may not see; OK is the other good answer.
CLIENT_ERRORS = frozenset({
    "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE", "ALREADY_EXISTS",
    "UNAUTHENTICATED", "PERMISSION_DENIED",
})
# Refusals an account gets for another account's object (the architecture answers NOT_FOUND so ids cannot be probed;
# a request the server rejects before looking the object up is refused as well).
REFUSALS = frozenset({"NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARGUMENT", "FAILED_PRECONDITION"})


@dataclass(frozen=True)
class Rpc:
    process: str           # the service process that serves it: scheduler, trainer, rollout, weightsync
    service: str           # full service name, e.g. trainyard.v1.JobService
    name: str              # method name, e.g. CreateJob
    method: MethodDescriptor

    @property
    def full(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.name}"

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def input(self) -> Descriptor:
        return self.method.input_type

    @property
    def output(self) -> Descriptor:
        return self.method.output_type

    @property
    def client_streaming(self) -> bool:
        return self.method.client_streaming

    @property
    def server_streaming(self) -> bool:
        return self.method.server_streaming

    def request(self, **fields):
        return message_class(self.input)(**fields)


def message_class(descriptor: Descriptor):
    return message_factory.GetMessageClass(descriptor)


def all_rpcs() -> list[Rpc]:
    """Every method of every service of every generated module of trainyard.v1."""
    out = []
    for info in pkgutil.iter_modules(trainyard.v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"trainyard.v1.{info.name}")
        process = module.DESCRIPTOR.name.rsplit("/", 1)[-1].removesuffix(".proto")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                out.append(Rpc(process, service.full_name, method.name, method))
    return out


@dataclass
class Outcome:
    """What one call got back: the status code name, its message, and the responses (a stream's, in order)."""

    code: str
    details: str = ""
    responses: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    def text(self) -> str:
        """Everything the caller was told, as text: to search for what it must not see."""
        return self.details + "\n" + "\n".join(str(r) for r in self.responses)


def invoke(channel: grpc.Channel, rpc: Rpc, request, metadata, timeout_s: float = 20.0,
           max_messages: int = 50) -> Outcome:
    """Call rpc with request (a list of messages for a client stream). A server stream is read for up to
    max_messages messages or until the deadline; a stream still open then (a watch) is an OK answer."""
    cls_out = message_class(rpc.output)
    kw = {"request_serializer": lambda m: m.SerializeToString(), "response_deserializer": cls_out.FromString}
    responses: list = []
    try:
        if rpc.client_streaming and rpc.server_streaming:
            call = channel.stream_stream(rpc.path, **kw)(iter(request), metadata=metadata, timeout=timeout_s)
        elif rpc.client_streaming:
            responses.append(channel.stream_unary(rpc.path, **kw)(iter(request), metadata=metadata,
                                                                  timeout=timeout_s))
            return Outcome("OK", "", responses)
        elif rpc.server_streaming:
            call = channel.unary_stream(rpc.path, **kw)(request, metadata=metadata, timeout=timeout_s)
        else:
            responses.append(channel.unary_unary(rpc.path, **kw)(request, metadata=metadata, timeout=timeout_s))
            return Outcome("OK", "", responses)
        for msg in call:
            responses.append(msg)
            if len(responses) >= max_messages:
                call.cancel()
                break
        return Outcome("OK", "", responses)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        if code == "DEADLINE_EXCEEDED" and rpc.server_streaming and responses:
            return Outcome("OK", "", responses)  # a watch still delivering
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return Outcome(code, details or "", responses)
