"""The OpenAI-compatible HTTP endpoint of the rollout service (docs/openai.md).

POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}], GET /health. Served by the rollout process
next to gRPC over the same SamplingCore: `model` resolves as SampleRequest.model does (a live deployment of the
caller's account, else a base model it can see), the API key is the same (`Authorization: Bearer <key>`), and the
samples, logprobs and finish reasons are the engine's (docs/rollout.md), only reshaped (openai_protocol.py).

Threads: uvicorn runs the app's event loop in one thread (OpenAIServer.serve, a background task of the gRPC Server:
it starts with it and stops on its SIGTERM path, giving in-flight requests shutdown_grace_s). The core blocks
(database, model and adapter loads, the engine's request handles), so a request's submission, and the wait for each
of its engine requests' outputs, run in worker threads, at most openai_max_requests at once; outputs cross to the
loop through an asyncio queue. A request joins the engine as soon as it is submitted, so concurrent HTTP requests
share engine steps (continuous batching) as concurrent gRPC calls do. A client that goes away aborts its requests.

Errors: one handler maps domain errors to HTTP statuses and OpenAI's {"error": {message, type, param, code}}, naming
the OpenAI parameter; an error after a stream has started is its last event, `data: {"error": ...}`, before [DONE].
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import anyio
import sqlalchemy.exc
import uvicorn
from sqlalchemy import select
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.common import auth, registry
from services.common.config import https_kwargs
from services.common.db import Database
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TrainyardError,
    Unauthenticated,
    Unavailable,
    log_internal,
)
from services.common.schema import SHARED_SCOPE, Deployment
from services.rollout.sampling_core import SERVABLE_STATUSES, Prompt, SamplingCore, SampleStream
from services.rollout.engine import RequestOutput
from services.rollout.openai_protocol import (
    ChatRequest,
    CompletionLogprobs,
    CompletionRequest,
    TokenTexts,
    chat_logprobs,
    joined,
    openai_param,
    parse_chat,
    parse_completion,
    read_body,
)
from services.rollout.sampling import SampledSequence, SamplingParams

log = logging.getLogger("trainyard.rollout.openai")

# Domain error -> HTTP status, OpenAI error type and code; any other error is a 500.
ERRORS: dict[type[TrainyardError], tuple[int, str, str]] = {
    InvalidArgument: (400, "invalid_request_error", "invalid_value"),
    Unauthenticated: (401, "invalid_request_error", "invalid_api_key"),
    NotFound: (404, "invalid_request_error", "model_not_found"),
    FailedPrecondition: (409, "invalid_request_error", "model_not_ready"),  # e.g. a failed deployment
    Unavailable: (503, "server_error", "unavailable"),
}


def error_response(exc: Exception, param_names: dict[str, str]) -> tuple[int, dict]:
    """HTTP status and OpenAI error body for an exception."""
    param = None
    if isinstance(exc, TrainyardError):
        status, kind, code = next((v for cls, v in ERRORS.items() if isinstance(exc, cls)),
                                  (500, "server_error", "internal_error"))
        message = exc.message
        if isinstance(exc, InvalidArgument) and exc.violations:
            v = exc.violations[0]
            param = openai_param(v.field, param_names)
            message = f"{param}: {v.reason}" if param else v.reason
        elif isinstance(exc, NotFound):
            param = "model"
    elif isinstance(exc, sqlalchemy.exc.OperationalError):
        status, kind, code = 503, "server_error", "unavailable"
        message = "the database is unavailable; try again shortly"
    elif isinstance(exc, HTTPException):
        status, kind, code, message = exc.status_code, "invalid_request_error", None, exc.detail
    else:  # the detail (SQL, paths, ...) goes to the log only, under the id the client gets
        status, kind, code = 500, "server_error", "internal_error"
        message = log_internal(log, "the OpenAI endpoint", exc)
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class _Head:
    """The fields a response and every chunk of its stream share."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, model: str) -> _Head:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()))

    def body(self, obj: str, **fields) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, **fields}


@dataclass
class _Run:
    """One HTTP request's engine requests (one per prompt) and what formatting their outputs needs."""

    streams: list[SampleStream]
    prompts: list[Prompt]
    texts: TokenTexts
    n: int

    def cancel(self) -> None:
        for s in self.streams:
            s.handle.cancel()

    def prompt_text(self, p: int) -> str:
        prompt = self.prompts[p]
        if prompt.text is not None:
            return prompt.text
        return self.texts.tokenizer.decode(self.streams[p].prompt_tokens, skip_special_tokens=False)

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(s.prompt_tokens) for s in self.streams)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


