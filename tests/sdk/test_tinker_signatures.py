"""`import trainyard as tinker`: the public API compared with the real `tinker` package (pinned in requirements.lock).

For every public method both SDKs' clients (ServiceClient, TrainingClient, SamplingClient, APIFuture) have, the
parameters' names, order, kinds and defaults must be Tinker's, except the deliberate differences in DIFFERENT (each
with its reason; docs/tinker_compat.md lists them for users). An `_async` twin that forwards (*args, **kwargs) shows
its plain method's signature (trainyard.futures.async_twin_signatures), and that is what is compared. Tinker's names
Trainyard does not have are listed in NOT_PROVIDED, and the types both have must have Tinker's fields and defaults.
No server is needed.
"""
from __future__ import annotations

import inspect
import warnings

import pydantic
import pytest

import trainyard

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    tinker = pytest.importorskip("tinker", reason="the tinker package (requirements.lock) is not installed")

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "APIFuture", "RestClient")

# (class, method): why Trainyard's parameters differ from Tinker's.
DIFFERENT = {
    ("ServiceClient", "close"): "closes the channels now and returns nothing; there is no server-side session to "
                                "close with a status",
    ("ServiceClient", "create_lora_training_client"): "keyword-only alpha added",
    ("TrainingClient", "forward"): "loss_fn defaults to 'cross_entropy'",
    ("TrainingClient", "forward_backward"): "keyword-only micro_batch_tokens added",
    ("TrainingClient", "save_state"): "name may be left out (an unnamed checkpoint)",
    ("TrainingClient", "save_weights_for_sampler"): "name may be left out (an unnamed version)",
}
DIFFERENT |= {(c, f"{m}_async"): why for (c, m), why in DIFFERENT.items() if m != "close"}

# Tinker's public methods that Trainyard's clients do not have, and why.
MISSING_METHODS = {
    ("ServiceClient", "copy_weights"): "checkpoints of other accounts are not readable",
    ("ServiceClient", "create_custom_loss"): "no server-side custom losses; forward_backward_custom runs the loss "
                                             "in the client",
    ("ServiceClient", "get_console_url"): "no web console URL per session",
    ("ServiceClient", "get_telemetry"): "no client telemetry",
    ("TrainingClient", "get_console_url"): "no web console URL per session",
    ("TrainingClient", "get_telemetry"): "no client telemetry",
    ("TrainingClient", "save_weights_external"): "no export to external storage",
    ("TrainingClient", "save_weights_external_async"): "no export to external storage",
    ("SamplingClient", "create"): "internal to Tinker's ServiceClient",
    ("SamplingClient", "from_sampler_handle"): "no sampler handles",
    ("SamplingClient", "get_sampler_handle"): "no sampler handles",
    ("SamplingClient", "get_telemetry"): "no client telemetry",
    ("SamplingClient", "on_queue_state_change"): "no queue-state reports",
    # RestClient: each raises AttributeError with the reason (trainyard/rest_client.py's REFUSED)
    **{("RestClient", f"{name}{twin}"): "refused: see trainyard.rest_client.REFUSED"
       for name in ("copy_weights", "get_external_weights_urls", "get_audit_log", "get_billing_usage",
                    "get_current_checkpoint_storage_usage", "assign_session_project", "export_session_trace",
                    "get_sampler") for twin in ("", "_async")},
    ("RestClient", "search_sessions"): "refused: no session search",
    ("RestClient", "get_telemetry"): "no client telemetry",
}

# Names in tinker.__all__ that `trainyard` does not export.
NOT_PROVIDED = {
    "AdminClient", "auth", "BackcompatTrainingClientFuture", "BackcompatSamplingClientFuture",
    "LossHandle", "PerDatumLossFn", "AdamOptimizerConfig", "DimuonOptimizerConfig", "DimuonParams", "DmelChunk",
    "SampledProvenanceSpan", "PromptProvenanceSpan", "OptimStepRequest", "ParsedCheckpointTinkerPath", "SampleRequest", "Timeout", "RequestOptions",
    "APIResponseValidationError", "RequestFailedError", "BillingError", "ExperimentalWarning", "__title__",
}


def _params(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _ours(cls, name: str):
    return getattr(cls, name)


def _public_methods(cls) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)))


