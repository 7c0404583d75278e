"""Managed RFT: the RL loop a worker drives for one job, as a stream of events (services/trainer/sft.py's Log,
Started, Metrics, Checkpoint, Finished), with checkpoints it resumes from.

Versions: the policy after k optimizer steps is version k (version 0: the base model, or the base with a fresh LoRA
adapter, which changes nothing). Batch j (prompts_per_step prompts x group_size samples) is trained by step j, at
trainer version j, and the step publishes version j + 1 to the rollout (rollout.py: hot-loaded, never reloaded; or,
rollout_service.py, as the next version of the job's weight lineage, which a rollout deployment follows).

sync mode, step k:  submit batch k (the rollout is at version k) -> wait for it -> train -> publish k + 1.
async mode, step k: submit batches up to k + max_staleness (each as soon as the one before it was sent: the rollout
                    samples them in order, one at a time, while the trainer trains) -> wait for batch k -> train ->
                    publish k + 1 (in-flight samples are aborted and, with partial_rollouts, continue on k + 1).
So a batch submitted at version v is trained at version v + max_staleness at the latest: staleness (trainer version -
the oldest version behind any token of the sample) is <= max_staleness by construction; the loop still checks every
sample and drops (and counts) any beyond the bound.

One training step on batch k (algo.py for the arithmetic):
  rewards (the evaluator; an error is logged and scores 0) -> minus kl_coef * sum_t k3(rollout, reference) when
  kl_coef > 0 (the KL penalty to the base policy is shaped into the reward: a constant per sample, before the group
  normalization) -> drop samples beyond max_staleness, then groups with fewer than 2 samples and, with dynamic
  sampling, groups whose rewards are all equal -> group-normalized advantages -> datums (prompt positions masked) ->
  the engine's fused loss (loss_call) -> AdamW step -> publish.
Truncated importance sampling (tis token | sequence): before the loss, a forward without gradient gives the trainer's
logprobs p at version k; the loss's `logprobs` input is then p (its ratio exp(lp - p) is 1 in value, its clipping a
trust region around version k, as in decoupled PPO) and the rollout/trainer mismatch is corrected by the weight
w = min(exp(p - q), tis_cap) (token or sequence level), applied per token by scaling the advantage: w is a constant
>= 0, so w * min(r A, clip(r) A) = min(r (w A), clip(r) (w A)) for every built-in loss's per-token objective. With
tis off, the loss's `logprobs` is the rollout's q and its own ratio exp(lp - q) and clipping absorb the mismatch and
the staleness.

With an Environment evaluator (env), each sample is an episode (episodes.py: EpisodeRunner drives them over the
rollout with the rollout's interface): its reward is the sum of its steps' rewards and its trajectory is prompt +
action1 + obs1 + action2 + ...; the observation tokens are context only (advantage 0, mask 0, logprobs unused) and
TIS weights, KL penalties and staleness are taken over the action tokens alone. A single-turn sample is the
trajectory of one action, trained exactly as before.

Per step, each sample is recorded (version ids of its tokens, staleness, reward, advantage, whether it trained) and
the samples since the previous checkpoint are kept in that checkpoint's state/rl_samples.jsonl.

Resume: a checkpoint at step k holds the weights, AdamW state, RNG and k; the data position and every sampling seed
derive from the batch index, so the run continues at batch k on version k (the restored weights are published to
the rollout first). Samples in flight when the worker died are sampled again, from version k.
"""
from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from models import load_pretrained
from models.chat import encode_chat_prompt
from models.lora import LoraConfig
from models.tokenizer import load_tokenizer
from services.common.methods.rft import RftHyperparams
from services.evaluators.sandbox import Sandbox
from services.trainer.engine import AdamW, TrainingEngine, losses
from services.trainer.engine.checkpoint import CheckpointMismatch, read_checkpoint
from services.trainer.engine.forward_backward import Datum, LossCall, LossRequest, moe_layers, run_call
from services.trainer.rl import algo
from services.trainer.rl.episodes import EpisodeRunner, Trajectory, completion_text
from services.trainer.rl.rewards import Reward
from services.trainer.rl.rollout import RolloutProcess, Sample, SampleRequest
from services.trainer.rl.rollout_service import RolloutService
from services.trainer.sft import Checkpoint, Finished, Log, Metrics, SftCheckpoint, Started, StopFlag

MICRO_BATCH_TOKENS = 8192
SAMPLES_FILE = "rl_samples.jsonl"
MAX_LOGGED_ERRORS = 5  # reward errors logged per step (the rest are counted)


