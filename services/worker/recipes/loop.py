"""The loop recipe: iteration i trains on train_datasets[i] (SFT or DPO, from the best checkpoint so far: its weights
only), evaluates the iteration's checkpoints on the job's held-out rft dataset with the evaluator, deploys the best
(evaluator reward mean; ties: the later) under the stable deployment name -- created by the first iteration,
re-pointed by the next ones (DeploymentCore.repoint) -- and the next iteration starts from it (docs/loop.md).

Everything runs in this worker process, one iteration after another: the trainings through recording.py (the SFT
and DPO recipes' recording loop), the evaluations through the evaluation recipe's functions (evaluate.py).

Recorded under the loop job, each write conditional on the lease:
  - every training checkpoint, at the job's step (the iteration's steps follow the previous iterations': step
    offset + the run's step);
  - each evaluated checkpoint's scores: a metric point at the checkpoint's step, {"loop/iteration": i,
    "loop/checkpoint_reward_mean", "loop/checkpoint_pass@1", "loop/checkpoint_pass@k", "loop/checkpoint_errors"};
  - each finished iteration: a point at its last step, {"loop/iteration": i, "loop/iterations_done": i + 1,
    "iteration/<i>/eval_reward_mean", "iteration/<i>/eval_pass@k" (the best checkpoint's), "iteration/<i>/best_step"
    (the best checkpoint's step), "iteration/<i>/deployed": 1}, and log lines naming the best checkpoint and the
    deployment. GetJob's latest_metrics keep every iteration's keys.
Resume: those points are all at or before the job's latest checkpoint's step, so a retried attempt keeps them
(Ledger.rewind drops later ones only) and reads back from them what is done: the finished iterations (and the best
checkpoint so far: the checkpoint at the last best_step), the current iteration's checkpoints (training resumes from
its latest one, or is skipped once its final one is stored) and the evaluations already recorded.
"""
from __future__ import annotations

from pathlib import Path

import grpc
from sqlalchemy import select

from services.common import channels, registry
from services.common.methods.loop import LoopHyperparams
from services.common.schema import Checkpoint, JobMetric
from services.worker.job import JobContext, RecipeOutcome
from services.worker.recipes.evaluate import read_rows, rollout_engine, score_rows, summarize, weights
from services.worker.recipes.recording import laid_out, run_recorded
from trainyard.v1 import scheduler_pb2 as pb
from trainyard.v1 import scheduler_pb2_grpc as rpc


class LoopStopped(Exception):
    """The job's stop flag ended a training or an evaluation: the attempt ends as cancelled (or lease lost)."""


def run(ctx: JobContext) -> RecipeOutcome:
    job, ledger = ctx.job, ctx.ledger
    if ctx.settings.managed_nproc != 1:
        raise ValueError(f"loop jobs train in one process, but this worker is set up for managed_nproc="
                         f"{ctx.settings.managed_nproc} (TRAINYARD_MANAGED_NPROC); run them on a worker with 1")
    cfg = LoopHyperparams.from_json(job.config)
    done, end_step, best = _recorded_iterations(ctx)
    if done:
        ledger.log(job.id, f"resuming the loop after {done} of {len(cfg.train_datasets)} iterations; the best "
                           f"checkpoint so far is {best.id} (step {best.step})")
    try:
        for i in range(done, len(cfg.train_datasets)):
            end_step, best = _iteration(ctx, cfg, i, end_step, best)
    except LoopStopped:
        return RecipeOutcome(step=end_step, stopped=True)
    return RecipeOutcome(step=end_step, stopped=False, output_checkpoint_id=best.id if best else "")


