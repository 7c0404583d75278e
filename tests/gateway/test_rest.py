"""The REAL `tinker` package's RestClient (pinned in requirements.lock) against the gateway's REST routes: training
runs and their checkpoints in Tinker's form, publishing (another account reads, never changes), TTL expiry, deletion,
and downloads through get_external_weights_urls checked against each file's sha256 in the checkpoint's manifest.

Most checkpoints are made with trainyard's drop-in SDK over gRPC (the same services the gateway calls), so what is
under test is the REST surface; the last test saves through the gateway with the tinker SDK itself and finds the
paths it got back among the run's checkpoints, and its client session with the run."""
from __future__ import annotations

import hashlib
import time
import urllib.request
import warnings

import pytest

import trainyard

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    tinker = pytest.importorskip("tinker", reason="the tinker package (requirements.lock) is not installed")

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
SEQ = [5, 17, 33, 60, 71, 88, 2]


def _trainyard(stack, key: str) -> trainyard.ServiceClient:
    return trainyard.ServiceClient(base_url=stack.url("trainer"), api_key=key, rollout_url=stack.url("rollout"),
                                   url=stack.url("scheduler"))


def _rest(stack, key: str):
    return tinker.RestClient(base_url=stack.gateway_url(), api_key=f"tml-{key}")


