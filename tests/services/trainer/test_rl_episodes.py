"""Multi-turn episodes in managed RFT (services/trainer/rl/episodes.py): the trained sequence and its masks against a
hand-built reference, the episodes the real rollout and the real evaluator sandbox produce (each action's logprobs
are the model's given everything before it), per-episode errors, and a short loop run with an Environment."""
from __future__ import annotations

import json
import textwrap
import threading

import pytest
import torch

from models import load_pretrained
from models.chat import encode_chat_prompt
from models.tokenizer import load_tokenizer
from services.common.methods.rft import RftHyperparams
from services.evaluators.sandbox import Limits, Sandbox, Score
from services.trainer.engine import losses
from services.trainer.rl.episodes import EpisodeRunner, Renderer, Trajectory
from services.trainer.rl.loop import SAMPLES_FILE, _RftRun, run_rft
from services.trainer.rl.rollout import RolloutProcess
from services.trainer.sft import Checkpoint, Log, Metrics

LIMITS = Limits(cpu_s=2, memory_mb=512, wall_s=3, max_processes=8)

# Arithmetic with a tool: the first observation is a question, each step answers whether the action held the
# answer's digit; "boom" in a row makes step raise, "bad_reset" makes reset raise, "nan" a non-numeric reward.
ENVIRONMENT = '''\
class Environment:
    def reset(self, row):
        if row.get("bad_reset"):
            raise RuntimeError("no such task")
        self.row, self.turn = row, 0
        return f" Q{row['a']}+{row['b']}?"

    def step(self, action):
        self.turn += 1
        if self.row.get("boom") and self.turn == 2:
            raise ValueError("the tool crashed")
        if self.row.get("nan"):
            return "x", float("nan"), False
        hit = str(self.row["a"] + self.row["b"]) in action
        return f" T{self.turn}", (0.5 if hit else 0.0) + 0.25 * self.turn, self.turn == 3
'''


def _hp(**kw):
    return RftHyperparams.from_request({"evaluator": "env", "full_parameter": True, "prompts_per_step": 2,
                                        "group_size": 2, "max_tokens": 4, "learning_rate": 1e-3, "max_turns": 2, **kw})


