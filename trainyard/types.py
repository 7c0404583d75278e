"""Types of the Training API SDK (trainyard.training), shaped like the Tinker API's `tinker.types`.

Inputs: ModelInput (chunks of token ids), Datum (a model input and the loss's per-position inputs), TensorData,
SamplingParams, AdamParams. Outputs: ForwardBackwardOutput, OptimStepResponse, SaveWeightsResponse,
SaveWeightsForSamplerResponse, LoadWeightsResponse, GetInfoResponse, SampleResponse. Each converts to or from its
message in protos/trainyard/v1/trainer.proto and rollout.proto here, so the clients hold no wire details.

Checks made before anything is sent raise ValueError naming the field the way the server names it
(e.g. "data[2].loss_fn_inputs['weights']"); range checks that need the model or the server's rules are the server's,
and arrive as trainyard.errors.TrainyardError (INVALID_ARGUMENT, with the field).
"""
from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from trainyard.rest_types import *  # noqa: F403 - Tinker's REST types are tinker.types' too
from trainyard.rest_types import __all__ as _rest_names
from trainyard.v1 import rollout_pb2, trainer_pb2

__all__ = [
    "AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "GetInfoResponse",
    "GetServerCapabilitiesResponse", "LoadWeightsResponse", "LoraConfig", "ModelData", "ModelInput",
    "ModelInputChunk", "OptimParams", "OptimStepResponse", "SampleResponse", "SampledSequence", "SamplingParams",
    "SaveWeightsForSamplerResponse", "SaveWeightsResponse", "StopReason", "SupportedModel", "TensorData",
    "TensorDtype", *_rest_names,
]

TensorDtype = Literal["int64", "float32"]
StopReason = Literal["stop", "length"]
_NUMPY = {"int64": np.dtype("<i8"), "float32": np.dtype("<f4")}
_WIRE = {"int64": trainer_pb2.TensorData.DTYPE_INT64, "float32": trainer_pb2.TensorData.DTYPE_FLOAT32}
_FROM_WIRE = {v: k for k, v in _WIRE.items()}
# The wire dtype of well-known loss inputs given as plain lists or arrays of another dtype.
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {"target_tokens": "int64", "weights": "float32", "advantages": "float32",
                                             "logprobs": "float32", "mask": "float32",
                                             # Tinker's other float inputs
                                             "clip_low_threshold": "float32", "clip_high_threshold": "float32",
                                             "sequence_ratio_mask": "float32"}
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32


# ---- tensors ------------------------------------------------------------------------------------------------------

def _as_array(values: Any, dtype: str | None, where: str) -> np.ndarray:
    """values (list, numpy array, torch tensor, TensorData) as a little-endian int64 or float32 numpy array."""
    if dtype is not None and dtype not in _NUMPY:
        raise ValueError(f"{where}: dtype must be 'int64' or 'float32', got {dtype!r}")
    if isinstance(values, TensorData):
        values = values.to_numpy()
    elif type(values).__module__.startswith("torch"):
        values = values.detach().cpu()
        values = values.float() if values.is_floating_point() else values
        values = values.numpy()
    try:
        arr = np.asarray(values)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{where}: must be a rectangular array of numbers ({exc})") from None
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{where}: must hold numbers, got {arr.dtype} values")
    if dtype is None:
        dtype = "float32" if arr.dtype.kind == "f" else "int64"
    if dtype == "int64" and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.array_equal(arr, np.round(arr)):
            raise ValueError(f"{where}: int64 values must be whole numbers")
    return np.ascontiguousarray(arr.astype(_NUMPY[dtype], copy=False))


