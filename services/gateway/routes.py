"""The Tinker wire protocol's core routes: client config, sessions, models, training, sampling and futures
(docs/gateway.md). Each handler checks its request, answers a future's request_id at once, and does the work in the
future through the trainyard SDK; state.py holds the futures, orders each model's calls and keeps idempotency keys.
"""
from __future__ import annotations

import asyncio
import io
from typing import Any

import grpc
import zstandard
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway import paths, wire
from services.gateway.context import GatewayCaller, GatewayContext, read_json, route
from services.gateway.errors import GatewayError, bad_request, body as error_body
from services.gateway.state import Model, SamplingSession, Sequencer, new_id
from trainyard import types
from trainyard.errors import from_rpc_error
from trainyard.v1 import tinker_wire_pb2, trainer_pb2

IDEMPOTENCY_HEADER = "x-idempotency-key"
# A cloned SamplingClient numbers its requests from clone id * CLONE_STRIDE (the original from 0).
CLONE_STRIDE = 1_000_000_000


def _field(body: dict, name: str, kind: type | tuple[type, ...], required: bool = True, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(name, "required")
        return default
    if isinstance(value, bool) and kind is int or not isinstance(value, kind):
        raise bad_request(name, f"must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


class CoreRoutes:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    def routes(self) -> list[Route]:
        ctx, post = self.ctx, self._idempotent
        return [
            route(ctx, "/api/v1/client/config", self.client_config),
            route(ctx, "/api/v1/client/dynamic_config", self.dynamic_config),
            route(ctx, "/api/v1/get_server_capabilities", self.capabilities, ("GET",)),
            route(ctx, "/api/v1/create_session", post(self.create_session)),
            route(ctx, "/api/v1/session_heartbeat", self.heartbeat),
            route(ctx, "/api/v1/sessions/{session_id}/finish", self.finish_session),
            route(ctx, "/api/v1/create_model", post(self.create_model)),
            route(ctx, "/api/v1/get_info", self.get_info),
            route(ctx, "/api/v1/forward_backward", post(self.forward_backward)),
            route(ctx, "/api/v1/forward", post(self.forward)),
            route(ctx, "/api/v1/optim_step", post(self.optim_step)),
            route(ctx, "/api/v1/save_weights", post(self.save_weights)),
            route(ctx, "/api/v1/load_weights", post(self.load_weights)),
            route(ctx, "/api/v1/save_weights_for_sampler", post(self.save_weights_for_sampler)),
            route(ctx, "/api/v1/create_sampling_session", post(self.create_sampling_session)),
            route(ctx, "/api/v1/samplers/{sampler_id}", self.get_sampler, ("GET",)),
            route(ctx, "/api/v1/asample", post(self.asample)),
            route(ctx, "/api/v1/retrieve_future", self.retrieve_future),
            route(ctx, "/api/v1/retrieve_futures", self.retrieve_futures),
            route(ctx, "/api/v1/cancel_future", self.cancel_future),
            route(ctx, "/api/v1/telemetry", self.telemetry),
        ]

    def _idempotent(self, handler):
        async def run(request: Request, caller: GatewayCaller):
            key = request.headers.get(IDEMPOTENCY_HEADER)
            return await self.ctx.idempotency.once(caller.account_id, request.url.path, key,
                                                   lambda: handler(request, caller))
        return run

    # -- client configuration and sessions ---------------------------------------------------------------------------
    async def client_config(self, request: Request, caller: GatewayCaller) -> dict:
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": True, "fwdbwd_max_chunk_len": self.ctx.settings.fwdbwd_max_chunk_len,
                "use_pyqwest_transport": False, "sample_use_retrieve_futures": True,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    async def dynamic_config(self, request: Request, caller: GatewayCaller) -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}

    async def capabilities(self, request: Request, caller: GatewayCaller) -> dict:
        caps = await asyncio.to_thread(self.ctx.service_client(caller).get_server_capabilities)
        return {"supported_models": [{"model_name": m.model_name, "trainable": True, "sampleable": True}
                                     for m in caps.supported_models]}

    async def create_session(self, request: Request, caller: GatewayCaller) -> dict:
        await read_json(request)
        return {"type": "create_session", "session_id": self.ctx.new_client_session(caller)}

    async def heartbeat(self, request: Request, caller: GatewayCaller) -> dict:
        session = self.ctx.client_session(caller, _field(await read_json(request), "session_id", str))
        if session.finished:
            raise GatewayError("EXPIRED", f"session_id: the session finished ({session.finished})", "session_id")
        session.heartbeat()
        return {"type": "session_heartbeat"}

    async def finish_session(self, request: Request, caller: GatewayCaller) -> dict:
        session = self.ctx.client_session(caller, request.path_params["session_id"])
        reason = (await read_json(request)).get("reason") or {}
        session.finished = session.finished or (reason.get("type") if isinstance(reason, dict) else "") or "finished"
        # Its models are done: their trainer sessions close (memory freed; checkpoints and weights stay).
        models = {k: m for k, m in self.ctx.models.owned_by(caller.account_id).items()
                  if m.session_id == request.path_params["session_id"]}
        for model_id in models:
            self.ctx.models.pop(model_id)
        await asyncio.gather(*[asyncio.to_thread(m.client.close) for m in models.values()])
        return {}

    # -- models ------------------------------------------------------------------------------------------------------
    async def create_model(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        session_id = _field(body, "session_id", str)
        self.ctx.client_session(caller, session_id)
        base_model = _field(body, "base_model", str)
        optimizer = body.get("optimizer_config") or {}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise bad_request("optimizer_config", f"only Adam(W) ('adamw') is supported, got {optimizer!r}")
        lora = body.get("lora_config")
        service = self.ctx.service_client(caller)
        if lora is None:
            creating = service.create_training_client(base_model, seed=None)
        else:
            if not isinstance(lora, dict):
                raise bad_request("lora_config", "must be an object {rank, seed, train_mlp, train_attn, train_unembed}")
            config = wire.checked(lambda c: types.LoraConfig(**c), lora, field="lora_config")
            creating = wire.checked(lambda: service.create_lora_training_client(
                base_model, rank=config.rank, seed=config.seed, train_mlp=config.train_mlp,
                train_attn=config.train_attn, train_unembed=config.train_unembed,
                user_metadata=body.get("user_metadata")))

        async def work():
            client = await creating.result_async()
            self.ctx.models.put(client.model_id, Model(caller.account_id, client, Sequencer(1), session_id))
            return _json({"type": "create_model", "model_id": client.model_id})

        return {"request_id": self.ctx.futures.submit(caller.account_id, work()), "model_id": None}

    async def get_info(self, request: Request, caller: GatewayCaller) -> dict:
        model = await self.ctx.model(caller, _field(await read_json(request), "model_id", str))
        info = await asyncio.to_thread(model.client.get_info)
        return info.model_dump(mode="json") | {"type": "get_info"}

    # -- training ----------------------------------------------------------------------------------------------------
    async def _ordered(self, caller: GatewayCaller, body: dict, start, render) -> dict:
        """A future that makes start(client) at the request's seq_id turn and renders what its APIFuture gives."""
        model_id = _field(body, "model_id", str)
        seq_id = _field(body, "seq_id", int)
        model = await self.ctx.model(caller, model_id)
        self.ctx.futures.check_room(caller.account_id)

        async def work():
            started = await model.sequencer.turn(seq_id, lambda: wire.checked(start, model.client))
            rendered = render(await started.result_async())
            return await rendered if asyncio.iscoroutine(rendered) else rendered

        return {"request_id": self.ctx.futures.submit(caller.account_id, work()), "model_id": model_id}

    async def _refusing(self, caller: GatewayCaller, body: dict, parse):
        """parse(); when it refuses the request (400), the model's seq_id turn it held is given up."""
        try:
            return parse()
        except GatewayError:
            model = self.ctx.models.find(caller.account_id, body.get("model_id") or "")
            if model is not None and isinstance(body.get("seq_id"), int):
                await model.sequencer.skip(body["seq_id"])
            raise

    async def forward_backward(self, request: Request, caller: GatewayCaller) -> dict:
        if request.headers.get("content-type", "").startswith(wire.PROTO):
            msg = await self._proto_body(request)
            body = {"model_id": msg.model_id, "seq_id": msg.seq_id}

            def parse():
                return ([wire.proto_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)], msg.loss_fn,
                        wire.proto_loss_fn_config(msg), msg.forward_only)
        else:
            body = await read_json(request)

            def parse():
                fb = _field(body, "forward_backward_input", dict)
                return (*self._fb_input(fb), bool(body.get("forward_only", False)))

        data, loss_fn, config, forward_only = await self._refusing(caller, body, parse)
        if forward_only:
            return await self._ordered(caller, body, lambda c: c.forward(data, loss_fn, config), _forward_output)
        return await self._ordered(caller, body, lambda c: c.forward_backward(data, loss_fn, config),
                                   _forward_output)

    async def forward(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        data, loss_fn, config = await self._refusing(
            caller, body, lambda: self._fb_input(_field(body, "forward_input", dict)))
        return await self._ordered(caller, body, lambda c: c.forward(data, loss_fn, config), _forward_output)

    @staticmethod
    def _fb_input(fb: dict) -> tuple[list[types.Datum], str, dict[str, float] | None]:
        data = fb.get("data")
        if not isinstance(data, list) or not data:
            raise bad_request("data", "must be a non-empty list of Datum")
        return ([wire.datum(d, f"data[{i}]") for i, d in enumerate(data)], _field(fb, "loss_fn", str),
                wire.loss_fn_config(fb.get("loss_fn_config")))

    async def _proto_body(self, request: Request) -> tinker_wire_pb2.ForwardBackwardRequest:
        raw = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            limit = self.ctx.settings.max_body_mb * 2**20
            out = bytearray()
            try:  # a body that inflates past the limit is refused once it does, not inflated whole
                with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
                    while chunk := reader.read(1 << 20):
                        out += chunk
                        if len(out) > limit:
                            raise bad_request("body", f"decompresses to more than max_body_mb = {limit >> 20} MiB")
            except zstandard.ZstdError as exc:
                raise bad_request("body", f"not valid zstd ({exc})") from None
            raw = bytes(out)
        msg = tinker_wire_pb2.ForwardBackwardRequest()
        try:
            msg.ParseFromString(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise bad_request("body", f"not a ForwardBackwardRequest protobuf ({exc})") from None
        return msg

    async def optim_step(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        params = await self._refusing(caller, body, lambda: wire.adam_params(body))
        return await self._ordered(caller, body, lambda c: c.optim_step(params),
                                   lambda r: _json({"type": "optim_step", "metrics": r.metrics}))

    async def _run_id(self, caller: GatewayCaller, body: dict) -> str:
        """The trainer session id of the request's model: what a Tinker path names (the SDK's model id may be an
        alias, see load_weights)."""
        return (await self.ctx.model(caller, _field(body, "model_id", str))).client.model_id

    async def save_weights(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        name = body.get("path") or ""
        run_id = await self._run_id(caller, body)
        return await self._ordered(
            caller, body, lambda c: c.save_state(name, ttl_seconds=body.get("ttl_seconds"),
                                                 user_metadata=body.get("user_metadata")),
            lambda r: _json({"type": "save_weights", "path": paths.to_tinker(run_id, r.path)}))

    async def load_weights(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        if body.get("model_id") is None:
            return await self._model_from_state(caller, body)
        path = await self._refusing(caller, body, lambda: paths_field(body, "path", "weights"))
        optimizer = bool(body.get("optimizer", False))
        model_id = body.get("model_id")
        return await self._ordered(
            caller, body,
            lambda c: c.load_state_with_optimizer(path) if optimizer else c.load_state(path),
            lambda r: _json({"type": "load_weights", "path": body["path"], "model_id": model_id}))

    async def _model_from_state(self, caller: GatewayCaller, body: dict) -> dict:
        """create_training_client_from_state[_with_optimizer]: a new trainer session restored from a save_state
        checkpoint. The SDK names the model itself, "<client session id>:train:<model_seq_id>"; the gateway keeps
        that name as an alias of the trainer session (Tinker paths it makes name the trainer session)."""
        session_id = _field(body, "session_id", str)
        self.ctx.client_session(caller, session_id)
        alias = f"{session_id}:train:{_field(body, 'model_seq_id', int)}"
        path = paths_field(body, "path", "weights")
        optimizer = body.get("optimizer_config") or {}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise bad_request("optimizer_config", f"only Adam(W) ('adamw') is supported, got {optimizer!r}")
        service = self.ctx.service_client(caller)
        with_optimizer = service.create_training_client_from_state_with_optimizer
        creating = wire.checked(
            with_optimizer if body.get("optimizer") else service.create_training_client_from_state, path,
            body.get("base_model"), body.get("user_metadata"), body.get("weights_access_token"))

        async def work():
            client = await creating.result_async()
            self.ctx.models.put(alias, Model(caller.account_id, client, Sequencer(1), session_id))
            return _json({"type": "load_weights", "path": body["path"], "model_id": alias})

        return {"request_id": self.ctx.futures.submit(caller.account_id, work()), "model_id": alias}

    async def save_weights_for_sampler(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        name = body.get("path") or ""
        model_id = body.get("model_id")
        run_id = await self._run_id(caller, body)
        kind = body.get("kind") or "snapshot"
        if kind != "snapshot":
            await self._refusing(caller, body, lambda: _refuse(bad_request("kind", f"only 'snapshot' is supported, "
                                                                           f"got {kind!r}")))
        with_session = body.get("sampling_session_seq_id") is not None

        async def render(r: types.SaveWeightsForSamplerResponse):
            tinker_path = paths.to_tinker(run_id, r.path)
            out = {"type": "save_weights_for_sampler", "path": tinker_path}
            if with_session:
                model = self.ctx.models.get(caller.account_id, model_id, "model_id")
                client = await self.ctx.service_client(caller).create_sampling_client(model_path=r.path).result_async()
                out["sampling_session_id"] = self.ctx.new_sampler(caller, client, model.client.base_model,
                                                                  tinker_path)
            return _json(out)

        return await self._ordered(
            caller, body, lambda c: c.save_weights_for_sampler(name, ttl_seconds=body.get("ttl_seconds"),
                                                               user_metadata=body.get("user_metadata")), render)

    # -- sampling ----------------------------------------------------------------------------------------------------
    async def create_sampling_session(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        self.ctx.client_session(caller, _field(body, "session_id", str))
        sampler = await self._sampler_for(caller, body.get("model_path"), body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    async def _sampler_for(self, caller: GatewayCaller, model_path: Any, base_model: Any) -> str:
        service = self.ctx.service_client(caller)
        if model_path is not None:
            trainyard_path = paths_field({"model_path": model_path}, "model_path", "sampler_weights")
            session_id = paths.parse_tinker(model_path, "model_path")[0]
            base = await asyncio.to_thread(self._base_model_of, caller, session_id)
            client = await service.create_sampling_client(model_path=trainyard_path).result_async()
            return self.ctx.new_sampler(caller, client, base, model_path)
        if not isinstance(base_model, str) or not base_model:
            raise bad_request("base_model", "required when model_path is not given")
        client = await service.create_sampling_client(base_model=base_model).result_async()
        return self.ctx.new_sampler(caller, client, base_model, None)

    def _base_model_of(self, caller: GatewayCaller, session_id: str) -> str:
        model = self.ctx.models.find(caller.account_id, session_id)
        if model is not None:
            return model.client.base_model
        service = self.ctx.service_client(caller)
        try:
            return service.trainer.GetSession(trainer_pb2.GetSessionRequest(id=session_id),
                                              metadata=service.metadata, timeout=30).base_model
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            raise GatewayError(err.code, f"model_path: training run {session_id}: {err.message}",
                               "model_path") from None

    async def get_sampler(self, request: Request, caller: GatewayCaller) -> dict:
        sampler_id = request.path_params["sampler_id"]
        s = self.ctx.samplers.get(caller.account_id, sampler_id, "sampler_id")
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    async def asample(self, request: Request, caller: GatewayCaller) -> dict:
        body = await read_json(request)
        for name in ("target_prompt_logprobs", "record_stability_info"):
            if body.get(name):
                raise bad_request(name, "not supported by Trainyard's rollout")
        for name in ("topk_prompt_logprobs", "prompt_alt_tokens_k"):
            if body.get(name):
                raise bad_request(name, "not supported by Trainyard's rollout (it returns each prompt token's "
                                  "logprob, not alternatives); use prompt_logprobs")
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:
            sampler_id = await self._sampler_for(caller, body.get("model_path"), body.get("base_model"))
        sampler: SamplingSession = self.ctx.samplers.get(caller.account_id, sampler_id, "sampling_session_id")
        num_samples = _field(body, "num_samples", int, required=False, default=1)
        if num_samples < 1:
            raise bad_request("num_samples", f"must be at least 1, got {num_samples}")
        prompt = wire.model_input(body.get("prompt"), "prompt")
        params = wire.sampling_params(body.get("sampling_params"))
        started = wire.checked(lambda: sampler.client.sample(
            prompt, num_samples, params, include_prompt_logprobs=bool(body.get("prompt_logprobs")),
            topk_sample_logprobs=_field(body, "topk_sample_logprobs", int, required=False, default=0),
            prompt_logprobs_last_n=body.get("prompt_logprobs_last_n")))

        async def work():
            return _sample_output(await started.result_async())

        seq_id = body.get("seq_id")
        log = sampler.log(seq_id // CLONE_STRIDE if isinstance(seq_id, int) and seq_id >= 0 else 0)
        request_id = self.ctx.futures.submit(caller.account_id, work(),
                                             on_done=lambda rid, fut: log.add(rid, fut.error is not None))
        return {"request_id": request_id, "sample_sequence_ids": [new_id("seq") for _ in range(num_samples)]}

    async def retrieve_futures(self, request: Request, caller: GatewayCaller) -> dict:
        """The sampling requests of one sampling session clone that finished since the client's cursor (long-polled;
        timeout 0: at once). The SDK then fetches each result with retrieve_future."""
        body = await read_json(request)
        target = _field(body, "target", dict)
        sampler = self.ctx.samplers.get(caller.account_id, _field(target, "sampling_session_id", str),
                                        "target.sampling_session_id")
        clone = _field(target, "cloned_sampler_id", int, required=False, default=0)
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise bad_request("timeout", f"must be a number of seconds >= 0, got {timeout!r}")
        wait_s = self.ctx.settings.long_poll_s if timeout is None else min(timeout, self.ctx.settings.long_poll_s)
        completions, cursor = await sampler.log(clone).since(
            _field(body, "prev_cursor", int, required=False, default=0), wait_s)
        return {"completions": completions, "cursor": cursor}

    # -- futures -----------------------------------------------------------------------------------------------------
    async def retrieve_future(self, request: Request, caller: GatewayCaller) -> Response:
        request_id = _field(await read_json(request), "request_id", str)
        fut = self.ctx.futures.get(caller.account_id, request_id)
        try:
            await asyncio.wait_for(asyncio.shield(fut.done.wait()), self.ctx.settings.long_poll_s)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        fut.retrieved = True
        if fut.error is not None:
            return JSONResponse(error_body(fut.error))
        content, media_type = fut.render(wire.PROTO in request.headers.get("accept", ""))
        if media_type == wire.PROTO:
            return Response(content, media_type=wire.PROTO)
        return JSONResponse(content)

    async def telemetry(self, request: Request, caller: GatewayCaller) -> dict:
        """The SDK's telemetry events: accepted and dropped (the services' logs and metrics are the record)."""
        return {"status": "accepted"}

    async def cancel_future(self, request: Request, caller: GatewayCaller) -> dict:
        self.ctx.futures.cancel(caller.account_id, _field(await read_json(request), "request_id", str))
        return {}


def _refuse(err: GatewayError):
    raise err


def paths_field(body: dict, name: str, kind: str) -> str:
    try:
        return paths.to_trainyard(_field(body, name, str), kind, name)
    except paths.BadPath as exc:
        raise bad_request(name, str(exc).split(": ", 1)[-1]) from None


def _json(value: dict):
    return lambda proto: (value, "application/json")


def _forward_output(out: types.ForwardBackwardOutput):
    return lambda proto: ((wire.forward_output_proto(out), wire.PROTO) if proto
                          else (wire.forward_output_json(out), "application/json"))


def _sample_output(out: types.SampleResponse):
    return lambda proto: ((wire.sample_proto(out), wire.PROTO) if proto
                          else (wire.sample_json(out), "application/json"))
