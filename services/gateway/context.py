"""What every gateway route shares: who the caller is, and the trainyard SDK clients that act for them.

Auth stays in the services: the SDK sends `X-API-Key: tml-<Trainyard key>`; the gateway strips "tml-" and passes the
key on to every gRPC call (`authorization: Bearer ty_...`), so the services authenticate and authorize each call as
they do the drop-in SDK's. The gateway asks the scheduler once per key who the caller is (WhoAmI, cached for
whoami_ttl_s) only to scope its own in-memory state (futures, sampling sessions, idempotency keys) by account.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common import metrics
from services.gateway.errors import GatewayError, classify, response
from services.gateway.settings import GatewaySettings
from services.gateway.state import (
    ClientSession,
    Futures,
    Idempotency,
    Model,
    Registry,
    SamplingSession,
    Sequencer,
    new_id,
)
from trainyard import Client, ServiceClient
from trainyard.errors import TrainyardError

log = logging.getLogger("trainyard.gateway")

KEY_HEADER = "x-api-key"
SESSION_ID = re.compile(r"session_[0-9a-f]{24}")  # what state.new_id("session") makes
KEY_PREFIX = "tml-"


@dataclass(frozen=True)
class GatewayCaller:
    account_id: str
    key: str  # the Trainyard key, "ty_..."


class GatewayContext:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._accounts: dict[str, tuple[str, float]] = {}  # key -> (account id, when asked)
        self._services: dict[str, ServiceClient] = {}
        self.futures = Futures(settings.max_pending_futures_per_account, settings.future_ttl_s)
        self.idempotency = Idempotency(settings.future_ttl_s)
        self.client_sessions = Registry("session")  # Tinker's client sessions (create_session)
        self.models = Registry("model")  # model id (= trainer session id) -> Model
        self.samplers = Registry("sampling session")  # sampling session id -> SamplingSession

    def _tls(self) -> dict[str, str | None]:
        s = self.settings
        return {name: str(getattr(s, name)) if getattr(s, name) else None
                for name in ("tls_ca_file", "tls_client_cert_file", "tls_client_key_file")}

    async def caller(self, request: Request) -> GatewayCaller:
        """The caller of a request, from its X-API-Key; GatewayError UNAUTHENTICATED (401) when missing or refused."""
        header = request.headers.get(KEY_HEADER, "")
        if not header.startswith(KEY_PREFIX) or len(header) == len(KEY_PREFIX):
            raise GatewayError("UNAUTHENTICATED", f"X-API-Key: expected '{KEY_PREFIX}<Trainyard API key>'")
        key = header[len(KEY_PREFIX):]
        with self._lock:
            known = self._accounts.get(key)
        if known is not None and time.monotonic() - known[1] < self.settings.whoami_ttl_s:
            return GatewayCaller(known[0], key)
        account_id = await asyncio.to_thread(self._whoami, key)
        with self._lock:
            self._accounts[key] = (account_id, time.monotonic())
        return GatewayCaller(account_id, key)

    def _whoami(self, key: str) -> str:
        client = Client(self.settings.scheduler_url, api_key=key, rollout_url=self.settings.rollout_url,
                        timeout_s=10, **self._tls())
        try:
            return client.whoami().id
        except TrainyardError as exc:
            if exc.code == "UNAUTHENTICATED":
                raise GatewayError("UNAUTHENTICATED", f"X-API-Key: {exc.message}") from None
            raise
        finally:
            client.close()

    def service_client(self, caller: GatewayCaller) -> ServiceClient:
        """The trainyard ServiceClient acting with caller's key (one per key, kept for the gateway's life)."""
        with self._lock:
            client = self._services.get(caller.key)
            if client is None:
                client = ServiceClient(url=self.settings.scheduler_url, base_url=self.settings.trainer_url,
                                       rollout_url=self.settings.rollout_url, api_key=caller.key, **self._tls())
                self._services[caller.key] = client
            return client

    def new_client_session(self, caller: GatewayCaller) -> str:
        session_id = new_id("session")
        self.client_sessions.put(session_id, ClientSession(caller.account_id))
        return session_id

    def client_session(self, caller: GatewayCaller, session_id: str) -> ClientSession:
        """The caller's client session. One this process never saw (made before a gateway restart: sessions live in
        memory) is taken up for the caller, so a running SDK goes on; another account's is NOT_FOUND."""
        with self._lock:
            session = self.client_sessions.find(caller.account_id, session_id)
            if session is None and SESSION_ID.fullmatch(session_id) and not self.client_sessions.known(session_id):
                session = ClientSession(caller.account_id)
                self.client_sessions.put(session_id, session)
        if session is None:
            raise GatewayError("NOT_FOUND", f"session_id: no session {session_id!r}", "session_id")
        return session

    def new_sampler(self, caller: GatewayCaller, client, base_model: str, model_path: str | None) -> str:
        sampler_id = new_id("sampler")
        self.samplers.put(sampler_id, SamplingSession(caller.account_id, client, base_model, model_path))
        return sampler_id

    async def model(self, caller: GatewayCaller, model_id: str) -> Model:
        """The caller's model: one this gateway created, or a trainer session of the caller's account it attaches
        to (after a gateway restart: the trainer checks the account, so another's is NOT_FOUND)."""
        model = self.models.find(caller.account_id, model_id)
        if model is not None:
            return model
        client = await asyncio.to_thread(self.service_client(caller).resume_training_client, model_id)
        with self._lock:
            model = self.models.find(caller.account_id, model_id)
            if model is None:
                model = Model(caller.account_id, client, Sequencer(None))
                self.models.put(model_id, model)
        return model

    def close(self) -> None:
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for client in services:
            client.close()


Handler = Callable[[Request, GatewayCaller], Awaitable[Any]]


def route(ctx: GatewayContext, path: str, handler: Handler, methods: tuple[str, ...] = ("POST",)) -> Route:
    """A Starlette route whose handler gets the authenticated caller and returns a Response, a dict or a pydantic
    model (answered as JSON); any error it raises is answered by errors.response."""
    async def endpoint(request: Request) -> Response:
        start = time.monotonic()
        answer = await _answer(request)
        status = str(answer.status_code)
        metrics.GATEWAY_REQUESTS.labels(path, status).inc()
        metrics.GATEWAY_SECONDS.labels(path, status).observe(time.monotonic() - start)
        return answer

    async def _answer(request: Request) -> Response:
        try:
            out = await handler(request, await ctx.caller(request))
        except Exception as exc:  # noqa: BLE001 - every error becomes the caller's answer (errors.py)
            err = classify(exc)
            if err.code == "INTERNAL":
                log.exception("%s %s failed", request.method, path)
            return response(err)
        if isinstance(out, Response):
            return out
        if isinstance(out, BaseModel):
            out = out.model_dump(mode="json")
        return JSONResponse(out)

    return Route(path, endpoint, methods=list(methods))


async def read_json(request: Request) -> dict:
    """The request's JSON object body; 400 when it is not one."""
    try:
        data = await request.json()
    except ValueError as exc:
        raise GatewayError("INVALID_ARGUMENT", f"body: not JSON ({exc})", "body") from None
    if not isinstance(data, dict):
        raise GatewayError("INVALID_ARGUMENT", "body: must be a JSON object", "body")
    return data
