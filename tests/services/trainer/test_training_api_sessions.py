"""Training API sessions (services/trainer/sessions.py): LoRA sessions share one frozen base, each an adapter with its
own optimizer; they interleave call by call (or run in parallel threads) and each ends bitwise where it would alone.
Lora defaults, account scoping, closing, full-parameter sessions. float32, CPU, one torch thread."""
from __future__ import annotations

from dataclasses import replace

import threading

import pytest
import torch

from api_helpers import ADAM, VOCAB, grads, lora, random_tokens, rl_datum, same, sft_datum, weights
from models.lora import adapter_names
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.trainer.session_spec import CreateSpec, LoraSpec


def _scripts():
    """Three sessions with different ranks, alphas, targets, seeds, losses and optimizer settings; each a list of
    calls (kind, arguments)."""
    gen = torch.Generator().manual_seed(7)
    sft = [sft_datum(random_tokens(gen, n), weights=torch.rand(n - 1, generator=gen).tolist()) for n in (9, 30, 17)]
    rl = [rl_datum(gen, n) for n in (12, 25, 6, 20)]
    masked = [rl_datum(gen, n, mask=True) for n in (12, 25, 6, 20)]
    k_data = []
    for n in (14, 22):
        tokens = random_tokens(gen, n)
        k_data.append(sft_datum(tokens, weights=torch.rand(n - 1, 3, generator=gen).tolist(),
                                k_targets=torch.randint(0, VOCAB, (n - 1, 3), generator=gen).tolist()))

    def fb(data, loss="cross_entropy", cfg=None, mbt=0):
        return ("fb", dict(data=data, loss_fn=loss, loss_fn_config=cfg or {}, micro_batch_tokens=mbt))

    def step(**kw):
        return ("step", replace(ADAM, **kw))

    fwd = ("fwd", dict(data=sft[:2], loss_fn="cross_entropy", loss_fn_config={}))
    return [
        ("alice", lora(rank=4, seed=1),
         [fb(sft), step(), fb(sft[:1]), fb(sft[1:], mbt=20), step(learning_rate=3e-3), fwd]),
        ("bob", lora(rank=8, alpha=16.0, seed=2),
         [fb(rl, "ppo"), step(learning_rate=5e-3, grad_clip_norm=0.5), fb(masked, "grpo", mbt=30),
          step(beta2=0.99), fb(masked[:2], "dapo", {"clip_high_threshold": 1.3}), step(), fwd]),
        ("alice", lora(rank=2, train_mlp=False, seed=3),
         [fb(k_data), step(learning_rate=2e-2, weight_decay=0.1), fb(k_data, mbt=16), step(), fwd]),
    ]


def _run(manager, account: str, sess, call, seq_id: int = 0):
    kind, args = call
    if kind == "step":
        return manager.optim_step(account, sess.id, seq_id, args)
    return manager.forward(account, sess.id, seq_id, backward=kind == "fb", **args)


def _alone(api_env, account: str, spec, calls):
    manager = api_env.manager()
    sess = manager.create(account, spec)
    results = [_run(manager, account, sess, c) for c in calls]
    return results, weights(sess)


def test_interleaved_sessions_match_each_alone_bitwise(api_env):
    scripts = _scripts()
    accounts = {"alice": api_env.alice, "bob": api_env.bob}
    manager = api_env.manager()
    sessions = [manager.create(accounts[who], spec) for who, spec, _ in scripts]
    assert [s.lora.rank for s in sessions] == [4, 8, 2]
    shared = manager.pool.loaded_bases()
    assert list(shared.values()) == [{s.id for s in sessions}]  # one base model for the three of them
    model = sessions[0].holder.model
    assert all(s.holder.model is model for s in sessions)
    results = [[] for _ in scripts]
    for i in range(max(len(calls) for _, _, calls in scripts)):  # call by call, round robin
        for n, ((who, _, calls), sess) in enumerate(zip(scripts, sessions)):
            if i < len(calls):
                results[n].append(_run(manager, accounts[who], sess, calls[i]))
    for (who, spec, calls), sess, got in zip(scripts, sessions, results):
        want, want_weights = _alone(api_env, accounts[who], spec, calls)
        assert same([r[0] for r in got if isinstance(r[0], list)], [r[0] for r in want if isinstance(r[0], list)])
        assert [r[1] for r in got] == [r[1] for r in want]  # metrics (and optimizer steps), exactly
        assert same(weights(sess), want_weights)
    for sess, (who, _, _) in zip(sessions, scripts):
        manager.close(accounts[who], sess.id)
    assert manager.pool.loaded_bases() == {}