def _iteration(ctx: JobContext, cfg: LoopHyperparams, i: int, offset: int,
               best: Checkpoint | None) -> tuple[int, Checkpoint]:
    """Iteration i, from the job's step offset and the best checkpoint so far: train, evaluate, deploy, record.
    Returns (the iteration's last step, its best checkpoint)."""
    job, ledger, n = ctx.job, ctx.ledger, len(cfg.train_datasets)
    mine = _checkpoints(ctx, after=offset)
    if not mine or not mine[-1].final:
        ledger.log(job.id, f"iteration {i} of {n}: training ({cfg.training_method}) on dataset "
                           f"{cfg.train_datasets[i]}" + (f", from checkpoint {best.id}" if best else ""))
        outcome = _train(ctx, cfg, i, offset, best, mine[-1] if mine else None)
        if outcome.stopped:
            raise LoopStopped()
        mine = _checkpoints(ctx, after=offset)
    end_step = mine[-1].step
    chosen = mine[-cfg.checkpoints_per_iteration:] if cfg.checkpoints_per_iteration else mine
    scores = _evaluate(ctx, cfg, i, chosen)
    best_ckpt, best_metrics = max(((c, scores[c.step]) for c in chosen),
                                  key=lambda cm: (cm[1]["loop/checkpoint_reward_mean"], cm[0].step))
    dep = _deploy(ctx, cfg.deployment, best_ckpt.id)
    ledger.progress(job.id, ctx.worker_id, step=end_step, metrics={
        "loop/iteration": float(i), "loop/iterations_done": float(i + 1),
        f"iteration/{i}/eval_reward_mean": best_metrics["loop/checkpoint_reward_mean"],
        f"iteration/{i}/eval_pass@k": best_metrics["loop/checkpoint_pass@k"],
        f"iteration/{i}/best_step": float(best_ckpt.step), f"iteration/{i}/deployed": 1.0})
    ledger.log(job.id, f"iteration {i} of {n}: best checkpoint {best_ckpt.id} (step {best_ckpt.step}, reward mean "
                       f"{best_metrics['loop/checkpoint_reward_mean']:.4g}); deployment '{dep.name}' ({dep.id}) "
                       f"serves it")
    return end_step, best_ckpt


def _train(ctx: JobContext, cfg: LoopHyperparams, i: int, offset: int, best: Checkpoint | None,
           resume_from: Checkpoint | None) -> RecipeOutcome:
    hp = cfg.training()
    start = None
    if best is not None and resume_from is None:  # a new iteration: the best adapter so far, its weights only
        start = laid_out(ctx, best, ctx.work / f"start-{i}", step=best.step)
    if cfg.training_method == "dpo":
        from services.trainer.dpo import run_dpo as train
    else:
        from services.trainer.sft import run_sft as train

    def events(data_path, resume):
        return train(Path(ctx.job.model_path), data_path, hp, stop=ctx.heartbeat.stop, resume=resume,
                     base_model_name=ctx.job.base_model, work_dir=ctx.work / f"train-{i}", start_from=start)

    return run_recorded(ctx, events, dataset_id=cfg.train_datasets[i], resume_from=resume_from, step_offset=offset)


def _evaluate(ctx: JobContext, cfg: LoopHyperparams, i: int, chosen: list[Checkpoint]) -> dict[int, dict]:
    """Each chosen checkpoint's scores by step: recorded ones read back, the others evaluated and recorded."""
    from services.evaluators.sandbox import Sandbox
    from services.evaluators.store import load_evaluator

    job, ledger = ctx.job, ctx.ledger
    scores = _recorded_scores(ctx, [c.step for c in chosen])
    todo = [c for c in chosen if c.step not in scores]
    if not todo:
        return scores
    ev = cfg.evaluation("")
    rows = read_rows(ctx, job.dataset_id, ev.max_rows)
    code_dir = ctx.work / f"evaluator-{i}"
    evaluator = load_evaluator(ctx.db, ctx.blobs, job.account_id, ev.evaluator, code_dir)
    ledger.log(job.id, f"iteration {i}: evaluating {len(todo)} checkpoints on {len(rows)} rows of dataset "
                       f"{job.dataset_id}, {ev.samples_per_row} samples each, with evaluator "
                       f"{evaluator.name}@{evaluator.version} ({evaluator.id})")
    engine = rollout_engine(ctx)
    try:
        with Sandbox(code_dir, limits=ctx.settings.evaluator_limits()) as sandbox:
            for ckpt in todo:
                model_dir, adapter = weights(ctx, engine, ckpt)
                results = score_rows(ctx, engine, sandbox, model_dir, adapter, rows, ev,
                                     what=f"checkpoint {ckpt.id}: ")
                if results is None:
                    raise LoopStopped()
                engine.unload_adapter(adapter)
                summary = summarize(results, ev.samples_per_row)
                point = {"loop/iteration": float(i), **{"loop/checkpoint_" + k.removeprefix("eval/"): v
                                                        for k, v in summary.items()}}
                ledger.progress(job.id, ctx.worker_id, step=ckpt.step, metrics=point)
                ledger.log(job.id, f"iteration {i}: checkpoint {ckpt.id} (step {ckpt.step}): " + ", ".join(
                    f"{k} {v:.4g}" for k, v in summary.items()))
                scores[ckpt.step] = point
    finally:
        engine.close()
    return scores


