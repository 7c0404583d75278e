"""The `trainyard` command line against the running services, as a user types it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.data import chat_rows, jsonl
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture()
def cli(stack, api_key, tmp_path):
    env = {**os.environ, "TRAINYARD_URL": stack.url("scheduler"), "TRAINYARD_ROLLOUT_URL": stack.url("rollout"),
           "TRAINYARD_API_KEY": api_key, "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "client.json"),
           "COLUMNS": "200"}

    def run(*args, ok=True):
        proc = subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], env=env, capture_output=True,
                              text=True, timeout=600)
        if ok:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc
    return run


def test_import_own_model_directory(cli, stack, tmp_path):
    from models.tiny import build_tiny_model

    # The compose file mounts the model volume at /models and allows imports only from there; locally that volume
    # is stack.models_dir.
    mine = build_tiny_model(stack.models_dir / "my-model")
    out = cli("models", "import", str(mine), "--name", "my-model").stdout
    assert "imported my-model: Qwen3ForCausalLM" in out
    assert "my-model" in cli("models", "list").stdout
    empty = stack.models_dir / "empty"
    empty.mkdir()
    bad = cli("models", "import", str(empty), ok=False)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "config.json" in bad.stderr
    missing = cli("models", "import", str(stack.models_dir / "nope"), ok=False)
    assert missing.returncode == 1 and "path" in missing.stderr
    outside = build_tiny_model(tmp_path / "elsewhere")
    refused = cli("models", "import", str(outside), ok=False)
    assert refused.returncode == 1 and f"under {stack.models_dir}" in refused.stderr.replace("\n", "")


def test_upload_train_watch_download_deploy_sample(cli, client, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from models import load_pretrained
    from models.lora import load_peft_adapter

    data = tmp_path / "train.jsonl"
    data.write_bytes(jsonl(chat_rows(8)))
    out = cli("datasets", "upload", str(data), "--name", "cli-data").stdout
    ds_id = out.split()[1]
    assert ds_id.startswith("ds_") and "sft_chat, 8 rows" in out
    preview = cli("datasets", "preview", ds_id, "--limit", "2").stdout.splitlines()
    assert json.loads(preview[0].split(" ", 1)[1]) == chat_rows(8)[0]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    failed = cli("datasets", "upload", str(bad), ok=False)
    assert failed.returncode == 1 and "row 1" in failed.stderr and "messages[0].content" in failed.stderr

    planned = cli("jobs", "plan", "--model", "tiny-qwen3", "--dataset", ds_id, "--max-steps", "6", "--lr", "5e-3",
                  "--checkpoint-every", "3", "--rank", "8").stdout
    assert "nothing created" in planned and "steps" in planned and "--rank" in planned and "(default)" in planned
    plan = json.loads(cli("jobs", "plan", "--model", "tiny-qwen3", "--dataset", ds_id, "--max-steps", "6",
                          "--rank", "8", "--json").stdout)
    assert (plan["total_steps"], plan["spec"]["sft"]["lora"]["rank"], plan["spec"]["sft"]["lora"]["alpha"]) == \
        ("6", 8, 32.0)
    rejected = cli("jobs", "plan", "--model", "tiny-qwen3", "--dataset", ds_id, "--lr", "-1", "--rank", "0", ok=False)
    assert rejected.returncode == 1 and "INVALID_ARGUMENT" in rejected.stderr
    assert "--lr (spec.sft.learning_rate)" in rejected.stderr and "--rank (spec.sft.lora.rank)" in rejected.stderr
    created = cli("jobs", "create", "--model", "tiny-qwen3", "--dataset", ds_id, "--max-steps", "6", "--lr", "5e-3",
                  "--checkpoint-every", "3", "--rank", "8", "--watch")
    assert "succeeded" in created.stdout and "6/6" in created.stdout
    job_id = created.stdout.split("job ")[1].split()[0]
    metrics = json.loads(cli("jobs", "metrics", job_id, "--json").stdout)
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3, 4, 5, 6]
    assert job_id in cli("jobs", "list").stdout

    ckpt = json.loads(cli("jobs", "get", job_id).stdout)["output_checkpoint_id"]
    adapter = tmp_path / "adapter"
    cli("checkpoints", "download", ckpt, str(adapter))
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # The downloaded adapter is a real PEFT adapter: peft on transformers gives Trainyard's logits (fp32, 1e-5).
    base = client.get_model("tiny-qwen3").path
    ids = torch.tensor([[1, 5, 17, 33, 60, 2, 9]])
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter))
    ours = load_pretrained(base)
    load_peft_adapter(ours, adapter)
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5, diff

    cli("deployments", "create", "cli-dep", "--job", job_id)
    assert "cli-dep" in cli("deployments", "list").stdout
    sampled = json.loads(cli("sample", "cli-dep", "What is 2 plus 2?", "--chat", "--temperature", "0",
                             "--max-tokens", "8", "--json").stdout)
    assert sampled["model"] == "cli-dep" and len(sampled["sequences"][0]["tokens"]) >= 1
    cli("deployments", "delete", "cli-dep")
    gone = cli("sample", "cli-dep", "hi", ok=False)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr


def test_cancel_and_resume_a_job(cli, client):
    ds, _ = client.upload_dataset(jsonl(chat_rows(8)), name="cli-resume")
    job = client.create_sft_job("tiny-qwen3", ds.id, max_steps=100000, checkpoint_every=100000, batch_size=1)
    refused = cli("jobs", "resume", job.id, ok=False)
    assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr and "is " in refused.stderr
    cli("jobs", "cancel", job.id)
    client.wait_job(job.id, timeout_s=120)
    out = cli("jobs", "resume", job.id).stdout
    assert f"job {job.id}: " in out and "continues from its latest checkpoint" in out
    assert not client.get_job(job.id).cancel_requested
    cli("jobs", "cancel", job.id)
    assert client.wait_job(job.id, timeout_s=120).status == pb.JOB_STATUS_CANCELLED


def test_upload_of_a_sharegpt_file_says_how_it_was_mapped(cli, tmp_path):
    data = tmp_path / "share.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"hi {i}"},
                                                            {"from": "gpt", "value": "hello"}]}) for i in range(3)))
    out = cli("datasets", "validate", str(data)).stdout
    assert "mapped: sharegpt -> sft_chat" in out and "valid: sft_chat, 3 rows" in out
    out = cli("datasets", "upload", str(data), "--name", "share").stdout
    assert "sft_chat, 3 rows" in out and "mapped: sharegpt -> sft_chat" in out


def test_cli_reports_auth_and_connection_errors(cli, stack, tmp_path):
    env = {**os.environ, "TRAINYARD_URL": stack.url("scheduler"), "TRAINYARD_API_KEY": "ty_wrong",
           "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "none.json")}
    proc = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "datasets", "list"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr and "Traceback" not in proc.stderr
    env["TRAINYARD_URL"] = "127.0.0.1:1"
    proc = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "whoami"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "cannot reach the server" in proc.stderr
