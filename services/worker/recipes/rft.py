"""The managed RFT recipe: resume from the job's latest checkpoint if any, run the RL loop (services/trainer/rl/loop.py)
with the job's evaluator as the reward, and record its events like every recipe (recording.py). The loop runs in
this worker process (one rank) and samples from a deployment of the rollout service that follows the job's weight
lineage, with the attempt's job-scoped key (services/trainer/rl/rollout_service.py), when the worker is configured
with the rollout and weight-sync services (WorkerSettings.rft_rollout), else from a rollout process of its own
(services/trainer/rl/rollout.py)."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

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
        reward = evaluator(ctx, hp.evaluator, stack)
        return run_recorded(ctx, lambda data_path, resume: run_rft(
            Path(job.model_path), data_path, hp, reward=reward, stop=ctx.heartbeat.stop, resume=resume,
            base_model_name=job.base_model, work_dir=ctx.work, torch_threads=ctx.settings.torch_threads,
            rollout=rollout_backend(ctx)), checkpoint_kind="full" if hp.full_parameter else "lora_adapter")


def rollout_backend(ctx: JobContext):
    """RolloutProcess, or a factory (RolloutProcess's arguments) of the job's rollout-service deployment: lineage
    "<job id>", deployment "<job id>-rollout", both the job's account's."""
    st = ctx.settings
    if not st.rft_rollout_service():
        return RolloutProcess
    conn = Connection(rollout_url=st.rollout_url, weightsync_url=st.weightsync_url, scheduler_url=st.scheduler_url,
                      api_key=ctx.credential, credentials=st.channel_credentials(),
                      max_message_mb=st.grpc_max_message_mb)

    def backend(model_dir, *, lora, partial, max_tokens, temperature, router_ids, work_dir, torch_threads):
        return RolloutService(conn, lineage=ctx.job.id, deployment=f"{ctx.job.id}-rollout",
                              base_model=ctx.job.base_model, lora=lora, partial=partial, max_tokens=max_tokens,
                              temperature=temperature, router_ids=router_ids)
    return backend


def evaluator(ctx: JobContext, ref: str, stack: ExitStack) -> Reward:
    """The reward of an evaluator reference: a built-in one, or the account's uploaded evaluator (its reward_fn)
    in a sandbox (services/evaluators/sandbox.py) closed with the stack. A user's error in it is a row's error
    (scored 0, logged); one that stops it loading fails the job with the evaluator's message."""
    if ref.startswith(BUILTIN_PREFIX):
        if ref not in BUILTINS:
            raise ValueError(f"no built-in evaluator {ref!r}; known: {', '.join(BUILTINS)}")
        return builtin(ref)
    row = load_evaluator(ctx.db, ctx.blobs, ctx.job.account_id, ref, ctx.work / "evaluator")
    sandbox = stack.enter_context(Sandbox(ctx.work / "evaluator", limits=ctx.settings.evaluator_limits()))
    if sandbox.kind != "reward_fn":
        raise ValueError(f"evaluator {ref!r} defines an Environment (multi-turn episodes); an RFT job scores "
                         "single completions with a reward_fn(completion, row)")
    ctx.ledger.log(ctx.job.id, f"reward: evaluator {row.name}@{row.version} ({row.id}) in the sandbox")

    def reward(completions, rows):
        return sandbox.score(list(zip(completions, rows)))
    return reward
