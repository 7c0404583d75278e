"""What the Training API tells of its sessions and saves for Tinker's REST surface: ListSessions (paged, newest first,
the caller's only), the last request time and newest checkpoints of a session, the TTL and user metadata a save
keeps (bad ones refused by field, the session going on), and a published state another account may start from."""
from __future__ import annotations

import pytest
import torch

from api_helpers import ADAM, lora, random_tokens, sft_datum
from services.common.errors import InvalidArgument, NotFound
from services.common.schema import Checkpoint
from services.trainer.session_spec import CreateSpec
from services.trainer.session_states import SaveOptions


def _step(manager, account, sess) -> None:
    gen = torch.Generator().manual_seed(0)
    manager.forward(account, sess.id, 0, [sft_datum(random_tokens(gen, 9))], "", {}, backward=True)
    manager.optim_step(account, sess.id, 0, ADAM)


def test_list_sessions_pages_the_callers_sessions_newest_first(api_env):
    manager = api_env.manager()
    mine = [manager.create(api_env.alice, lora(rank=4, seed=i)) for i in range(3)]
    manager.create(api_env.bob, lora(rank=4))
    manager.close(api_env.alice, mine[0].id)
    page, total = manager.list_sessions(api_env.alice, 2, 0)
    assert total == 3 and [i.id for i in page] == [mine[2].id, mine[1].id]
    rest, _ = manager.list_sessions(api_env.alice, 2, 2)
    assert [(i.id, i.closed) for i in rest] == [(mine[0].id, True)]
    assert page[0].lora_rank == 4 and page[0].base_model == "tiny" and not page[0].closed
    for limit, offset, field in ((1001, 0, "limit"), (-1, 0, "limit"), (1, -1, "offset")):
        with pytest.raises(InvalidArgument) as exc:
            manager.list_sessions(api_env.alice, limit, offset)
        assert exc.value.violations[0].field == field


def test_a_session_reports_its_last_call_and_newest_checkpoints(api_env):
    published = []
    manager = api_env.manager(publish=lambda key, sess, directory, kind, checkpoint_id="": published.append(
        checkpoint_id) or f"wv_{len(published)}")
    sess = manager.create(api_env.alice, lora(rank=4))
    created = manager.describe(api_env.alice, sess.id)
    assert created.last_request_at == sess.created_at and created.last_state_checkpoint_id == ""
    _step(manager, api_env.alice, sess)
    state_id, _ = manager.save_state(api_env.alice, sess.id, 0, "s")
    weights_id, version_id, _ = manager.save_weights(api_env.alice, "ty_key", sess.id, 0, "w")
    info = manager.describe(api_env.alice, sess.id)
    assert info.last_request_at > sess.created_at
    assert (info.last_state_checkpoint_id, info.last_weights_checkpoint_id) == (state_id, weights_id)
    assert published == [weights_id]  # the version names its checkpoint ...
    with api_env.db.session() as s:  # ... and the checkpoint its version
        assert s.get(Checkpoint, weights_id).weight_version_id == version_id == "wv_1"
        assert s.get(Checkpoint, state_id).weight_version_id == ""
    (listed,), _ = manager.list_sessions(api_env.alice, 1, 0)
    assert (listed.id, listed.last_weights_checkpoint_id, listed.optim_steps) == (sess.id, weights_id, 1)


def test_saves_keep_ttl_and_user_metadata_and_refuse_bad_ones_by_field(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4))
    ckpt_id, _ = manager.save_state(api_env.alice, sess.id, 0, "kept",
                                    options=SaveOptions(ttl_seconds=3600, user_metadata=(("run", "a"),)))
    with api_env.db.session() as s:
        row = s.get(Checkpoint, ckpt_id)
        assert row.user_metadata == {"run": "a"}
        assert 3599 <= (row.expires_at.replace(tzinfo=None) - row.created_at.replace(tzinfo=None)).total_seconds() \
            <= 3601
    bad = ((SaveOptions(ttl_seconds=0), "ttl_seconds"),
           (SaveOptions(user_metadata=tuple((f"k{i}", "v") for i in range(65))), "user_metadata"),
           (SaveOptions(user_metadata=(("", "v"),)), "user_metadata"),
           (SaveOptions(user_metadata=(("k", "v" * 4097),)), "user_metadata['k']"))
    for options, field in bad:
        before = sess.next_seq_id
        with pytest.raises(InvalidArgument) as exc:
            manager.save_state(api_env.alice, sess.id, 0, "bad", options=options)
        assert exc.value.violations[0].field == field and sess.next_seq_id == before + 1  # its seq_id used up, nothing saved
    _step(manager, api_env.alice, sess)  # the session goes on


def test_another_account_starts_from_a_state_only_while_it_is_published(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4, seed=1))
    _step(manager, api_env.alice, sess)
    ckpt_id, path = manager.save_state(api_env.alice, sess.id, 0, "")
    with pytest.raises(NotFound):
        manager.create(api_env.bob, CreateSpec(from_state=path))
    with api_env.db.session() as s:
        s.get(Checkpoint, ckpt_id).public = True
    theirs = manager.create(api_env.bob, CreateSpec(from_state=path, with_optimizer=True))
    assert theirs.optim_steps == 1 and theirs.account_id == api_env.bob
    _step(manager, api_env.bob, theirs)  # their own session from then on
    with api_env.db.session() as s:
        s.get(Checkpoint, ckpt_id).public = False
    with pytest.raises(NotFound):
        manager.load_state(api_env.bob, theirs.id, 0, path, False)