def test_sessions_in_parallel_threads_match_each_alone_bitwise(api_env):
    scripts = _scripts()
    accounts = {"alice": api_env.alice, "bob": api_env.bob}
    manager = api_env.manager()
    sessions = [manager.create(accounts[who], spec) for who, spec, _ in scripts]
    results: list[list] = [[] for _ in scripts]
    errors = []

    def drive(n: int) -> None:
        who, _, calls = scripts[n]
        try:
            for seq_id, call in enumerate(calls, start=1):
                results[n].append(_run(manager, accounts[who], sessions[n], call, seq_id))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(n,)) for n in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (who, spec, calls), sess, got in zip(scripts, sessions, results):
        want, want_weights = _alone(api_env, accounts[who], spec, calls)
        assert [r[1] for r in got] == [r[1] for r in want]
        assert same(weights(sess), want_weights)


def test_lora_defaults_targets_and_bad_settings(api_env):
    manager = api_env.manager()
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    default = manager.create(api_env.alice, CreateSpec(base_model="tiny"))
    info = manager.info(default)
    assert (info.lora_rank, info.lora_alpha, list(info.target_modules)) == (32, 32.0, projections)
    assert (info.vocab_size, info.num_layers, info.hidden_size, info.architecture) == (VOCAB, 4, 128,
                                                                                      "Qwen3ForCausalLM")
    assert info.lineage == default.id and not info.full_parameter
    assert info.num_trainable_parameters == sum(p.numel() for p in default.params) > 0
    attn = manager.create(api_env.alice, lora(rank=4, train_mlp=False))
    assert list(attn.lora.target_modules) == projections[:4]
    mlp = manager.create(api_env.alice, lora(alpha=8.0, train_attn=False))
    assert list(mlp.lora.target_modules) == projections[4:] and mlp.lora.alpha == 8.0
    explicit = manager.create(api_env.alice, lora(target_modules=("q_proj", "down_proj"), train_mlp=False))
    assert list(explicit.lora.target_modules) == ["q_proj", "down_proj"]
    unembed = manager.create(api_env.alice, lora(rank=4, train_unembed=True))  # tiny ties lm_head to the embeddings
    assert list(unembed.lora.target_modules) == projections + ["lm_head"]
    bad = [
        (lora(rank=0), "lora.rank"),
        (lora(alpha=-1.0), "lora.alpha"),
        (lora(target_modules=("nope_proj",)), "lora.target_modules"),
        (lora(train_attn=False, train_mlp=False), "lora"),
        (CreateSpec(base_model="tiny", lora=LoraSpec(rank=4), full_parameter=True), "lora"),
        (CreateSpec(base_model="nope"), "base_model"),
        (CreateSpec(base_model="tiny", with_optimizer=True), "with_optimizer"),
    ]
    for spec, field in bad:
        with pytest.raises(InvalidArgument) as exc:
            manager.create(api_env.alice, spec)
        assert [v.field for v in exc.value.violations] == [field], exc.value
    assert len(adapter_names(default.holder.model)) == 5  # the failed creates left nothing behind


