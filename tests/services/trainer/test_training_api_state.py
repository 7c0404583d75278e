"""SaveState / LoadState / CreateSession(from_state) (services/trainer/engine/checkpoint.py): a saved state restores
weights and optimizer bit for bit, so training continues exactly as if it never stopped (LoRA and full-parameter
sessions, and a managed job's checkpoint opened as a session); a state that does not fit is INVALID_ARGUMENT naming
the field and changes nothing; another account's is NOT_FOUND."""
from __future__ import annotations

import socket
from dataclasses import replace

import grpc
import pytest
import torch
from safetensors.torch import load_file

from api_helpers import ADAM, grads, lora, random_tokens, same, sft_datum, weights
from models.lora import lora_state_dict
from services.common import fsck
from services.common.methods.sft import SftHyperparams
from services.common.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from services.common.schema import Checkpoint, new_id, utcnow
from services.trainer.app import make_publisher
from services.trainer.session_spec import CreateSpec, LoraSpec
from trainyard.v1.weightsync_pb2_grpc import WeightSyncServiceStub


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [sft_datum(random_tokens(gen, n)) for n in (14, 23, 9)]


def _steps(manager, account, sess, seeds, lr=1e-2):
    for seed in seeds:
        manager.forward(account, sess.id, 0, _data(seed), "", {}, backward=True)
        manager.optim_step(account, sess.id, 0, replace(ADAM, learning_rate=lr))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_resuming_from_a_saved_state_continues_bitwise(api_env, kind):
    spec = lora(rank=4, seed=3) if kind == "lora" else CreateSpec(base_model="tiny", full_parameter=True)
    lr = 1e-2 if kind == "lora" else 1e-3
    manager = api_env.manager()
    straight = manager.create(api_env.alice, spec)
    _steps(manager, api_env.alice, straight, [1, 2], lr)
    ckpt_id, path = manager.save_state(api_env.alice, straight.id, 0, "")
    assert path == f"trainyard://state/{ckpt_id}"
    _steps(manager, api_env.alice, straight, [3, 4], lr)
    probe = _data(9)
    want = manager.forward(api_env.alice, straight.id, 0, probe, "", {}, backward=False)

    manager_b = api_env.manager()  # a fresh trainer
    resumed = manager_b.create(api_env.alice, CreateSpec(from_state=path, with_optimizer=True))
    assert resumed.optim_steps == 2 and resumed.full_parameter == (kind == "full")
    _steps(manager_b, api_env.alice, resumed, [3, 4], lr)
    assert same(weights(resumed), weights(straight))
    assert same(manager_b.forward(api_env.alice, resumed.id, 0, probe, "", {}, backward=False)[0], want[0])
    assert resumed.optim_steps == straight.optim_steps == 4

    fresh_optimizer = manager_b.create(api_env.alice, CreateSpec(from_state=path))
    assert fresh_optimizer.optim_steps == 0 and len(fresh_optimizer.optimizer.state) == 0
    _steps(manager_b, api_env.alice, fresh_optimizer, [3, 4], lr)
    assert not same(weights(fresh_optimizer), weights(straight))  # Adam's moments and step counts did matter


