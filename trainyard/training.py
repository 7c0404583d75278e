"""The Training API SDK, shaped like the Tinker API (docs/training_api.md), over the trainer and rollout services.

    from trainyard import ServiceClient, types
    service = ServiceClient()                     # TRAINYARD_TRAINER_URL / TRAINYARD_API_KEY or `trainyard login`
    tc = service.create_lora_training_client("tiny-qwen3", rank=8)
    fb = tc.forward_backward(data, "cross_entropy")                # sent now ...
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))      # ... and so is this: the trainer runs it after fb
    print(fb.result().metrics["loss:mean"]); opt.result()
    sampler = tc.save_weights_and_get_sampling_client("step-1")
    out = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=32)).result()

How a TrainingClient's calls are ordered, pipelined, failed, and carried across trainer restarts:
trainyard/ordered_calls.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainyard import types
from trainyard.client import _channel
from trainyard.config import ClientConfig, cache_dir
from trainyard.errors import TrainyardError, from_rpc_error
from trainyard.futures import APIFuture, async_twin_signatures
from trainyard.rest_client import RestClient
from trainyard.ordered_calls import OrderedCalls, SessionUnchanged, session_when_reachable
from trainyard.sampling_client import WEIGHTS_PREFIX, SamplingClient
from trainyard.v1 import rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, trainer_pb2 as tpb, trainer_pb2_grpc

__all__ = ["APIFuture", "ClientFuture", "SamplingClient", "ServiceClient", "TrainingClient"]

STATE_PREFIX = "trainyard://state/"
# Calls of all TrainingClients of a ServiceClient in flight at once; more wait here, in order.
MAX_CALLS_IN_FLIGHT = 16
C = TypeVar("C")
CustomLossFn = Callable[[list[types.Datum], list[Any]], tuple[Any, dict[str, float]]]


@async_twin_signatures
class ServiceClient:
    """Entry point: creates training clients (trainer sessions) and sampling clients; Tinker's signature.

    base_url is the trainer's address (host:port), the one address a client needs, as Tinker's: the rollout's
    (sampling) and the scheduler's (get_server_capabilities) are asked of the trainer (its GetEndpoints, what its
    operator advertises) when first needed. rollout_url and url (Trainyard keywords) or the environment
    (TRAINYARD_ROLLOUT_URL, TRAINYARD_URL) win over that; a trainer that does not answer it leaves them to the file
    `trainyard login` writes, then the local defaults. base_url and api_key unset come from the environment
    (TRAINYARD_TRAINER_URL, TRAINYARD_API_KEY), the file, the defaults, as trainyard.Client's.
    create_sampling_client's future checks that the rollout answers, so a wrong rollout address fails there, not
    at the first sample.
    user_metadata, project_id and display_name are kept on this client only (Trainyard sessions have no such
    fields); default_headers_overrides travel as gRPC metadata with every call. Other keywords are ignored with a
    FutureWarning, as Tinker's."""

    def __init__(self, user_metadata: dict[str, str] | None = None, project_id: str | None = None, *,
                 display_name: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 default_headers_overrides: Mapping[str, str] | None = None, rollout_url: str | None = None,
                 url: str | None = None, retry_unavailable_s: float = 300.0, tls_ca_file: str | None = None,
                 tls_client_cert_file: str | None = None, tls_client_key_file: str | None = None, **kwargs: Any):
        if user_metadata is not None and not isinstance(user_metadata, Mapping):
            raise ValueError(f"user_metadata: must be a dict of strings, got {user_metadata!r} (Tinker's order: the "
                             "first parameter is user_metadata; give the address as base_url=...)")
        if kwargs:
            warnings.warn(f"ServiceClient ignores unsupported arguments: {', '.join(sorted(kwargs))}",
                          FutureWarning, stacklevel=2)
        self.user_metadata, self.project_id, self.display_name = user_metadata, project_id, display_name
        self.config = ClientConfig.resolve(url=url, rollout_url=rollout_url, api_key=api_key, trainer_url=base_url,
                                           tls_ca_file=tls_ca_file, tls_client_cert_file=tls_client_cert_file,
                                           tls_client_key_file=tls_client_key_file)
        # How long a Training API call waits for an unreachable or restarting trainer (ordered_calls.py, "Restarts").
        self.retry_unavailable_s = retry_unavailable_s
        self._trainer_channel = _channel(self.config.trainer_url, self.config)
        self._rollout_channel: grpc.Channel | None = None
        self._scheduler_channel: grpc.Channel | None = None
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self._trainer_channel)
        self._rollout: rollout_pb2_grpc.RolloutServiceStub | None = None
        # Addresses to ask the trainer for (neither argument nor environment gave them), until asked.
        self._to_discover = [n for n, v in (("rollout_url", rollout_url), ("url", url)) if not ClientConfig.given(n, v)]
        self._discover_lock = threading.Lock()
        headers = tuple((k.lower(), v) for k, v in (default_headers_overrides or {}).items())
        self.metadata = headers + ((("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key
                                   else ())
        self.pool = ThreadPoolExecutor(MAX_CALLS_IN_FLIGHT, thread_name_prefix="trainyard-training")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for channel in (self._trainer_channel, self._rollout_channel, self._scheduler_channel):
            if channel is not None:
                channel.close()

    def _discover(self) -> None:
        """Once: the addresses left to the trainer, from its GetEndpoints. A trainer that cannot tell (an older one,
        or one not answering now) leaves the login file's or the defaults; a later use does not ask again."""
        with self._discover_lock:
            if not self._to_discover:
                return
            try:
                endpoints = self.trainer.GetEndpoints(tpb.GetEndpointsRequest(), metadata=self.metadata)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise from_rpc_error(exc) from None
            else:
                advertised = {"rollout_url": endpoints.rollout_url, "url": endpoints.scheduler_url}
                for name in self._to_discover:
                    if advertised[name]:
                        setattr(self.config, name, advertised[name])
            self._to_discover = []

    @property
    def rollout(self) -> rollout_pb2_grpc.RolloutServiceStub:
        """The rollout service's stub (its address asked of the trainer first, if it is left to it)."""
        if self._rollout is None:
            self._discover()
            with self._discover_lock:
                if self._rollout is None:
                    self._rollout_channel = _channel(self.config.rollout_url, self.config)
                    self._rollout = rollout_pb2_grpc.RolloutServiceStub(self._rollout_channel)
        return self._rollout

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The base models this account can train and sample (the scheduler's model registry, TRAINYARD_URL)."""
        if self._scheduler_channel is None:
            self._discover()
            self._scheduler_channel = _channel(self.config.url, self.config)
        try:
            models = scheduler_pb2_grpc.ModelServiceStub(self._scheduler_channel).ListModels(
                scheduler_pb2.ListModelsRequest(), metadata=self.metadata).models
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return types.GetServerCapabilitiesResponse(
            supported_models=[types.SupportedModel(model_name=m.name) for m in models])

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return await asyncio.to_thread(self.get_server_capabilities)

    def create_rest_client(self) -> RestClient:
        """Tinker's RestClient (runs, checkpoints, TTL, publishing) over this client's addresses and key."""
        return RestClient(self)

    # -- training clients: each returns a future of the client, as Tinker 0.38 (ClientFuture) --------------------
    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None, optimizer: Any = None, *,
                                    alpha: float | None = None) -> ClientFuture[TrainingClient]:
        """A LoRA adapter over base_model (alpha, a Trainyard keyword, defaults to 32 whatever the rank, as
        Tinker's). seed None: random. train_unembed (Tinker's default, True) adapts lm_head too, also where it is
        tied to the input embeddings (the small Qwen3 models): the adapter runs next to the shared frozen weight."""
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("train_mlp, train_attn, train_unembed: at least one must be True")
        _check_optimizer(optimizer)
        lora = tpb.SessionLora(rank=rank, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed)
        if alpha is not None:
            lora.alpha = alpha
        return self._create(tpb.CreateSessionRequest(base_model=base_model, lora=lora, seed=_seed(seed)),
                            user_metadata)

    def create_training_client(self, base_model: str, seed: int | None = None) -> ClientFuture[TrainingClient]:
        """Full-parameter training (a Trainyard method): the session trains every parameter of its own copy of
        base_model."""
        return self._create(tpb.CreateSessionRequest(base_model=base_model, full_parameter=True, seed=_seed(seed)),
                            None)

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: Any = None) -> ClientFuture[TrainingClient]:
        """A new session with the weights saved by save_state at path (a fresh optimizer)."""
        _check_from_state(base_model, weights_access_token)
        _check_optimizer(optimizer)
        return self._create(tpb.CreateSessionRequest(from_state=_check_path(path, STATE_PREFIX, "save_state")),
                            user_metadata)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None
                                                         ) -> ClientFuture[TrainingClient]:
        """As create_training_client_from_state, also restoring the optimizer (Adam moments and step count)."""
        _check_from_state(base_model, weights_access_token)
        return self._create(tpb.CreateSessionRequest(from_state=_check_path(path, STATE_PREFIX, "save_state"),
                                                     with_optimizer=True), user_metadata)

    def resume_training_client(self, session_id: str) -> TrainingClient:
        """A TrainingClient on an existing session of this account, going on at the seq_id it expects next: after a
        trainer restart lost calls (ABORTED), or from another process."""
        return TrainingClient(self, session_when_reachable(self.trainer, self.metadata, session_id,
                                                            time.monotonic() + self.retry_unavailable_s))

    async def create_lora_training_client_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_lora_training_client(*args, **kwargs)

    async def create_training_client_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_training_client(*args, **kwargs)

    async def create_training_client_from_state_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_training_client_from_state(*args, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(self, *args, **kwargs) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    def _create(self, request: tpb.CreateSessionRequest,
                user_metadata: dict[str, str] | None) -> ClientFuture[TrainingClient]:
        def create() -> TrainingClient:
            try:
                session = self.trainer.CreateSession(request, metadata=self.metadata)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            client = TrainingClient(self, session)
            client.user_metadata = user_metadata
            return client

        return ClientFuture(self.pool.submit(create))

    # -- sampling clients ---------------------------------------------------------------------------------------
    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture[SamplingClient]:
        """Sample from saved weights (model_path "trainyard://weights/<version id>", from save_weights_for_sampler:
        that exact version) or from a base model (or a deployment) by name. The future fails if the rollout service
        does not answer (a wrong or unset rollout_url)."""
        if model_path is None and base_model is None:
            raise ValueError("model_path, base_model: give one of them")
        _check_sampling_options(retry_config, record_stability_info)
        if model_path is not None:
            client = SamplingClient(self, _check_path(model_path, WEIGHTS_PREFIX, "save_weights_for_sampler"),
                                    base_model)
        else:
            client = SamplingClient(self, base_model, base_model)
        return ClientFuture(self.pool.submit(self._rollout_answering, client))

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           retry_config: Any = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        return await self.create_sampling_client(model_path, base_model, retry_config, record_stability_info)

    def _rollout_answering(self, client: SamplingClient) -> SamplingClient:
        """client, once the rollout's health service answered (UNAVAILABLE at once when nothing listens there)."""
        self.rollout  # noqa: B018 - opens the rollout's channel (its address asked of the trainer first)
        try:
            health_pb2_grpc.HealthStub(self._rollout_channel).Check(health_pb2.HealthCheckRequest(),
                                                                    metadata=self.metadata)
        except grpc.RpcError as exc:
            raise TrainyardError(exc.code().name, f"the rollout service at {self.config.rollout_url} does not answer "
                                 f"({exc.details()}); set it with ServiceClient(rollout_url=...), "
                                 "TRAINYARD_ROLLOUT_URL or `trainyard login --rollout-url`") from None
        return client


class ClientFuture(APIFuture[C]):
    """A future of a TrainingClient or SamplingClient (what Tinker 0.38's create_* methods return): `.result()` or
    `await` it. Using it directly as the client still works, with a FutureWarning, as Tinker's
    BackcompatTrainingClientFuture / BackcompatSamplingClientFuture."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        warnings.warn(f"Reading `.{name}` from the future a client-creation method returned is deprecated (as in "
                      "Tinker): call .result() on it, or await it, to get the client first", FutureWarning,
                      stacklevel=2)
        return getattr(self.result(), name)


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and getattr(optimizer, "type", None) != "adamw":
        raise ValueError(f"optimizer: only Adam(W) is supported (None or an optimizer config of type 'adamw'), got "
                         f"{optimizer!r}")


def _check_from_state(base_model: str | None, weights_access_token: str | None) -> None:
    if base_model is not None:
        raise ValueError("base_model: not supported; a state is restored onto the base model it was saved from")
    if weights_access_token is not None:
        raise ValueError("weights_access_token: not supported; an account reads only its own checkpoints")


def _check_sampling_options(retry_config: Any, record_stability_info: bool) -> None:
    if retry_config is not None:
        raise ValueError("retry_config: not supported; the rollout's errors reach the sample's future as they are")
    if record_stability_info:
        raise ValueError("record_stability_info: not supported by Trainyard's rollout")


def _seed(seed: int | None) -> int:
    return secrets.randbits(31) if seed is None else seed


def _check_path(path: str, prefix: str, maker: str) -> str:
    if not isinstance(path, str) or not path.startswith(prefix) or len(path) == len(prefix):
        raise ValueError(f"path: expected '{prefix}<id>' (as {maker} returns), got {path!r}")
    return path


@async_twin_signatures
class TrainingClient(OrderedCalls):
    """One trainer session: a LoRA adapter (or full weights) and its optimizer state. Calls return APIFutures."""

    def __init__(self, service: ServiceClient, session: tpb.Session):
        super().__init__(service, session)
        self.base_model = session.base_model
        self._tokenizer = None

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _data(data: Iterable[types.Datum]) -> list[types.Datum]:
        if isinstance(data, types.Datum) or not isinstance(data, Iterable):
            raise ValueError("data: must be a list of Datum")
        data = list(data)
        if not data:
            raise ValueError("data: at least one datum is required")
        for i, d in enumerate(data):
            if not isinstance(d, types.Datum):
                raise ValueError(f"data[{i}]: must be a Datum, got {type(d).__name__}")
            d.check(f"data[{i}]")
        return data

    @staticmethod
    def _loss_fn(loss_fn: str) -> str:
        if not isinstance(loss_fn, str) or not loss_fn:
            raise ValueError(f"loss_fn: must be the name of a built-in loss (e.g. 'cross_entropy'), got {loss_fn!r}")
        return loss_fn

    def forward(self, data: list[types.Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, float] | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        """Logprobs of the targets and the loss's value, without gradients."""
        request = tpb.ForwardRequest(session_id=self.model_id, data=[d.to_proto() for d in self._data(data)],
                                     loss_fn=self._loss_fn(loss_fn),
                                     loss_fn_config=types.check_loss_fn_config(loss_fn_config))

        def body(seq_id: int) -> types.ForwardBackwardOutput:
            request.seq_id = seq_id
            return types.ForwardBackwardOutput.from_proto(self._ordered("Forward", request))

        return self._submit("forward", 1, body)

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None, *,
                         micro_batch_tokens: int = 0) -> APIFuture[types.ForwardBackwardOutput]:
        """Forward and backward of a built-in loss; gradients accumulate until optim_step."""
        request = tpb.ForwardBackwardRequest(session_id=self.model_id, data=[d.to_proto() for d in self._data(data)],
                                             loss_fn=self._loss_fn(loss_fn),
                                             loss_fn_config=types.check_loss_fn_config(loss_fn_config),
                                             micro_batch_tokens=micro_batch_tokens)

        def body(seq_id: int) -> types.ForwardBackwardOutput:
            request.seq_id = seq_id
            return types.ForwardBackwardOutput.from_proto(self._ordered("ForwardBackward", request))

        return self._submit("forward_backward", 1, body)

    def forward_backward_stream(self, data: Iterable[types.Datum], loss_fn: str,
                                loss_fn_config: dict[str, float] | None = None, *,
                                micro_batch_tokens: int = 0) -> APIFuture[types.ForwardBackwardOutput]:
        """forward_backward over datums sent as the iterable yields them (the trainer computes micro-batches as they
        fill; same result as forward_backward on the same datums). An iterable that raises, or yields a bad datum,
        aborts the call after some micro-batches may have run: the session counts as failed."""
        header = tpb.ForwardBackwardRequest(session_id=self.model_id, loss_fn=self._loss_fn(loss_fn),
                                            loss_fn_config=types.check_loss_fn_config(loss_fn_config),
                                            micro_batch_tokens=micro_batch_tokens)

        def body(seq_id: int) -> types.ForwardBackwardOutput:
            header.seq_id = seq_id
            failure: list[BaseException] = []

            def requests():
                yield tpb.ForwardBackwardStreamRequest(header=header)
                try:
                    for i, d in enumerate(data):
                        if not isinstance(d, types.Datum):
                            raise ValueError(f"data[{i}]: must be a Datum, got {type(d).__name__}")
                        d.check(f"data[{i}]")
                        yield tpb.ForwardBackwardStreamRequest(datums=tpb.DatumBatch(data=[d.to_proto()]))
                except Exception as exc:
                    failure.append(exc)
                    raise  # gRPC cancels the call

            try:
                return types.ForwardBackwardOutput.from_proto(self._ordered(
                    "ForwardBackwardStream", requests, seq_id=seq_id, resendable=isinstance(data, (list, tuple))))
            except grpc.RpcError:
                if failure:
                    raise failure[0] from None
                raise

        return self._submit("forward_backward_stream", 1, body)

    def forward_backward_custom(self, data: list[types.Datum], loss_fn: CustomLossFn, *,
                                loss_type_input: str | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        """Any differentiable function of the logprobs, in two passes: Forward gives each datum's logprobs of its
        target_tokens; loss, metrics = loss_fn(data, logprobs_list) runs here with torch autograd (one tensor per
        datum, shaped like its target_tokens: [T] or [T, K]); then ForwardBackward with the built-in cross_entropy
        and weights = -dloss/dlogprobs, whose gradient is exactly dloss/dparams. metrics of the result: the user's,
        with "loss" = the user's loss (the surrogate's own loss:* values are left out). loss_type_input: None or
        "logprobs" (Tinker's; the only input a custom loss gets)."""
        if loss_type_input not in (None, "logprobs"):
            raise ValueError(f"loss_type_input: must be None or 'logprobs', got {loss_type_input!r}")
        if not callable(loss_fn):
            raise ValueError("loss_fn: must be a function (data, logprobs_list) -> (loss, metrics); Tinker's "
                             "server-side LossHandle is not supported")
        data = self._data(data)
        for i, d in enumerate(data):
            if "target_tokens" not in d.loss_fn_inputs:
                raise ValueError(f"data[{i}].loss_fn_inputs['target_tokens']: required (the logprobs are of these "
                                 "tokens)")
        targets = [d.loss_fn_inputs["target_tokens"] for d in data]
        forward = tpb.ForwardRequest(session_id=self.model_id, loss_fn="cross_entropy", data=[
            types.Datum(d.model_input, {"target_tokens": t}).to_proto() for d, t in zip(data, targets)])

        def body(seq_id: int) -> types.ForwardBackwardOutput:
            forward.seq_id = seq_id
            try:
                out = types.ForwardBackwardOutput.from_proto(self._ordered("Forward", forward))
            except (grpc.RpcError, SessionUnchanged):
                self._skip(seq_id + 1)
                raise
            try:
                weights, loss, metrics = _custom_weights(data, out, loss_fn)
            except Exception as exc:
                self._skip(seq_id + 1)
                raise SessionUnchanged(exc) from None
            backward = tpb.ForwardBackwardRequest(session_id=self.model_id, seq_id=seq_id + 1, loss_fn="cross_entropy",
                                                  data=[types.Datum(d.model_input, {"target_tokens": t, "weights": w})
                                                        .to_proto() for d, t, w in zip(data, targets, weights)])
            result = types.ForwardBackwardOutput.from_proto(self._ordered("ForwardBackward", backward))
            kept = {k: v for k, v in result.metrics.items() if not k.startswith("loss:")}
            result.metrics = kept | {"loss": loss} | metrics
            return result

        return self._submit("forward_backward_custom", 2, body)

    def optim_step(self, optim_params: types.OptimParams | None = None, *,
                   adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        """One Adam(W) step on the accumulated gradients, which it then clears. Give the parameters as optim_params
        or adam_params (Tinker's older keyword), not both; neither: AdamParams()'s defaults."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("optim_params, adam_params: give one of them")
        params = optim_params if optim_params is not None else adam_params
        if params is not None and not isinstance(params, types.AdamParams):
            raise ValueError(f"optim_params: only AdamParams is supported, got {type(params).__name__}")
        request = tpb.OptimStepRequest(session_id=self.model_id, adam=(params or types.AdamParams()).to_proto())

        def body(seq_id: int) -> types.OptimStepResponse:
            request.seq_id = seq_id
            resp = self._ordered("OptimStep", request)
            return types.OptimStepResponse(metrics=dict(resp.metrics), step=resp.step)

        return self._submit("optim_step", 1, body)

    def save_state(self, name: str = "", ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        """Weights and optimizer state, to resume later; the result's path is "trainyard://state/<checkpoint id>".
        name is a label (several checkpoints may share one, so overwrite changes nothing); the checkpoint expires
        ttl_seconds after the save (None: kept until deleted) and carries user_metadata (RestClient shows both)."""
        options = _save_options(ttl_seconds, user_metadata)

        def body(seq_id: int) -> types.SaveWeightsResponse:
            resp = self._ordered("SaveState", tpb.SaveStateRequest(session_id=self.model_id, seq_id=seq_id,
                                                                   name=name, **options))
            return types.SaveWeightsResponse(path=resp.path or f"{STATE_PREFIX}{resp.checkpoint_id}",
                                             checkpoint_id=resp.checkpoint_id)

        return self._submit("save_state", 1, body)

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        """Replace the weights with a saved state's (same shape); the optimizer state is kept."""
        return self._load(path, weights_access_token, with_optimizer=False)

    def load_state_with_optimizer(self, path: str,
                                  weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, weights_access_token, with_optimizer=True)

    def _load(self, path: str, weights_access_token: str | None,
              with_optimizer: bool) -> APIFuture[types.LoadWeightsResponse]:
        _check_from_state(None, weights_access_token)
        path = _check_path(path, STATE_PREFIX, "save_state")

        def body(seq_id: int) -> types.LoadWeightsResponse:
            self._ordered("LoadState", tpb.LoadStateRequest(session_id=self.model_id, seq_id=seq_id, path=path,
                                                            with_optimizer=with_optimizer))
            return types.LoadWeightsResponse(path=path, model_id=self.model_id)

        return self._submit("load_state_with_optimizer" if with_optimizer else "load_state", 1, body)

    def save_weights_for_sampler(self, name: str = "", ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Publish the weights as the next version of the session's lineage; the result's path
        ("trainyard://weights/<version id>") is what a SamplingClient samples, pinned to that version, as long as its
        checkpoint lives: it expires ttl_seconds after the save (None: kept until deleted) and carries
        user_metadata."""
        return self._save_weights(name, ephemeral=False, options=_save_options(ttl_seconds, user_metadata))

    def _save_weights(self, name: str, ephemeral: bool,
                      options: dict | None = None) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        options = options or {}

        def body(seq_id: int) -> types.SaveWeightsForSamplerResponse:
            resp = self._ordered("SaveWeights", tpb.SaveWeightsRequest(session_id=self.model_id, seq_id=seq_id,
                                                                       name=name, ephemeral=ephemeral, **options))
            return types.SaveWeightsForSamplerResponse(path=resp.path or f"{WEIGHTS_PREFIX}{resp.version_id}",
                                                       version_id=resp.version_id, checkpoint_id=resp.checkpoint_id)

        return self._submit("save_weights_for_sampler", 1, body)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: str = "snapshot") -> ClientFuture[SamplingClient]:
        """The current weights published for sampling only, then a SamplingClient pinned to them (a future of it,
        as Tinker 0.38). Ephemeral, as Tinker's: no checkpoint is written, and the weight-sync service keeps only the
        session's few newest such versions (a SamplingClient of an older one fails with FAILED_PRECONDITION naming
        it) and none once the session is closed; save_weights_for_sampler(name) keeps a version."""
        _check_sampling_options(retry_config, record_stability_info)
        if kind != "snapshot":
            raise ValueError(f"kind: only 'snapshot' is supported, got {kind!r}")
        saved = self._save_weights(name or "", ephemeral=True)
        return ClientFuture(_then(
            saved.future(), lambda r: SamplingClient(self.service, r.path, self.base_model, self.get_tokenizer)))

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture[SamplingClient]:
        _check_sampling_options(retry_config, record_stability_info)
        client = SamplingClient(self.service, _check_path(model_path, WEIGHTS_PREFIX, "save_weights_for_sampler"),
                                self.base_model, self.get_tokenizer)
        return ClientFuture(self.service.pool.submit(self.service._rollout_answering, client))

    # Async variants, as Tinker's: `fut = await tc.forward_backward_async(...)`, then `result = await fut`.
    async def forward_async(self, *args, **kwargs) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args, **kwargs) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    async def forward_backward_stream_async(self, *args, **kwargs) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward_backward_stream(*args, **kwargs)

    async def forward_backward_custom_async(self, *args, **kwargs) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args, **kwargs) -> APIFuture[types.OptimStepResponse]:
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args, **kwargs) -> APIFuture[types.SaveWeightsResponse]:
        return self.save_state(*args, **kwargs)

    async def load_state_async(self, *args, **kwargs) -> APIFuture[types.LoadWeightsResponse]:
        return self.load_state(*args, **kwargs)

    async def load_state_with_optimizer_async(self, *args, **kwargs) -> APIFuture[types.LoadWeightsResponse]:
        return self.load_state_with_optimizer(*args, **kwargs)

    async def save_weights_for_sampler_async(self, *args, **kwargs) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(*args, **kwargs)

    async def save_weights_and_get_sampling_client_async(self, *args, **kwargs) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client(*args, **kwargs)

    async def create_sampling_client_async(self, *args, **kwargs) -> SamplingClient:
        return await self.create_sampling_client(*args, **kwargs)

    # -- unordered calls ----------------------------------------------------------------------------------------
    def get_info(self) -> types.GetInfoResponse:
        """The session as the trainer has it now (waiting, like the ordered calls, while the trainer restarts)."""
        return types.GetInfoResponse.from_proto(session_when_reachable(
            self._stub, self._md, self.model_id, time.monotonic() + self.service.retry_unavailable_s))

    async def get_info_async(self) -> types.GetInfoResponse:
        return await asyncio.to_thread(self.get_info)

    def get_tokenizer(self):
        """The base model's tokenizer (transformers), its files fetched from the trainer into the cache directory
        (TRAINYARD_CACHE_DIR, default ~/.cache/trainyard) once per client."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                str(_download_tokenizer(self._stub, self._md, self.model_id)), local_files_only=True)
        return self._tokenizer

    def close(self) -> None:
        """Wait for this client's calls in flight, then close the session (its memory on the trainer is freed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        wait(pending)
        try:
            self._call("CloseSession", tpb.CloseSessionRequest(id=self.model_id))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None


def _save_options(ttl_seconds: int | None, user_metadata: Mapping[str, str] | None) -> dict[str, Any]:
    """save_state / save_weights_for_sampler's keywords as request fields (the server checks their ranges)."""
    if user_metadata is not None and not (isinstance(user_metadata, Mapping) and
                                          all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in user_metadata.items())):
        raise ValueError(f"user_metadata: must be a dict of strings, got {user_metadata!r}")
    if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int)):
        raise ValueError(f"ttl_seconds: must be an int (seconds) or None, got {ttl_seconds!r}")
    options: dict[str, Any] = {"user_metadata": dict(user_metadata or {})}
    if ttl_seconds is not None:
        options["ttl_seconds"] = ttl_seconds
    return options