class TensorData:
    """A tensor on the wire: int64 or float32 values with a shape (row-major).

    Built from a flat list and a shape as Tinker's is (TensorData(data=[...], dtype="float32", shape=[2, 3])), or
    from nested lists, numpy arrays or torch tensors (from_list / from_numpy / from_torch: floating point becomes
    float32, integers and booleans int64)."""

    __slots__ = ("_array",)

    def __init__(self, data: Any = None, dtype: TensorDtype | None = None, shape: Sequence[int] | None = None):
        arr = _as_array(np.empty(0, _NUMPY[dtype or "float32"]) if data is None else data, dtype, "TensorData.data")
        if shape is not None:
            shape = tuple(operator.index(s) for s in shape)
            if any(s < 0 for s in shape) or math.prod(shape) != arr.size:
                raise ValueError(f"TensorData.shape: {list(shape)} holds {math.prod(shape)} values; data has "
                                 f"{arr.size}")
            arr = arr.reshape(shape)
        arr.flags.writeable = False
        self._array = arr

    @classmethod
    def from_list(cls, values: Any, dtype: TensorDtype | None = None) -> TensorData:
        return cls(values, dtype)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        return cls(array)

    @classmethod
    def from_torch(cls, tensor) -> TensorData:
        return cls(tensor)

    @property
    def dtype(self) -> TensorDtype:
        return "float32" if self._array.dtype.kind == "f" else "int64"

    @property
    def shape(self) -> list[int]:
        return list(self._array.shape)

    @property
    def data(self) -> list:
        """The values, flattened (row-major)."""
        return self._array.reshape(-1).tolist()

    def to_numpy(self) -> np.ndarray:
        return self._array.copy()

    def to_torch(self):
        import torch

        return torch.from_numpy(self._array.copy())

    def tolist(self) -> list:
        return self._array.tolist()

    def to_proto(self) -> trainer_pb2.TensorData:
        return trainer_pb2.TensorData(dtype=_WIRE[self.dtype], shape=self.shape, data=self._array.tobytes())

    @classmethod
    def from_proto(cls, msg: trainer_pb2.TensorData) -> TensorData:
        if msg.dtype not in _FROM_WIRE:
            raise ValueError(f"TensorData.dtype: unknown wire dtype {msg.dtype}")
        dtype = _FROM_WIRE[msg.dtype]
        return cls(np.frombuffer(msg.data, dtype=_NUMPY[dtype]), dtype, list(msg.shape))

    def __eq__(self, other) -> bool:
        return (isinstance(other, TensorData) and self.dtype == other.dtype
                and np.array_equal(self._array, other._array) and self.shape == other.shape)

    def __len__(self) -> int:
        return len(self._array)

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype!r}, shape={self.shape}, data={self._array.reshape(-1)[:8].tolist()}" \
               f"{'...' if self._array.size > 8 else ''})"


# ---- model inputs -------------------------------------------------------------------------------------------------

def _token_ids(tokens: Iterable[int], where: str) -> tuple[int, ...]:
    try:
        ids = tuple(operator.index(t) for t in tokens)
    except TypeError:
        raise ValueError(f"{where}: token ids must be integers") from None
    bad = [t for t in ids if not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"{where}: token ids must be in [0, {MAX_TOKEN_ID}], got {bad[:5]}")
    return ids


class _Model(BaseModel):
    """Tinker's request types: frozen pydantic models that refuse unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Response(BaseModel):
    """Tinker's response types (and SamplingParams): frozen pydantic models that ignore unknown fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class EncodedTextChunk(_Model):
    tokens: Sequence[int]
    type: Literal["encoded_text"] = "encoded_text"

    def __init__(self, tokens: Iterable[int] | None = None, /, **kwargs: Any):
        super().__init__(**kwargs) if tokens is None else super().__init__(tokens=tokens, **kwargs)

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, tokens: Any) -> tuple[int, ...]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            raise ValueError("EncodedTextChunk.tokens: token ids must be integers")
        return _token_ids(tokens, "EncodedTextChunk.tokens")

    @property
    def length(self) -> int:
        return len(self.tokens)


ModelInputChunk = EncodedTextChunk  # Tinker's union also has image chunks; Trainyard's models take only text


class ModelInput(_Model):
    """The tokens fed to the model, as chunks (only encoded text: Trainyard's models take no images)."""

    chunks: Sequence[EncodedTextChunk]

    def __init__(self, chunks: Iterable[EncodedTextChunk] | None = None, /, **kwargs: Any):
        super().__init__(**kwargs) if chunks is None else super().__init__(chunks=chunks, **kwargs)

    @field_validator("chunks", mode="before")
    @classmethod
    def _chunks(cls, chunks: Any) -> tuple[EncodedTextChunk, ...]:
        chunks = tuple(chunks)
        for i, c in enumerate(chunks):
            if not isinstance(c, EncodedTextChunk):
                raise ValueError(f"ModelInput.chunks[{i}]: only EncodedTextChunk is supported, got "
                                 f"{type(c).__name__}")
        return chunks

    @classmethod
    def from_ints(cls, tokens: Iterable[int]) -> ModelInput:
        return cls(chunks=(EncodedTextChunk(tokens=tuple(tokens)),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=())

    def to_ints(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=(*self.chunks, chunk))

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=(token,)))


