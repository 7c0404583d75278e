"""Gateway settings (env TRAINYARD_*, see services/common/config.py). The services it calls are the common
scheduler_url, trainer_url and rollout_url (and the TLS client files) of TrainyardSettings."""
from __future__ import annotations

from pydantic import Field

from services.common.config import TrainyardSettings


class GatewaySettings(TrainyardSettings):
    # The Tinker wire-protocol HTTP port (docs/gateway.md); docker-compose.yml publishes 8080.
    gateway_port: int = Field(default=8080, ge=0, le=65535)
    # Futures of one account not yet retrieved (running, queued or done): beyond this a new request is answered 429.
    max_pending_futures_per_account: int = Field(default=256, ge=1)
    # How long a retrieve_future waits for its result before answering try_again; a done future's result is kept
    # this long after it finished (then 410).
    long_poll_s: float = Field(default=30.0, gt=0)
    future_ttl_s: float = Field(default=3600.0, gt=0)
    # How long an API key's account id (scheduler WhoAmI) is trusted before it is asked again: a revoked key stops
    # working at the gateway within this long (the services refuse it at once).
    whoami_ttl_s: float = Field(default=30.0, gt=0)
    # Largest request body, and largest forward_backward body once zstd-decompressed (larger: 413 / 400). The SDK
    # keeps each forward_backward chunk near 5 MB before compression.
    max_body_mb: int = Field(default=256, ge=1)
    # Datums per forward_backward request the SDK sends (client config); larger batches come in several requests.
    fwdbwd_max_chunk_len: int = Field(default=1024, ge=1)
