"""Corrupted-blob injection through the real services: bytes flipped in stored checkpoints are DATA_LOSS naming the
object on every read path (CLI download, deploy, a managed job's resume), `trainyard admin fsck` finds and
quarantines them, and staging files of killed processes are gone after the owners' restart."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import grpc
import pytest

from services.common.blobstore import BlobStore
from services.common.channels import auth_metadata
from services.common.db import Database
from services.common.schema import Checkpoint
from tests.integration.data import chat_rows, jsonl
from tests.integration.test_jobs import FAST, wait_until
from trainyard import TrainyardError
from trainyard.v1 import common_pb2, weightsync_pb2_grpc
from trainyard.v1 import scheduler_pb2 as pb
from trainyard.v1 import weightsync_pb2 as wpb

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def blobs(stack) -> BlobStore:
    return BlobStore(stack.data_dir / "blobs")


def cli(stack, *args: str, api_key: str = "") -> subprocess.CompletedProcess:
    env = stack.env_for("scheduler")
    env.update({"TRAINYARD_URL": stack.url("scheduler"), "TRAINYARD_API_KEY": api_key, "COLUMNS": "400"})
    return subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def staging_of(stack, pid: int) -> list:
    return list((stack.data_dir / "blobs" / "tmp").glob(f"proc-*-{pid}-*"))


def test_damaged_checkpoints_are_data_loss_on_every_read_path(stack, pg_url, client, api_key, tmp_path, flip_byte):
    ds, _ = client.upload_dataset(jsonl(chat_rows(16)), name="integrity")
    done = client.wait_job(client.create_sft_job("tiny-qwen3", ds.id, max_steps=4, checkpoint_every=2, **FAST).id,
                           timeout_s=300)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    ckpt = client.get_checkpoint(done.output_checkpoint_id)
    weights = next(f for f in ckpt.files if f.path == "adapter_model.safetensors")
    flip_byte(blobs(stack).path(weights.sha256), weights.size_bytes // 2)
    named = f"checkpoint {ckpt.id} file adapter_model.safetensors"

    # Download through the CLI: DATA_LOSS naming the checkpoint and file, no damaged file written.
    out = cli(stack, "checkpoints", "download", ckpt.id, str(tmp_path / "download"), api_key=api_key)
    assert out.returncode == 1 and "DATA_LOSS" in out.stderr and named in " ".join(out.stderr.split()), out.stderr
    assert list((tmp_path / "download").iterdir()) == []

    # Deploy: refused with DATA_LOSS, the deployment FAILED with the reason, never READY.
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("damaged", checkpoint_id=ckpt.id)
    assert exc.value.code == "DATA_LOSS" and f"{named}: blob {weights.sha256} is damaged" in exc.value.message
    dep = next(d for d in client.list_deployments(include_deleted=True) if d.name == "damaged")
    assert dep.status == pb.DEPLOYMENT_STATUS_FAILED and named in dep.error

    # Resume: a worker killed mid-job; the checkpoint the retry would resume from is damaged at rest.
    job = client.create_sft_job("tiny-qwen3", ds.id, max_steps=40, checkpoint_every=5, **FAST)
    wait_until(lambda: any(c.step >= 5 for c in client.list_checkpoints(job.id)), 180, "a checkpoint")
    worker_pid = stack.procs["worker"].popen.pid
    stack.kill("worker")
    assert staging_of(stack, worker_pid)  # the killed worker's scratch is still there
    latest = max(client.list_checkpoints(job.id), key=lambda c: c.step)
    db = Database(pg_url)  # the API shows a checkpoint's files; its state is in the row
    try:
        with db.session() as s:
            state = next(f for f in s.get(Checkpoint, latest.id).state if f["path"] == "optimizer.pt")
    finally:
        db.dispose()
    flip_byte(blobs(stack).path(state["sha256"]), 100)
    stack.start("worker")
    # Swept when the new worker starts (its log still holds the old worker's "ready", so wait for the sweep itself).
    wait_until(lambda: staging_of(stack, worker_pid) == [], 120, "the killed worker's staging swept")
    failed = client.wait_job(job.id, timeout_s=300)
    assert failed.status == pb.JOB_STATUS_FAILED and failed.attempts == 2
    assert f"DataLoss: checkpoint {latest.id} state file optimizer.pt: blob {state['sha256']} is damaged" \
        in failed.error

    # fsck: both damaged blobs and an orphan found; quarantined (moved, never deleted); exit 1 while rows name them.
    orphan, _ = blobs(stack).put_bytes(b"stored, then its save was killed")
    report = cli(stack, "admin", "fsck")
    assert report.returncode == 1, report.stdout + report.stderr
    lines = report.stdout.splitlines()
    assert any(line.startswith(f"damaged  {weights.sha256}:") and f"checkpoint {ckpt.id} (account" in line
               for line in lines), report.stdout
    assert any(line.startswith(f"damaged  {state['sha256']}:") for line in lines)
    assert f"orphan   {orphan}: no row names it" in lines
    moved = cli(stack, "admin", "fsck", "--quarantine")
    assert moved.returncode == 1 and "moved" in moved.stdout, moved.stdout + moved.stderr
    quarantine = blobs(stack).quarantine_dir
    assert all((quarantine / d).is_file() for d in (weights.sha256, state["sha256"], orphan))
    after = cli(stack, "admin", "fsck").stdout.splitlines()
    assert any(line.startswith(f"missing  {weights.sha256}: not in the object store; named by checkpoint {ckpt.id} ")
               for line in after), after
    assert not any(line.startswith(f"orphan   {orphan}") for line in after)


def test_a_killed_weight_sync_leaves_no_staging_behind(stack, api_key):
    """A publish cut by kill -9 leaves its staging file; the restarted service sweeps it."""
    data = os.urandom(3 << 20)
    first = data[:1 << 20]
    release = threading.Event()

    def requests():
        yield wpb.PublishVersionRequest(header=wpb.PublishVersionHeader(
            lineage="killed-mid-publish", kind=wpb.WEIGHT_KIND_LORA_ADAPTER, base_model="tiny-qwen3",
            files=[wpb.WeightFile(path="adapter_model.safetensors", sha256=hashlib.sha256(data).hexdigest(),
                                  size_bytes=len(data))]))
        yield wpb.PublishVersionRequest(chunk=common_pb2.FileChunk(
            path="adapter_model.safetensors", offset=0, data=first, sha256=hashlib.sha256(first).hexdigest()))
        release.wait(120)

    pid = stack.procs["weightsync"].popen.pid
    with grpc.insecure_channel(stack.url("weightsync")) as channel:
        stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
        call = stub.PublishVersion.future(requests(), metadata=auth_metadata(api_key), timeout=120)
        staged = wait_until(lambda: [p for d in staging_of(stack, pid) for p in d.glob("upload-*")
                                     if p.stat().st_size >= len(first)], 60, "the publish's staging file")
        stack.kill("weightsync")
        release.set()
        with pytest.raises(grpc.RpcError):
            call.result()
    try:
        assert staged[0].is_file()
    finally:
        stack.start("weightsync")
        stack.wait_ready("weightsync")
    assert staging_of(stack, pid) == []
