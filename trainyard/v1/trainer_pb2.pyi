import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from trainyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionLora(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules", "train_attn", "train_mlp", "train_unembed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("base_model", "lora", "seed", "full_parameter", "from_state", "with_optimizer")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FULL_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    lora: SessionLora
    seed: int
    full_parameter: bool
    from_state: str
    with_optimizer: bool
    def __init__(self, base_model: _Optional[str] = ..., lora: _Optional[_Union[SessionLora, _Mapping]] = ..., seed: _Optional[int] = ..., full_parameter: _Optional[bool] = ..., from_state: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "base_model", "lora_rank", "lora_alpha", "target_modules", "next_seq_id", "optim_steps", "closed", "error", "created_at", "num_trainable_parameters", "full_parameter", "lineage", "vocab_size", "num_layers", "hidden_size", "architecture", "last_request_at", "last_state_checkpoint_id", "last_weights_checkpoint_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    FULL_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_WEIGHTS_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    base_model: str
    lora_rank: int
    lora_alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    next_seq_id: int
    optim_steps: int
    closed: bool
    error: str
    created_at: _timestamp_pb2.Timestamp
    num_trainable_parameters: int
    full_parameter: bool
    lineage: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    architecture: str
    last_request_at: _timestamp_pb2.Timestamp
    last_state_checkpoint_id: str
    last_weights_checkpoint_id: str
    def __init__(self, id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., next_seq_id: _Optional[int] = ..., optim_steps: _Optional[int] = ..., closed: _Optional[bool] = ..., error: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., num_trainable_parameters: _Optional[int] = ..., full_parameter: _Optional[bool] = ..., lineage: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., architecture: _Optional[str] = ..., last_request_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_state_checkpoint_id: _Optional[str] = ..., last_weights_checkpoint_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("limit", "offset")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    total: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DTYPE_UNSPECIFIED: _ClassVar[TensorData.DType]
        DTYPE_FLOAT32: _ClassVar[TensorData.DType]
        DTYPE_INT64: _ClassVar[TensorData.DType]
    DTYPE_UNSPECIFIED: TensorData.DType
    DTYPE_FLOAT32: TensorData.DType
    DTYPE_INT64: TensorData.DType
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: TensorData.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[TensorData.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("tokens", "loss_fn_inputs")
    class LossFnInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    loss_fn_inputs: _containers.MessageMap[str, TensorData]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., loss_fn_inputs: _Optional[_Mapping[str, TensorData]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "data", "loss_fn", "loss_fn_config")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "data", "loss_fn", "loss_fn_config", "micro_batch_tokens")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    micro_batch_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., micro_batch_tokens: _Optional[int] = ...) -> None: ...

class ForwardBackwardStreamRequest(_message.Message):
    __slots__ = ("header", "datums")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    header: ForwardBackwardRequest
    datums: DatumBatch
    def __init__(self, header: _Optional[_Union[ForwardBackwardRequest, _Mapping]] = ..., datums: _Optional[_Union[DatumBatch, _Mapping]] = ...) -> None: ...

class DatumBatch(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    def __init__(self, data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("loss_fn_outputs",)
    class LossFnOutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    LOSS_FN_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    loss_fn_outputs: _containers.MessageMap[str, TensorData]
    def __init__(self, loss_fn_outputs: _Optional[_Mapping[str, TensorData]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "adam")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    adam: AdamParams
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveWeightsRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "name", "ttl_seconds", "user_metadata", "ephemeral")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    name: str
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    ephemeral: bool
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., ephemeral: _Optional[bool] = ...) -> None: ...

class SaveWeightsResponse(_message.Message):
    __slots__ = ("checkpoint_id", "version_id", "path")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    version_id: str
    path: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., version_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "name", "ttl_seconds", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    name: str
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("checkpoint_id", "path")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    path: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("session_id", "seq_id", "path", "with_optimizer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    path: str
    with_optimizer: bool
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Endpoints(_message.Message):
    __slots__ = ("rollout_url", "scheduler_url")
    ROLLOUT_URL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_URL_FIELD_NUMBER: _ClassVar[int]
    rollout_url: str
    scheduler_url: str
    def __init__(self, rollout_url: _Optional[str] = ..., scheduler_url: _Optional[str] = ...) -> None: ...
