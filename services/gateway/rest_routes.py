"""Tinker's REST routes (the `tinker` SDK's RestClient): training runs, checkpoints, TTL, publishing, sessions and
checkpoint downloads, over the same backend as trainyard.RestClient -- this module IS a trainyard.RestClient per API
key whose checkpoints are named in Tinker's form (services/gateway/paths.py), so both answer with the same types
built by the same functions (trainyard/rest_types.py).

    GET    /api/v1/training_runs?limit&offset               TrainingRunsResponse (the account's sessions, newest first)
    GET    /api/v1/training_runs/{run}                       TrainingRun
    GET    /api/v1/training_runs/{run}/checkpoints           CheckpointsListResponse
    DELETE /api/v1/training_runs/{run}/checkpoints/{kind}/{id}           delete
    POST   /api/v1/training_runs/{run}/checkpoints/{kind}/{id}/publish   publish (DELETE: unpublish)
    PUT    /api/v1/training_runs/{run}/checkpoints/{kind}/{id}/ttl       {"ttl_seconds": int | null}
    GET    /api/v1/training_runs/{run}/checkpoints/external_weights/{id}/external_weights_urls
    GET    /api/v1/checkpoints?limit&offset                  the account's checkpoints, newest first
    POST   /api/v1/weights_info                              {"tinker_path": ...} -> WeightsInfoResponse
    GET    /api/v1/sessions?limit&offset, /api/v1/sessions/{id}   the caller's Tinker client sessions in this gateway
                                                      (newest first) and the training runs each created
    GET    /api/v1/files/{token}                             a file of a checkpoint (no API key: the token is it)

A checkpoint's Tinker id is "weights/<checkpoint id>" (a training state) or "sampler_weights/<weight version id>";
its path "tinker://<run>/<that id>", where the run is the session (a job's checkpoint: the job). A path whose run is
not the checkpoint's is NOT_FOUND. Downloads (Tinker's get_external_weights_urls, which accepts only
"tinker://<run>/external_weights/<id>"): <id> is a checkpoint id or a weight version id; each file gets an
unguessable URL on this gateway, valid for URL_TTL_S, that streams the file through the scheduler's verified read and
checks it again against the manifest's sha256 as it goes (a mismatch cuts the response short of its Content-Length).
The URLs live in this process: a restarted gateway hands out new ones.
"""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import grpc
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from services.gateway import paths
from services.gateway.context import GatewayCaller, GatewayContext, read_json, route
from services.gateway.errors import GatewayError, bad_request, response
from trainyard import types
from trainyard.errors import TrainyardError, from_rpc_error
from trainyard.rest_client import RestClient
from trainyard.rest_types import STATE_PREFIX, WEIGHTS_PREFIX, checkpoint_path
from trainyard.v1 import scheduler_pb2

URL_TTL_S = 3600.0
EXTERNAL = "external_weights"
CHECKPOINT = "/api/v1/training_runs/{run}/checkpoints/{checkpoint_id:path}"


class TinkerRest(RestClient):
    """trainyard.RestClient naming checkpoints as Tinker does: the only difference between the two surfaces."""

    @staticmethod
    def _checkpoint(c: scheduler_pb2.Checkpoint) -> types.Checkpoint:
        tinker_path = paths.to_tinker(c.session_id or c.job_id, checkpoint_path(c))
        return types.Checkpoint.from_proto(c, tinker_path, tinker_path.split("/", 3)[3])

    def _by_path(self, tinker_path: str) -> scheduler_pb2.Checkpoint:
        run, kind, ident = paths.parse_tinker(tinker_path, "tinker_path")
        c = super()._by_path(paths.KINDS[kind] + ident)
        if run not in (c.session_id, c.job_id):
            raise TrainyardError("NOT_FOUND", f"training run {run} has no checkpoint {kind}/{ident}")
        return c

    def external(self, run: str, ident: str) -> scheduler_pb2.Checkpoint:
        """The checkpoint "tinker://<run>/external_weights/<ident>" names: ident a checkpoint or weight version id."""
        try:
            c = super()._by_path(STATE_PREFIX + ident)
        except TrainyardError as exc:
            if exc.code != "NOT_FOUND":
                raise
            c = super()._by_path(WEIGHTS_PREFIX + ident)
        if run not in (c.session_id, c.job_id):
            raise TrainyardError("NOT_FOUND", f"training run {run} has no checkpoint {ident}")
        return c


