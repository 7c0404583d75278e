"""Typed configuration shared by every Trainyard process.

One mechanism for all of them: each component owns a pydantic-settings class (this file holds the common base), and
every field can be set from the environment (``TRAINYARD_<FIELD>``, nested with ``__``) or from a YAML file named by
``TRAINYARD_CONFIG`` (top-level keys are field names). Precedence: explicit arguments > environment > file > defaults.

The defaults are the embedded quickstart: SQLite and a filesystem Celery broker under ``data_dir``, so a machine with
no servers runs the whole platform. docker-compose.yml points the same fields at Postgres and Redis.
"""
from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)


def _config_file() -> Path | None:
    path = os.environ.get("TRAINYARD_CONFIG")
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"TRAINYARD_CONFIG={path} does not name a readable file")
    return p


class TrainyardSettings(BaseSettings):
    """Settings every process reads: where state lives and where the other services listen."""

    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", env_nested_delimiter="__", extra="ignore")

    data_dir: Path = Field(default=Path.home() / ".trainyard", description="Root of the embedded defaults.")
    database_url: str = Field(default="", description="SQLAlchemy URL; default sqlite:///<data_dir>/trainyard.db")
    blob_dir: Path | None = Field(default=None, description="Object store root; default <data_dir>/blobs")
    log_level: str = "INFO"
    # "json": one JSON object per record (time, level, logger, message, and the request, account, job and session ids
    # of the call or job it belongs to: services/common/logs.py); "text": the same as a line of plain text.
    log_format: Literal["text", "json"] = "text"
    # Prometheus metrics of this process at http://<host>:<metrics_port>/metrics (services/common/metrics.py); 0 turns
    # them off, so processes started outside compose take no fixed port. docker-compose.yml sets 9100 for every
    # service and publishes each on its own host port.
    metrics_port: int = Field(default=0, ge=0, le=65535)

    # Where each service listens (bind address) ...
    host: str = "0.0.0.0"
    scheduler_port: int = Field(default=50051, ge=0, le=65535)
    trainer_port: int = Field(default=50052, ge=0, le=65535)
    rollout_port: int = Field(default=50053, ge=0, le=65535)
    weightsync_port: int = Field(default=50054, ge=0, le=65535)
    # ... and how the services reach each other.
    scheduler_url: str = "127.0.0.1:50051"
    trainer_url: str = "127.0.0.1:50052"
    rollout_url: str = "127.0.0.1:50053"
    weightsync_url: str = "127.0.0.1:50054"

    # Threads serving RPCs per service. Long calls (WatchJob streams, ordered Training API calls waiting their turn)
    # hold one each; beyond twice this many calls in flight a service answers RESOURCE_EXHAUSTED instead of queueing.
    grpc_workers: int = Field(default=64, ge=1)
    # Quota: calls one account may have in flight on one service (each holds a serving thread while it runs or
    # waits, e.g. an ordered Training API call waiting for its turn). Beyond it the account's calls are refused with
    # RESOURCE_EXHAUSTED, so keep it below grpc_workers: the threads left over serve the other accounts.
    max_concurrent_calls_per_account: int = Field(default=32, ge=1)
    grpc_max_message_mb: int = Field(default=64, ge=4, le=2047)
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="How long SIGTERM waits for in-flight calls.")
    # CPU threads for torch in this process (0 = torch's default). Several processes sharing few cores run far
    # faster with 1 each than with every process spinning up a full thread pool.
    torch_threads: int = Field(default=0, ge=0)
    # How often a server stream (WatchJob, WatchLineage, downloads) re-checks its caller's API key: a revoked key's
    # open streams end with UNAUTHENTICATED within about this long.
    auth_recheck_s: float = Field(default=2.0, gt=0)

    # TLS (docs/security.md). All unset: plain TCP, the default for a local single-user install.
    # This service's certificate chain and private key (PEM): with both, its gRPC port (and the rollout's OpenAI HTTP
    # endpoint) speaks TLS only.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Mutual TLS: a client must present a certificate signed by this CA (PEM), or the handshake fails.
    tls_client_ca_file: Path | None = None
    # This process as a client of the other services (the SDK, the CLI and the dashboard read the same
    # TRAINYARD_TLS_* variables, trainyard/config.py): the CA their certificates are signed by and, for mutual TLS,
    # this process's own certificate and key.
    tls_ca_file: Path | None = None
    tls_client_cert_file: Path | None = None
    tls_client_key_file: Path | None = None

    @model_validator(mode="after")
    def _check_tls(self) -> "TrainyardSettings":
        for a, b in (("tls_cert_file", "tls_key_file"), ("tls_client_cert_file", "tls_client_key_file")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"{a} and {b} go together: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        return self

    def server_credentials(self):
        """grpc.ServerCredentials for this service's port, None for plain TCP."""
        if self.tls_cert_file is None:
            return None
        import grpc

        client_ca = self.tls_client_ca_file.read_bytes() if self.tls_client_ca_file else None
        return grpc.ssl_server_credentials([(self.tls_key_file.read_bytes(), self.tls_cert_file.read_bytes())],
                                           root_certificates=client_ca, require_client_auth=client_ca is not None)

    def channel_credentials(self):
        """grpc.ChannelCredentials for calls to the other services, None for plain TCP."""
        from trainyard.tls import channel_credentials

        return channel_credentials(self.tls_ca_file, self.tls_client_cert_file, self.tls_client_key_file)

    @model_validator(mode="after")
    def _fill_derived(self) -> "TrainyardSettings":
        self.data_dir = self.data_dir.expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'trainyard.db'}"
        if self.blob_dir is None:
            self.blob_dir = self.data_dir / "blobs"
        self.blob_dir = self.blob_dir.expanduser()
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    def apply_torch_threads(self) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)

    def ensure_dirs(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        assert self.blob_dir is not None
        self.blob_dir.mkdir(parents=True, exist_ok=True)


def https_kwargs(cert_file=None, key_file=None, client_ca_file=None) -> dict:
    """uvicorn's TLS arguments for an HTTP endpoint of a service (the rollout's OpenAI endpoint, the gateway): HTTPS
    with the service's certificate and key (the settings' tls_cert_file, tls_key_file), requiring a client
    certificate signed by client_ca_file when one is set; {} for plain HTTP."""
    if cert_file is None:
        return {}
    out = {"ssl_certfile": str(cert_file), "ssl_keyfile": str(key_file)}
    if client_ca_file is not None:
        out |= {"ssl_ca_certs": str(client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return out