def load_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_rft(model_dir: Path, dataset_path: Path, hp: RftHyperparams, *, reward: Reward | None = None,
            env: Sandbox | None = None, stop: StopFlag, resume: SftCheckpoint | None = None,
            base_model_name: str = "", work_dir: Path, torch_threads: int = 1,
            rollout: Callable[..., RolloutProcess | RolloutService] = RolloutProcess) -> Iterator:
    """Run the RL loop (module docstring); yields the events a recipe records. The reward is a reward function over
    completions, or env: an Environment evaluator's sandbox, whose episodes (episodes.py) give each sample.
    rollout: the backend, called with RolloutProcess's arguments: the rollout process (rollout.py), or a deployment
    of the rollout service (rollout_service.py)."""
    if (reward is None) == (env is None):
        raise ValueError("run_rft needs a reward or an env, one of the two")
    run = _RftRun(Path(model_dir), load_rows(Path(dataset_path)), hp, reward, env, stop,
                  base_model_name or str(model_dir), Path(work_dir), torch_threads, rollout)
    if resume is not None:
        run.restore(resume)
        yield Log(f"resumed at step {run.step} of {hp.steps}")
    else:
        torch.manual_seed(hp.seed)
    yield Started(hp.steps, {"prompts": len(run.prompts), "mode": hp.mode, "loss": hp.loss,
                             "trainable params": run.engine.num_trainable})
    try:
        yield from run.train()
    finally:
        run.close()


