"""Sampling a weight version by path ("trainyard://weights/<version id>", services/rollout/pinned.py): a real
weight-sync server in process, LoRA and full-weight versions on the shared engine, account scoping, and the bound
on full-weight versions held in memory.

Every check compares the engine's logprobs with a plain forward of the model holding the expected weights (fp32,
no cache: rollout_reference.naive_logprobs_TV), within 1e-5.
"""
import copy

import pytest
import torch

from models import load_pretrained, save_pretrained
from rollout_reference import write_adapter
from services.common.auth import create_account
from services.common.errors import FailedPrecondition, NotFound
from services.rollout.pinned import PinnedWeights
from test_rollout_weights import SAMPLE, Env, adapter_model, check_against
from trainyard.v1 import weightsync_pb2 as wpb


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    e = Env(tmp_path_factory.mktemp("pinned"), tiny_model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def other_key(env):
    return create_account(env.db, "bob")[2]


def base_dir(env):
    return lambda name: str(env.model_dir)


def test_lora_versions_are_served_exactly_and_only_to_their_account(env, engine, prompt_ids, other_key, tmp_path):
    v1_dir = write_adapter(env.model_dir, tmp_path / "v1", seed=21, b_scale=0.5)
    v2_dir = write_adapter(env.model_dir, tmp_path / "v2", seed=22, b_scale=0.5)
    v1 = env.publish("pin-lora", wpb.WEIGHT_KIND_LORA_ADAPTER, v1_dir)
    v2 = env.publish("pin-lora", wpb.WEIGHT_KIND_LORA_ADAPTER, v2_dir)
    pinned = PinnedWeights(engine, env.stub, tmp_path / "root")
    for version, directory in ((v1, v1_dir), (v2, v2_dir), (v1, v1_dir)):  # v1 stays v1 after v2 exists
        with pinned.using("acct-alice", env.key, version.id, base_dir(env)) as (served, meta):
            assert served.adapter_id == f"weights@{version.id}" and meta.version == version.version
            handle = engine.submit(served.model_dir, served.adapter_id, prompt_ids, SAMPLE)
        check_against(adapter_model(env.model_dir, directory), prompt_ids, handle.result().sequences)
    for key, version_id in ((other_key, v1.id), (env.key, "wv_unknown")):
        with pytest.raises(NotFound, match=version_id):
            with pinned.using("acct-other", key, version_id, base_dir(env)):
                pass


def test_ephemeral_versions_are_dropped_here_once_deleted(env, engine, prompt_ids, tmp_path):
    """An RL loop's sampler versions (ephemeral; the weight-sync service keeps a lineage's 4 newest): each served
    exactly while it lives; a deleted one is refused naming it, and its adapter and files leave this rollout when a
    newer version of the lineage arrives, so the rollout holds the live ones only."""
    pinned = PinnedWeights(engine, env.stub, tmp_path / "root")
    versions = []
    for i in range(6):
        directory = write_adapter(env.model_dir, tmp_path / f"e{i}", seed=40 + i, b_scale=0.5)
        versions.append(env.publish("pin-ephemeral", wpb.WEIGHT_KIND_LORA_ADAPTER, directory, ephemeral=True))
        with pinned.using("acct-alice", env.key, versions[-1].id, base_dir(env)) as (served, meta):
            assert meta.ephemeral
            handle = engine.submit(served.model_dir, served.adapter_id, prompt_ids, SAMPLE)
        check_against(adapter_model(env.model_dir, directory), prompt_ids, handle.result().sequences)
    live = {v.id for v in versions[2:]}
    assert {p.name for p in (tmp_path / "root" / "adapters").iterdir()} == live
    for gone in versions[:2]:
        with pytest.raises(FailedPrecondition, match=f"ephemeral weight version '{gone.id}'.*replaced"):
            with pinned.using("acct-alice", env.key, gone.id, base_dir(env)):
                pass


def test_full_versions_are_bounded_in_memory(env, engine, prompt_ids, tmp_path):
    model = load_pretrained(env.model_dir)
    dirs = []
    for i in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.01)
        save_pretrained(copy.deepcopy(model), tmp_path / f"full{i}")
        dirs.append(tmp_path / f"full{i}")
    versions = [env.publish("pin-full", wpb.WEIGHT_KIND_FULL, d) for d in dirs]
    pinned = PinnedWeights(engine, env.stub, tmp_path / "root", max_full_versions=1)
    model_dirs = {}
    for version, directory in zip(versions + versions[:1], dirs + dirs[:1]):  # the first is reloaded at the end
        with pinned.using("acct-alice", env.key, version.id, base_dir(env)) as (served, _):
            assert served.adapter_id is None
            model_dirs[version.id] = served.model_dir
            handle = engine.submit(served.model_dir, None, prompt_ids, SAMPLE)
        check_against(load_pretrained(directory), prompt_ids, handle.result().sequences)
        others = [d for v, d in model_dirs.items() if v != version.id]
        assert served.model_dir in engine.loaded_models()
        assert not set(others) & set(engine.loaded_models())  # at most one full version held
