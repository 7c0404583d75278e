"""The managed RFT recipe: resume from the job's latest checkpoint if any, run the RL loop (services/trainer/rl/loop.py)
with the job's evaluator as the reward, and record its events like every recipe (recipes/sft.py's record). The loop
samples from its own rollout process (services/trainer/rl/rollout.py); it runs in this worker process (one rank)."""
from __future__ import annotations

from pathlib import Path

from services.common.methods.rft import RftHyperparams
from services.trainer.rl.loop import run_rft
from services.trainer.rl.rewards import BUILTIN_PREFIX, BUILTINS, Reward, builtin
from services.worker.job import JobContext, RecipeOutcome
from services.worker.recipes.sft import dataset_file, record, resume_from


def run(ctx: JobContext) -> RecipeOutcome:
    job = ctx.job
    hp = RftHyperparams.from_json(job.config)
    reward = evaluator(ctx, hp.evaluator)
    events = run_rft(Path(job.model_path), dataset_file(ctx), hp, reward=reward, stop=ctx.heartbeat.stop,
                     resume=resume_from(ctx), base_model_name=job.base_model, work_dir=ctx.work,
                     torch_threads=ctx.settings.torch_threads)
    return record(ctx, events, kind="full" if hp.full_parameter else "lora_adapter")


def evaluator(ctx: JobContext, ref: str) -> Reward:
    """The reward of an evaluator reference: a built-in one, or the account's uploaded evaluator."""
    if ref.startswith(BUILTIN_PREFIX):
        if ref not in BUILTINS:
            raise ValueError(f"no built-in evaluator {ref!r}; known: {', '.join(BUILTINS)}")
        return builtin(ref)
    raise ValueError(f"evaluator {ref!r}: uploaded evaluators are not available on this worker yet; use one of "
                     f"{', '.join(BUILTINS)}")
