import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from trainyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATASET_FORMAT_UNSPECIFIED: _ClassVar[DatasetFormat]
    DATASET_FORMAT_SFT_CHAT: _ClassVar[DatasetFormat]
    DATASET_FORMAT_SFT_PROMPT_COMPLETION: _ClassVar[DatasetFormat]
    DATASET_FORMAT_DPO: _ClassVar[DatasetFormat]
    DATASET_FORMAT_RFT: _ClassVar[DatasetFormat]

class JobMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_METHOD_UNSPECIFIED: _ClassVar[JobMethod]
    JOB_METHOD_SFT: _ClassVar[JobMethod]
    JOB_METHOD_DPO: _ClassVar[JobMethod]
    JOB_METHOD_RFT: _ClassVar[JobMethod]
    JOB_METHOD_EVAL: _ClassVar[JobMethod]
    JOB_METHOD_LOOP: _ClassVar[JobMethod]

class JobStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATUS_UNSPECIFIED: _ClassVar[JobStatus]
    JOB_STATUS_QUEUED: _ClassVar[JobStatus]
    JOB_STATUS_RUNNING: _ClassVar[JobStatus]
    JOB_STATUS_SUCCEEDED: _ClassVar[JobStatus]
    JOB_STATUS_FAILED: _ClassVar[JobStatus]
    JOB_STATUS_CANCELLED: _ClassVar[JobStatus]