@pytest.fixture(scope="module")
def env_code(tmp_path_factory):
    d = tmp_path_factory.mktemp("env")
    (d / "evaluator.py").write_text(textwrap.dedent(ENVIRONMENT))
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [{"prompt": f"{a}+{b}=", "a": a, "b": b} for a in range(4) for b in range(4)]
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_observation_tokens_are_context_only(tiny_model_dir, data, tmp_path):
    """prompt + action1 + obs1 + action2: the datum's targets are the whole sequence; only the action tokens carry
    the advantage, the mask and the rollout's logprobs. For every RFT loss the loss and its gradient equal those of
    the hand-built reference datum that holds the action tokens alone, and observation positions get no gradient."""
    run = _RftRun(tiny_model_dir, [json.loads(line) for line in data.read_text().splitlines()], _hp(loss="grpo"), None, None,
                  threading.Event(), "tiny", tmp_path, 1)
    traj = Trajectory(prompt=[5, 17, 3], completion=[42, 8, 99, 5, 61, 7], mask=[1, 1, 0, 0, 1, 1],
                      logprobs=[-1.0, -2.0, 0.0, 0.0, -0.5, -0.25], token_versions=[0, 0, 1, 1], versions=[0, 1],
                      router_ids=None, text="")
    assert traj.actions == [0, 1, 4, 5]
    d = run._datum(traj, 1.5)
    assert d.tokens.tolist() == [5, 17, 3, 42, 8, 99, 5, 61]
    assert d.targets.tolist() == [17, 3, 42, 8, 99, 5, 61, 7]
    assert d.inputs["advantages"].tolist() == [0, 0, 1.5, 1.5, 0, 0, 1.5, 1.5]
    assert d.inputs["mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert d.inputs["logprobs"].tolist() == [0, 0, -1.0, -2.0, 0, 0, -0.5, -0.25]
    actions = torch.tensor([2, 3, 6, 7])
    torch.manual_seed(0)
    lp_all = -torch.rand(8) * 3
    for loss in ("grpo", "dapo", "gspo", "cispo", "dro", "dr_grpo"):
        run.hp = _hp(loss=loss)
        full = run._datum(traj, 1.5).inputs
        cfg = losses.resolve_config(loss, {})
        lp = lp_all.clone().requires_grad_(True)
        value, _ = losses.datum_loss(loss, cfg, lp, full)
        value.backward()
        reference = {"target_tokens": torch.tensor([42, 8, 61, 7]), "logprobs": torch.tensor([-1.0, -2.0, -0.5, -0.25]),
                     "advantages": torch.full((4,), 1.5)}
        if "mask" in losses.LOSS_FNS[loss].optional_inputs:
            reference["mask"] = torch.ones(4)
        ref_lp = lp_all[actions].clone().requires_grad_(True)
        ref_value, _ = losses.datum_loss(loss, cfg, ref_lp, reference)
        ref_value.backward()
        assert value.item() == pytest.approx(ref_value.item(), rel=1e-12, abs=1e-15), loss
        grad = lp.grad.clone()
        torch.testing.assert_close(grad[actions], ref_lp.grad, rtol=1e-6, atol=0)
        grad[actions] = 0
        assert torch.count_nonzero(grad) == 0, (loss, lp.grad)  # prompt and observations: no gradient
    # a single-turn sample is the trajectory of one action: all ones
    from services.trainer.rl.rollout import Sample, Segment
    single = Trajectory.single([5, 17], Sample([Segment(0, [42, 8], [-1.0, -2.0])], "stop"), "x")
    assert (single.completion, single.mask, single.logprobs) == ([42, 8], [1, 1], [-1.0, -2.0])


def test_chat_observations_are_user_turns_of_the_template(tiny_model_dir):
    """A messages row: obs0 is one more user message before the generation prompt; a later observation, after an
    action that ends in the end-of-turn token, is what the template renders for a user turn and the next
    generation prompt: together, token for token, the template's rendering of the whole conversation."""
    tok = load_tokenizer(tiny_model_dir)
    renderer = Renderer(tok)
    row = {"messages": [{"role": "user", "content": "Play."}]}
    first = renderer.initial(row, encode_chat_prompt(tok, row["messages"]), "Guess 1-9.")
    action = tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    tokens = first + action + renderer.observation(row, "higher")
    convo = row["messages"] + [{"role": "user", "content": "Guess 1-9."}, {"role": "assistant", "content": "5"},
                               {"role": "user", "content": "higher"}]
    assert tokens == encode_chat_prompt(tok, convo)
    plain = {"prompt": "2+2="}
    assert renderer.initial(plain, [7, 8], " Q") == [7, 8] + tok.encode(" Q", add_special_tokens=False)
    assert renderer.observation(plain, "") == [] and renderer.initial(plain, [7, 8], "") == [7, 8]


def _sequence_logprobs(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(context + tokens)
    with torch.no_grad():
        logits = model(ids[None])[0].float()
    return torch.log_softmax(logits[len(context) - 1:-1], dim=-1).gather(1, ids[len(context):, None])[:, 0]


def test_episodes_from_the_rollout_and_the_sandbox(tiny_model_dir, env_code, tmp_path):
    """Three turns at most: each action is sampled from prompt + obs0 + earlier actions and observations (its
    logprobs are the model's given exactly that context), the reward is the sum of the steps', done ends an episode,
    and an env error (reset, a step, a non-number) ends that episode alone with reward 0 and the error."""
    tok = load_tokenizer(tiny_model_dir)
    rows = [{"prompt": "1+2=", "a": 1, "b": 2}, {"prompt": "3+4=", "a": 3, "b": 4, "boom": True},
            {"prompt": "0+0=", "a": 0, "b": 0, "bad_reset": True}, {"prompt": "1+1=", "a": 1, "b": 1, "nan": True}]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    rollout = RolloutProcess(tiny_model_dir, lora=False, work_dir=tmp_path, partial=True, max_tokens=3,
                             temperature=1.0, torch_threads=1)
    with Sandbox(env_code, limits=LIMITS, max_episodes=3) as env:  # 8 episodes: run 3 at a time
        runner = EpisodeRunner(rollout, env, tok, max_turns=3, rows=rows, prompts=prompts)
        try:
            runner.submit(0, [[(0, 11), (0, 12)], [(1, 13), (1, 14)], [(2, 15), (2, 16)], [(3, 17), (3, 18)]])
            groups, stats = runner.result(0)
        finally:
            runner.close()
            rollout.close()
            runner.join()
        assert env.open_episodes == 0  # every episode's instance was freed
    model = load_pretrained(tiny_model_dir).eval()
    assert stats.tokens > 0
    for traj in groups[0]:  # plain: three steps, done at the third
        assert traj.score.error == "" and len(traj.turns) == 3 and traj.turns[-1]["done"]
        assert traj.score.value == pytest.approx(sum(t["reward"] for t in traj.turns))
        assert traj.observation == " Q1+2?"
        assert traj.prompt == prompts[0] + tok.encode(" Q1+2?", add_special_tokens=False)
        spans, i = [], 0
        while i < len(traj.mask):  # the runs of action / observation tokens
            j = i
            while j < len(traj.mask) and traj.mask[j] == traj.mask[i]:
                j += 1
            spans.append((traj.mask[i], i, j))
            i = j
        assert [m for m, _, _ in spans] == [1, 0, 1, 0, 1]
        for n, (_, a, b) in enumerate(spans[1::2], 1):
            assert traj.completion[a:b] == tok.encode(f" T{n}", add_special_tokens=False)
        for _, a, b in spans[0::2]:
            expected = _sequence_logprobs(model, traj.prompt + traj.completion[:a], traj.completion[a:b])
            torch.testing.assert_close(torch.tensor(traj.logprobs[a:b]), expected, rtol=0, atol=1e-4)
        assert len(traj.token_versions) == sum(traj.mask) and traj.versions == [0]
    for traj in groups[1]:  # the second step raised
        assert traj.score == Score(None, "step: ValueError: the tool crashed (line 11)")
        assert [t.get("error") for t in traj.turns] == [None, "step: ValueError: the tool crashed (line 11)"]
        assert traj.mask.count(0) > 0 and traj.mask[-1] == 1  # two actions, the observation between them
    for traj in groups[2]:  # reset raised: one action from the bare prompt, scored 0
        assert traj.score == Score(None, "reset: RuntimeError: no such task (line 4)")
        assert traj.prompt == prompts[2] and traj.mask == [1] * len(traj.completion) and traj.turns == []
    for traj in groups[3]:
        assert traj.score.value is None and "step returned reward nan, not a finite number" in traj.score.error


def test_a_loop_run_with_an_environment_trains_and_records_episodes(tiny_model_dir, data, env_code, tmp_path):
    """Async, with token TIS and the KL penalty: each step trains on episodes of two turns; the samples record holds
    reset's observation and every turn, and crashing rows are logged and scored 0 while the run goes on."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for r in rows:  # 7 of the 16 rows: at least 3 of the 12 a run of 3 steps x 4 prompts takes
        r["boom"] = r["a"] == 0 or r["b"] == 0
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hp = _hp(steps=3, mode="async", max_staleness=1, tis="token", kl_coef=0.1, checkpoint_every=3,
             prompts_per_step=4)
    events = []
    with Sandbox(env_code, limits=LIMITS) as env:
        for ev in run_rft(tiny_model_dir, path, hp, env=env, stop=threading.Event(), work_dir=tmp_path / "w",
                          torch_threads=1):
            if isinstance(ev, Checkpoint):
                ev.samples = [json.loads(line) for line in (ev.checkpoint.state_dir / SAMPLES_FILE).read_text().splitlines()]
            events.append(ev)
    metrics = [e.metrics for e in events if isinstance(e, Metrics)]
    assert len(metrics) == 3 and all("train/loss" in m and m["kl/ref"] >= 0 for m in metrics)
    assert all(m["staleness/max"] <= 1 and m["tis/weight_mean"] > 0 for m in metrics)
    # two actions per episode (max_turns; the env's done would come at 3; the crash is at the second step)
    assert all(m["episode/turns_mean"] == 2 and m["episode/done"] == 0 for m in metrics)
    (ckpt,) = [e for e in events if isinstance(e, Checkpoint)]
    samples = ckpt.samples
    assert len(samples) == 3 * 4 * 2
    for s in samples:
        assert s["observation"].startswith(" Q") and 1 <= len(s["turns"]) <= 2
        if s["error"]:
            assert s["reward"] == 0.0 and "the tool crashed" in s["error"]
        else:
            assert s["reward"] == pytest.approx(sum(t["reward"] for t in s["turns"]))
        assert s["staleness"] == s["trainer_version"] - min(v for v, _ in s["token_versions"])
    errors = sum(m["reward/errors"] for m in metrics)
    logged = [e.message for e in events if isinstance(e, Log) and "reward error" in e.message]
    assert errors == sum(1 for s in samples if s["error"]) > 0
    assert logged and "the tool crashed" in logged[0] and "dataset row" in logged[0]
    with pytest.raises(ValueError, match="a reward or an env"):
        run_rft(tiny_model_dir, path, hp, stop=threading.Event(), work_dir=tmp_path / "x").__next__()


def test_max_turns_is_checked_with_its_field():
    """More than one turn needs an Environment: a built-in reward is refused at the request (an uploaded reward_fn
    when the job is created, tests/integration/test_rft_jobs.py); the bounds come from the declaration."""
    from services.common.errors import InvalidArgument

    for given, reason in (({"evaluator": "builtin:digit_share", "max_turns": 2}, "need an Environment evaluator"),
                          ({"evaluator": "env", "max_turns": 65}, "")):
        with pytest.raises(InvalidArgument) as exc:
            RftHyperparams.from_request(given)
        (v,) = exc.value.violations
        assert v.field == "spec.rft.max_turns" and reason in v.reason
    assert RftHyperparams.from_request({"evaluator": "env", "max_turns": 64}).max_turns == 64
    assert RftHyperparams.from_request({"evaluator": "builtin:digit_share"}).max_turns == 1


def test_router_replay_covers_every_turn_of_an_episode(family_dirs, data, env_code, tmp_path):
    """The last turn's request holds the whole episode (prompt, earlier actions and observations), so its routes
    cover every position of the trained sequence: replayed, the trainer's logprobs of the actions match the
    rollout's (as for single-turn samples, test_rl.py)."""
    hp = _hp(steps=1, router_replay=True, max_tokens=3)
    with Sandbox(env_code, limits=LIMITS) as env:
        metrics = [e.metrics for e in run_rft(family_dirs["qwen3_moe"], data, hp, env=env, stop=threading.Event(),
                                              work_dir=tmp_path, torch_threads=1) if isinstance(e, Metrics)]
    assert len(metrics) == 1 and metrics[0]["episode/turns_mean"] == 2
    assert metrics[0]["kl/k3_rollout_trainer"] < 1e-3