def test_sessions_are_invisible_to_other_accounts(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=2))
    data = [sft_datum([5, 6, 7, 8])]
    calls = [lambda: manager.describe(api_env.bob, sess.id), lambda: manager.close(api_env.bob, sess.id),
             lambda: manager.forward(api_env.bob, sess.id, 0, data, "", {}, backward=True),
             lambda: manager.optim_step(api_env.bob, sess.id, 0, ADAM),
             lambda: manager.save_state(api_env.bob, sess.id, 0, ""),
             lambda: manager.tokenizer_files(api_env.bob, sess.id),
             lambda: manager.describe(api_env.alice, "sess_unknown")]
    for call in calls:
        with pytest.raises(NotFound):
            call()
    assert sess.next_seq_id == 1 and grads(sess) == [None] * len(sess.params)


def test_close_removes_the_adapter_and_the_last_one_unloads_the_base(api_env):
    manager = api_env.manager()
    a = manager.create(api_env.alice, lora(rank=4, seed=1))
    b = manager.create(api_env.alice, lora(rank=4, seed=2))
    data = [sft_datum([5, 17, 33, 60, 2])]
    manager.forward(api_env.alice, b.id, 0, data, "", {}, backward=True)
    before = manager.forward(api_env.alice, b.id, 0, data, "", {}, backward=False)
    closed = manager.close(api_env.alice, a.id)
    assert closed.closed and closed.id == a.id
    assert adapter_names(b.holder.model) == [b.id]
    assert same(manager.forward(api_env.alice, b.id, 0, data, "", {}, backward=False)[0], before[0])
    with pytest.raises(FailedPrecondition, match="closed"):
        manager.forward(api_env.alice, a.id, 0, data, "", {}, backward=True)
    described = manager.describe(api_env.alice, a.id)
    assert described.closed and described.lora_rank == 4 and described.error == ""
    manager.close(api_env.alice, b.id)
    assert manager.pool.loaded_bases() == {}
    assert adapter_names(b.holder.model) == []


def test_full_parameter_session_trains_its_own_copy(api_env):
    manager = api_env.manager()
    shared = manager.create(api_env.alice, lora(rank=4))
    full = manager.create(api_env.alice, CreateSpec(base_model="tiny", full_parameter=True))
    assert full.holder.model is not shared.holder.model
    info = manager.info(full)
    assert info.full_parameter and info.lora_rank == 0 and list(info.target_modules) == []
    assert info.num_trainable_parameters == sum(p.numel() for p in full.holder.model.parameters())
    gen = torch.Generator().manual_seed(0)
    data = [sft_datum(random_tokens(gen, 12)), sft_datum(random_tokens(gen, 7))]
    base_before = manager.forward(api_env.alice, shared.id, 0, data, "", {}, backward=False)
    losses = []
    for _ in range(3):
        losses.append(manager.forward(api_env.alice, full.id, 0, data, "", {}, backward=True)[1]["loss:mean"])
        manager.optim_step(api_env.alice, full.id, 0, replace(ADAM, learning_rate=1e-3))
    assert losses[-1] < losses[0]
    assert same(manager.forward(api_env.alice, shared.id, 0, data, "", {}, backward=False)[0], base_before[0])
    assert list(manager.pool.loaded_bases().values()) == [{shared.id}]
    manager.close(api_env.alice, full.id)


def test_calls_run_in_seq_id_order(api_env):
    """A call with a later seq_id waits for the earlier ones; a used seq_id is refused."""
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=2))
    data = [sft_datum([5, 17, 33, 60, 2])]
    order = []

    def later():
        order.append(("step", manager.optim_step(api_env.alice, sess.id, 2, ADAM)[0]))

    t = threading.Thread(target=later)
    t.start()
    t.join(0.2)
    assert t.is_alive() and sess.next_seq_id == 1  # seq_id 2 waits for seq_id 1
    outputs, _ = manager.forward(api_env.alice, sess.id, 1, data, "", {}, backward=True)
    order.append(("fb", len(outputs)))
    t.join()
    assert order == [("fb", 1), ("step", 1)] and sess.next_seq_id == 3
    with pytest.raises(InvalidArgument, match="seq_id"):
        manager.forward(api_env.alice, sess.id, 2, data, "", {}, backward=False)