def test_load_state_replaces_weights_and_optimizer_in_place(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    _steps(manager, api_env.alice, sess, [1, 2])
    saved = weights(sess)
    _, path = manager.save_state(api_env.alice, sess.id, 0, "two steps")
    _steps(manager, api_env.alice, sess, [3, 4])
    want = weights(sess)
    manager.forward(api_env.alice, sess.id, 0, _data(5), "", {}, backward=True)  # pending gradients get dropped
    info = manager.load_state(api_env.alice, sess.id, 0, path, with_optimizer=True)
    assert info is sess and sess.optim_steps == 2
    assert same(weights(sess), saved) and grads(sess) == [None] * len(sess.params)
    _steps(manager, api_env.alice, sess, [3, 4])
    assert same(weights(sess), want)
    # Without the optimizer: the weights only; the session's own AdamW state stays as it was.
    moments = [sess.optimizer.state[p]["exp_avg"].clone() for p in sess.params]
    manager.load_state(api_env.alice, sess.id, 0, path, with_optimizer=False)
    assert same(weights(sess), saved) and sess.optim_steps == 4
    assert same([sess.optimizer.state[p]["exp_avg"] for p in sess.params], moments)


def test_states_that_do_not_fit_are_refused_by_field(api_env):
    manager = api_env.manager()
    rank4 = manager.create(api_env.alice, lora(rank=4, seed=3))
    _steps(manager, api_env.alice, rank4, [1])
    _, path = manager.save_state(api_env.alice, rank4.id, 0, "")
    rank8 = manager.create(api_env.alice, lora(rank=8))
    attn = manager.create(api_env.alice, lora(rank=4, train_mlp=False))
    full = manager.create(api_env.alice, CreateSpec(base_model="tiny", full_parameter=True))
    with api_env.db.session() as s:  # a weights-only checkpoint (as SaveWeights stores)
        weights_only = Checkpoint(id=new_id("ckpt"), account_id=api_env.alice, session_id=rank4.id, kind="lora_adapter",
                                  base_model="tiny", files=[], created_at=utcnow())
        s.add(weights_only)
    before = {s.id: weights(s) for s in (rank8, attn, full)}
    cases = [
        (lambda: manager.load_state(api_env.alice, rank8.id, 0, path, True), "path", "lora.rank"),
        (lambda: manager.load_state(api_env.alice, attn.id, 0, path, True), "path", "lora.target_modules"),
        (lambda: manager.load_state(api_env.alice, full.id, 0, path, True), "path", "LoRA session"),
        (lambda: manager.load_state(api_env.alice, rank8.id, 0, "ckpt_x", True), "path", "trainyard://state/"),
        (lambda: manager.load_state(api_env.alice, rank8.id, 0, f"trainyard://state/{weights_only.id}", False),
         "path", "weights only"),
        (lambda: manager.create(api_env.alice, CreateSpec(from_state=path, lora=LoraSpec(rank=8))), "lora.rank",
         "rank is 4"),
        (lambda: manager.create(api_env.alice, CreateSpec(from_state=path, lora=LoraSpec(alpha=2.0))),
         "lora.alpha", "alpha"),
        (lambda: manager.create(api_env.alice, CreateSpec(from_state=path, lora=LoraSpec(train_mlp=False))),
         "lora.target_modules", "target_modules"),
        (lambda: manager.create(api_env.alice, CreateSpec(from_state=path, base_model="other")), "base_model",
         "tiny"),
        (lambda: manager.create(api_env.alice, CreateSpec(from_state=path, full_parameter=True)), "full_parameter",
         "LoRA"),
    ]
    for call, field, words in cases:
        with pytest.raises(InvalidArgument) as exc:
            call()
        assert [v.field for v in exc.value.violations] == [field] and words in str(exc.value), exc.value
    for s in (rank8, attn, full):
        assert same(weights(s), before[s.id]) and s.error == ""
    # Equal settings are accepted.
    same_lora = manager.create(api_env.alice, CreateSpec(from_state=path, base_model="tiny",
                                                          lora=LoraSpec(rank=4, alpha=32.0)))
    assert same(weights(same_lora), weights(rank4))
    # Another account's state does not exist for bob.
    bobs = manager.create(api_env.bob, lora(rank=4))
    with pytest.raises(NotFound):
        manager.load_state(api_env.bob, bobs.id, 0, path, True)
    with pytest.raises(NotFound):
        manager.create(api_env.bob, CreateSpec(from_state=path))


def test_a_managed_job_checkpoint_continues_in_a_session(api_env, chat_dataset, make_run, tmp_path):
    """Managed SFT and sessions share the engine's checkpoint format: a job's checkpoint, stored as the worker stores
    it, opens as a session (CreateSession(from_state)) with the job's adapter and AdamW state, bit for bit."""
    hp = SftHyperparams(lora_rank=4, lora_alpha=8.0, max_seq_len=64, learning_rate=2e-3, max_steps=3, batch_size=4,
                        checkpoint_every=100)
    hooks = make_run()
    hooks.run(api_env.model_dir, chat_dataset, hp, base_model_name="tiny", work_dir=tmp_path / "work")
    job_ckpt, final, _ = hooks.checkpoints[-1]
    assert final
    with api_env.db.session() as s:
        row = Checkpoint(id=new_id("ckpt"), account_id=api_env.alice, kind="lora_adapter", base_model="tiny",
                         step=job_ckpt.step, files=[f.to_json() for f in api_env.blobs.put_tree(job_ckpt.weights_dir)],
                         state=[f.to_json() for f in api_env.blobs.put_tree(job_ckpt.state_dir)], created_at=utcnow())
        s.add(row)
        ckpt_id = row.id
    manager = api_env.manager()
    sess = manager.create(api_env.alice, CreateSpec(from_state=f"trainyard://state/{ckpt_id}", with_optimizer=True))
    assert (sess.lora.rank, sess.lora.alpha, sess.optim_steps) == (4, 8.0, 3)
    saved = load_file(str(job_ckpt.weights_dir / "adapter_model.safetensors"))
    with sess.use() as model:
        assert same(lora_state_dict(model, sess.id), saved)
    optimizer = torch.load(job_ckpt.state_dir / "optimizer.pt", weights_only=True)
    assert same([sess.optimizer.state[p]["exp_avg"] for p in sess.params],
                [optimizer["state"][i]["exp_avg"] for i in range(len(sess.params))])
    _steps(manager, api_env.alice, sess, [1])  # and it trains on
    assert sess.optim_steps == 4


@pytest.mark.reliability
def test_a_damaged_state_is_data_loss_and_changes_nothing(api_env, flip_byte):
    """CreateSession(from_state) and LoadState verify the state's files while laying them out: DataLoss naming the
    checkpoint and the file, before anything changes (the session goes on, as after INVALID_ARGUMENT)."""
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    _steps(manager, api_env.alice, sess, [1])
    ckpt_id, path = manager.save_state(api_env.alice, sess.id, 0, "")
    with api_env.db.session() as s:
        optimizer = next(f for f in s.get(Checkpoint, ckpt_id).state if f["path"] == "optimizer.pt")
    flip_byte(api_env.blobs.path(optimizer["sha256"]), -3)
    _steps(manager, api_env.alice, sess, [2])
    before = weights(sess)
    damage = f"checkpoint {ckpt_id} state file optimizer.pt: blob {optimizer['sha256']} is damaged"
    with pytest.raises(DataLoss, match=damage):
        manager.load_state(api_env.alice, sess.id, 0, path, with_optimizer=True)
    with pytest.raises(DataLoss, match=damage):
        manager.create(api_env.alice, CreateSpec(from_state=path, with_optimizer=True))
    assert same(weights(sess), before) and sess.error == "" and sess.optim_steps == 2
    _steps(manager, api_env.alice, sess, [3])  # still usable
    assert sess.optim_steps == 3


@pytest.mark.reliability
def test_a_save_whose_publish_fails_leaves_no_orphan_blobs(api_env):
    """SaveWeights stores the files, then publishes them: when the weight-sync service cannot be reached, the call is
    UNAVAILABLE and the blobs it had stored are taken back; a later save keeps its own."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    channel = grpc.insecure_channel(target)
    manager = api_env.manager(publish=make_publisher(WeightSyncServiceStub(channel)))
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    _steps(manager, api_env.alice, sess, [1])
    try:
        with pytest.raises(Unavailable, match="not published"):
            manager.save_weights(api_env.alice, "ty_key", sess.id, 0, "")
    finally:
        channel.close()
    assert fsck.blob_files(api_env.blobs) == []
    manager.save_state(api_env.alice, sess.id, 0, "")
    report = fsck.check(api_env.blobs, api_env.db)
    assert report.blobs > 0 and report.findings == []


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_an_ephemeral_save_publishes_and_writes_nothing_else(api_env, kind):
    """SaveWeights with ephemeral (Tinker's save_weights_and_get_sampling_client): the weights go to the publisher
    marked ephemeral (a full-parameter session's as a complete model directory), no checkpoint row, no blob, no
    recorded state even with state_with_weights; closing the session deletes what it published ephemerally."""
    published, dropped = [], []

    def publish(api_key, sess, directory, kind, checkpoint_id="", ephemeral=False):
        published.append((kind, ephemeral, sorted(p.name for p in directory.iterdir())))
        return f"wv_{len(published)}"

    manager = api_env.manager(state_with_weights=True, publish=publish,
                              drop_ephemeral=lambda api_key, session_id: dropped.append((api_key, session_id)))
    spec = lora(rank=4, seed=3) if kind == "lora" else CreateSpec(base_model="tiny", full_parameter=True)
    sess, durable = manager.create(api_env.alice, spec), manager.create(api_env.alice, lora(rank=4, seed=4))
    _steps(manager, api_env.alice, sess, [1])
    assert manager.save_weights(api_env.alice, "ty_key", sess.id, 0, "", ephemeral=True) == (
        "", "wv_1", "trainyard://weights/wv_1")
    ((published_kind, ephemeral, files),) = published
    assert (published_kind, ephemeral) == ("lora_adapter" if kind == "lora" else "full", True)
    assert set(files) >= ({"adapter_config.json", "adapter_model.safetensors"} if kind == "lora" else
                          {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    with api_env.db.session() as s:
        assert s.query(Checkpoint).count() == 0
    assert fsck.blob_files(api_env.blobs) == []
    manager.save_weights(api_env.alice, "ty_key", durable.id, 0, "kept")  # a durable save: its session drops nothing
    manager.close(api_env.alice, durable.id, "ty_key")
    manager.close(api_env.alice, sess.id, "ty_key")
    assert dropped == [("ty_key", sess.id)]
