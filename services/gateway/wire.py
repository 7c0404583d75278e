"""Tinker's request and result shapes (JSON and protobuf) to and from trainyard.types: the gateway's one converter.

Requests arrive as Tinker's JSON (pydantic model_dump of its request types) or, for forward_backward, as the
tinker_wire.proto ForwardBackwardRequest; each becomes the trainyard.types value the trainyard SDK takes, whose
checks name the field at fault. Results leave as Tinker's JSON, or as protobuf for the two types the SDK only
accepts that way (SampleResponse, ForwardBackwardOutput: tinker/proto/response_conv.py).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.gateway.errors import GatewayError, bad_request
from trainyard import types
from trainyard.v1 import tinker_wire_pb2 as wire

PROTO = "application/x-protobuf"
_DTYPES = {wire.DTYPE_FLOAT32: ("float32", np.float32), wire.DTYPE_INT64: ("int64", np.int64),
           wire.DTYPE_INT32: ("int64", np.int32)}
_TO_WIRE = {"float32": wire.DTYPE_FLOAT32, "int64": wire.DTYPE_INT64}
_STOP = {"stop": wire.STOP_REASON_STOP, "length": wire.STOP_REASON_LENGTH}


def checked(fn, *args, field: str = ""):
    """fn(*args), a ValueError from trainyard.types' checks (or pydantic's) as a 400 naming the field."""
    try:
        return fn(*args)
    except GatewayError:
        raise
    except (ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GatewayError("INVALID_ARGUMENT", f"{field}: {message}" if field else message, field) from None


# -- requests: JSON ---------------------------------------------------------------------------------------------------

def model_input(value: Any, field: str) -> types.ModelInput:
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise bad_request(f"{field}.chunks", "must be a list of chunks")
    chunks = []
    for i, chunk in enumerate(value["chunks"]):
        where = f"{field}.chunks[{i}]"
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise bad_request(where, f"only encoded_text chunks are supported (Trainyard's models take text), "
                              f"got {kind!r}")
        chunks.append(checked(lambda c: types.EncodedTextChunk(tokens=c.get("tokens")), chunk, field=where))
    return types.ModelInput(chunks=chunks)


def tensor(value: Any, field: str) -> types.TensorData:
    if not isinstance(value, dict) or "data" not in value:
        raise bad_request(field, "must be a TensorData object {data, dtype, shape}")
    if value.get("sparse_crow_indices") is not None or value.get("sparse_col_indices") is not None:
        raise bad_request(field, "sparse tensors are not supported; send it dense")
    return checked(types.TensorData, value["data"], value.get("dtype"), value.get("shape"), field=field)


def datum(value: Any, field: str) -> types.Datum:
    if not isinstance(value, dict):
        raise bad_request(field, "must be a Datum object {model_input, loss_fn_inputs}")
    inputs = value.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict):
        raise bad_request(f"{field}.loss_fn_inputs", "must be an object of tensors")
    d = checked(types.Datum, model_input(value.get("model_input"), f"{field}.model_input"),
                {k: tensor(v, f"{field}.loss_fn_inputs[{k!r}]") for k, v in inputs.items()}, field=field)
    checked(d.check, field)
    return d


def loss_fn_config(value: Any, field: str = "loss_fn_config") -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(field, "must be an object of numbers")
    return checked(types.check_loss_fn_config, value, field=field)


def adam_params(body: dict) -> types.AdamParams:
    params = next((body[k] for k in ("adam_params", "optim_params", "optimizer_params") if k in body), None)
    if params is None:
        raise bad_request("adam_params", "required")
    if not isinstance(params, dict) or params.get("type", "adam") not in ("adam", "adamw"):
        raise bad_request("adam_params", f"only Adam(W) parameters are supported, got {params!r}")
    return checked(lambda p: types.AdamParams(**{k: v for k, v in p.items() if k != "type"}), params,
                   field="adam_params")


def sampling_params(value: Any) -> types.SamplingParams:
    if not isinstance(value, dict):
        raise bad_request("sampling_params", "must be an object")
    return checked(lambda v: types.SamplingParams(**v), value, field="sampling_params")


# -- requests: protobuf -----------------------------------------------------------------------------------------------

def _proto_tensor(msg: wire.Tensor, field: str) -> types.TensorData:
    if msg.WhichOneof("encoding") == "sparse_csr":
        raise bad_request(field, "sparse tensors are not supported; send it dense")
    if msg.dtype not in _DTYPES:
        raise bad_request(f"{field}.dtype", f"must be float32, int64 or int32, got {msg.dtype}")
    name, np_dtype = _DTYPES[msg.dtype]
    if len(msg.dense) % np.dtype(np_dtype).itemsize:
        raise bad_request(f"{field}.dense", f"{len(msg.dense)} bytes is not a whole number of {name} values")
    values = np.frombuffer(msg.dense, dtype=np.dtype(np_dtype).newbyteorder("<"))
    return checked(types.TensorData, values, name, list(msg.shape) or None, field=field)


def proto_datum(msg: wire.Datum, field: str) -> types.Datum:
    chunks = []
    for i, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad_request(f"{field}.model_input[{i}]", f"only encoded_text chunks are supported, got {kind!r}")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise bad_request(f"{field}.model_input[{i}].tokens", "must be int32 values (a multiple of 4 bytes)")
        tokens = np.frombuffer(raw, dtype="<i4").tolist()
        chunks.append(checked(lambda t: types.EncodedTextChunk(tokens=t), tokens, field=f"{field}.model_input[{i}]"))
    d = checked(types.Datum, types.ModelInput(chunks=chunks),
                {k: _proto_tensor(v, f"{field}.loss_fn_inputs[{k!r}]") for k, v in msg.loss_fn_inputs.items()},
                field=field)
    checked(d.check, field)
    return d


def proto_loss_fn_config(msg: wire.ForwardBackwardRequest) -> dict[str, float] | None:
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise bad_request(f"loss_fn_config[{key!r}]", "text values are not supported; give a number")
        config[key] = value.number
    return loss_fn_config(config) if config else None


# -- results ------------------------------------------------------------------------------------------------------------

def _tensor_json(t: types.TensorData) -> dict:
    return {"data": t.data, "dtype": t.dtype, "shape": t.shape}


def forward_output_json(out: types.ForwardBackwardOutput) -> dict:
    return {"loss_fn_output_type": out.loss_fn_output_type, "metrics": out.metrics,
            "loss_fn_outputs": [{k: _tensor_json(v) for k, v in o.items()} for o in out.loss_fn_outputs]}


def forward_output_proto(out: types.ForwardBackwardOutput) -> bytes:
    """One ArrayRecord per datum (the SDK concatenates records), so datums may differ in shape."""
    msg = wire.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type, metrics=out.metrics)
    for outputs in out.loss_fn_outputs:
        record = msg.loss_fn_outputs.add(type_tag=out.loss_fn_output_type, num_datums=1)
        for name, t in outputs.items():
            arr = t.to_numpy()
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            record.fields[name].CopyFrom(wire.BatchedTensor(
                data=data, offsets=np.array([0, len(data)], dtype="<i8").tobytes(), dtype=_TO_WIRE[t.dtype],
                trailing_shape=t.shape[1:]))
    return msg.SerializeToString()


def _f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _topk_proto(rows: types.TopkLogprobs, field: str) -> wire.TopkLogprobs:
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), -math.inf, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    return wire.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def sample_proto(out: types.SampleResponse) -> bytes:
    msg = wire.SampleResponse()
    for s in out.sequences:
        seq = msg.sequences.add(stop_reason=_STOP[s.stop_reason], tokens=np.asarray(s.tokens, "<i4").tobytes(),
                                logprobs=_f32(s.logprobs))
        if s.topk_logprobs is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk_proto(s.topk_logprobs, "topk_sample_logprobs"))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = _f32([math.nan if v is None else v for v in out.prompt_logprobs])
    return msg.SerializeToString()


def sample_json(out: types.SampleResponse) -> dict:
    return {"type": "sample", "prompt_logprobs": out.prompt_logprobs,
            "sequences": [{"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs,
                           "sequence_id": s.sequence_id,
                           **({"topk_logprobs": s.topk_logprobs} if s.topk_logprobs is not None else {})}
                          for s in out.sequences]}