@pytest.mark.parametrize("cls", CLIENTS)
def test_client_methods_have_tinkers_parameters(cls):
    theirs, ours = getattr(tinker, cls), getattr(trainyard, cls)
    mismatched, missing = [], []
    for name in _public_methods(theirs):
        if not hasattr(ours, name):
            missing.append((cls, name))
        elif (cls, name) not in DIFFERENT and _params(getattr(theirs, name)) != _params(_ours(ours, name)):
            mismatched.append(f"{cls}.{name}: tinker {_params(getattr(theirs, name))}, "
                              f"trainyard {_params(_ours(ours, name))}")
    assert not mismatched, "\n".join(mismatched)
    assert set(missing) == {k for k in MISSING_METHODS if k[0] == cls}


@pytest.mark.parametrize("cls, name", sorted(DIFFERENT))
def test_listed_differences_are_real(cls, name):
    """A difference that no longer exists must leave the list (and docs/tinker_compat.md)."""
    assert _params(getattr(getattr(tinker, cls), name)) != _params(_ours(getattr(trainyard, cls), name))


def test_constructors_take_tinkers_leading_parameters():
    """ServiceClient(user_metadata, project_id, *, display_name, base_url, api_key, default_headers_overrides, ...):
    Tinker's parameters first and in order; Trainyard's keywords (rollout_url, TLS files, ...) after them."""
    theirs = [p for p in _params(tinker.ServiceClient.__init__) if p[1] != "VAR_KEYWORD"]
    ours = _params(trainyard.ServiceClient.__init__)
    assert ours[:len(theirs)] == theirs and ours[-1][1] == "VAR_KEYWORD"


def test_top_level_names():
    provided = {n for n in tinker.__all__ if hasattr(trainyard, n)}
    assert set(tinker.__all__) - provided == NOT_PROVIDED
    assert {"SamplingParams", "AdamParams", "ModelInput", "Datum", "TensorData", "EncodedTextChunk",
            "ForwardBackwardOutput", "SampledSequence", "SampleResponse", "StopReason", "types"} <= provided


def _fields(cls) -> dict[str, object]:
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return {k: "<required>" if f.is_required() else f.get_default(call_default_factory=True)
                for k, f in cls.model_fields.items()}
    return {k: p.default for k, p in inspect.signature(cls).parameters.items()}


# Tinker's fields that Trainyard's type of the same name lacks, and why.
MISSING_FIELDS = {
    ("Datum", "model_input_spans"): "no provenance spans",
    ("Datum", "loss_fn_input_spans"): "no provenance spans",
    ("TensorData", "sparse_crow_indices"): "no sparse (CSR) tensors",
    ("TensorData", "sparse_col_indices"): "no sparse (CSR) tensors",
    ("GetInfoResponse", "optimizer_config"): "the optimizer is always Adam(W)",
    ("SampledSequence", "tokens_np"): "tokens are lists (as Tinker's .tokens)",
    ("SampledSequence", "logprobs_np"): "logprobs are lists (as Tinker's .logprobs)",
    ("SampledSequence", "topk_logprobs_np"): "topk_logprobs are lists (as Tinker's .topk_logprobs)",
    ("SampledSequence", "_tokens_list"): "private",
    ("SampledSequence", "_logprobs_list"): "private",
    ("SampledSequence", "_topk_logprobs_list"): "private",
    ("SampleResponse", "prompt_logprobs_np"): "a list (as Tinker's .prompt_logprobs)",
    ("SampleResponse", "topk_prompt_logprobs_np"): "a list (as Tinker's .topk_prompt_logprobs)",
    ("SampleResponse", "target_prompt_logprobs"): "target_prompt_logprobs is refused",
    ("SampleResponse", "prompt_cache_hit_tokens"): "not reported by the rollout",
    ("SampleResponse", "prompt_alt_tokens"): "prompt_alt_tokens_k is refused",
    ("SampleResponse", "_prompt_logprobs_list"): "private",
    ("SampleResponse", "_topk_prompt_logprobs_list"): "private",
    ("WeightsInfoResponse", "optimizer_config"): "the optimizer is always Adam(W)",
}
TYPES = ("SamplingParams", "AdamParams", "ModelInput", "EncodedTextChunk", "Datum", "TensorData", "LoraConfig",
         "ForwardBackwardOutput", "SampledSequence", "SampleResponse", "OptimStepResponse", "SaveWeightsResponse",
         "SaveWeightsForSamplerResponse", "LoadWeightsResponse", "GetInfoResponse",
         # RestClient's
         "Checkpoint", "Cursor", "CheckpointsListResponse", "TrainingRun", "TrainingRunsResponse",
         "WeightsInfoResponse", "GetSessionResponse", "ListSessionsResponse", "ExternalWeightsUrlsResponse",
         "WhoamiResponse")