class Downloads:
    """Unguessable, expiring download URLs: token -> (the caller's key, checkpoint id, its file entry, expiry)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._urls: dict[str, tuple[str, str, scheduler_pb2.CheckpointFile, float]] = {}

    def issue(self, key: str, c: scheduler_pb2.Checkpoint) -> tuple[dict[str, str], datetime]:
        expires = time.monotonic() + URL_TTL_S
        now = time.monotonic()
        with self._lock:
            for token in [t for t, entry in self._urls.items() if entry[3] < now]:
                del self._urls[token]
            tokens = {}
            for f in c.files:
                tokens[f.path] = token = secrets.token_urlsafe(32)
                self._urls[token] = (key, c.id, f, expires)
        return tokens, datetime.now(timezone.utc) + timedelta(seconds=URL_TTL_S)

    def get(self, token: str) -> tuple[str, str, scheduler_pb2.CheckpointFile]:
        with self._lock:
            entry = self._urls.get(token)
        if entry is None or entry[3] < time.monotonic():
            raise GatewayError("NOT_FOUND", "this download URL is unknown or expired; ask for new ones "
                                            "(get_external_weights_urls)")
        return entry[:3]


def routes(ctx: GatewayContext) -> list[Route]:
    clients: dict[str, TinkerRest] = {}
    lock = threading.Lock()
    downloads = Downloads()

    def rest(caller: GatewayCaller) -> TinkerRest:
        with lock:
            if caller.key not in clients:
                clients[caller.key] = TinkerRest(ctx.service_client(caller))
            return clients[caller.key]

    def tinker_path(request: Request) -> str:
        return f"{paths.TINKER}{request.path_params['run']}/{request.path_params['checkpoint_id']}"

    # -- training runs ---------------------------------------------------------------------------------------------
    async def list_runs(request: Request, caller: GatewayCaller):
        limit, offset = _page(request, 20)
        return await rest(caller).list_training_runs(limit, offset, _scope(request), request.query_params.get(
            "project_id"))

    async def get_run(request: Request, caller: GatewayCaller):
        return await rest(caller).get_training_run(request.path_params["run"], _scope(request))

    async def list_run_checkpoints(request: Request, caller: GatewayCaller):
        return await rest(caller).list_checkpoints(request.path_params["run"])

    # -- checkpoints ---------------------------------------------------------------------------------------------
    async def delete_checkpoint(request: Request, caller: GatewayCaller):
        await rest(caller).delete_checkpoint_from_tinker_path(tinker_path(request))

    async def publish(request: Request, caller: GatewayCaller):
        await rest(caller).publish_checkpoint_from_tinker_path(tinker_path(request))

    async def unpublish(request: Request, caller: GatewayCaller):
        await rest(caller).unpublish_checkpoint_from_tinker_path(tinker_path(request))

    async def set_ttl(request: Request, caller: GatewayCaller):
        ttl = (await read_json(request)).get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int)):
            raise bad_request("ttl_seconds", f"must be an integer number of seconds or null, got {ttl!r}")
        await rest(caller).set_checkpoint_ttl_from_tinker_path(tinker_path(request), ttl)

    async def list_user_checkpoints(request: Request, caller: GatewayCaller):
        limit, offset = _page(request, 100)
        return await rest(caller).list_user_checkpoints(limit, offset)

    async def weights_info(request: Request, caller: GatewayCaller):
        path = (await read_json(request)).get("tinker_path")
        if not isinstance(path, str):
            raise bad_request("tinker_path", "required: the checkpoint's tinker:// path")
        return await rest(caller).get_weights_info_by_tinker_path(path)

    async def external_urls(request: Request, caller: GatewayCaller):
        kind, _, ident = request.path_params["checkpoint_id"].partition("/")
        if kind != EXTERNAL or not ident or "/" in ident:
            raise bad_request("checkpoint_id", f"expected '{EXTERNAL}/<checkpoint or weight version id>', got "
                                               f"{request.path_params['checkpoint_id']!r}")
        client = rest(caller)
        c = await client._submit(client.external, request.path_params["run"], ident)
        tokens, expires = downloads.issue(caller.key, c)
        base = str(request.base_url).rstrip("/")
        return types.ExternalWeightsUrlsResponse(urls={p: f"{base}/api/v1/files/{t}" for p, t in tokens.items()},
                                                 expires=expires)

    async def download(request: Request) -> Response:
        try:
            key, checkpoint_id, f = downloads.get(request.path_params["token"])
            stream = rest(GatewayCaller(account_id="", key=key)).client.checkpoint_chunks(checkpoint_id)
            chunks = _verified(stream, f, checkpoint_id)
            # The first chunk's errors (a checkpoint deleted or expired since) still answer with their status.
            first = await asyncio.to_thread(next, chunks, b"")
        except Exception as exc:  # noqa: BLE001 - answered as every gateway error is (errors.py)
            return response(from_rpc_error(exc) if isinstance(exc, grpc.RpcError) else exc)

        def body() -> Iterator[bytes]:
            yield first
            yield from chunks

        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"content-length": str(f.size_bytes), "x-sha256": f.sha256})

    # -- sessions: Tinker's client sessions (create_session), which live in this gateway ---------------------------
    async def list_sessions(request: Request, caller: GatewayCaller):
        limit, offset = _page(request, 20)
        _scope(request)
        owned = sorted(ctx.client_sessions.owned_by(caller.account_id).items(), key=lambda kv: -kv[1].created)
        return types.ListSessionsResponse(sessions=[sid for sid, _ in owned[offset:offset + limit]])

    async def get_session(request: Request, caller: GatewayCaller):
        _scope(request)
        session_id = request.path_params["session"]
        if ctx.client_sessions.find(caller.account_id, session_id) is None:
            raise GatewayError("NOT_FOUND", f"session_id: no session {session_id!r}", "session_id")
        runs = {m.client.model_id: None for m in ctx.models.owned_by(caller.account_id).values()
                if m.session_id == session_id}
        return types.GetSessionResponse(training_run_ids=list(runs), sampler_ids=[])

    # Most specific first: a checkpoint id spans two path segments, and Starlette tries the routes in order.
    return [
        route(ctx, "/api/v1/training_runs", list_runs, ("GET",)),
        route(ctx, CHECKPOINT + "/external_weights_urls", external_urls, ("GET",)),
        route(ctx, CHECKPOINT + "/publish", publish, ("POST",)),
        route(ctx, CHECKPOINT + "/publish", unpublish, ("DELETE",)),
        route(ctx, CHECKPOINT + "/ttl", set_ttl, ("PUT",)),
        route(ctx, CHECKPOINT, delete_checkpoint, ("DELETE",)),
        route(ctx, "/api/v1/training_runs/{run}/checkpoints", list_run_checkpoints, ("GET",)),
        route(ctx, "/api/v1/training_runs/{run}", get_run, ("GET",)),
        route(ctx, "/api/v1/checkpoints", list_user_checkpoints, ("GET",)),
        route(ctx, "/api/v1/weights_info", weights_info, ("POST",)),
        route(ctx, "/api/v1/sessions", list_sessions, ("GET",)),
        route(ctx, "/api/v1/sessions/{session}", get_session, ("GET",)),
        Route("/api/v1/files/{token}", download, methods=["GET"]),
    ]


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    out = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        value = request.query_params.get(name, str(default))
        if not value.isdigit() or len(value) > 9:
            raise bad_request(name, f"must be a non-negative integer, got {value!r}")
        out.append(int(value))
    return out[0], out[1]


def _scope(request: Request) -> str:
    scope = request.query_params.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise bad_request("access_scope", f"must be 'owned' or 'accessible', got {scope!r}")
    return scope


def _verified(stream, f: scheduler_pb2.CheckpointFile, checkpoint_id: str) -> Iterator[bytes]:
    """The file's bytes from a DownloadCheckpoint stream, hashed as they pass; bytes that are not the manifest's end
    the stream with DATA_LOSS (the client then holds fewer bytes than the Content-Length it was promised)."""
    digest, size = hashlib.sha256(), 0
    try:
        for chunk in stream:
            if chunk.path != f.path:
                continue
            digest.update(chunk.data)
            size += len(chunk.data)
            yield chunk.data
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    if size != f.size_bytes or digest.hexdigest() != f.sha256:
        raise TrainyardError("DATA_LOSS", f"checkpoint {checkpoint_id} file {f.path}: sent {size} bytes hashing to "
                                          f"{digest.hexdigest()}; the checkpoint holds {f.size_bytes} bytes hashing "
                                          f"to {f.sha256}")
