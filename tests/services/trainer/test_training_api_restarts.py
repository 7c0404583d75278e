"""Sessions that survive a trainer restart (services/trainer/sessions.py, "Restarts"): a new SessionManager over the
same database and blob store plays the restarted trainer. A graceful restart (begin_shutdown, record_all) loses
nothing, pending gradients included; a crash goes back to the last record (SaveState, SaveWeights, every k steps);
a session never recorded comes back as created; what cannot be restored says why. float32, CPU, one torch thread."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from alembic import command
from sqlalchemy import text

from api_helpers import ADAM, grads, lora, random_tokens, same, sft_datum, weights
from services.common.blobstore import BlobStore
from services.common.db import Database, alembic_config, migrate
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.schema import Checkpoint, TrainingSession, utcnow
from services.trainer.session_spec import CreateSpec


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [sft_datum(random_tokens(gen, n)) for n in (14, 23, 9)]


def _fb(manager, account, sess, seed):
    return manager.forward(account, sess.id, 0, _data(seed), "", {}, backward=True)


def _step(manager, account, sess, lr=1e-2):
    return manager.optim_step(account, sess.id, 0, replace(ADAM, learning_rate=lr))


def _moments(sess):
    return [{k: v.clone() for k, v in sess.optimizer.state[p].items()} for p in sess.params]


def _shutdown(manager) -> None:
    """What the trainer does on SIGTERM once its calls in flight are done."""
    manager.begin_shutdown()
    manager.record_all()


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_graceful_restart_loses_nothing(api_env, kind):
    spec = lora(rank=4, seed=3) if kind == "lora" else CreateSpec(base_model="tiny", full_parameter=True)
    lr = 1e-2 if kind == "lora" else 1e-3
    alice = api_env.alice
    straight_mgr, first = api_env.manager(), api_env.manager()
    straight, sess = straight_mgr.create(alice, spec), first.create(alice, spec)
    for manager, s in ((straight_mgr, straight), (first, sess)):
        _fb(manager, alice, s, 1)
        _step(manager, alice, s, lr)
        _fb(manager, alice, s, 2)  # gradients pending at the restart
    want = {"weights": weights(sess), "grads": grads(sess), "moments": _moments(sess), "seq": sess.next_seq_id}
    _shutdown(first)

    second = api_env.manager()  # the restarted trainer
    back = second.get(alice, sess.id)
    assert back.id == sess.id and back.next_seq_id == want["seq"] == 4 and back.optim_steps == 1
    assert same(weights(back), want["weights"]) and same(grads(back), want["grads"])
    assert all(same(a, b) for a, b in zip(_moments(back), want["moments"]))
    assert second.describe(alice, sess.id).next_seq_id == 4
    for manager, s in ((straight_mgr, straight), (second, back)):
        _step(manager, alice, s, lr)
        _fb(manager, alice, s, 3)
        _step(manager, alice, s, lr)
    assert same(weights(back), weights(straight)) and back.optim_steps == 3
    with api_env.db.session() as db:
        names = [c.name for c in db.query(Checkpoint).filter_by(session_id=sess.id)]
    assert names == [f"{sess.id}-shutdown-step1"]


def test_a_crash_goes_back_to_the_last_record(api_env):
    alice = api_env.alice
    first = api_env.manager(state_every_steps=2)
    sess = first.create(alice, lora(rank=4, seed=5))
    snapshots = {}
    for step in range(1, 4):  # seq_ids 1..6; recorded after step 2 (seq_id 4), expecting seq_id 5
        _fb(first, alice, sess, step)
        _step(first, alice, sess)
        snapshots[step] = (weights(sess), _moments(sess))
    _fb(first, alice, sess, 9)
    # No shutdown: the process died.
    second = api_env.manager(order_timeout_s=0.3)
    back = second.get(alice, sess.id)
    assert (back.next_seq_id, back.optim_steps) == (5, 2) and grads(back) == [None] * len(back.params)
    assert same(weights(back), snapshots[2][0])
    assert all(same(a, b) for a, b in zip(_moments(back), snapshots[2][1]))
    # A call past the lost ones waits in vain and says why; the lost seq_ids are the session's again, in order.
    with pytest.raises(FailedPrecondition, match="restored this session at seq_id 5"):
        second.forward(alice, back.id, 7, _data(1), "", {}, backward=True)
    with pytest.raises(InvalidArgument, match="already used"):
        second.forward(alice, back.id, 4, _data(1), "", {}, backward=True)
    _fb(second, alice, back, 3)
    _step(second, alice, back)
    assert same(weights(back), snapshots[3][0])


@pytest.mark.parametrize("save", ["save_state", "save_weights"])
def test_save_state_and_save_weights_record_the_session(api_env, save):
    alice = api_env.alice
    first = api_env.manager(state_with_weights=True, publish=lambda key, sess, directory, kind, ephemeral: "wv_1")
    sess = first.create(alice, lora(rank=4, seed=2))
    _fb(first, alice, sess, 1)
    _step(first, alice, sess)
    _fb(first, alice, sess, 2)  # pending: recorded with the state
    if save == "save_state":
        first.save_state(alice, sess.id, 0, "")
    else:
        first.save_weights(alice, "key", sess.id, 0, "")
    want = weights(sess), grads(sess)
    _step(first, alice, sess)  # lost with the crash
    back = api_env.manager().get(alice, sess.id)
    assert (back.next_seq_id, back.optim_steps) == (5, 1)
    assert same(weights(back), want[0]) and same(grads(back), want[1])


def test_save_weights_without_the_state_records_nothing(api_env):
    alice = api_env.alice
    first = api_env.manager(publish=lambda key, sess, directory, kind, ephemeral: "wv_1")
    sess = first.create(alice, lora(rank=4, seed=2))
    created = weights(sess)
    _fb(first, alice, sess, 1)
    _step(first, alice, sess)
    ckpt_id, _, _ = first.save_weights(alice, "key", sess.id, 0, "")
    with api_env.db.session() as db:
        assert db.get(Checkpoint, ckpt_id).state == []
    back = api_env.manager().get(alice, sess.id)
    assert back.next_seq_id == 1 and same(weights(back), created)


def test_sessions_never_recorded_come_back_as_created(api_env):
    alice = api_env.alice
    first = api_env.manager()
    source = first.create(alice, lora(rank=4, seed=11))
    _fb(first, alice, source, 1)
    _step(first, alice, source)
    _fb(first, alice, source, 3)  # the saved state holds gradients: source's own, no session created from it gets them
    _, path = first.save_state(alice, source.id, 0, "")
    sessions = {"fresh": first.create(alice, lora(rank=4, seed=11)),
                "full": first.create(alice, CreateSpec(base_model="tiny", full_parameter=True)),
                "from_state": first.create(alice, CreateSpec(from_state=path, with_optimizer=True)),
                "from_state_weights": first.create(alice, CreateSpec(from_state=path))}
    created = {k: (weights(s), s.optim_steps, _moments(s) if s.optim_steps else None) for k, s in sessions.items()}
    closed = first.create(alice, lora(rank=2))
    first.close(alice, closed.id)
    for s in sessions.values():  # each trains, then the trainer dies
        _fb(first, alice, s, 2)
        _step(first, alice, s, lr=1e-3)

    second = api_env.manager()
    second.restore_all(threading.Event())
    assert set(second._sessions) == {source.id, *(s.id for s in sessions.values())}
    for kind, s in sessions.items():
        back = second.get(alice, s.id)
        assert back.next_seq_id == 1 and back.optim_steps == created[kind][1], kind
        assert same(weights(back), created[kind][0]) and grads(back) == [None] * len(back.params), kind
    assert grads(second.get(alice, source.id)) != [None] * len(source.params)
    assert all(same(a, b) for a, b in zip(_moments(second.get(alice, sessions["from_state"].id)),
                                          created["from_state"][2]))
    assert len(second.get(alice, sessions["from_state_weights"].id).optimizer.state) == 0
    with pytest.raises(FailedPrecondition, match="closed"):
        second.get(alice, closed.id)


def test_what_cannot_be_restored_says_why(api_env):
    alice = api_env.alice
    first = api_env.manager()
    broken = first.create(alice, lora(rank=4, seed=1))
    _fb(first, alice, broken, 1)
    _step(first, alice, broken)
    ckpt_id, _ = first.save_state(alice, broken.id, 0, "")
    old = first.create(alice, lora(rank=4, seed=2))
    with api_env.db.session() as db:
        state = db.get(Checkpoint, ckpt_id).state
        db.get(TrainingSession, old.id).state_next_seq_id = 0  # as migration 0005 marks sessions held before it
    optimizer_blob = next(f["sha256"] for f in state if f["path"] == "optimizer.pt")
    api_env.blobs.path(optimizer_blob).unlink()

    second = api_env.manager()
    with pytest.raises(FailedPrecondition, match="lost when the trainer restarted") as exc:
        second.get(alice, broken.id)
    assert "optimizer.pt" in str(exc.value) or "No such file" in str(exc.value)
    assert "lost when the trainer restarted" in second.describe(alice, broken.id).error
    with pytest.raises(FailedPrecondition, match="did not record sessions"):
        second.get(alice, old.id)
    with pytest.raises(NotFound):  # another account's session is not restored for bob, nor named to him
        second.get(api_env.bob, old.id)
    # A lost session can be closed (no trainer tries it again); closing one not restored yet does not load it.
    assert second.close(alice, broken.id).closed
    waiting = first.create(alice, lora(rank=2, seed=4))
    third = api_env.manager()
    assert third.close(alice, waiting.id).closed and third._sessions == {}
    third.restore_all(threading.Event())
    assert set(third._sessions) == set()  # the lost ones stay lost; the closed ones stay closed


def test_a_record_that_fails_does_not_fail_the_step(api_env, tmp_path):
    alice = api_env.alice
    manager = api_env.manager(state_every_steps=1)
    sess = manager.create(alice, lora(rank=4, seed=1))
    broken = BlobStore(tmp_path / "broken")
    (tmp_path / "broken" / "tmp").rmdir()
    (tmp_path / "broken" / "tmp").write_text("")  # its staging directory is a file: every write fails
    manager.states.blobs = broken
    _fb(manager, alice, sess, 1)
    step, _ = _step(manager, alice, sess)
    assert step == 1 and sess.error == "" and sess.recorded_seq_id == 1
    _shutdown(manager)  # nor does shutdown fail: the session keeps its last record
    assert sess.recorded_seq_id == 1
    manager.states.blobs = api_env.blobs
    manager._stopping.clear()
    _fb(manager, alice, sess, 2)
    _step(manager, alice, sess)
    assert sess.recorded_seq_id == 5  # the next interval records again


def test_a_restarting_trainer_refuses_waiting_calls_unrun(api_env):
    alice = api_env.alice
    manager = api_env.manager()
    sess = manager.create(alice, lora(rank=4, seed=1))
    before = weights(sess)
    errors = []
    waiting = threading.Thread(target=lambda: errors.append(_catch(lambda: manager.optim_step(alice, sess.id, 2,
                                                                                              ADAM))))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # seq_id 2 waits for seq_id 1
    manager.begin_shutdown()
    waiting.join(10)
    assert not waiting.is_alive() and isinstance(errors[0], Unavailable) and "did not run" in str(errors[0])
    assert isinstance(_catch(lambda: _fb(manager, alice, sess, 1)), Unavailable)  # a new call: refused too
    assert sess.next_seq_id == 1 and same(weights(sess), before)


def test_sessions_held_before_revision_0005_are_marked_lost(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0004")
    db = Database(url)
    account = "acct_old"
    with db.session() as s:  # an account and a session row as revision 0004 has them (the ORM is the newest schema)
        s.execute(text("INSERT INTO accounts (id, name, created_at) VALUES (:a, 'alice', :t)"),
                  {"a": account, "t": utcnow()})
        s.execute(text("INSERT INTO training_sessions (id, account_id, base_model, lora_rank, lora_alpha, "
                       "target_modules, seed, full_parameter, from_state, created_at) VALUES ('sess_old', :a, 'tiny', "
                       "4, 32.0, '[]', 0, false, '', :t)"), {"a": account, "t": utcnow()})
    migrate(url)
    with db.session() as s:
        row = s.get(TrainingSession, "sess_old")
        assert (row.state_next_seq_id, row.state_checkpoint_id, row.state_with_optimizer) == (0, None, True)
    db.dispose()


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc
    return None
