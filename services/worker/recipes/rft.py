"""The managed RFT recipe: resume from the job's latest checkpoint if any, run the RL loop (services/trainer/rl/loop.py)
with the job's evaluator as the reward (a reward_fn, or an Environment's episodes), and record its events like every
recipe (recording.py). The loop runs in this worker process (one rank) and samples from a deployment of the rollout
service that follows the job's weight lineage, with the attempt's job-scoped key
(services/trainer/rl/rollout_service.py), when the worker is configured with the rollout and weight-sync services
(WorkerSettings.rft_rollout), else from a rollout process of its own (services/trainer/rl/rollout.py)."""
from __future__ import annotations

import functools
from contextlib import ExitStack
from pathlib import Path

from services.common.ledger import HeldDevice
from services.common.methods.rft import RftHyperparams
from services.evaluators.sandbox import Sandbox
from services.evaluators.store import load_evaluator
from services.trainer.rl.loop import run_rft
from services.trainer.rl.rewards import BUILTIN_PREFIX, BUILTINS, Reward, builtin
from services.trainer.rl.rollout import RolloutProcess
from services.trainer.rl.rollout_service import Connection, RolloutService
from services.worker.job import JobContext, RecipeOutcome
from services.worker.recipes.recording import run_recorded


def run(ctx: JobContext) -> RecipeOutcome:
    job = ctx.job
    hp = RftHyperparams.from_json(job.config)
    with ExitStack() as stack:
        reward = evaluator(ctx, hp, stack)
        scoring = {"env": reward} if isinstance(reward, Sandbox) else {"reward": reward}
        return run_recorded(ctx, lambda data_path, resume: run_rft(
            Path(job.model_path), data_path, hp, **scoring, stop=ctx.heartbeat.stop, resume=resume,
            base_model_name=job.base_model, work_dir=ctx.work, torch_threads=ctx.settings.torch_threads,
            rollout=rollout_backend(ctx)), checkpoint_kind="full" if hp.full_parameter else "lora_adapter")


def rollout_device(devices: list[HeldDevice]) -> str | None:
    """The rollout process's device: the job's first rollout GPU ("cuda:N"; the trainer trains on its first trainer
    GPU, services/worker/job.py), or None (the trainer's rule) when its rollout devices are CPU slots."""
    gpus = [d for d in devices if d.role == "rollout" and d.kind == "gpu"]
    return f"cuda:{gpus[0].index}" if gpus else None


def rollout_backend(ctx: JobContext):
    """RolloutProcess, or a factory (RolloutProcess's arguments) of the job's rollout-service deployment: lineage
    "<job id>", deployment "<job id>-rollout", both the job's account's."""
    st = ctx.settings
    if not st.rft_rollout_service():
        return functools.partial(RolloutProcess, device=rollout_device(ctx.devices))
    conn = Connection(rollout_url=st.rollout_url, weightsync_url=st.weightsync_url, scheduler_url=st.scheduler_url,
                      api_key=ctx.credential, credentials=st.channel_credentials(),
                      max_message_mb=st.grpc_max_message_mb)

    def backend(model_dir, *, lora, partial, max_tokens, temperature, router_ids, work_dir, torch_threads):
        return RolloutService(conn, lineage=ctx.job.id, deployment=f"{ctx.job.id}-rollout",
                              base_model=ctx.job.base_model, lora=lora, partial=partial, max_tokens=max_tokens,
                              temperature=temperature, router_ids=router_ids)
    return backend


def evaluator(ctx: JobContext, hp: RftHyperparams, stack: ExitStack) -> Reward | Sandbox:
    """The reward of the job's evaluator reference: a built-in one, or the account's uploaded evaluator in a sandbox
    (services/evaluators/sandbox.py) closed with the stack: its reward_fn, or, for an Environment, the sandbox itself
    (the loop runs its episodes, services/trainer/rl/episodes.py). A user's error in it is a row's error (scored 0,
    logged); one that stops it loading fails the job with the evaluator's message."""
    ref = hp.evaluator
    if ref.startswith(BUILTIN_PREFIX):
        if ref not in BUILTINS:
            raise ValueError(f"no built-in evaluator {ref!r}; known: {', '.join(BUILTINS)}")
        return builtin(ref)
    row = load_evaluator(ctx.db, ctx.blobs, ctx.job.account_id, ref, ctx.work / "evaluator")
    sandbox = stack.enter_context(Sandbox(ctx.work / "evaluator", limits=ctx.settings.evaluator_limits()))
    if sandbox.kind == "environment":
        ctx.ledger.log(ctx.job.id, f"reward: Environment evaluator {row.name}@{row.version} ({row.id}) in the "
                                   f"sandbox, episodes of up to {hp.max_turns} turns")
        return sandbox
    if hp.max_turns > 1:
        raise ValueError(f"evaluator {ref!r} is a reward_fn, which scores one completion; max_turns "
                         f"{hp.max_turns} needs an Environment")
    ctx.ledger.log(ctx.job.id, f"reward: evaluator {row.name}@{row.version} ({row.id}) in the sandbox")

    def reward(completions, rows):
        return sandbox.score(list(zip(completions, rows)))
    return reward