def _then(future: concurrent.futures.Future, convert: Callable[[Any], Any]) -> concurrent.futures.Future:
    """A future of convert(future's result), failing as future does."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            out.set_result(convert(f.result()))
        except BaseException as exc:  # noqa: BLE001 - the failure belongs to the future's waiter
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def _custom_weights(data: list[types.Datum], out: types.ForwardBackwardOutput,
                    loss_fn: CustomLossFn) -> tuple[list[Any], float, dict[str, float]]:
    """The user's loss on the Forward's logprobs, and -dloss/dlogprobs per datum (zero where it does not depend)."""
    import torch

    logprobs = [o["logprobs"].to_torch().requires_grad_(True) for o in out.loss_fn_outputs]
    returned = loss_fn(data, logprobs)
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TypeError("loss_fn must return (loss, metrics): a scalar torch tensor and a dict of floats")
    loss, metrics = returned
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError("loss_fn's loss must be a scalar torch tensor computed from the logprobs it was given")
    loss.backward()
    weights = [-(lp.grad if lp.grad is not None else torch.zeros_like(lp)) for lp in logprobs]
    metrics = {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in dict(metrics or {}).items()}
    return weights, float(loss.detach()), metrics


def _download_tokenizer(stub, metadata, session_id: str) -> Path:
    """GetTokenizer's files, each chunk checked against its sha256, under <cache>/tokenizers/<digest of the files>
    (written whole, then renamed into place)."""
    root = cache_dir() / "tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".download-"))
    try:
        digests: dict[str, Any] = {}
        try:
            for chunk in stub.GetTokenizer(tpb.GetTokenizerRequest(session_id=session_id), metadata=metadata):
                if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256:
                    raise TrainyardError("DATA_LOSS", f"tokenizer file {chunk.path} at {chunk.offset}: bad checksum")
                target = (staging / chunk.path).resolve()
                if not target.is_relative_to(staging.resolve()):
                    raise TrainyardError("DATA_LOSS", f"refusing to write outside the cache: {chunk.path}")
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "r+b" if target.exists() else "wb") as f:
                    f.seek(chunk.offset)
                    f.write(chunk.data)
                digests.setdefault(chunk.path, hashlib.sha256()).update(chunk.data)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if not digests:
            raise TrainyardError("NOT_FOUND", f"the trainer sent no tokenizer files for session {session_id}")
        key = hashlib.sha256("".join(f"{p}:{d.hexdigest()};" for p, d in sorted(digests.items())).encode())
        dest = root / key.hexdigest()[:32]
        if not dest.exists():
            try:
                staging.rename(dest)
            except OSError:  # another process put the same files there first
                pass
        return dest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