@pytest.fixture()
def saved(stack, api_key):
    """A trained session with a training state and sampler weights: (session id, state path, weights path)."""
    service = _trainyard(stack, api_key)
    tc = service.create_lora_training_client(BASE, rank=4, seed=5).result()
    datum = trainyard.Datum(model_input=trainyard.ModelInput.from_ints(SEQ[:-1]),
                            loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(trainyard.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("gw", user_metadata={"via": "gateway"}).result()
    weights = tc.save_weights_for_sampler("gw-w").result()
    tc.save_state("latest").result()  # the session's recorded state moves on: the first one can be deleted
    yield tc.model_id, state, weights
    service.close()


def _tinker_path(run: str, trainyard_path: str) -> str:
    kind = "weights" if trainyard_path.startswith("trainyard://state/") else "sampler_weights"
    return f"tinker://{run}/{kind}/{trainyard_path.rsplit('/', 1)[1]}"


def test_runs_and_checkpoints(stack, api_key, saved):
    run, state, weights = saved
    rest = _rest(stack, api_key)
    runs = rest.list_training_runs(limit=10).result()
    assert runs.training_runs[0].training_run_id == run and runs.cursor.total_count >= 1
    got = rest.get_training_run(run).result()
    assert (got.base_model, got.is_lora, got.lora_rank) == (BASE, True, 4)
    assert got.last_sampler_checkpoint.tinker_path == _tinker_path(run, weights.path)

    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    state_path, weights_path = _tinker_path(run, state.path), _tinker_path(run, weights.path)
    assert {state_path, weights_path} <= set(listed)
    assert listed[state_path].checkpoint_type == "training" and listed[state_path].user_metadata == {"via": "gateway"}
    assert listed[weights_path].checkpoint_type == "sampler" and listed[weights_path].size_bytes > 0
    parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(state_path)
    assert listed[state_path].checkpoint_id == parsed.checkpoint_id
    assert rest.get_training_run_by_tinker_path(weights_path).result().training_run_id == run
    info = rest.get_weights_info_by_tinker_path(state_path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE, True, 4)
    page = rest.list_user_checkpoints(limit=2).result()
    assert len(page.checkpoints) == 2 and page.cursor.total_count >= 3
    with pytest.raises(tinker.NotFoundError):  # a trainer session is not one of Tinker's client sessions
        rest.get_session(run).result()

    with pytest.raises(tinker.NotFoundError):  # a path whose run is not the checkpoint's
        rest.get_weights_info_by_tinker_path(f"tinker://sess_other/weights/{state.checkpoint_id}").result()
    with pytest.raises(tinker.BadRequestError):
        rest.set_checkpoint_ttl_from_tinker_path(state_path, -5).result()


def test_publish_ttl_delete(stack, api_key, other_api_key, saved):
    run, state, weights = saved
    mine, theirs = _rest(stack, api_key), _rest(stack, other_api_key)
    state_path, weights_path = _tinker_path(run, state.path), _tinker_path(run, weights.path)

    with pytest.raises(tinker.NotFoundError):
        theirs.get_weights_info_by_tinker_path(state_path).result()
    mine.publish_checkpoint_from_tinker_path(state_path).result()
    assert theirs.get_weights_info_by_tinker_path(state_path).result().base_model == BASE
    assert {c.public for c in mine.list_checkpoints(run).result().checkpoints
            if c.tinker_path == state_path} == {True}
    for change in (lambda: theirs.delete_checkpoint_from_tinker_path(state_path),
                   lambda: theirs.unpublish_checkpoint_from_tinker_path(state_path),
                   lambda: theirs.set_checkpoint_ttl_from_tinker_path(state_path, 3600)):
        with pytest.raises(tinker.NotFoundError):
            change().result()
    mine.unpublish_checkpoint_from_tinker_path(state_path).result()
    with pytest.raises(tinker.NotFoundError):
        theirs.get_weights_info_by_tinker_path(state_path).result()

    mine.set_checkpoint_ttl_from_tinker_path(weights_path, 1).result()
    time.sleep(1.2)
    with pytest.raises(tinker.NotFoundError):
        mine.get_weights_info_by_tinker_path(weights_path).result()
    mine.delete_checkpoint_from_tinker_path(state_path).result()
    remaining = {c.tinker_path for c in mine.list_checkpoints(run).result().checkpoints}
    assert state_path not in remaining and weights_path not in remaining


def test_download_through_external_weights_urls(stack, api_key, other_api_key, saved):
    run, state, _ = saved
    mine = _rest(stack, api_key)
    with trainyard.Client(url=stack.url("scheduler"), api_key=api_key) as client:
        manifest = {f.path: f for f in client.get_checkpoint(state.checkpoint_id).files}
    out = mine.get_external_weights_urls(f"tinker://{run}/external_weights/{state.checkpoint_id}").result()
    assert set(out.urls) == set(manifest) and out.expires.timestamp() > time.time() + 600
    for path, url in out.urls.items():
        with urllib.request.urlopen(url, timeout=30) as r:  # no API key: the URL is the credential
            data = r.read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (manifest[path].size_bytes, manifest[path].sha256)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(f"{stack.gateway_url()}/api/v1/files/not-a-token", timeout=30)
    assert exc.value.code == 404
    with pytest.raises(tinker.NotFoundError):  # not theirs, and not published
        _rest(stack, other_api_key).get_external_weights_urls(
            f"tinker://{run}/external_weights/{state.checkpoint_id}").result()


def test_what_the_tinker_sdk_saved_through_the_gateway(tinker_service, stack, api_key, other_api_key):
    # train_unembed=False: the tiny model ties its output layer to the embeddings, which the trainer refuses to adapt.
    tc = tinker_service.create_lora_training_client(BASE, rank=4, seed=1, train_unembed=False).result()
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(SEQ[:-1]),
                         loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("via-sdk", ttl_seconds=7200).result()
    sampler = tc.save_weights_for_sampler("via-sdk-w").result()
    rest = _rest(stack, api_key)
    run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(state.path).training_run_id
    assert run == tc.model_id
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert listed[state.path].checkpoint_type == "training" and listed[state.path].expires_at is not None
    assert listed[sampler.path].checkpoint_type == "sampler"
    assert rest.get_training_run(run).result().last_sampler_checkpoint.tinker_path == sampler.path

    session_id = tinker_service.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=100).result().sessions
    assert rest.get_session(session_id).result().training_run_ids == [run]
    with pytest.raises(tinker.NotFoundError):  # another account's client session
        _rest(stack, other_api_key).get_session(session_id).result()
    with pytest.raises(tinker.BadRequestError):
        rest.list_sessions(limit=-1).result()
