"""The Tinker wire-protocol HTTP gateway (docs/gateway.md): the unmodified `tinker` SDK over Trainyard's trainer and
rollout services.

A client of the services through Trainyard's own SDK (trainyard.ServiceClient, TrainingClient, SamplingClient), so
requests and results convert once, in trainyard/types.py, whose types carry Tinker's field names. One event loop
(uvicorn) serves every request; the SDK's blocking calls run in its worker threads and its futures complete there.

    python -m services.gateway          TRAINYARD_GATEWAY_PORT (8080), TRAINYARD_SCHEDULER_URL / _TRAINER_URL /
                                        _ROLLOUT_URL for the services
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.common import metrics
from services.common.config import https_kwargs
from services.common.logs import configure_logging
from services.gateway.context import GatewayContext
from services.gateway.routes import CoreRoutes
from services.gateway.settings import GatewaySettings

log = logging.getLogger("trainyard.gateway")

# The REST routes over checkpoints, training runs and sessions, when this checkout has them.
REST_ROUTES = "services.gateway.rest_routes"


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def build_app(ctx: GatewayContext) -> Starlette:
    routes = [Route("/api/v1/healthz", healthz, methods=["GET"]), *CoreRoutes(ctx).routes()]
    if importlib.util.find_spec(REST_ROUTES) is not None:
        routes += importlib.import_module(REST_ROUTES).routes(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        ctx.close()

    return Starlette(routes=routes, lifespan=lifespan, max_body_size=ctx.settings.max_body_mb * 2**20)


def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    log.info("Tinker wire-protocol gateway on port %d (trainer %s, rollout %s)", settings.gateway_port,
             settings.trainer_url, settings.rollout_url)
    if settings.metrics_port:
        metrics.serve(settings.host, settings.metrics_port)
    uvicorn.run(build_app(GatewayContext(settings)), host=settings.host, port=settings.gateway_port,
                log_config=None, access_log=False, ws="none", timeout_graceful_shutdown=settings.shutdown_grace_s,
                **https_kwargs(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file))
