from trainyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "n", "min_p", "top_logprobs", "prompt_logprobs", "return_router_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTER_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    n: int
    min_p: float
    top_logprobs: int
    prompt_logprobs: bool
    return_router_ids: bool
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., min_p: _Optional[float] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., return_router_ids: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("model", "text", "tokens", "messages", "params", "min_weight_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    tokens: _common_pb2.TokenList
    messages: _common_pb2.ChatMessages
    params: SamplingParams
    min_weight_version: int
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenList, _Mapping]] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "text", "logprobs", "finish_reason", "top_logprobs", "router_ids")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    router_ids: RouterIds
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., router_ids: _Optional[_Union[RouterIds, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RouterIds(_message.Message):
    __slots__ = ("num_tokens", "layers", "top_k", "dtype", "ids")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    dtype: str
    ids: bytes
    def __init__(self, num_tokens: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ..., dtype: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("model", "prompt_tokens", "sequences", "prompt_logprobs", "weight_version_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version_id: str
    def __init__(self, model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., weight_version_id: _Optional[str] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("index", "tokens", "text", "logprobs", "top_logprobs", "finish_reason", "router_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    finish_reason: str
    router_ids: RouterIds
    def __init__(self, index: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., router_ids: _Optional[_Union[RouterIds, _Mapping]] = ...) -> None: ...

class SampleStreamResponse(_message.Message):
    __slots__ = ("model", "prompt_tokens", "deltas", "done", "prompt_logprobs", "weight_version_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    done: bool
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version_id: str
    def __init__(self, model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., deltas: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., done: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., weight_version_id: _Optional[str] = ...) -> None: ...

class LoadDeploymentRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class LoadedModel(_message.Message):
    __slots__ = ("name", "base_model", "deployment_id", "checkpoint_id", "lineage", "weight_version_id", "weight_version", "weight_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    deployment_id: str
    checkpoint_id: str
    lineage: str
    weight_version_id: str
    weight_version: int
    weight_error: str
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., deployment_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., lineage: _Optional[str] = ..., weight_version_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., weight_error: _Optional[str] = ...) -> None: ...

class UnloadDeploymentRequest(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class UnloadDeploymentResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class ListLoadedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoadedResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[LoadedModel]
    def __init__(self, models: _Optional[_Iterable[_Union[LoadedModel, _Mapping]]] = ...) -> None: ...
