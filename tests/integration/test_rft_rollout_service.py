"""A managed RFT job sampling through the platform (real scheduler, worker, rollout and weight-sync services on
Postgres and Redis): every policy version is published to the weight-sync service under the job's lineage, the job
samples from a deployment that follows it, each recorded sample names the weight versions its tokens came from and
they are the lineage's versions of its policy versions, and the deployment is deleted at the end (the lineage
stays)."""
from __future__ import annotations

import json
import grpc
import pytest

from services.common.channels import auth_metadata
from trainyard.v1 import rollout_pb2, rollout_pb2_grpc, scheduler_pb2 as pb, weightsync_pb2, weightsync_pb2_grpc

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]


@pytest.fixture()
def dataset(client, tmp_path):
    data = tmp_path / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return client.upload_dataset(data, name="arithmetic-svc")[0].id


def _samples(stack, job, tmp_path) -> list[dict]:
    """The recorded samples: state/rl_samples.jsonl of the final checkpoint's state (what resuming reads, kept in
    the object store beside the user's files)."""
    from services.common.blobstore import BlobStore, StoredFile
    from services.common.config import TrainyardSettings
    from services.common.db import Database
    from services.common.schema import Checkpoint

    settings = TrainyardSettings(**{k.removeprefix("TRAINYARD_").lower(): v for k, v in
                                                    stack.env_for("scheduler").items()
                                                    if k in ("TRAINYARD_DATA_DIR", "TRAINYARD_BLOB_DIR")})
    db = Database(stack.database_url)
    try:
        with db.session() as s:
            state = s.get(Checkpoint, job.output_checkpoint_id).state
    finally:
        db.dispose()
    root = BlobStore(settings.blob_dir).materialize([StoredFile.from_json(f) for f in state], tmp_path / "state")
    return [json.loads(line) for line in (root / "rl_samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rft_job_samples_through_a_deployment_that_follows_its_lineage(stack, client, api_key, dataset, mode,
                                                                        tmp_path):
    steps = 3
    job = client.create_rft_job("tiny-qwen3", dataset, "builtin:digit_share", steps=steps, full_parameter=True,
                                prompts_per_step=4, group_size=4, max_tokens=4, mode=mode, max_staleness=1,
                                learning_rate=1e-3, checkpoint_every=steps)
    done = client.wait_job(job.id, timeout_s=400)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error

    # The lineage: policy versions 0 .. steps (the last one, the final checkpoint's, for the user to deploy).
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(stack.url("weightsync")))
    versions = ws.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=job.id),
                               metadata=auth_metadata(api_key)).versions
    policy = {v.id: int(v.metadata["policy_version"]) for v in versions}
    assert sorted(policy.values()) == list(range(steps + 1)), versions
    assert all(v.kind == weightsync_pb2.WEIGHT_KIND_FULL and v.base_model == "tiny-qwen3" for v in versions)

    records = _samples(stack, done, tmp_path)
    assert len(records) == steps * 4 * 4
    for r in records:
        assert r["weight_version_ids"], r
        assert {policy[i] for i in r["weight_version_ids"]} == set(r["versions"]), (r, policy)
        assert 0 <= r["trainer_version"] - min(r["versions"]) <= (0 if mode == "sync" else 1), r
    rewards = [m for m in client.job_metrics(job.id) if "reward/mean" in m.values]
    assert [m.step for m in rewards] == list(range(1, steps + 1))
    assert all(m.values["staleness/max"] <= (0 if mode == "sync" else 1) and m.values["rollout/tokens_per_s"] > 0
               for m in rewards)

    # The job's deployment is gone, and unloaded; the lineage stays for the user to deploy.
    name = f"{job.id}-rollout"
    deps = [d for d in client.list_deployments(include_deleted=True) if d.name == name]
    assert deps and all(d.status == pb.DEPLOYMENT_STATUS_DELETED for d in deps), deps
    loaded = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(stack.url("rollout"))).ListLoaded(
        rollout_pb2.ListLoadedRequest(), metadata=auth_metadata(api_key)).models
    assert name not in [m.name for m in loaded]
    final = client.create_deployment(f"{job.id}-final", lineage=job.id)
    assert final.status == pb.DEPLOYMENT_STATUS_READY
    served = {m.name: m for m in rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(stack.url(
        "rollout"))).ListLoaded(rollout_pb2.ListLoadedRequest(), metadata=auth_metadata(api_key)).models}
    assert policy[served[final.name].weight_version_id] == steps
    client.delete_deployment(final.id)
