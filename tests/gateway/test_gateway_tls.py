"""`python -m services.gateway` with the service TLS settings serves HTTPS only, requiring a client certificate
signed by the client CA under mutual TLS (as the rollout's OpenAI endpoint: tests/services/common/test_common_tls.py).
/api/v1/healthz calls no other service, so none runs here."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from trainyard.localstack import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_gateway_serves_mutual_tls_only(tmp_path, pki):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINYARD_HOST": "127.0.0.1", "TRAINYARD_GATEWAY_PORT": str(port),
           "TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_TLS_CERT_FILE": str(pki["server"]),
           "TRAINYARD_TLS_KEY_FILE": str(pki["server.key"]), "TRAINYARD_TLS_CLIENT_CA_FILE": str(pki["ca"])}
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"https://127.0.0.1:{port}/api/v1/healthz"
        verify = ssl.create_default_context(cafile=pki["ca"])
        verify.load_cert_chain(pki["client"], pki["client.key"])
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(url, verify=verify, timeout=5).status_code == 200
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline and proc.poll() is None, "the gateway did not start"
                time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=ssl.create_default_context(cafile=pki["ca"]), timeout=5)  # no certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=5)  # plaintext
    finally:
        proc.terminate()
        proc.wait(30)