class LrScheduler(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LR_SCHEDULER_UNSPECIFIED: _ClassVar[LrScheduler]
    LR_SCHEDULER_COSINE: _ClassVar[LrScheduler]
    LR_SCHEDULER_LINEAR: _ClassVar[LrScheduler]
    LR_SCHEDULER_CONSTANT: _ClassVar[LrScheduler]

class RftLoss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RFT_LOSS_UNSPECIFIED: _ClassVar[RftLoss]
    RFT_LOSS_GRPO: _ClassVar[RftLoss]
    RFT_LOSS_DAPO: _ClassVar[RftLoss]
    RFT_LOSS_GSPO: _ClassVar[RftLoss]
    RFT_LOSS_CISPO: _ClassVar[RftLoss]
    RFT_LOSS_DRO: _ClassVar[RftLoss]
    RFT_LOSS_DR_GRPO: _ClassVar[RftLoss]

class RftMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RFT_MODE_UNSPECIFIED: _ClassVar[RftMode]
    RFT_MODE_SYNC: _ClassVar[RftMode]
    RFT_MODE_ASYNC: _ClassVar[RftMode]

class RftTis(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RFT_TIS_UNSPECIFIED: _ClassVar[RftTis]
    RFT_TIS_OFF: _ClassVar[RftTis]
    RFT_TIS_TOKEN: _ClassVar[RftTis]
    RFT_TIS_SEQUENCE: _ClassVar[RftTis]

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_LORA_ADAPTER: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_FULL: _ClassVar[CheckpointKind]

class DeploymentStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEPLOYMENT_STATUS_UNSPECIFIED: _ClassVar[DeploymentStatus]
    DEPLOYMENT_STATUS_DEPLOYING: _ClassVar[DeploymentStatus]
    DEPLOYMENT_STATUS_READY: _ClassVar[DeploymentStatus]
    DEPLOYMENT_STATUS_FAILED: _ClassVar[DeploymentStatus]
    DEPLOYMENT_STATUS_DELETED: _ClassVar[DeploymentStatus]
DATASET_FORMAT_UNSPECIFIED: DatasetFormat
DATASET_FORMAT_SFT_CHAT: DatasetFormat
DATASET_FORMAT_SFT_PROMPT_COMPLETION: DatasetFormat
DATASET_FORMAT_DPO: DatasetFormat
DATASET_FORMAT_RFT: DatasetFormat
JOB_METHOD_UNSPECIFIED: JobMethod
JOB_METHOD_SFT: JobMethod
JOB_METHOD_DPO: JobMethod
JOB_METHOD_RFT: JobMethod
JOB_METHOD_EVAL: JobMethod
JOB_METHOD_LOOP: JobMethod
JOB_STATUS_UNSPECIFIED: JobStatus
JOB_STATUS_QUEUED: JobStatus
JOB_STATUS_RUNNING: JobStatus
JOB_STATUS_SUCCEEDED: JobStatus
JOB_STATUS_FAILED: JobStatus
JOB_STATUS_CANCELLED: JobStatus
LR_SCHEDULER_UNSPECIFIED: LrScheduler
LR_SCHEDULER_COSINE: LrScheduler
LR_SCHEDULER_LINEAR: LrScheduler
LR_SCHEDULER_CONSTANT: LrScheduler
RFT_LOSS_UNSPECIFIED: RftLoss
RFT_LOSS_GRPO: RftLoss
RFT_LOSS_DAPO: RftLoss
RFT_LOSS_GSPO: RftLoss
RFT_LOSS_CISPO: RftLoss
RFT_LOSS_DRO: RftLoss
RFT_LOSS_DR_GRPO: RftLoss
RFT_MODE_UNSPECIFIED: RftMode
RFT_MODE_SYNC: RftMode
RFT_MODE_ASYNC: RftMode
RFT_TIS_UNSPECIFIED: RftTis
RFT_TIS_OFF: RftTis
RFT_TIS_TOKEN: RftTis
RFT_TIS_SEQUENCE: RftTis
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_LORA_ADAPTER: CheckpointKind
CHECKPOINT_KIND_FULL: CheckpointKind
DEPLOYMENT_STATUS_UNSPECIFIED: DeploymentStatus
DEPLOYMENT_STATUS_DEPLOYING: DeploymentStatus
DEPLOYMENT_STATUS_READY: DeploymentStatus
DEPLOYMENT_STATUS_FAILED: DeploymentStatus
DEPLOYMENT_STATUS_DELETED: DeploymentStatus

class Account(_message.Message):
    __slots__ = ("id", "name", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("id", "name", "prefix", "created_at", "revoked_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    prefix: str
    created_at: _timestamp_pb2.Timestamp
    revoked_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., prefix: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    secret: str
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "path", "architecture", "num_parameters", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings", "shared", "created_at", "torch_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TORCH_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    architecture: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    shared: bool
    created_at: _timestamp_pb2.Timestamp
    torch_dtype: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., architecture: _Optional[str] = ..., num_parameters: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., shared: _Optional[bool] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., torch_dtype: _Optional[str] = ...) -> None: ...

class ImportModelRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("id", "name", "format", "num_rows", "size_bytes", "sha256", "created_at", "filename")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    format: DatasetFormat
    num_rows: int
    size_bytes: int
    sha256: str
    created_at: _timestamp_pb2.Timestamp
    filename: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., num_rows: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., filename: _Optional[str] = ...) -> None: ...

class UploadDatasetHeader(_message.Message):
    __slots__ = ("name", "format", "filename")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: DatasetFormat
    filename: str
    def __init__(self, name: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., filename: _Optional[str] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadDatasetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadDatasetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadDatasetResponse(_message.Message):
    __slots__ = ("dataset", "deduplicated", "mapping")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    dataset: Dataset
    deduplicated: bool
    mapping: str
    def __init__(self, dataset: _Optional[_Union[Dataset, _Mapping]] = ..., deduplicated: _Optional[bool] = ..., mapping: _Optional[str] = ...) -> None: ...

class ValidationReport(_message.Message):
    __slots__ = ("valid", "format", "num_rows", "size_bytes", "violations", "truncated", "mapping")
    VALID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    format: DatasetFormat
    num_rows: int
    size_bytes: int
    violations: _containers.RepeatedCompositeFieldContainer[_common_pb2.FieldViolation]
    truncated: bool
    mapping: str
    def __init__(self, valid: _Optional[bool] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., num_rows: _Optional[int] = ..., size_bytes: _Optional[int] = ..., violations: _Optional[_Iterable[_Union[_common_pb2.FieldViolation, _Mapping]]] = ..., truncated: _Optional[bool] = ..., mapping: _Optional[str] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ("page",)
    PAGE_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets", "next_page_token")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    next_page_token: str
    def __init__(self, datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetDatasetRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PreviewDatasetRequest(_message.Message):
    __slots__ = ("id", "offset", "limit")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    limit: int
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class PreviewDatasetResponse(_message.Message):
    __slots__ = ("dataset", "rows")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    dataset: Dataset
    rows: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    def __init__(self, dataset: _Optional[_Union[Dataset, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ...) -> None: ...

class DeleteDatasetRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class SftConfig(_message.Message):
    __slots__ = ("lora", "learning_rate", "epochs", "max_steps", "batch_size", "gradient_accumulation_steps", "warmup_steps", "lr_scheduler", "weight_decay", "max_seq_len", "eval_fraction", "eval_every", "checkpoint_every", "seed", "max_grad_norm")
    LORA_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EVAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    lora: LoraConfig
    learning_rate: float
    epochs: int
    max_steps: int
    batch_size: int
    gradient_accumulation_steps: int
    warmup_steps: int
    lr_scheduler: LrScheduler
    weight_decay: float
    max_seq_len: int
    eval_fraction: float
    eval_every: int
    checkpoint_every: int
    seed: int
    max_grad_norm: float
    def __init__(self, lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., learning_rate: _Optional[float] = ..., epochs: _Optional[int] = ..., max_steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., gradient_accumulation_steps: _Optional[int] = ..., warmup_steps: _Optional[int] = ..., lr_scheduler: _Optional[_Union[LrScheduler, str]] = ..., weight_decay: _Optional[float] = ..., max_seq_len: _Optional[int] = ..., eval_fraction: _Optional[float] = ..., eval_every: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., seed: _Optional[int] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class DpoConfig(_message.Message):
    __slots__ = ("lora", "learning_rate", "epochs", "max_steps", "batch_size", "gradient_accumulation_steps", "warmup_steps", "lr_scheduler", "weight_decay", "max_seq_len", "eval_fraction", "eval_every", "checkpoint_every", "seed", "max_grad_norm", "full_parameter", "beta", "label_smoothing")
    LORA_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EVAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    FULL_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    LABEL_SMOOTHING_FIELD_NUMBER: _ClassVar[int]
    lora: LoraConfig
    learning_rate: float
    epochs: int
    max_steps: int
    batch_size: int
    gradient_accumulation_steps: int
    warmup_steps: int
    lr_scheduler: LrScheduler
    weight_decay: float
    max_seq_len: int
    eval_fraction: float
    eval_every: int
    checkpoint_every: int
    seed: int
    max_grad_norm: float
    full_parameter: bool
    beta: float
    label_smoothing: float
    def __init__(self, lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., learning_rate: _Optional[float] = ..., epochs: _Optional[int] = ..., max_steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., gradient_accumulation_steps: _Optional[int] = ..., warmup_steps: _Optional[int] = ..., lr_scheduler: _Optional[_Union[LrScheduler, str]] = ..., weight_decay: _Optional[float] = ..., max_seq_len: _Optional[int] = ..., eval_fraction: _Optional[float] = ..., eval_every: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., seed: _Optional[int] = ..., max_grad_norm: _Optional[float] = ..., full_parameter: _Optional[bool] = ..., beta: _Optional[float] = ..., label_smoothing: _Optional[float] = ...) -> None: ...

class EvalConfig(_message.Message):
    __slots__ = ("evaluator", "checkpoint_id", "samples_per_row", "temperature", "max_tokens", "pass_threshold", "max_rows", "seed")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PASS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    evaluator: str
    checkpoint_id: str
    samples_per_row: int
    temperature: float
    max_tokens: int
    pass_threshold: float
    max_rows: int
    seed: int
    def __init__(self, evaluator: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., samples_per_row: _Optional[int] = ..., temperature: _Optional[float] = ..., max_tokens: _Optional[int] = ..., pass_threshold: _Optional[float] = ..., max_rows: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class LoopConfig(_message.Message):
    __slots__ = ("training_method", "training", "eval", "train_datasets", "deployment", "checkpoints_per_iteration")
    TRAINING_METHOD_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    TRAIN_DATASETS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_PER_ITERATION_FIELD_NUMBER: _ClassVar[int]
    training_method: str
    training: DpoConfig
    eval: EvalConfig
    train_datasets: _containers.RepeatedScalarFieldContainer[str]
    deployment: str
    checkpoints_per_iteration: int
    def __init__(self, training_method: _Optional[str] = ..., training: _Optional[_Union[DpoConfig, _Mapping]] = ..., eval: _Optional[_Union[EvalConfig, _Mapping]] = ..., train_datasets: _Optional[_Iterable[str]] = ..., deployment: _Optional[str] = ..., checkpoints_per_iteration: _Optional[int] = ...) -> None: ...

class RftConfig(_message.Message):
    __slots__ = ("lora", "full_parameter", "learning_rate", "steps", "prompts_per_step", "group_size", "max_tokens", "temperature", "loss", "kl_coef", "clip_low", "clip_high", "dynamic_sampling", "mode", "max_staleness", "tis", "tis_cap", "partial_rollouts", "router_replay", "evaluator", "checkpoint_every", "seed", "max_grad_norm", "weight_decay", "max_turns")
    LORA_FIELD_NUMBER: _ClassVar[int]
    FULL_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    TIS_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_REPLAY_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    lora: LoraConfig
    full_parameter: bool
    learning_rate: float
    steps: int
    prompts_per_step: int
    group_size: int
    max_tokens: int
    temperature: float
    loss: RftLoss
    kl_coef: float
    clip_low: float
    clip_high: float
    dynamic_sampling: bool
    mode: RftMode
    max_staleness: int
    tis: RftTis
    tis_cap: float
    partial_rollouts: bool
    router_replay: bool
    evaluator: str
    checkpoint_every: int
    seed: int
    max_grad_norm: float
    weight_decay: float
    max_turns: int
    def __init__(self, lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., full_parameter: _Optional[bool] = ..., learning_rate: _Optional[float] = ..., steps: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., loss: _Optional[_Union[RftLoss, str]] = ..., kl_coef: _Optional[float] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., dynamic_sampling: _Optional[bool] = ..., mode: _Optional[_Union[RftMode, str]] = ..., max_staleness: _Optional[int] = ..., tis: _Optional[_Union[RftTis, str]] = ..., tis_cap: _Optional[float] = ..., partial_rollouts: _Optional[bool] = ..., router_replay: _Optional[bool] = ..., evaluator: _Optional[str] = ..., checkpoint_every: _Optional[int] = ..., seed: _Optional[int] = ..., max_grad_norm: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_turns: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("method", "base_model", "dataset_id", "display_name", "sft", "dpo", "rft", "eval", "loop", "resources", "priority")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    SFT_FIELD_NUMBER: _ClassVar[int]
    DPO_FIELD_NUMBER: _ClassVar[int]
    RFT_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    LOOP_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    method: JobMethod
    base_model: str
    dataset_id: str
    display_name: str
    sft: SftConfig
    dpo: DpoConfig
    rft: RftConfig
    eval: EvalConfig
    loop: LoopConfig
    resources: ResourceRequest
    priority: int
    def __init__(self, method: _Optional[_Union[JobMethod, str]] = ..., base_model: _Optional[str] = ..., dataset_id: _Optional[str] = ..., display_name: _Optional[str] = ..., sft: _Optional[_Union[SftConfig, _Mapping]] = ..., dpo: _Optional[_Union[DpoConfig, _Mapping]] = ..., rft: _Optional[_Union[RftConfig, _Mapping]] = ..., eval: _Optional[_Union[EvalConfig, _Mapping]] = ..., loop: _Optional[_Union[LoopConfig, _Mapping]] = ..., resources: _Optional[_Union[ResourceRequest, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class ResourceRequest(_message.Message):
    __slots__ = ("trainer_devices", "rollout_devices")
    TRAINER_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_DEVICES_FIELD_NUMBER: _ClassVar[int]
    trainer_devices: int
    rollout_devices: int
    def __init__(self, trainer_devices: _Optional[int] = ..., rollout_devices: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "spec", "status", "created_at", "started_at", "finished_at", "error", "step", "total_steps", "attempts", "cancel_requested", "output_checkpoint_id", "latest_metrics")
    class LatestMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: JobSpec
    status: JobStatus
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    error: str
    step: int
    total_steps: int
    attempts: int
    cancel_requested: bool
    output_checkpoint_id: str
    latest_metrics: _containers.ScalarMap[str, float]
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., status: _Optional[_Union[JobStatus, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., attempts: _Optional[int] = ..., cancel_requested: _Optional[bool] = ..., output_checkpoint_id: _Optional[str] = ..., latest_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class MemoryEstimate(_message.Message):
    __slots__ = ("device", "weights_dtype", "weights_bytes", "trainable_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes", "logprob_chunk_bytes", "total_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    weights_dtype: str
    weights_bytes: int
    trainable_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    logprob_chunk_bytes: int
    total_bytes: int
    def __init__(self, device: _Optional[str] = ..., weights_dtype: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., trainable_bytes: _Optional[int] = ..., gradient_bytes: _Optional[int] = ..., optimizer_bytes: _Optional[int] = ..., activation_bytes: _Optional[int] = ..., logprob_chunk_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class JobPlan(_message.Message):
    __slots__ = ("spec", "dataset_rows", "train_rows", "eval_rows", "skipped_rows", "tokens_per_epoch", "target_tokens_per_epoch", "eval_target_tokens", "steps_per_epoch", "total_steps", "epochs", "checkpoints", "eval_passes", "trainable_parameters", "base_parameters", "largest_micro_batch_tokens", "memory", "warnings")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROWS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVAL_TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    EVAL_PASSES_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BASE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    dataset_rows: int
    train_rows: int
    eval_rows: int
    skipped_rows: int
    tokens_per_epoch: int
    target_tokens_per_epoch: int
    eval_target_tokens: int
    steps_per_epoch: int
    total_steps: int
    epochs: float
    checkpoints: int
    eval_passes: int
    trainable_parameters: int
    base_parameters: int
    largest_micro_batch_tokens: int
    memory: MemoryEstimate
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., dataset_rows: _Optional[int] = ..., train_rows: _Optional[int] = ..., eval_rows: _Optional[int] = ..., skipped_rows: _Optional[int] = ..., tokens_per_epoch: _Optional[int] = ..., target_tokens_per_epoch: _Optional[int] = ..., eval_target_tokens: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., total_steps: _Optional[int] = ..., epochs: _Optional[float] = ..., checkpoints: _Optional[int] = ..., eval_passes: _Optional[int] = ..., trainable_parameters: _Optional[int] = ..., base_parameters: _Optional[int] = ..., largest_micro_batch_tokens: _Optional[int] = ..., memory: _Optional[_Union[MemoryEstimate, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenStatsRequest(_message.Message):
    __slots__ = ("dataset_id", "base_model", "max_seq_len")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    base_model: str
    max_seq_len: int
    def __init__(self, dataset_id: _Optional[str] = ..., base_model: _Optional[str] = ..., max_seq_len: _Optional[int] = ...) -> None: ...

class TokenStats(_message.Message):
    __slots__ = ("dataset_id", "base_model", "rows", "mean_tokens", "p95_tokens", "max_tokens", "max_seq_len", "over_max_seq_len", "counted")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    P95_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    OVER_MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    base_model: str
    rows: int
    mean_tokens: float
    p95_tokens: int
    max_tokens: int
    max_seq_len: int
    over_max_seq_len: int
    counted: str
    def __init__(self, dataset_id: _Optional[str] = ..., base_model: _Optional[str] = ..., rows: _Optional[int] = ..., mean_tokens: _Optional[float] = ..., p95_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., over_max_seq_len: _Optional[int] = ..., counted: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page", "status")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    status: JobStatus
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., status: _Optional[_Union[JobStatus, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("id", "from_step")
    ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    id: str
    from_step: int
    def __init__(self, id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class MetricPoint(_message.Message):
    __slots__ = ("step", "values", "time")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    step: int
    values: _containers.ScalarMap[str, float]
    time: _timestamp_pb2.Timestamp
    def __init__(self, step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class JobLog(_message.Message):
    __slots__ = ("level", "message", "time", "id")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    level: str
    message: str
    time: _timestamp_pb2.Timestamp
    id: int
    def __init__(self, level: _Optional[str] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., id: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job", "metric", "log")
    JOB_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    job: Job
    metric: MetricPoint
    log: JobLog
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., metric: _Optional[_Union[MetricPoint, _Mapping]] = ..., log: _Optional[_Union[JobLog, _Mapping]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResumeJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobMetricsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobMetricsResponse(_message.Message):
    __slots__ = ("points",)
    POINTS_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[MetricPoint]
    def __init__(self, points: _Optional[_Iterable[_Union[MetricPoint, _Mapping]]] = ...) -> None: ...

class ListJobLogsRequest(_message.Message):
    __slots__ = ("id", "after_id", "limit")
    ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    id: str
    after_id: int
    limit: int
    def __init__(self, id: _Optional[str] = ..., after_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobLogsResponse(_message.Message):
    __slots__ = ("logs",)
    LOGS_FIELD_NUMBER: _ClassVar[int]
    logs: _containers.RepeatedCompositeFieldContainer[JobLog]
    def __init__(self, logs: _Optional[_Iterable[_Union[JobLog, _Mapping]]] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("path", "sha256", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    sha256: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("id", "job_id", "step", "kind", "base_model", "files", "final", "metrics", "created_at", "session_id", "name", "checkpoint_type", "weight_version_id", "size_bytes", "public", "user_metadata", "expires_at", "account_id", "lora_rank")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    step: int
    kind: CheckpointKind
    base_model: str
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    final: bool
    metrics: _containers.ScalarMap[str, float]
    created_at: _timestamp_pb2.Timestamp
    session_id: str
    name: str
    checkpoint_type: str
    weight_version_id: str
    size_bytes: int
    public: bool
    user_metadata: _containers.ScalarMap[str, str]
    expires_at: _timestamp_pb2.Timestamp
    account_id: str
    lora_rank: int
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., base_model: _Optional[str] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., final: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., session_id: _Optional[str] = ..., name: _Optional[str] = ..., checkpoint_type: _Optional[str] = ..., weight_version_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., public: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., account_id: _Optional[str] = ..., lora_rank: _Optional[int] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "session_id", "limit", "offset", "weight_version_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_id: str
    limit: int
    offset: int
    weight_version_id: str
    def __init__(self, job_id: _Optional[str] = ..., session_id: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ..., weight_version_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "total")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    total: int
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SetCheckpointTtlRequest(_message.Message):
    __slots__ = ("id", "ttl_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    ttl_seconds: int
    def __init__(self, id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class PublishCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ExportMergedModelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("id", "name", "checkpoint_id", "base_model", "status", "error", "created_at", "job_id", "lineage")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    checkpoint_id: str
    base_model: str
    status: DeploymentStatus
    error: str
    created_at: _timestamp_pb2.Timestamp
    job_id: str
    lineage: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., base_model: _Optional[str] = ..., status: _Optional[_Union[DeploymentStatus, str]] = ..., error: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_id: _Optional[str] = ..., lineage: _Optional[str] = ...) -> None: ...

class CreateDeploymentRequest(_message.Message):
    __slots__ = ("name", "checkpoint_id", "job_id", "lineage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    checkpoint_id: str
    job_id: str
    lineage: str
    def __init__(self, name: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., job_id: _Optional[str] = ..., lineage: _Optional[str] = ...) -> None: ...

class RepointDeploymentRequest(_message.Message):
    __slots__ = ("id", "checkpoint_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    checkpoint_id: str
    def __init__(self, id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ("include_deleted",)
    INCLUDE_DELETED_FIELD_NUMBER: _ClassVar[int]
    include_deleted: bool
    def __init__(self, include_deleted: _Optional[bool] = ...) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments",)
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    def __init__(self, deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ...) -> None: ...

class GetDeploymentRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteDeploymentRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("id", "host", "kind", "index", "name", "memory_bytes", "free", "job_id", "role", "held_by_other_account", "live", "heartbeat_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_OTHER_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    host: str
    kind: str
    index: int
    name: str
    memory_bytes: int
    free: bool
    job_id: str
    role: str
    held_by_other_account: bool
    live: bool
    heartbeat_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., host: _Optional[str] = ..., kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., free: _Optional[bool] = ..., job_id: _Optional[str] = ..., role: _Optional[str] = ..., held_by_other_account: _Optional[bool] = ..., live: _Optional[bool] = ..., heartbeat_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DeviceQuota(_message.Message):
    __slots__ = ("max_devices", "devices_in_use", "max_queued_jobs", "queued_jobs")
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    max_devices: int
    devices_in_use: int
    max_queued_jobs: int
    queued_jobs: int
    def __init__(self, max_devices: _Optional[int] = ..., devices_in_use: _Optional[int] = ..., max_queued_jobs: _Optional[int] = ..., queued_jobs: _Optional[int] = ...) -> None: ...

class DeviceQueueEntry(_message.Message):
    __slots__ = ("job_id", "priority", "devices", "wait_reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WAIT_REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    priority: int
    devices: int
    wait_reason: str
    def __init__(self, job_id: _Optional[str] = ..., priority: _Optional[int] = ..., devices: _Optional[int] = ..., wait_reason: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "quota", "queue")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    quota: DeviceQuota
    queue: _containers.RepeatedCompositeFieldContainer[DeviceQueueEntry]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., quota: _Optional[_Union[DeviceQuota, _Mapping]] = ..., queue: _Optional[_Iterable[_Union[DeviceQueueEntry, _Mapping]]] = ...) -> None: ...

class EvaluatorSource(_message.Message):
    __slots__ = ("evaluator", "content")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    evaluator: Evaluator
    content: bytes
    def __init__(self, evaluator: _Optional[_Union[Evaluator, _Mapping]] = ..., content: _Optional[bytes] = ...) -> None: ...

class Evaluator(_message.Message):
    __slots__ = ("id", "name", "version", "kind", "filename", "size_bytes", "sha256", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    version: int
    kind: str
    filename: str
    size_bytes: int
    sha256: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[str] = ..., filename: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class EvaluatorUploadRequest(_message.Message):
    __slots__ = ("name", "filename", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    filename: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., filename: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class EvaluatorListRequest(_message.Message):
    __slots__ = ("page", "name")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    page: _common_pb2.PageRequest
    name: str
    def __init__(self, page: _Optional[_Union[_common_pb2.PageRequest, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class EvaluatorListResponse(_message.Message):
    __slots__ = ("evaluators", "next_page_token")
    EVALUATORS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    evaluators: _containers.RepeatedCompositeFieldContainer[Evaluator]
    next_page_token: str
    def __init__(self, evaluators: _Optional[_Iterable[_Union[Evaluator, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class EvaluatorGetRequest(_message.Message):
    __slots__ = ("evaluator",)
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    evaluator: str
    def __init__(self, evaluator: _Optional[str] = ...) -> None: ...

class EvaluatorTestRequest(_message.Message):
    __slots__ = ("evaluator", "rows", "completions", "dataset_id", "num_rows", "content")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    evaluator: str
    rows: _containers.RepeatedScalarFieldContainer[str]
    completions: _containers.RepeatedScalarFieldContainer[str]
    dataset_id: str
    num_rows: int
    content: bytes
    def __init__(self, evaluator: _Optional[str] = ..., rows: _Optional[_Iterable[str]] = ..., completions: _Optional[_Iterable[str]] = ..., dataset_id: _Optional[str] = ..., num_rows: _Optional[int] = ..., content: _Optional[bytes] = ...) -> None: ...

class EvaluatorTestResult(_message.Message):
    __slots__ = ("row", "completion", "ok", "reward", "error", "observation")
    ROW_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    row: int
    completion: str
    ok: bool
    reward: float
    error: str
    observation: str
    def __init__(self, row: _Optional[int] = ..., completion: _Optional[str] = ..., ok: _Optional[bool] = ..., reward: _Optional[float] = ..., error: _Optional[str] = ..., observation: _Optional[str] = ...) -> None: ...

class EvaluatorTestSummary(_message.Message):
    __slots__ = ("num_rows", "num_ok", "num_errors", "reward_mean", "reward_min", "reward_max", "elapsed_s")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_OK_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_MIN_FIELD_NUMBER: _ClassVar[int]
    REWARD_MAX_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    num_ok: int
    num_errors: int
    reward_mean: float
    reward_min: float
    reward_max: float
    elapsed_s: float
    def __init__(self, num_rows: _Optional[int] = ..., num_ok: _Optional[int] = ..., num_errors: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_min: _Optional[float] = ..., reward_max: _Optional[float] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class EvaluatorTestResponse(_message.Message):
    __slots__ = ("evaluator", "results", "summary", "output_tail")
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TAIL_FIELD_NUMBER: _ClassVar[int]
    evaluator: Evaluator
    results: _containers.RepeatedCompositeFieldContainer[EvaluatorTestResult]
    summary: EvaluatorTestSummary
    output_tail: str
    def __init__(self, evaluator: _Optional[_Union[Evaluator, _Mapping]] = ..., results: _Optional[_Iterable[_Union[EvaluatorTestResult, _Mapping]]] = ..., summary: _Optional[_Union[EvaluatorTestSummary, _Mapping]] = ..., output_tail: _Optional[str] = ...) -> None: ...