class _RftRun:
    def __init__(self, model_dir: Path, rows: list[dict], hp: RftHyperparams, reward: Reward | None,
                 env: Sandbox | None, stop: StopFlag, base_name: str, work_dir: Path, torch_threads: int,
                 rollout_backend: Callable[..., RolloutProcess | RolloutService] = RolloutProcess):
        self.model_dir, self.rows, self.hp, self.reward, self.env, self.stop = model_dir, rows, hp, reward, env, stop
        self.base_name, self.work_dir, self.torch_threads = base_name, work_dir, torch_threads
        self.tokenizer = load_tokenizer(model_dir)
        self.prompts = [self._prompt(r, i) for i, r in enumerate(rows)]
        self.lora = None if hp.full_parameter else LoraConfig(rank=hp.lora_rank, alpha=hp.lora_alpha,
                                                              dropout=hp.lora_dropout,
                                                              target_modules=hp.target_modules)
        self.engine = TrainingEngine.load(model_dir, lora=self.lora, seed=hp.seed, optimizer=self._adamw())
        self.vocab = self.engine.model.args.vocab_size
        if hp.router_replay and not moe_layers(self.engine.model):
            raise ValueError("router_replay is for MoE models; this model has no MoE layer")
        self.reference = None
        if hp.kl_coef > 0:  # the base policy, frozen, for the KL penalty
            self.reference = load_pretrained(model_dir, dtype=torch.float32, device=self.engine.device).eval()
            self.reference.requires_grad_(False)
        self.rollout: RolloutProcess | RolloutService | None = None
        self.rollout_backend = rollout_backend
        self.sampler: RolloutProcess | RolloutService | EpisodeRunner | None = None  # the rollout, or episodes over it
        self.records: list[dict] = []  # samples since the last checkpoint
        cfg = {}
        defaults = losses.LOSS_FNS[hp.loss].config_defaults
        if "clip_low_threshold" in defaults and hp.clip_low is not None:
            cfg["clip_low_threshold"] = hp.clip_low
        if "clip_high_threshold" in defaults and hp.clip_high is not None:
            cfg["clip_high_threshold"] = hp.clip_high
        if "max_tokens" in defaults:
            cfg["max_tokens"] = float(hp.max_tokens)
        self.loss = LossRequest(hp.loss, losses.resolve_config(hp.loss, cfg), MICRO_BATCH_TOKENS)

    def _prompt(self, row: dict, i: int) -> list[int]:
        if isinstance(row.get("messages"), list):
            return encode_chat_prompt(self.tokenizer, row["messages"])
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"dataset row {i + 1}: needs a 'prompt' string or a 'messages' list")
        return self.tokenizer.encode(row["prompt"], add_special_tokens=False)

    def _adamw(self) -> AdamW:
        return AdamW(learning_rate=self.hp.learning_rate, weight_decay=self.hp.weight_decay,
                     grad_clip_norm=self.hp.max_grad_norm)

    @property
    def step(self) -> int:
        return self.engine.steps

    # -- data and rollout -----------------------------------------------------------------------------------------
    def _batch_rows(self, batch: int) -> list[int]:
        """The row indices of a batch: an endless stream of seeded per-epoch permutations of the rows."""
        n, per = len(self.rows), self.hp.prompts_per_step
        out = []
        for pos in range(batch * per, (batch + 1) * per):
            epoch, i = divmod(pos, n)
            order = list(range(n))
            random.Random(self.hp.seed * 1_000_003 + epoch).shuffle(order)
            out.append(order[i])
        return out

    def _seeds(self, batch: int) -> list[list[tuple[int, int]]]:
        """Per prompt of the batch, its samples' (row index, sampling seed)."""
        hp = self.hp
        return [[(r, ((hp.seed * 1_000_003 + batch) * 4096 + p) * 64 + s) for s in range(hp.group_size)]
                for p, r in enumerate(self._batch_rows(batch))]

    def _submit(self, batch: int) -> None:
        seeds = self._seeds(batch)
        if isinstance(self.sampler, EpisodeRunner):
            self.sampler.submit(batch, seeds)
        else:
            self.sampler.submit(batch, [[SampleRequest(self.prompts[r], seed) for r, seed in g] for g in seeds])

    def _publish(self) -> None:
        """Hand version `step` to the rollout."""
        path = self.work_dir / "rollout" / f"v{self.step}"
        if self.lora is not None or self.rollout.serves_lineage:
            self.engine.save_weights(path, base_model=self.base_name)
        else:
            path = path.with_suffix(".safetensors")
            save_file({k: v.detach().cpu().contiguous() for k, v in self.engine.model.named_parameters()}, str(path))
        self.sampler.update(self.step, path)

    # -- the loop -------------------------------------------------------------------------------------------------
    def train(self) -> Iterator:
        hp = self.hp
        (self.work_dir / "rollout").mkdir(parents=True, exist_ok=True)
        self.rollout = self.rollout_backend(self.model_dir, lora=self.lora is not None,
                                            work_dir=self.work_dir / "rollout", partial=hp.partial_rollouts,
                                            max_tokens=hp.max_tokens, temperature=hp.temperature,
                                            router_ids=hp.router_replay, torch_threads=self.torch_threads)
        self.sampler = self.rollout
        if self.env is not None:
            self.sampler = EpisodeRunner(self.rollout, self.env, self.tokenizer, max_turns=hp.max_turns,
                                         rows=self.rows, prompts=self.prompts)
        if self.step > 0 or self.rollout.serves_lineage:
            self._publish()  # the restored weights (or version 0, for a rollout that holds no weights yet)
        ahead = hp.max_staleness if hp.mode == "async" else 0
        next_batch, start, metrics = self.step, self.step, {}
        last = time.perf_counter()
        while self.step < hp.steps:
            if self.stop.is_set():
                yield Finished(step=self.step, stopped=True, metrics=metrics)
                return
            while next_batch <= min(self.step + ahead, hp.steps - 1):
                self._submit(next_batch)
                next_batch += 1
            t0 = time.perf_counter()
            samples, stats = self.sampler.result(self.step)
            waited = time.perf_counter() - t0
            for event in self._train_step(samples):
                if isinstance(event, dict):
                    metrics = event
                else:
                    yield event
            if self.step < hp.steps or self.rollout.serves_lineage:  # nothing samples the last version (the final
                self._publish()  # checkpoint's), but a lineage keeps it for the user to deploy
            now = time.perf_counter()
            metrics |= {"time/step_s": now - last, "time/wait_rollout_s": waited,
                        "rollout/tokens_per_s": stats.tokens / max(stats.seconds, 1e-9),
                        "rollout/discarded_tokens": float(stats.discarded_tokens)}
            last = now
            final = self.step == hp.steps
            yield Metrics(self.step, metrics)
            if final or self.step % hp.checkpoint_every == 0:
                yield from self._checkpoint(final, metrics)
        if self.step == start:  # resumed at the end: checkpoint again as final
            yield from self._checkpoint(True, metrics)
        yield Finished(step=self.step, stopped=False, metrics=metrics)

    def _train_step(self, groups: list[list[Sample | Trajectory]]) -> Iterator:
        """Train version k = step on its batch; yields Log events, then the step's metrics (a dict)."""
        hp, k = self.hp, self.step
        rows = self._batch_rows(k)
        flat = [(g, self._trajectory(rows[g], s)) for g, group in enumerate(groups) for s in group]
        texts = [s.text for _, s in flat]
        if self.env is not None:  # an episode's reward: the sum of its steps' (episodes.py)
            scores = [s.score for _, s in flat]
        else:
            scores = self.reward(texts, [self.rows[rows[g]] for g, _ in flat])
        errors = [(i, sc.error) for i, sc in enumerate(scores) if sc.value is None]
        for i, err in errors[:MAX_LOGGED_ERRORS]:
            yield Log(f"step {k + 1}: reward error on dataset row {rows[flat[i][0]] + 1} (scored 0): {err}", "warning")
        rewards = [sc.value if sc.value is not None else 0.0 for sc in scores]
        stale = [algo.staleness(k, s.versions) for _, s in flat]
        fresh = [st <= hp.max_staleness for st in stale]
        raw_rewards = list(rewards)
        kl_ref = []
        if self.reference is not None:
            ref_lps = self._logprobs(self.reference, [self._datum(s, 0.0) for _, s in flat])
            for i, ((_, s), ref) in enumerate(zip(flat, ref_lps)):
                per_token = algo.k3(_action_q(s, torch.float64), _on_actions(s, ref).double())
                kl_ref.append(per_token)
                rewards[i] -= hp.kl_coef * float(per_token.sum())
        # groups -> advantages
        advantages: dict[int, float] = {}
        dropped_groups = 0
        for g in range(len(groups)):
            members = [i for i, (gg, _) in enumerate(flat) if gg == g and fresh[i]]
            rs = [rewards[i] for i in members]
            if len(members) < 2 or (self.hp.dynamic and algo.constant(rs)):
                dropped_groups += 1
                continue
            advantages.update(zip(members, algo.group_advantages(rs, hp.loss)))
        chosen = sorted(advantages)
        datums = [self._datum(flat[i][1], advantages[i]) for i in chosen]
        tis_w = {}
        if datums and hp.tis != "off":
            trainer_lps = self._logprobs(self.engine.model, datums)
            for i, d, p in zip(chosen, datums, trainer_lps):
                s = flat[i][1]
                n, at = len(s.completion), torch.tensor(s.actions, dtype=torch.int64)  # observations: untouched
                w = algo.tis_weights(_on_actions(s, p), _action_q(s, torch.float32), hp.tis, hp.tis_cap)
                tis_w[i] = w
                d.inputs["logprobs"][-n:][at] = p[-n:][at]
                d.inputs["advantages"][-n:][at] *= w
        out = {"reward/mean": _mean(raw_rewards), "reward/std": _std(raw_rewards),
               "reward/errors": float(len(errors)), "staleness/mean": _mean(stale), "staleness/max": float(max(stale)),
               "samples/dropped_stale": float(fresh.count(False)), "samples/trained": float(len(datums)),
               "groups/dropped": float(dropped_groups)}
        if self.env is not None:  # episodes: actions per episode, and the share the environment ended (done)
            out["episode/turns_mean"] = _mean([len(s.turns) for _, s in flat])
            out["episode/done"] = _mean([float(bool(s.turns) and bool(s.turns[-1].get("done"))) for _, s in flat])
        if kl_ref:
            out["kl/ref"] = float(torch.cat(kl_ref).mean())
        if tis_w:
            out["tis/weight_mean"] = float(torch.cat(list(tis_w.values())).mean())
        t0 = time.perf_counter()
        if datums:
            call = self.engine.loss_call(self.loss, backward=True, deterministic=False, lock=contextlib.nullcontext)
            lps, m = run_call(call, datums)
            grad_norm = float(self.engine.step(self._adamw()))
            k3s = [algo.k3(_action_q(flat[i][1], torch.float64), _on_actions(flat[i][1], lp)) for i, lp in zip(chosen, lps)]
            out |= {"train/loss": m["loss:mean"], "train/grad_norm": grad_norm, "train/lr": self.hp.learning_rate,
                    "train/clip_fraction": m.get("clip_fraction:mean", 0.0),
                    "kl/k3_rollout_trainer": float(torch.cat(k3s).mean()),
                    "train/tokens_per_s": sum(d.length for d in datums) / max(time.perf_counter() - t0, 1e-9)}
        else:
            self.engine.steps += 1  # nothing to learn from: the version advances with the same weights
            yield Log(f"step {k + 1}: no group with a learning signal; the weights are unchanged")
        for i, ((g, s), text) in enumerate(zip(flat, texts)):
            record = {"step": k + 1, "trainer_version": k, "row": rows[g], "group": g,
                      "versions": s.versions, "token_versions": _runs(s.token_versions),
                      "weight_version_ids": s.version_ids,
                      "staleness": stale[i], "reward": raw_rewards[i], "error": scores[i].error,
                      "trained": i in advantages, "advantage": advantages.get(i), "completion": text}
            if s.turns is not None:  # an episode: reset's observation and each step's action, observation, reward
                record |= {"observation": s.observation, "turns": s.turns}
            self.records.append(record)
        yield out

    def _trajectory(self, row: int, s: Sample | Trajectory) -> Trajectory:
        if isinstance(s, Trajectory):
            return s
        return Trajectory.single(self.prompts[row], s, completion_text(self.tokenizer, s))

    def _datum(self, s: Trajectory, advantage: float) -> Datum:
        """A trajectory as a policy-gradient datum: the prompt's and the observations' positions have advantage 0
        and mask 0 (context only); the actions' carry the advantage and the rollout's logprobs. With router replay,
        the rollout's routes of every position (its last request's: a partial rollout's earlier tokens, and an
        episode's earlier turns, are re-prefilled, and routed, by the version that sampled its last tokens)."""
        prompt, completion = s.prompt, s.completion
        pad = [0.0] * (len(prompt) - 1)
        tokens = torch.tensor(prompt + completion[:-1], dtype=torch.int64)
        inputs = {"target_tokens": torch.tensor(prompt[1:] + completion, dtype=torch.int64),
                  "logprobs": torch.tensor(pad + s.logprobs, dtype=torch.float32),
                  "advantages": torch.tensor(pad + [advantage if m else 0.0 for m in s.mask], dtype=torch.float32)}
        if "mask" in losses.LOSS_FNS[self.hp.loss].optional_inputs:
            inputs["mask"] = torch.tensor(pad + [float(m) for m in s.mask], dtype=torch.float32)
        routes = None
        if self.hp.router_replay:
            routes = torch.as_tensor(s.router_ids)
            assert routes.shape[0] == len(tokens), (routes.shape, len(tokens))
        return Datum(tokens, losses.check_datum(self.hp.loss, inputs, len(tokens), self.vocab, where="sample"),
                     routes=routes)

    def _logprobs(self, model, datums: list[Datum]) -> list[torch.Tensor]:
        """Each datum's target logprobs under model, without gradient (a forward-only loss call)."""
        req = LossRequest("cross_entropy", {}, MICRO_BATCH_TOKENS)
        plain = [Datum(d.tokens, {"target_tokens": d.targets, "weights": torch.zeros(d.length)}, d.routes)
                 for d in datums]
        call = LossCall(model, [], req, backward=False, deterministic=False, device=self.engine.device,
                        lock=contextlib.nullcontext)
        with torch.no_grad():
            return [lp.float().cpu() for lp in run_call(call, plain)[0]]

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _checkpoint(self, final: bool, metrics: dict) -> Iterator:
        root = self.work_dir / "checkpoints" / f"step-{self.step:07d}"
        self.engine.save(root, base_model=self.base_name,
                         progress={"step": self.step, "total_steps": self.hp.steps, "rows": len(self.rows),
                                   "hyperparams": self.hp.to_json(), "metrics": metrics})
        with open(root / "state" / SAMPLES_FILE, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        self.records = []
        yield Checkpoint(SftCheckpoint(step=self.step, root=root), final, metrics)
        shutil.rmtree(root)

    def restore(self, ckpt: SftCheckpoint) -> None:
        try:
            saved = read_checkpoint(Path(ckpt.root))
            if saved.progress.get("rows") != len(self.rows):
                raise CheckpointMismatch(f"it was trained on {saved.progress.get('rows')} rows, this run has "
                                         f"{len(self.rows)}")
            self.engine.restore(saved, weights=True, optimizer=True, rng=True)
        except CheckpointMismatch as exc:
            raise ValueError(f"The checkpoint at step {ckpt.step} cannot be resumed: {exc}") from None

    def close(self) -> None:
        episodes = self.sampler if isinstance(self.sampler, EpisodeRunner) else None
        if episodes is not None:
            episodes.close()
        if self.rollout is not None:
            self.rollout.close()  # ends a turn the episodes' thread waits on
        if episodes is not None:
            episodes.join()


def _mean(xs) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _std(xs) -> float:
    m = _mean(xs)
    return float((sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5) if xs else 0.0


def _on_actions(s: Trajectory, lp: torch.Tensor) -> torch.Tensor:
    """A datum's per-position values (targets order) at the trajectory's action tokens."""
    return lp[-len(s.completion):][torch.tensor(s.actions, dtype=torch.int64)]


def _action_q(s: Trajectory, dtype: torch.dtype) -> torch.Tensor:
    """The rollout's logprobs of the action tokens."""
    return torch.tensor([s.logprobs[i] for i in s.actions], dtype=dtype)


def _runs(versions: list[int]) -> list[list[int]]:
    """[[version, tokens], ...]: a sample's per-token versions, run-length encoded."""
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out