def _accumulate(seqs: list[SampledSequence], out: RequestOutput) -> None:
    for d in out.sequences:
        s = seqs[d.index]
        s.tokens += d.tokens
        s.logprobs += d.logprobs
        s.top_logprobs += d.top_logprobs
        s.text += d.text
        s.finish_reason = d.finish_reason or s.finish_reason


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


async def _json_body(request: Request):
    return read_body(await request.body())


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIApp:
    """The Starlette application over a SamplingCore."""

    def __init__(self, core: SamplingCore, authenticate: Callable[[str | None], auth.Caller], *, max_requests: int):
        self.core, self.authenticate = core, authenticate
        self.limiter = anyio.CapacityLimiter(max_requests)
        self.stopping = threading.Event()  # the service's: /health answers 503 once shutdown begins
        self._texts: dict[int, TokenTexts] = {}  # per tokenizer (base models stay loaded)
        self._pumps: set[asyncio.Future] = set()
        handlers = {cls: self._on_error for cls in (TrainyardError, HTTPException, sqlalchemy.exc.OperationalError,
                                                    Exception)}
        self.asgi = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers=handlers)

    async def _on_error(self, request: Request, exc: Exception) -> JSONResponse:
        status, body = error_response(exc, getattr(request.state, "param_names", {}))
        return JSONResponse(body, status_code=status)

    # ---- endpoints ----------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.stopping.is_set():
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        caller = await self._caller(request)
        return JSONResponse({"object": "list", "data": await run_in_threadpool(servable_models, self.core.db, caller)})

    async def model(self, request: Request) -> Response:
        caller = await self._caller(request)
        name = request.path_params["model"]
        for card in await run_in_threadpool(servable_models, self.core.db, caller):
            if card["id"] == name:
                return JSONResponse(card)
        raise NotFound(f"model '{name}' not found: no deployment or base model with that name")

    async def completions(self, request: Request) -> Response:
        caller = await self._caller(request)
        req = parse_completion(await _json_body(request))
        request.state.param_names = req.param_names
        run = await self._submit(caller, req.model, req.prompts, req.params)
        head = _Head.new("cmpl", req.model)
        if req.stream:
            return self._event_stream(self._completion_chunks(req, run, head), req.param_names)
        done = await self._collect(request, run)
        if done is None:
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        seqs, prompt_logprobs = done
        choices = []
        for p, stream in enumerate(run.streams):
            prompt_text = run.prompt_text(p) if req.echo or req.logprobs is not None else ""
            for s in seqs[p]:
                logprobs = None
                if req.logprobs is not None:
                    pieces = [CompletionLogprobs(run.texts, req.logprobs, len(prompt_text)).add(
                        s.tokens, s.logprobs, s.top_logprobs)]
                    if req.echo:
                        pieces.insert(0, CompletionLogprobs(run.texts, 0, 0).add(
                            stream.prompt_tokens, [None, *prompt_logprobs[p]]))
                    logprobs = joined(*pieces)
                choices.append({"index": len(choices), "text": (prompt_text if req.echo else "") + s.text,
                                "logprobs": logprobs, "finish_reason": s.finish_reason})
        usage = run.usage(sum(len(s.tokens) for ss in seqs for s in ss))
        return JSONResponse(head.body("text_completion", choices=choices, usage=usage))

    async def chat_completions(self, request: Request) -> Response:
        caller = await self._caller(request)
        req = parse_chat(await _json_body(request))
        request.state.param_names = req.param_names
        run = await self._submit(caller, req.model, [req.prompt], req.params)
        head = _Head.new("chatcmpl", req.model)
        if req.stream:
            return self._event_stream(self._chat_chunks(req, run, head), req.param_names)
        done = await self._collect(request, run)
        if done is None:
            return Response(status_code=499)
        (seqs,), _ = done
        choices = [{"index": i, "message": {"role": "assistant", "content": s.text},
                    "logprobs": {"content": chat_logprobs(run.texts, s.tokens, s.logprobs, s.top_logprobs)}
                    if req.logprobs else None, "finish_reason": s.finish_reason} for i, s in enumerate(seqs)]
        usage = run.usage(sum(len(s.tokens) for s in seqs))
        return JSONResponse(head.body("chat.completion", choices=choices, usage=usage))

    # ---- streams ------------------------------------------------------------------------------------------------

    def _event_stream(self, chunks: AsyncIterator[dict], param_names: dict[str, str]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async with contextlib.aclosing(chunks):
                try:
                    async for chunk in chunks:
                        yield _sse(chunk)
                except Exception as exc:  # noqa: BLE001 - the status line is sent: the error becomes an event
                    yield _sse(error_response(exc, param_names)[1])
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _completion_chunks(self, req: CompletionRequest, run: _Run, head: _Head) -> AsyncIterator[dict]:
        n, usage = run.n, {"usage": None} if req.include_usage else {}

        def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str = "") -> dict:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason or None}
            return head.body("text_completion", choices=[choice], **usage)

        choices = len(run.streams) * n
        needed = req.echo or req.logprobs is not None
        prompt_texts = [run.prompt_text(p) for p in range(len(run.streams))] if needed else []
        builders = [CompletionLogprobs(run.texts, req.logprobs, len(prompt_texts[i // n]))
                    for i in range(choices)] if req.logprobs is not None else None
        if req.echo:
            for i in range(choices):
                yield chunk(i, prompt_texts[i // n])
        completion_tokens = 0
        async with contextlib.aclosing(self._outputs(run)) as outputs:
            async for p, out in outputs:
                for d in out.sequences:
                    i = p * n + d.index
                    completion_tokens += len(d.tokens)
                    logprobs = builders[i].add(d.tokens, d.logprobs, d.top_logprobs) if builders else None
                    if d.text or d.finish_reason or (logprobs and d.tokens):
                        yield chunk(i, d.text, logprobs, d.finish_reason)
        if req.include_usage:
            yield head.body("text_completion", choices=[], usage=run.usage(completion_tokens))

    async def _chat_chunks(self, req: ChatRequest, run: _Run, head: _Head) -> AsyncIterator[dict]:
        usage = {"usage": None} if req.include_usage else {}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str = "") -> dict:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason or None}
            return head.body("chat.completion.chunk", choices=[choice], **usage)

        for i in range(run.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        completion_tokens = 0
        async with contextlib.aclosing(self._outputs(run)) as outputs:
            async for _, out in outputs:
                for d in out.sequences:
                    completion_tokens += len(d.tokens)
                    if d.text or (req.logprobs and d.tokens):
                        logprobs = ({"content": chat_logprobs(run.texts, d.tokens, d.logprobs, d.top_logprobs)}
                                    if req.logprobs else None)
                        yield chunk(d.index, {"content": d.text}, logprobs)
                    if d.finish_reason:
                        yield chunk(d.index, {}, finish_reason=d.finish_reason)
        if req.include_usage:
            yield head.body("chat.completion.chunk", choices=[], usage=run.usage(completion_tokens))

    # ---- the core, from the event loop --------------------------------------------------------------------------

    async def _caller(self, request: Request) -> auth.Caller:
        key = auth.key_from_metadata(request.headers.items())
        if not key:
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <Trainyard API key>'")
        return await run_in_threadpool(self.authenticate, key)

    async def _submit(self, caller: auth.Caller, model: str, prompts: list[Prompt], params: SamplingParams) -> _Run:
        return await anyio.to_thread.run_sync(self._submit_blocking, caller, model, prompts, params,
                                              limiter=self.limiter)

    def _submit_blocking(self, caller: auth.Caller, model: str, prompts: list[Prompt], params: SamplingParams) -> _Run:
        streams: list[SampleStream] = []
        try:
            for i, prompt in enumerate(prompts):
                try:
                    streams.append(self.core.sample_stream(caller.account_id, model, prompt, params,
                                                           api_key=caller.api_key))
                except InvalidArgument as exc:
                    v = exc.violations[0] if exc.violations else None
                    if len(prompts) == 1 or v is None or v.field != "prompt":
                        raise
                    raise InvalidArgument(v.reason, field=f"prompt[{i}]") from None
        except BaseException:
            for s in streams:
                s.handle.cancel()
            raise
        tokenizer = streams[0].tokenizer
        texts = self._texts.get(id(tokenizer)) or self._texts.setdefault(id(tokenizer), TokenTexts(tokenizer))
        return _Run(streams, prompts, texts, params.n)

    async def _outputs(self, run: _Run) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of the run's engine requests as they come; closing it early aborts them. A worker
        thread per engine request waits on its handle and hands each output to this loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        def pump(p: int, stream: SampleStream) -> None:
            try:
                for out in stream.handle:
                    loop.call_soon_threadsafe(queue.put_nowait, (p, out))
            except Exception as exc:  # noqa: BLE001 - the engine failed the request: raised again in the loop
                loop.call_soon_threadsafe(queue.put_nowait, (p, exc))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, (p, None))

        for p, stream in enumerate(run.streams):
            task = asyncio.ensure_future(anyio.to_thread.run_sync(pump, p, stream, limiter=self.limiter))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)
        try:
            running = len(run.streams)
            while running:
                p, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            run.cancel()

    async def _collect(self, request: Request, run: _Run):
        """Every sample and the prompt logprobs of every prompt; None when the client went away first (the run is
        aborted then)."""
        seqs = [[SampledSequence() for _ in range(run.n)] for _ in run.streams]
        prompt_logprobs: list[list[float]] = [[] for _ in run.streams]

        async def gather() -> None:
            async with contextlib.aclosing(self._outputs(run)) as outputs:
                async for p, out in outputs:
                    _accumulate(seqs[p], out)
                    prompt_logprobs[p] = out.prompt_logprobs or prompt_logprobs[p]

        gathered = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this request is cancelled (shutdown past its grace): closing gather aborts the run
            gone.cancel()
            if not gathered.done():
                gathered.cancel()
        if not gathered.done():  # cancelled just above: the client went away
            return None
        gathered.result()  # the engine's error, if any
        return seqs, prompt_logprobs


def servable_models(db: Database, caller: auth.Caller) -> list[dict]:
    """What `model` can name for the caller, each name once and as resolution picks it: the account's live
    deployments, then the base models it sees (its own before a shared one of the same name)."""
    def card(name: str, created: datetime, owner: str, parent: str | None = None) -> dict:
        created = created if created.tzinfo else created.replace(tzinfo=timezone.utc)
        return {"id": name, "object": "model", "created": int(created.timestamp()), "owned_by": owner,
                "parent": parent}

    with db.session() as s:
        deps = s.scalars(select(Deployment).where(
            Deployment.account_id == caller.account_id, Deployment.deleted_at.is_(None),
            Deployment.status.in_(SERVABLE_STATUSES)).order_by(Deployment.name)).all()
        cards = {d.name: card(d.name, d.created_at, caller.account_name, d.base_model) for d in deps}
        for m in sorted(registry.visible_models(s, caller.account_id), key=lambda m: m.scope == SHARED_SCOPE):
            owner = "trainyard" if m.scope == SHARED_SCOPE else caller.account_name
            cards.setdefault(m.name, card(m.name, m.created_at, owner))
    return list(cards.values())


class _Uvicorn(uvicorn.Server):
    """Stops (gracefully) when the service's stopping event is set; uvicorn checks on_tick every 0.1 s."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event):
        super().__init__(config)
        self.stopping = stopping

    async def on_tick(self, counter: int) -> bool:
        return self.stopping.is_set() or await super().on_tick(counter)


class OpenAIServer:
    """The app on uvicorn, in a thread of the rollout process. The port is bound here, so a port in use fails the
    service's start; serve(stopping) is a gRPC Server background task: it runs until the service's shutdown begins,
    lets in-flight requests finish for grace_s (then cancels them, which aborts their engine requests) and returns."""

    def __init__(self, core: SamplingCore, authenticate: Callable[[str | None], auth.Caller], *, host: str, port: int,
                 max_requests: int, grace_s: float, tls: dict | None = None):
        self.app = OpenAIApp(core, authenticate, max_requests=max_requests)
        try:
            self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise OSError(f"rollout: cannot listen for HTTP on {host}:{port} ({exc.strerror}); set "
                          "TRAINYARD_OPENAI_PORT to a free port, or to 0 to turn the endpoint off") from None
        self.port = self.socket.getsockname()[1]
        self.config = uvicorn.Config(self.app.asgi, lifespan="off", log_config=None, access_log=False, ws="none",
                                     timeout_graceful_shutdown=grace_s, **https_kwargs(**(tls or {})))

    def serve(self, stopping: threading.Event) -> None:
        self.app.stopping = stopping
        log.info("OpenAI-compatible HTTP endpoint on port %d", self.port)
        _Uvicorn(self.config, stopping).run(sockets=[self.socket])
        log.info("OpenAI-compatible HTTP endpoint stopped")
