"""What the Playground, Deployments and Export pages compute, without Streamlit: the OpenAI endpoint's addresses and
the snippets that call it, a "Try it" call, the deployments table (multi-LoRA: adapters served together on one base),
export archives, and the Playground's conversations and token budget.

Kept apart from the page scripts so tests call it directly.
"""
from __future__ import annotations

import json
import os
import shlex
import tempfile
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dashboard.logic import when
from trainyard import Client, TrainyardError
from trainyard.client import _zip_dir, deployment_status_name
from trainyard.v1 import scheduler_pb2 as pb

OPENAI_PORT = 8000  # the rollout's OpenAI HTTP port in docker-compose.yml (TRAINYARD_OPENAI_PORT)
KEY_VAR = "TRAINYARD_API_KEY"  # the snippets read the key from this environment variable, never inline
TRY_TIMEOUT_S = 120.0
# OpenAI error statuses (docs/openai.md) -> the SDK's codes, so a failed "Try it" reads like every other error.
_HTTP_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 409: "FAILED_PRECONDITION",
               429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


# -- the OpenAI endpoint -----------------------------------------------------------------------------------------
def openai_url(rollout_url: str, env: Mapping[str, str] = os.environ) -> str:
    """The endpoint's public base URL, for the snippets: TRAINYARD_OPENAI_URL, else the rollout's host on port 8000."""
    if env.get("TRAINYARD_OPENAI_URL"):
        return env["TRAINYARD_OPENAI_URL"].rstrip("/")
    host = rollout_url.strip().removeprefix("https://").removeprefix("http://").rsplit(":", 1)[0] or "localhost"
    return f"http://{host}:{OPENAI_PORT}/v1"


def openai_internal_url(rollout_url: str, env: Mapping[str, str] = os.environ) -> str:
    """Where the dashboard itself calls the endpoint ("Try it"): TRAINYARD_OPENAI_INTERNAL_URL (a compose network
    name), else the public one."""
    return (env.get("TRAINYARD_OPENAI_INTERNAL_URL") or openai_url(rollout_url, env)).rstrip("/")


def openai_snippet(base_url: str, model: str, message: str = "Hello!") -> str:
    """Python with the OpenAI client (pip install openai); the key comes from the environment. Strings are written
    as JSON writes them: double-quoted, and valid Python. One argument a line, to fit the dashboard's code box."""
    q = json.dumps
    return (f"import os\n\nfrom openai import OpenAI\n\n"
            f"client = OpenAI(\n    base_url={q(base_url)},\n    api_key=os.environ[{q(KEY_VAR)}],\n)\n"
            f"reply = client.chat.completions.create(\n"
            f"    model={q(model)},\n"
            f"    messages=[{{\"role\": \"user\", \"content\": {q(message)}}}],\n"
            f"    max_tokens=128,\n)\n"
            f"print(reply.choices[0].message.content)\n")


def curl_snippet(base_url: str, model: str, message: str = "Hello!") -> str:
    """The same request with curl; the key comes from the environment (double quotes let the shell expand it). The
    body is spread over lines so that no line is wider than the dashboard's code box."""
    fields = {"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": 128}
    body = "{\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items()) + "\n  }"
    return (f"curl -s {shlex.quote(base_url + '/chat/completions')} \\\n"
            f"  -H \"Authorization: Bearer ${KEY_VAR}\" \\\n"
            f"  -H 'Content-Type: application/json' \\\n"
            f"  -d {shlex.quote(body)}\n")


def try_endpoint(base_url: str, api_key: str, model: str, message: str, max_tokens: int = 64) -> dict:
    """POST /chat/completions as the snippets do; the answer's JSON, or a TrainyardError with the endpoint's own
    message (and its status mapped to the SDK's code)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TRY_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise TrainyardError(_HTTP_CODES.get(exc.code, "INTERNAL"), f"HTTP {exc.code} from {base_url}: {message}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrainyardError("UNAVAILABLE", f"cannot reach the OpenAI endpoint at {base_url}: {reason}")


# -- deployments -------------------------------------------------------------------------------------------------
def deployments_frame(deployments: list[pb.Deployment]) -> pd.DataFrame:
    return pd.DataFrame([{"name": d.name, "status": deployment_status_name(d.status), "base model": d.base_model,
                          "serves": d.checkpoint_id or (f"lineage {d.lineage}" if d.lineage else ""),
                          "job": d.job_id, "error": d.error, "created (UTC)": when(d.created_at), "id": d.id}
                         for d in deployments], columns=["name", "status", "base model", "serves", "job", "error",
                                                         "created (UTC)", "id"])


def served_together(deployments: list[pb.Deployment], checkpoints: list[pb.Checkpoint]) -> dict[str, list[str]]:
    """Base model -> the live deployments of LoRA adapter checkpoints that the rollout serves on it at once
    (multi-LoRA: one copy of the base, each request batched with the others whatever adapter it names). A deployment
    of a full-parameter checkpoint is a whole model of its own, and a lineage's kind is not known here: both left out."""
    adapters = {c.id for c in checkpoints if c.kind == pb.CHECKPOINT_KIND_LORA_ADAPTER}
    out: dict[str, list[str]] = defaultdict(list)
    for d in deployments:
        if d.status in (pb.DEPLOYMENT_STATUS_READY, pb.DEPLOYMENT_STATUS_DEPLOYING) and d.checkpoint_id in adapters:
            out[d.base_model].append(d.name)
    return dict(out)


def checkpoint_label(c: pb.Checkpoint) -> str:
    origin = f"job {c.job_id}" if c.job_id else f"session {c.session_id}" if c.session_id else c.name
    loss = c.metrics.get("eval/loss", c.metrics.get("train/loss"))
    metric = f" · loss {loss:.4f}" if loss is not None else ""
    return f"{c.id} · {origin} · step {c.step}{' (final)' if c.final else ''}{metric}"


# -- export ------------------------------------------------------------------------------------------------------
def adapter_zip(client: Client, checkpoint_id: str) -> bytes:
    """The checkpoint's files (a PEFT adapter, or a whole model for full-parameter training) as a .zip, each file
    checked against the checkpoint's manifest as it arrives (client.download_checkpoint)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _zip_dir(client.download_checkpoint(checkpoint_id, Path(tmp)))


def merged_zip(client: Client, checkpoint_id: str) -> bytes:
    """The LoRA checkpoint merged into its base model by the server (ExportMergedModel), as a .zip of a Hugging Face
    model directory."""
    with tempfile.TemporaryDirectory() as tmp:
        return _zip_dir(client.export_merged_model(checkpoint_id, Path(tmp)))


# -- the Playground ----------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One answer in a column's conversation, with what it cost in the model's context."""

    text: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str


@dataclass
class Conversation:
    """A column's chat: the user's messages and the column's own answers (each column keeps its own history)."""

    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    @property
    def context_used(self) -> int:
        """Tokens the conversation already fills: the last prompt and what was generated after it."""
        return self.turns[-1].prompt_tokens + self.turns[-1].generated_tokens if self.turns else 0


def request_messages(conversation: Conversation, system: str, message: str) -> list[dict]:
    turns = [{"role": "system", "content": system}] if system.strip() else []
    return turns + conversation.messages + [{"role": "user", "content": message}]


def max_tokens_bound(max_positions: int, conversations: list[Conversation]) -> int:
    """The most new tokens any column can still take: the model's context less the longest conversation so far
    (the new message's own tokens are checked by the server, which names params.max_tokens if they do not fit)."""
    used = max((c.context_used for c in conversations), default=0)
    return max(1, max_positions - used - 1)