@dataclass(frozen=True)
class Datum:
    """One example: the model input and the loss's inputs. Position t of every loss input belongs to the prediction
    made at input position t (of the next token, target_tokens[t]), so each has model_input.length rows.
    loss_fn_inputs values may be TensorData, lists, numpy arrays or torch tensors; the well-known keys take their
    wire dtype (target_tokens int64; weights, advantages, logprobs, mask float32)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise ValueError(f"Datum.model_input: must be a ModelInput (e.g. ModelInput.from_ints(tokens)), got "
                             f"{type(self.model_input).__name__}")
        inputs = {}
        for key, value in dict(self.loss_fn_inputs).items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"Datum.loss_fn_inputs: keys must be non-empty strings, got {key!r}")
            if not isinstance(value, TensorData) or (key in LOSS_INPUT_DTYPES
                                                     and value.dtype != LOSS_INPUT_DTYPES[key]):
                value = TensorData(_as_array(value, LOSS_INPUT_DTYPES.get(key), f"loss_fn_inputs[{key!r}]"))
            inputs[key] = value
        object.__setattr__(self, "loss_fn_inputs", inputs)

    def check(self, where: str) -> None:
        """The checks that need no model; where: the datum's field name (e.g. 'data[3]')."""
        T = self.model_input.length
        if T == 0:
            raise ValueError(f"{where}.model_input: is empty")
        for key, value in self.loss_fn_inputs.items():
            if not value.shape or value.shape[0] != T:
                raise ValueError(f"{where}.loss_fn_inputs[{key!r}]: shape {value.shape} must start with the "
                                 f"model input's length {T} (one row per input position)")

    def to_proto(self) -> trainer_pb2.Datum:
        return trainer_pb2.Datum(tokens=self.model_input.to_ints(),
                                 loss_fn_inputs={k: v.to_proto() for k, v in self.loss_fn_inputs.items()})

    @classmethod
    def from_proto(cls, msg: trainer_pb2.Datum) -> Datum:
        return cls(ModelInput.from_ints(msg.tokens), {k: TensorData.from_proto(v)
                                                      for k, v in msg.loss_fn_inputs.items()})


def check_loss_fn_config(config: dict[str, float] | None) -> dict[str, float]:
    out = {}
    for key, value in (config or {}).items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}]: must be a finite number, got {value!r}")
        out[key] = float(value)
    return out


# ---- parameters ---------------------------------------------------------------------------------------------------

def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, got {value!r}")
    return float(value)