@pytest.mark.parametrize("name", TYPES)
def test_types_have_tinkers_fields_and_defaults(name):
    theirs, ours = getattr(tinker.types, name), getattr(trainyard.types, name)
    assert (issubclass(ours, pydantic.BaseModel)) == (isinstance(theirs, type) and
                                                      issubclass(theirs, pydantic.BaseModel)), \
        "a pydantic model in Tinker is one here, and a dataclass one too"
    if issubclass(ours, pydantic.BaseModel):
        assert {k: ours.model_config.get(k) for k in ("extra", "frozen")} == \
            {k: theirs.model_config.get(k) for k in ("extra", "frozen")}
    t, o = _fields(theirs), _fields(ours)
    for field, default in t.items():
        if (name, field) in MISSING_FIELDS:
            assert field not in o
            continue
        assert field in o, f"{name}.{field}"
        if default is not inspect.Parameter.empty and not callable(default):
            assert o[field] == default, f"{name}.{field}: tinker {default!r}, trainyard {o[field]!r}"


def test_types_behave_as_tinkers():
    """The same calls on both packages' types give the same values."""
    for pkg in (tinker, trainyard):
        mi = pkg.ModelInput.from_ints([3, 4]).append_int(5)
        assert (mi.to_ints(), mi.length, len(mi.chunks)) == ([3, 4, 5], 3, 2)
        assert pkg.ModelInput.empty().length == 0
        td = pkg.TensorData(data=[1.0, 2.0, 3.0, 4.0], dtype="float32", shape=[2, 2])
        assert (td.tolist(), td.dtype, td.shape, td.data) == ([[1.0, 2.0], [3.0, 4.0]], "float32", [2, 2],
                                                              [1.0, 2.0, 3.0, 4.0])
        d = pkg.Datum(model_input=mi, loss_fn_inputs={"target_tokens": [4, 5, 6], "weights": [0.0, 1.0, 1.0]})
        assert {k: v.dtype for k, v in d.loss_fn_inputs.items()} == {"target_tokens": "int64", "weights": "float32"}
        p = pkg.SamplingParams(max_tokens=4, stop=[])
        assert (p.max_tokens, p.stop, p.temperature, p.top_k, p.top_p, p.seed) == (4, [], 1.0, -1, 1.0, None)
        assert pkg.AdamParams(learning_rate=1e-3).model_dump() == {
            "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
        with pytest.raises(ValueError):
            pkg.AdamParams(learning_rate="fast")
        with pytest.raises(ValueError):
            pkg.ModelInput(chunks=[], unknown=1)  # request types refuse unknown fields ...
        assert pkg.SamplingParams(unknown=1) == pkg.SamplingParams()  # ... but SamplingParams ignores them
        with pytest.raises(ValueError):  # frozen
            p.max_tokens = 5


@pytest.mark.parametrize("code, tinker_class, status", [
    ("INVALID_ARGUMENT", "BadRequestError", 400), ("NOT_FOUND", "NotFoundError", 404),
    ("PERMISSION_DENIED", "PermissionDeniedError", 403), ("UNAUTHENTICATED", "AuthenticationError", 401),
    ("RESOURCE_EXHAUSTED", "RateLimitError", 429), ("FAILED_PRECONDITION", "UnprocessableEntityError", 422),
    ("INTERNAL", "InternalServerError", 500), ("UNAVAILABLE", "APIConnectionError", None),
    ("DEADLINE_EXCEEDED", "APITimeoutError", None)])
def test_errors_are_tinkers_exception_classes(code, tinker_class, status):
    """`except tinker.BadRequestError` catches the INVALID_ARGUMENT a server call raised, and so on; the class tree
    is Tinker's (BadRequestError is an APIStatusError is an APIError is a TinkerError)."""
    err = trainyard.TrainyardError(code, "boom")
    assert isinstance(err, trainyard.TrainyardError) and isinstance(err, getattr(trainyard, tinker_class))
    assert (err.code, err.message, err.status_code) == (code, "boom", status)
    for name in ("BadRequestError", "NotFoundError", "RateLimitError", "APITimeoutError", "APIStatusError"):
        ours, theirs = getattr(trainyard, name), getattr(tinker, name)
        assert [c.__name__ for c in ours.__mro__ if c.__name__ in dir(tinker)] == \
            [c.__name__ for c in theirs.__mro__ if c.__name__ in dir(tinker)]
    assert type(trainyard.TrainyardError("SOMETHING_NEW", "x")) is trainyard.TrainyardError