class DeployFailed(RuntimeError):
    """The scheduler refused to deploy or re-point (its reason is the message): the job fails with it."""


def _deploy(ctx: JobContext, name: str, checkpoint_id: str) -> pb.Deployment:
    """Serve the checkpoint under the stable name: CreateDeployment, or RepointDeployment of the live deployment of
    that name, called on the scheduler with the attempt's job-scoped key (which may deploy the job's checkpoints and
    re-point a deployment serving one of them: docs/resources.md)."""
    st = ctx.settings
    with ctx.db.session() as s:
        live = registry.find_deployment(s, ctx.job.account_id, name)
    channel = channels.open_channel(st.scheduler_url, st.grpc_max_message_mb, st.channel_credentials())
    try:
        stub = rpc.DeploymentServiceStub(channel)
        kw = dict(metadata=channels.auth_metadata(ctx.credential), timeout=600)
        channels.ready(channel, timeout_s=10)
        if live is None:
            return stub.CreateDeployment(pb.CreateDeploymentRequest(name=name, checkpoint_id=checkpoint_id), **kw)
        return stub.RepointDeployment(pb.RepointDeploymentRequest(id=live.id, checkpoint_id=checkpoint_id), **kw)
    except grpc.RpcError as exc:
        what = "create" if live is None else "re-point"
        raise DeployFailed(f"could not {what} deployment '{name}' to checkpoint {checkpoint_id}: "
                           f"{exc.code().name}: {exc.details()}") from None
    finally:
        channel.close()


# ---- what was recorded (resume) ------------------------------------------------------------------------------------

def _checkpoints(ctx: JobContext, *, after: int) -> list[Checkpoint]:
    """The job's training checkpoints after step `after` (the current iteration's), by step."""
    with ctx.db.session() as s:
        return list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == ctx.job.id, Checkpoint.step > after)
                              .order_by(Checkpoint.step, Checkpoint.created_at)))


def _points(ctx: JobContext, key: str) -> list[JobMetric]:
    with ctx.db.session() as s:
        rows = s.scalars(select(JobMetric).where(JobMetric.job_id == ctx.job.id)
                         .order_by(JobMetric.step, JobMetric.id)).all()
    return [r for r in rows if key in r.data]


def _recorded_iterations(ctx: JobContext) -> tuple[int, int, Checkpoint | None]:
    """(iterations done, the job's step where the last one ended, its best checkpoint) from the recorded points."""
    finished = _points(ctx, "loop/iterations_done")
    if not finished:
        return 0, 0, None
    last = max(finished, key=lambda r: r.data["loop/iterations_done"])
    i = int(last.data["loop/iterations_done"]) - 1
    best_step = int(last.data[f"iteration/{i}/best_step"])
    with ctx.db.session() as s:
        best = s.scalar(select(Checkpoint).where(Checkpoint.job_id == ctx.job.id, Checkpoint.step == best_step)
                        .order_by(Checkpoint.created_at.desc()).limit(1))
    return i + 1, last.step, best


def _recorded_scores(ctx: JobContext, steps: list[int]) -> dict[int, dict]:
    wanted = set(steps)
    return {r.step: r.data for r in _points(ctx, "loop/checkpoint_reward_mean") if r.step in wanted}
