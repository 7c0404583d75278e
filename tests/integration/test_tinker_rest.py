"""trainyard.RestClient (Tinker 0.38's RestClient over gRPC) against the real services on the tiny model: runs and
their checkpoints as Tinker shows them, user metadata and TTL kept from the save, expiry (unreadable, then swept),
publishing (another account reads -- samples, loads, downloads -- but changes nothing), deletion and its refusals."""
from __future__ import annotations

import time

import pytest

import trainyard as tinker

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
SEQ = [5, 17, 33, 60, 71, 88, 2]


def _service(stack, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.url("trainer"), api_key=key, rollout_url=stack.url("rollout"),
                                url=stack.url("scheduler"))


@pytest.fixture()
def alice(stack, api_key):
    client = _service(stack, api_key)
    yield client
    client.close()


@pytest.fixture()
def mallory(stack, other_api_key):
    client = _service(stack, other_api_key)
    yield client
    client.close()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _gone(future) -> bool:
    try:
        future.result()
    except tinker.NotFoundError:
        return True
    return False


def _trained(service: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = service.create_lora_training_client(BASE, rank=4, seed=3).result()
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(SEQ[:-1]),
                         loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    return tc


def _sample(service: tinker.ServiceClient, path: str):
    sampler = service.create_sampling_client(model_path=path).result()
    return sampler.sample(tinker.ModelInput.from_ints(SEQ[:3]), 1, tinker.SamplingParams(max_tokens=2, seed=1)).result()


def test_runs_and_checkpoints_as_tinker_shows_them(alice):
    tc = _trained(alice)
    state = tc.save_state("mid", user_metadata={"stage": "sft"}).result()
    weights = tc.save_weights_for_sampler("w", ttl_seconds=3600).result()
    rest = alice.create_rest_client()

    runs = rest.list_training_runs(limit=50).result()
    assert runs.cursor.total_count >= 1 and runs.training_runs[0].training_run_id == tc.model_id  # newest first
    run = rest.get_training_run(tc.model_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank, run.corrupted) == (BASE, True, 4, False)
    assert run.last_checkpoint.tinker_path == state.path
    assert run.last_sampler_checkpoint.tinker_path == weights.path
    assert run.model_owner == rest.whoami().result().user_urn.rsplit(":", 1)[1]
    assert rest.get_training_run_by_tinker_path(weights.path).result().training_run_id == tc.model_id

    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(listed) == {state.path, weights.path}
    assert (listed[state.path].checkpoint_type, listed[state.path].user_metadata) == ("training", {"stage": "sft"})
    assert listed[state.path].checkpoint_id == state.checkpoint_id and listed[state.path].expires_at is None
    sampler = listed[weights.path]
    assert sampler.checkpoint_type == "sampler" and sampler.size_bytes > 0 and not sampler.public
    assert 3500 < (sampler.expires_at - sampler.time).total_seconds() <= 3601

    info = rest.get_weights_info_by_tinker_path(state.path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE, True, 4)
    page = rest.list_user_checkpoints(limit=1).result()
    assert len(page.checkpoints) == 1 and page.cursor.total_count >= 2
    assert page.checkpoints[0].tinker_path == weights.path  # newest first
    assert tc.model_id in rest.list_sessions(limit=100).result().sessions
    assert rest.get_session(tc.model_id).result().training_run_ids == [tc.model_id]

    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(state.path, 0).result()
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_training_runs(limit=5000).result()
    with pytest.raises(tinker.BadRequestError, match="user_metadata"):
        tc.save_state("bad", user_metadata={"k": "v" * 5000}).result()
    with pytest.raises(ValueError, match="tinker_path"):
        rest.get_weights_info_by_tinker_path("tinker://run/weights/x").result()
    with pytest.raises(AttributeError, match="copy_weights: not provided"):
        rest.copy_weights("x", "p")


def test_ttl_expiry_and_deletion(alice):
    tc = _trained(alice)
    rest = alice.create_rest_client()
    short = tc.save_state("short").result()
    weights = tc.save_weights_for_sampler("w").result()
    kept = tc.save_state("kept").result()  # the session's recorded state moves on from "short"
    rest.set_checkpoint_ttl_from_tinker_path(short.path, 1).result()
    time.sleep(1.2)
    assert _gone(rest.get_weights_info_by_tinker_path(short.path))  # expired: unreadable at once ...
    with pytest.raises(tinker.NotFoundError):
        alice.create_training_client_from_state(short.path).result()
    _wait(lambda: short.path not in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints},
          30, "the sweep")  # ... and swept

    # The open session's recorded state is in use; deleting it is refused, naming the session.
    with pytest.raises(tinker.UnprocessableEntityError, match=tc.model_id):
        rest.delete_checkpoint_from_tinker_path(kept.path).result()
    assert _sample(alice, weights.path).sequences
    rest.delete_checkpoint(tc.model_id, weights.checkpoint_id).result()
    assert _gone(rest.get_weights_info_by_tinker_path(weights.path))
    with pytest.raises(tinker.NotFoundError):
        _sample(alice, weights.path)  # the version goes with its checkpoint
    tc.close()
    rest.delete_checkpoint_from_tinker_path(kept.path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_published_checkpoints_are_readable_by_other_accounts_only_while_published(alice, mallory, tmp_path):
    tc = _trained(alice)
    state = tc.save_state("shared").result()
    weights = tc.save_weights_for_sampler("shared-w").result()
    tc.save_state("latest").result()
    mine, theirs = alice.create_rest_client(), mallory.create_rest_client()

    for path in (state.path, weights.path):  # not published: another account sees nothing
        assert _gone(theirs.get_weights_info_by_tinker_path(path))
    with pytest.raises(tinker.NotFoundError):
        _sample(mallory, weights.path)
    with pytest.raises(tinker.NotFoundError):
        mallory.create_training_client_from_state(state.path).result()

    for path in (state.path, weights.path):
        mine.publish_checkpoint_from_tinker_path(path).result()
    assert mine.get_weights_info_by_tinker_path(state.path).result().lora_rank == 4
    assert theirs.get_weights_info_by_tinker_path(state.path).result().base_model == BASE
    ours, copy = _sample(alice, weights.path), _sample(mallory, weights.path)
    assert ours.sequences[0].tokens == copy.sequences[0].tokens  # the same weights, seeded alike
    loaded = mallory.create_training_client_from_state(state.path).result()
    out = theirs.download_checkpoint(state.path, tmp_path / "dl").result()
    assert (out / "adapter_model.safetensors").is_file()  # each file checked against its sha256 on the way

    # Read-only for them: every change is NOT_FOUND, as for an object that is not theirs.
    for change in (theirs.unpublish_checkpoint_from_tinker_path(state.path),
                   theirs.set_checkpoint_ttl_from_tinker_path(state.path, 60),
                   theirs.delete_checkpoint_from_tinker_path(weights.path)):
        with pytest.raises(tinker.NotFoundError):
            change.result()
    assert state.path not in {c.tinker_path for c in theirs.list_user_checkpoints().result().checkpoints}

    # Their session started from it: the owner cannot delete it meanwhile, and is not told whose session it is.
    with pytest.raises(tinker.UnprocessableEntityError, match="a session of another account"):
        mine.delete_checkpoint_from_tinker_path(state.path).result()
    assert loaded.model_id not in mine.list_sessions(limit=1000).result().sessions
    loaded.close()

    for path in (state.path, weights.path):
        mine.unpublish_checkpoint_from_tinker_path(path).result()
    assert _gone(theirs.get_weights_info_by_tinker_path(state.path))
    with pytest.raises(tinker.NotFoundError):
        _sample(mallory, weights.path)
    assert _sample(alice, weights.path).sequences
    mine.delete_checkpoint_from_tinker_path(state.path).result()
