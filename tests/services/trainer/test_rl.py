"""The RL loop of managed RFT: its arithmetic against naive references, and short runs of the loop itself on the
tiny model (sync and async) with a plain Python reward."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from services.common.methods.rft import RftHyperparams
from services.trainer.engine import losses
from services.trainer.rl import algo
from services.trainer.rl.loop import SAMPLES_FILE, run_rft
from services.trainer.rl.rewards import Score, builtin, from_function
from services.trainer.rl.rollout import Sample, Segment
from services.trainer.sft import Checkpoint, Log, Metrics


def test_group_advantages_match_numpy():
    r = [1.0, 0.0, 0.5, 0.0]
    a = np.array(r)
    assert algo.group_advantages(r, "grpo") == pytest.approx(list((a - a.mean()) / (a.std() + 1e-6)), abs=1e-12)
    assert algo.group_advantages(r, "dr_grpo") == pytest.approx(list(a - a.mean()), abs=1e-12)  # no std
    assert algo.group_advantages([1.0, 1.0], "grpo") == [0.0, 0.0]
    assert algo.constant([0.3, 0.3, 0.3]) and not algo.constant([0.3, 0.3, 0.4])


def test_staleness_is_counted_from_the_oldest_version_of_any_token():
    s = Sample([Segment(3, [5, 6], [-1.0, -2.0]), Segment(4, [], []), Segment(5, [7], [-0.5])])
    assert s.tokens == [5, 6, 7] and s.token_versions == [3, 3, 5] and s.versions == [3, 5]
    assert algo.staleness(6, s.versions) == 3
    assert Sample([Segment(2, [], [])]).versions == [2]


def test_tis_weights_match_a_naive_loop():
    torch.manual_seed(0)
    p, q = -torch.rand(7) * 3, -torch.rand(7) * 3
    token = algo.tis_weights(p, q, "token", 2.0)
    seq = algo.tis_weights(p, q, "sequence", 1.5)
    for t in range(7):
        assert token[t].item() == pytest.approx(min(np.exp(p[t].item() - q[t].item()), 2.0), rel=1e-6)
    ratio = np.exp(sum(p[t].item() - q[t].item() for t in range(7)))
    assert seq.tolist() == pytest.approx([min(ratio, 1.5)] * 7, rel=1e-6)
    assert torch.equal(algo.tis_weights(p, q, "off", 2.0), torch.ones(7))


@pytest.mark.parametrize("loss", ["grpo", "dapo", "cispo"])
def test_tis_as_scaled_advantages_is_the_weighted_objective(loss):
    """The loop applies the TIS weight by scaling each token's advantage; for the min-clipped losses this is
    w * the per-token objective (w >= 0 constant), checked against the objective written out by hand (grpo,
    dapo) and, for cispo (linear in the advantage), against the weighted sum of one-token losses."""
    torch.manual_seed(1)
    T = 6
    q = -torch.rand(T)
    lp = (q + 0.3 * torch.randn(T)).requires_grad_(True)
    adv = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 2.0])
    w = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 0.25])
    cfg = losses.resolve_config(loss, {})
    inputs = {"target_tokens": torch.zeros(T, dtype=torch.int64), "logprobs": q, "advantages": adv * w,
              "mask": torch.ones(T)}
    loss_w, _ = losses.datum_loss(loss, cfg, lp, inputs)
    if loss in ("grpo", "dapo"):
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        r = torch.exp(lp.double() - q.double())
        naive = -sum(w[t] * torch.min(r[t] * adv[t], r[t].clamp(lo, hi) * adv[t]) for t in range(T))
        naive = naive / T if loss == "grpo" else naive
        assert loss_w.item() == pytest.approx(naive.item(), rel=1e-9)
    if loss == "cispo":  # linear in the advantage per token: sum_t w_t * loss_t(A_t)
        total = 0.0
        for t in range(T):
            one = {**inputs, "advantages": torch.where(torch.arange(T) == t, adv, torch.zeros(T))}
            total += w[t].item() * losses.datum_loss(loss, cfg, lp, one)[0].item()
        assert loss_w.item() == pytest.approx(total, rel=1e-9, abs=1e-12)


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]
    path = d / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _hp(**kw):
    return RftHyperparams.from_request({**dict(evaluator="builtin:digit_share", full_parameter=True, prompts_per_step=4,
                                                group_size=4, max_tokens=4, learning_rate=1e-3), **kw})


def _run(tiny_model_dir, data, tmp_path, hp, reward=None):
    return list(_collect(tiny_model_dir, data, tmp_path, hp, reward))


def _collect(tiny_model_dir, data, tmp_path, hp, reward):
    """The run's events; a checkpoint's samples file is read while it exists (before the next event)."""
    for ev in run_rft(tiny_model_dir, data, hp, reward=reward or builtin(hp.evaluator), stop=threading.Event(),
                      work_dir=tmp_path, torch_threads=1):
        if isinstance(ev, Checkpoint):
            ev.samples = [json.loads(line) for line in open(ev.checkpoint.state_dir / SAMPLES_FILE)]
        yield ev


def test_async_run_bounds_staleness_and_records_versions(tiny_model_dir, arithmetic, tmp_path):
    hp = _hp(steps=4, mode="async", max_staleness=2, checkpoint_every=2, tis="token")
    events = _run(tiny_model_dir, arithmetic, tmp_path, hp)
    metrics = [e for e in events if isinstance(e, Metrics)]
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    assert all(m.metrics["staleness/max"] <= 2 and m.metrics["samples/dropped_stale"] == 0 for m in metrics)
    assert max(m.metrics["staleness/max"] for m in metrics) >= 1  # sampling did run ahead of training
    assert all(0 < m.metrics["tis/weight_mean"] <= 2.0 for m in metrics)
    ckpts = [e for e in events if isinstance(e, Checkpoint)]
    assert [c.checkpoint.step for c in ckpts] == [2, 4] and ckpts[-1].final
    samples = [s for c in ckpts for s in c.samples]
    assert len(samples) == 4 * 4 * 4 and sorted({s["step"] for s in samples}) == [1, 2, 3, 4]
    for s in samples:  # every token's version is recorded; staleness from the oldest one
        assert s["staleness"] == s["trainer_version"] - min(v for v, _ in s["token_versions"]) <= 2
        assert s["versions"] == sorted({v for v, _ in s["token_versions"]})


def test_sync_run_trains_on_fresh_samples_and_survives_reward_errors(tiny_model_dir, arithmetic, tmp_path):
    def flaky(completion: str, row: dict) -> float:
        if row["answer"] % 3 == 0:
            raise ZeroDivisionError("boom")
        return float(len(completion))

    hp = _hp(steps=2, mode="sync", kl_coef=0.1, loss="dr_grpo", checkpoint_every=5)
    events = _run(tiny_model_dir, arithmetic, tmp_path, hp, reward=from_function(flaky))
    metrics = [e.metrics for e in events if isinstance(e, Metrics)]
    assert len(metrics) == 2 and all(m["staleness/max"] == 0 for m in metrics)
    assert all(m["kl/ref"] >= 0 and "train/loss" in m for m in metrics)
    errors = sum(m["reward/errors"] for m in metrics)
    logged = [e.message for e in events if isinstance(e, Log) and "reward error" in e.message]
    assert errors > 0 and logged and "ZeroDivisionError: boom" in logged[0]
    assert from_function(lambda c, r: "x")(["a"], [{}]) == [Score(None, "the reward is not a finite number: 'x'")]


def _lp(model, datum, deterministic=False):
    from services.trainer.engine.forward_backward import LossCall, LossRequest, run_call

    call = LossCall(model, [], LossRequest("cross_entropy", {}, 4096), backward=False, deterministic=deterministic,
                    device=torch.device("cpu"), lock=__import__("contextlib").nullcontext)
    with torch.no_grad():
        return run_call(call, [datum])[0][0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_router_replay_routes_the_trainer_forward(family_dirs, deterministic):
    """The rollout records the experts of every position ([T, L, K], models.moe.RouterReplay); a datum carrying
    them makes the engine's forward route to exactly those: its own routes give the same logprobs, other routes
    other ones."""
    from models import load_pretrained
    from models.moe import RouterReplay
    from services.trainer.engine.forward_backward import Datum, moe_layers

    model = load_pretrained(family_dirs["qwen3_moe"]).eval()
    tokens = torch.tensor([3, 17, 42, 8, 99, 5, 61, 7])
    recorder = RouterReplay.record()
    with torch.no_grad():
        model(tokens[None], routing=recorder)
    assert recorder.layers == moe_layers(model)
    own = recorder.stacked()[0]  # [T, L, K]
    inputs = {"target_tokens": torch.roll(tokens, -1), "weights": torch.ones(8)}
    plain = _lp(model, Datum(tokens, inputs), deterministic)
    replayed = _lp(model, Datum(tokens, inputs, routes=own), deterministic)
    num_experts = model.args.moe_args().num_experts
    other = ((own.long() + 1) % num_experts).to(own.dtype)
    rerouted = _lp(model, Datum(tokens, inputs, routes=other), deterministic)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    assert (rerouted - plain).abs().max() > 1e-4


def test_loop_replays_the_rollouts_routes_on_a_moe_model(family_dirs, arithmetic, tmp_path):
    hp = _hp(steps=1, router_replay=True, max_tokens=3)
    metrics = [e.metrics for e in _run(family_dirs["qwen3_moe"], arithmetic, tmp_path, hp) if isinstance(e, Metrics)]
    assert len(metrics) == 1 and metrics[0]["kl/k3_rollout_trainer"] < 1e-3
    with pytest.raises(ValueError, match="router_replay is for MoE models"):
        _run(family_dirs["qwen3"], arithmetic, tmp_path / "dense", hp)


def test_lora_run_hot_loads_each_adapter_version(tiny_model_dir, arithmetic, tmp_path):
    hp = _hp(steps=3, full_parameter=False, lora_rank=4, mode="async", max_staleness=1, partial_rollouts=False,
             checkpoint_every=3)
    events = _run(tiny_model_dir, arithmetic, tmp_path, hp)
    metrics = [e.metrics for e in events if isinstance(e, Metrics)]
    assert len(metrics) == 3 and all(m["staleness/max"] <= 1 for m in metrics)
    (ckpt,) = [e for e in events if isinstance(e, Checkpoint)]
    # without partial rollouts a sample is never spread over two versions
    assert all(len(s["versions"]) == 1 for s in ckpt.samples)
    # versions 1 and 2 were handed over as adapters (3, the last, is not sampled); the rollout removed the one it
    # replaced once it had loaded the next (unless it was stopped first)
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) in (["v2"], ["v1", "v2"])


def _sequence_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids[None])[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(1, ids[len(prompt):, None])[:, 0]


@pytest.mark.parametrize("partial", [True, False])
def test_a_weight_update_mid_batch_tags_every_token_with_its_version(tiny_model_dir, tmp_path_factory, partial):
    """Long samples in flight when version 1 lands: with partial rollouts each continues on version 1, and every
    token's recorded version is the one whose weights produced it (its sampled logprob is that model's, to float
    rounding); without, the tokens so far are discarded and the sample is redone on version 1 alone. (A sample that
    ends before the update lands, on a loaded machine, is wholly version 0 in both modes.)"""
    from safetensors.torch import save_file

    from models import load_pretrained
    from models.tiny import build_tiny_model
    from services.trainer.rl.rollout import RolloutProcess, SampleRequest

    other_dir = build_tiny_model(tmp_path_factory.mktemp("other"), seed=1)
    v0, v1 = load_pretrained(tiny_model_dir).eval(), load_pretrained(other_dir).eval()
    work = tmp_path_factory.mktemp("rollout")
    save_file({k: v.contiguous() for k, v in v1.named_parameters()}, str(work / "v1.safetensors"))
    rollout = RolloutProcess(tiny_model_dir, lora=False, work_dir=work, partial=partial, max_tokens=400,
                             temperature=1.0, torch_threads=1)
    try:
        prompt = [5, 17, 42]
        rollout.submit(0, [[SampleRequest(prompt, seed=99)]])
        rollout.result(0)  # the rollout has loaded the model and sampled
        rollout.submit(1, [[SampleRequest(prompt, seed=s) for s in range(3)]])
        time.sleep(0.5)  # decoding under way: 400 tokens take longer than that
        rollout.update(1, work / "v1.safetensors")
        (group,), stats = rollout.result(1)
    finally:
        rollout.close()
    models = {0: v0, 1: v1}
    for s in group:
        if partial:
            assert s.versions in ([0, 1], [1], [0])
        else:  # never a mix: redone on version 1, or (it ended before the update landed) wholly version 0
            assert s.versions in ([1], [0]) and all(seg.version == s.versions[0] for seg in s.segments)
        done: list[int] = []
        for seg in s.segments:
            if seg.tokens:
                expected = _sequence_logprobs(models[seg.version], prompt + done, seg.tokens)
                torch.testing.assert_close(torch.tensor(seg.logprobs), expected, rtol=0, atol=1e-4)
            done += seg.tokens
    if partial:
        assert any(s.versions == [0, 1] for s in group), [s.versions for s in group]
        assert stats.discarded_tokens == 0
    else:
        assert any(s.versions == [1] for s in group), [s.versions for s in group]
        assert stats.discarded_tokens > 0