def _integer(value: Any, where: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: must be an integer, got {value!r}") from None


class SamplingParams(_Response):
    """As Tinker's: top_k -1 = no limit; stop is a string, a list of strings, or a list of token ids. stop None
    keeps the tokenizer's end-of-sequence stopping; stop [] turns it off too (generation runs to max_tokens)."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def to_proto(self, num_samples: int = 1, prompt_logprobs: bool = False) -> rollout_pb2.SamplingParams:
        p = rollout_pb2.SamplingParams(temperature=_number(self.temperature, "sampling_params.temperature"),
                                       top_p=_number(self.top_p, "sampling_params.top_p"),
                                       n=_integer(num_samples, "num_samples"), prompt_logprobs=prompt_logprobs)
        top_k = _integer(self.top_k, "sampling_params.top_k")
        if top_k < -1:
            raise ValueError(f"sampling_params.top_k: must be -1 (no limit) or >= 0, got {top_k}")
        p.top_k = max(top_k, 0)
        if self.max_tokens is not None:
            p.max_tokens = _integer(self.max_tokens, "sampling_params.max_tokens")
        if self.seed is not None:
            p.seed = _integer(self.seed, "sampling_params.seed")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        p.ignore_eos = self.stop is not None and not stop
        if all(isinstance(s, str) for s in stop):
            p.stop.extend(stop)
        else:
            p.stop_token_ids.extend(_token_ids(stop, "sampling_params.stop"))
        return p


class AdamParams(_Model):
    """Adam(W) hyperparameters of one optim_step; the defaults are Tinker's. grad_clip_norm 0 = no clipping. The
    server checks the ranges (INVALID_ARGUMENT naming adam.<field>)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def to_proto(self) -> trainer_pb2.AdamParams:
        names = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        return trainer_pb2.AdamParams(**{n: _number(getattr(self, n), f"adam_params.{n}") for n in names})


OptimParams = AdamParams  # Tinker's union also has DimuonParams; Trainyard's optimizer is Adam(W)


class LoraConfig(_Model):
    """What create_lora_training_client takes, as Tinker's LoraConfig."""

    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


# ---- outputs ------------------------------------------------------------------------------------------------------

@dataclass
class ForwardBackwardOutput:
    """Per datum, the loss's outputs ("logprobs": float32 [T] or [T, K]); metrics by "name:sum" / "name:mean"."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: trainer_pb2.ForwardResponse) -> ForwardBackwardOutput:
        return cls("TensorData", [{k: TensorData.from_proto(v) for k, v in o.loss_fn_outputs.items()}
                                  for o in msg.outputs], dict(msg.metrics))


class OptimStepResponse(_Response):
    metrics: dict[str, float] | None = None
    step: int = 0  # optimizer steps the session has taken, this one included


class SaveWeightsResponse(_Response):
    """save_state: path is "trainyard://state/<checkpoint id>"."""

    path: str
    type: Literal["save_weights"] | None = None
    checkpoint_id: str = ""


class SaveWeightsForSamplerResponse(_Response):
    """save_weights_for_sampler: path is "trainyard://weights/<version id>", the version published to the weight-sync
    service (sample it with ServiceClient.create_sampling_client(model_path=path)); checkpoint_id is the PEFT (or
    full-weight) checkpoint the scheduler can deploy."""

    path: str
    type: Literal["save_weights_for_sampler"] | None = None
    version_id: str = ""
    checkpoint_id: str = ""


class LoadWeightsResponse(_Response):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] | None = None


class ModelData(_Response):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(_Response):
    """Tinker's fields (model_data, model_id, is_lora, lora_rank, model_name), then the session's other facts."""

    type: Literal["get_info"] | None = None
    model_data: ModelData
    model_id: str  # the session id
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    lora_alpha: float | None = None
    target_modules: list[str] = []
    num_trainable_parameters: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    next_seq_id: int = 0
    optim_steps: int = 0
    lineage: str = ""
    closed: bool = False
    error: str = ""

    @classmethod
    def from_proto(cls, s: trainer_pb2.Session) -> GetInfoResponse:
        lora = not s.full_parameter
        return cls(model_id=s.id, model_data=ModelData(arch=s.architecture or None, model_name=s.base_model,
                                                       tokenizer_id=s.base_model),
                   model_name=s.base_model, is_lora=lora, lora_rank=s.lora_rank if lora else None,
                   lora_alpha=s.lora_alpha if lora else None, target_modules=list(s.target_modules),
                   num_trainable_parameters=s.num_trainable_parameters, vocab_size=s.vocab_size,
                   num_layers=s.num_layers, hidden_size=s.hidden_size, next_seq_id=s.next_seq_id,
                   optim_steps=s.optim_steps, lineage=s.lineage, closed=s.closed, error=s.error)


class SupportedModel(_Response):
    model_name: str | None = None


class GetServerCapabilitiesResponse(_Response):
    supported_models: list[SupportedModel]


TopkLogprobs = list[list[tuple[int, float]] | None]


@dataclass
class SampledSequence:
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float]  # of each sampled token under the raw distribution (before temperature and filters)
    sequence_id: str = ""
    # With topk_sample_logprobs = k: per sampled token, the k most likely (token id, logprob), most likely first.
    topk_logprobs: TopkLogprobs | None = None
    text: str = ""


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    # With include_prompt_logprobs: one entry per prompt token, None for the first (it has no context).
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None
    prompt_tokens: list[int] = field(default_factory=list)
    weight_version_id: str = ""  # the weight version the request ran on, when it names one

    @classmethod
    def from_proto(cls, msg: rollout_pb2.SampleResponse, prompt_logprobs: bool,
                   topk_logprobs: bool = False) -> SampleResponse:
        request = secrets.token_hex(8)
        seqs = [SampledSequence(stop_reason=s.finish_reason, tokens=list(s.tokens), logprobs=list(s.logprobs),
                                sequence_id=f"seq_{request}_{i}", text=s.text,
                                topk_logprobs=[list(zip(t.token_ids, t.logprobs)) for t in s.top_logprobs]
                                if topk_logprobs else None)
                for i, s in enumerate(msg.sequences)]
        return cls(sequences=seqs, prompt_logprobs=[None, *msg.prompt_logprobs] if prompt_logprobs else None,
                   prompt_tokens=list(msg.prompt_tokens), weight_version_id=msg.weight_version_id)
