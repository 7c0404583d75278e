"""Deploy a job's adapter onto the rollout service, sample it by name, undeploy."""
from __future__ import annotations

import pytest

from tests.integration.data import chat_rows, jsonl
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained_job(stack, api_key):
    from trainyard import Client

    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=api_key) as c:
        ds, _ = c.upload_dataset(jsonl(chat_rows(8)), name="deploy-me")
        job = c.create_sft_job("tiny-qwen3", ds.id, max_steps=8, learning_rate=5e-3, checkpoint_every=4)
        done = c.wait_job(job.id, timeout_s=300)
        assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
        return done


def test_deploy_sample_undeploy(client, other_client, trained_job):
    dep = client.create_deployment("adder", job_id=trained_job.id)
    assert dep.status == pb.DEPLOYMENT_STATUS_READY and dep.checkpoint_id == trained_job.output_checkpoint_id
    assert dep.base_model == "tiny-qwen3" and dep.job_id == trained_job.id
    assert [d.name for d in client.list_deployments()].count("adder") == 1

    msgs = [{"role": "user", "content": "What is 3 plus 3?"}]
    tuned = client.sample("adder", messages=msgs, temperature=0, max_tokens=16)
    base = client.sample("tiny-qwen3", messages=msgs, temperature=0, max_tokens=16)
    assert tuned.model == "adder" and len(tuned.sequences) == 1
    seq = tuned.sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) >= 1 and all(lp <= 0 for lp in seq.logprobs)
    assert seq.tokens != base.sequences[0].tokens  # the adapter changes the model
    again = client.sample("adder", messages=msgs, temperature=0, max_tokens=16)
    assert again.sequences[0].tokens == seq.tokens  # greedy is deterministic

    seeded = [client.sample("adder", prompt="What is", temperature=1.0, top_p=0.9, top_k=50, seed=7, n=3,
                            max_tokens=8) for _ in range(2)]
    assert [s.tokens for s in seeded[0].sequences] == [s.tokens for s in seeded[1].sequences]

    with pytest.raises(TrainyardError) as exc:
        other_client.sample("adder", prompt="hi")
    assert exc.value.code == "NOT_FOUND"
    with pytest.raises(TrainyardError) as exc:
        other_client.delete_deployment("adder")
    assert exc.value.code == "NOT_FOUND"

    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("adder", job_id=trained_job.id)
    assert exc.value.code == "ALREADY_EXISTS"

    client.delete_deployment("adder")
    with pytest.raises(TrainyardError) as exc:
        client.sample("adder", prompt="hi")
    assert exc.value.code == "NOT_FOUND"
    assert "adder" not in [d.name for d in client.list_deployments()]
    assert "adder" in [d.name for d in client.list_deployments(include_deleted=True)]
    # The name can be used again, here for an intermediate checkpoint.
    first = client.list_checkpoints(trained_job.id)[0]
    redeployed = client.create_deployment("adder", checkpoint_id=first.id)
    assert redeployed.checkpoint_id == first.id and redeployed.status == pb.DEPLOYMENT_STATUS_READY
    client.delete_deployment(redeployed.id)


def test_deploy_errors(client, trained_job):
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("bad name!", job_id=trained_job.id)
    assert exc.value.code == "INVALID_ARGUMENT" and exc.value.violations[0].field == "name"
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("x", job_id=trained_job.id, checkpoint_id="ckpt_x")
    assert exc.value.code == "INVALID_ARGUMENT"
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("x", job_id="job_missing")
    assert exc.value.code == "NOT_FOUND"
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("x", checkpoint_id="ckpt_missing")
    assert exc.value.code == "NOT_FOUND"
    ds, _ = client.upload_dataset(jsonl(chat_rows(2)), name="never-trained")
    queued = client.create_sft_job("tiny-qwen3", ds.id, max_steps=1)
    client.cancel_job(queued.id)
    with pytest.raises(TrainyardError) as exc:
        client.create_deployment("x", job_id=queued.id)
    assert exc.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "params.temperature"), (dict(top_p=0.0), "params.top_p"),
    (dict(top_k=-1), "params.top_k"), (dict(max_tokens=0), "params.max_tokens"), (dict(n=0), "params.n"),
])
def test_bad_sampling_params(client, kwargs, field):
    with pytest.raises(TrainyardError) as exc:
        client.sample("tiny-qwen3", prompt="hello", **kwargs)
    assert exc.value.code == "INVALID_ARGUMENT" and field in exc.value.message


def test_unknown_model_is_not_found(client):
    with pytest.raises(TrainyardError) as exc:
        client.sample("no-such-model", prompt="hello")
    assert exc.value.code == "NOT_FOUND"


def test_rollout_down_fails_the_deployment_clearly_and_frees_the_name(stack, client, trained_job):
    stack.stop("rollout")
    try:
        with pytest.raises(TrainyardError) as exc:
            client.create_deployment("while-down", job_id=trained_job.id)
        assert exc.value.code == "UNAVAILABLE"
        assert exc.value.message.startswith("deployment 'while-down' failed: the rollout service could not load it")
        failed = client.get_deployment("while-down")
        assert failed.status == pb.DEPLOYMENT_STATUS_FAILED and failed.error
    finally:
        stack.start("rollout")
        stack.wait_ready("rollout")
    ready = client.create_deployment("while-down", job_id=trained_job.id)
    assert ready.status == pb.DEPLOYMENT_STATUS_READY and ready.id != failed.id
    assert client.sample("while-down", prompt="hi", max_tokens=2).sequences
    client.delete_deployment("while-down")


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_moe_families_train_deploy_and_sample(client, model):
    """The MoE families through the whole platform: a LoRA job on attention and every expert, deployed and sampled."""
    ds, _ = client.upload_dataset(jsonl(chat_rows(8)), name=f"for-{model}")
    job = client.create_sft_job(model, ds.id, max_steps=6, learning_rate=5e-3, lora_rank=4, checkpoint_every=3)
    done = client.wait_job(job.id, timeout_s=300)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    metrics = [p.values["train/loss"] for p in client.job_metrics(job.id) if "train/loss" in p.values]
    assert len(metrics) == 6 and metrics[-1] < metrics[0]
    dep = client.create_deployment(f"{model}-tuned", job_id=job.id)
    msgs = [{"role": "user", "content": "What is 3 plus 3?"}]
    tuned = client.sample(dep.name, messages=msgs, temperature=0, max_tokens=8)
    base = client.sample(model, messages=msgs, temperature=0, max_tokens=8)
    assert tuned.sequences[0].tokens and base.sequences[0].tokens
    assert tuned.sequences[0].logprobs != base.sequences[0].logprobs
    client.delete_deployment(dep.name)


def test_job_with_targets_the_model_lacks_is_rejected(client):
    ds, _ = client.upload_dataset(jsonl(chat_rows(2)), name="targets")
    with pytest.raises(TrainyardError) as exc:
        client.create_sft_job("tiny-qwen3", ds.id, target_modules=["kv_b_proj"])  # an MLA projection
    assert exc.value.code == "INVALID_ARGUMENT"
    assert exc.value.violations[0].field == "spec.sft.lora.target_modules" and "valid module names" in \
        exc.value.violations[0].reason
    job = client.create_sft_job("tiny-deepseek-v3", ds.id, target_modules=["kv_b_proj", "experts"], max_steps=1)
    client.cancel_job(job.id)
