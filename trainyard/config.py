"""Where the SDK and CLI connect, and with which key.

Precedence: explicit arguments > environment (TRAINYARD_URL, TRAINYARD_ROLLOUT_URL, TRAINYARD_TRAINER_URL,
TRAINYARD_API_KEY, and for TLS TRAINYARD_TLS_CA_FILE, TRAINYARD_TLS_CLIENT_CERT_FILE, TRAINYARD_TLS_CLIENT_KEY_FILE:
the services' own names for them) > the file written by `trainyard login` (TRAINYARD_CLIENT_CONFIG or
~/.config/trainyard/client.json) > local defaults (plain TCP to 127.0.0.1).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_URL = "127.0.0.1:50051"
DEFAULT_ROLLOUT_URL = "127.0.0.1:50053"
DEFAULT_TRAINER_URL = "127.0.0.1:50052"  # the Training API (trainyard.training.ServiceClient)
# The environment variable of each address.
ENV = {"url": "TRAINYARD_URL", "rollout_url": "TRAINYARD_ROLLOUT_URL", "trainer_url": "TRAINYARD_TRAINER_URL"}


def config_path() -> Path:
    return Path(os.environ.get("TRAINYARD_CLIENT_CONFIG") or Path.home() / ".config" / "trainyard" / "client.json")


def cache_dir() -> Path:
    """Where the SDK keeps downloaded files (tokenizers): TRAINYARD_CACHE_DIR or ~/.cache/trainyard."""
    return Path(os.environ.get("TRAINYARD_CACHE_DIR") or Path.home() / ".cache" / "trainyard")


@dataclass
class ClientConfig:
    url: str = DEFAULT_URL
    rollout_url: str = DEFAULT_ROLLOUT_URL
    api_key: str = ""
    trainer_url: str = DEFAULT_TRAINER_URL
    # TLS (trainyard/tls.py): the CA that signed the servers' certificates; a certificate and key for mutual TLS.
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""

    @classmethod
    def resolve(cls, url: str | None = None, rollout_url: str | None = None, api_key: str | None = None,
                trainer_url: str | None = None, **tls: str | None) -> "ClientConfig":
        saved: dict = {}
        path = config_path()
        if path.is_file():
            saved = json.loads(path.read_text())
        files = {name: tls.get(name) or os.environ.get(f"TRAINYARD_{name.upper()}") or saved.get(name) or ""
                 for name in ("tls_ca_file", "tls_client_cert_file", "tls_client_key_file")}
        return cls(
            url=url or os.environ.get(ENV["url"]) or saved.get("url") or DEFAULT_URL,
            rollout_url=rollout_url or os.environ.get(ENV["rollout_url"]) or saved.get("rollout_url")
            or DEFAULT_ROLLOUT_URL,
            api_key=api_key or os.environ.get("TRAINYARD_API_KEY") or saved.get("api_key") or "",
            trainer_url=trainer_url or os.environ.get(ENV["trainer_url"]) or saved.get("trainer_url")
            or DEFAULT_TRAINER_URL,
            **files,
        )

    @staticmethod
    def given(name: str, value: str | None) -> bool:
        """Whether the address name ("url", "rollout_url") is set by an argument (value) or the environment, the
        two places that win over what a trainer advertises (trainyard.training.ServiceClient)."""
        return bool(value or os.environ.get(ENV[name]))

    def save(self) -> Path:
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds a secret
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        return path
