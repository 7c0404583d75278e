"""The client alone (sdk/pyproject.toml: `pip install ./sdk[tokenizer]`) in a fresh virtual environment with no torch
and no services: the SDK trains and samples through the real trainer, and the CLI's client commands work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from trainyard import Client, ServiceClient, types

client = Client(url=sys.argv[1], api_key=sys.argv[3])
names = [m.name for m in client.list_models()]
with ServiceClient(base_url=sys.argv[2], api_key=sys.argv[3]) as service:
    tc = service.create_lora_training_client("tiny-qwen3", rank=4, seed=0).result()
    tokens = tc.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                        {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    tc.close()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "services", "models", "kernels"))
print(json.dumps({"models": names, "losses": losses, "loaded": loaded}))
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    out = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{ROOT / 'sdk'}[tokenizer]"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return venv


def test_the_sdk_trains_without_torch_or_the_services(client_venv, stack, api_key, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRAINYARD_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([str(client_venv / "bin" / "python"), "-c", SCRIPT, stack.url("scheduler"),
                          stack.url("trainer"), api_key], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "tiny-qwen3" in result["models"]
    assert result["losses"][-1] < result["losses"][0], result["losses"]
    assert result["loaded"] == [], result["loaded"]  # the client environment has none of them, and needs none


def test_the_cli_client_commands_without_the_server_install(client_venv, stack, api_key, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TRAINYARD_URL=stack.url("scheduler"), TRAINYARD_API_KEY=api_key,
               TRAINYARD_CLIENT_CONFIG=str(tmp_path / "client.json"))
    run = [str(client_venv / "bin" / "trainyard")]
    for args in (["whoami"], ["models", "list"], ["datasets", "list"], ["jobs", "list"]):
        out = subprocess.run(run + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-2000:])
    assert "tiny-qwen3" in subprocess.run(run + ["models", "list"], cwd=tmp_path, env=env, capture_output=True,
                                          text=True, timeout=120).stdout
