"""Which request fields name an object of the caller's account, and what kind of object.

Every string field of every request message is classified here, as a reference (of a kind world.Account.refs
holds) or as plain text; test_isolation.py fails on a field that is neither, so a new RPC or field is classified
before it ships. Kinds: api_key, model, model_path, dataset, job, checkpoint, deployment (id or name),
deployment_id, deployment_name, session, lineage, version, state_path, weights_path, evaluator (id, name or
name@N); sample_model is what
SampleRequest.model takes (a deployment name, a saved-weights path or a model name).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# A field's name alone says what it refers to ...
BY_NAME = {
    "session_id": "session", "dataset_id": "dataset", "job_id": "job", "checkpoint_id": "checkpoint",
    "deployment_id": "deployment_id", "lineage": "lineage", "version_id": "version", "base_version_id": "version",
    "parent_id": "version", "from_state": "state_path", "base_model": "model",
}
# ... or the message it is in does.
BY_FIELD = {
    "RevokeApiKeyRequest.id": "api_key",
    "GetModelRequest.name": "model",
    "ImportModelRequest.path": "model_path",
    "GetDatasetRequest.id": "dataset", "PreviewDatasetRequest.id": "dataset", "DeleteDatasetRequest.id": "dataset",
    "GetJobRequest.id": "job", "WatchJobRequest.id": "job", "CancelJobRequest.id": "job",
    "ResumeJobRequest.id": "job",
    "ListJobMetricsRequest.id": "job", "ListJobLogsRequest.id": "job",
    "GetCheckpointRequest.id": "checkpoint", "DownloadCheckpointRequest.id": "checkpoint",
    "DeleteCheckpointRequest.id": "checkpoint", "SetCheckpointTtlRequest.id": "checkpoint",
    "PublishCheckpointRequest.id": "checkpoint", "ListCheckpointsRequest.weight_version_id": "version",
    "ExportMergedModelRequest.id": "checkpoint",
    "GetDeploymentRequest.id": "deployment", "DeleteDeploymentRequest.id": "deployment",
    "GetSessionRequest.id": "session", "CloseSessionRequest.id": "session",
    "LoadStateRequest.path": "state_path",
    "SampleRequest.model": "sample_model",
    "GetVersionRequest.id": "version", "FetchVersionRequest.id": "version",
    "EvaluatorGetRequest.evaluator": "evaluator", "EvaluatorTestRequest.evaluator": "evaluator",
    "RftConfig.evaluator": "evaluator", "EvalConfig.evaluator": "evaluator",
    "LoopConfig.train_datasets": "dataset",
    "RepointDeploymentRequest.id": "deployment",
}
# Strings that name something new, or are data rather than a reference.
PLAIN = {
    "CreateApiKeyRequest.name", "ImportModelRequest.name", "UploadDatasetHeader.name", "UploadDatasetHeader.filename",
    "JobSpec.display_name", "LoraConfig.target_modules", "PageRequest.page_token", "CreateDeploymentRequest.name",
    "SessionLora.target_modules", "ForwardRequest.loss_fn", "ForwardBackwardRequest.loss_fn",
    "SaveWeightsRequest.name", "SaveStateRequest.name", "SampleRequest.text", "SamplingParams.stop",
    "ChatMessage.role", "ChatMessage.content", "FileChunk.path", "FileChunk.sha256", "WeightFile.path",
    "WeightFile.sha256", "FetchVersionRequest.from_path",
    "EvaluatorUploadRequest.name", "EvaluatorUploadRequest.filename", "EvaluatorListRequest.name",
    "EvaluatorTestRequest.rows", "EvaluatorTestRequest.completions",
    "LoopConfig.training_method", "LoopConfig.deployment",  # the loop creates its deployment under this new name
}
# Reference fields a request never looks up (message name -> path prefixes): a loop evaluates its own checkpoints and
# refuses any checkpoint_id; PlanJob refuses a method that trains nothing before reading its settings.
NOT_LOOKED_UP = {
    "CreateJobRequest": (("spec", "loop", "eval", "checkpoint_id"),),
    "PlanJobRequest": (("spec", "loop", "eval", "checkpoint_id"), ("spec", "eval"), ("spec", "loop")),
}


def looked_up(d: Descriptor, path: tuple[str, ...]) -> bool:
    return not any(path[:len(prefix)] == prefix for prefix in NOT_LOOKED_UP.get(d.name, ()))
UNIONS = {"sample_model": ("deployment_name", "weights_path", "model")}


def short(field: FieldDescriptor) -> str:
    return f"{field.containing_type.name}.{field.name}"


def kind_of(field: FieldDescriptor) -> str | None:
    """The kind of object a string field refers to; None for plain text; KeyError for an unclassified field."""
    name = short(field)
    if name in BY_FIELD:
        return BY_FIELD[name]
    if name in PLAIN:
        return None
    if field.name in BY_NAME:
        return BY_NAME[field.name]
    raise KeyError(name)


def is_ours(d: Descriptor) -> bool:
    return d.full_name.startswith("trainyard.") and not d.GetOptions().map_entry


@dataclass(frozen=True)
class RefField:
    path: tuple[str, ...]  # field names from the request message down, e.g. ("spec", "dataset_id")
    kind: str


def string_fields(d: Descriptor, path: tuple[str, ...] = (), *, through_lists: bool = False,
                  ) -> Iterator[tuple[tuple[str, ...], FieldDescriptor]]:
    """Every string field reachable through singular message fields (a stream's header included), or through
    repeated ones too."""
    for f in d.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            yield path + (f.name,), f
        elif (f.type == FieldDescriptor.TYPE_MESSAGE and is_ours(f.message_type)
              and (through_lists or not f.is_repeated)):
            yield from string_fields(f.message_type, path + (f.name,), through_lists=through_lists)


def ref_fields(d: Descriptor) -> list[RefField]:
    return [RefField(path, kind) for path, f in string_fields(d)
            if not f.is_repeated and looked_up(d, path) and (kind := kind_of(f))]


def values(refs: dict[str, list[str]], kind: str) -> list[str]:
    return [v for k in UNIONS.get(kind, (kind,)) for v in refs.get(k, [])]


def put(message, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        message = getattr(message, name)
    setattr(message, path[-1], value)
