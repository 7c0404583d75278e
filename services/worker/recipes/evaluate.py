"""The managed evaluation recipe: sample samples_per_row completions per row of the dataset from a checkpoint (or the
base model) with the rollout engine in this process, score each with the account's evaluator in its sandbox, and
keep the results (docs/evaluation.md).

Rows are rft rows ({"prompt": ...} or {"messages": [...]}, plus the fields the evaluator reads); the first max_rows
of them are evaluated. Every row is submitted at once, so the engine batches them (continuous batching); results are
scored as rows finish, in row order. Progress: a step per row. A cancellation stops between rows.

Metrics (one point at the last row): eval/reward_mean over every scored completion, eval/pass@1 and eval/pass@k
(the unbiased estimator 1 - C(n-c, k)/C(n, k) per row, averaged over rows, with n = k samples of which c passed:
reward >= pass_threshold), eval/errors (completions the evaluator failed on: they count as not passed and are left
out of the mean), eval/rows, eval/k. Per-row results are one JSONL file (row, completions, rewards, errors, passed) stored
as the job's output checkpoint of kind eval_results: `trainyard checkpoints download <id>` fetches it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable

from services.common import blobrefs
from services.common.blobstore import StoredFile
from services.common.methods.evaluate import RESULT_KIND, EvalHyperparams
from services.common.schema import Checkpoint, Dataset
from services.worker.job import JobContext, RecipeOutcome
from trainyard.methods.evaluate import EvalSettings

MAX_LOGGED_ERRORS = 20  # per-completion evaluator errors written to the job log (all are in the results file)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c passed (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(results: list[dict], k: int) -> dict[str, float]:
    """The job's metrics from its per-row results."""
    rewards = [r for row in results for r in row["rewards"] if r is not None]
    errors = sum(e != "" for row in results for e in row["errors"])
    rows = len(results)
    return {
        "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "eval/pass@1": sum(pass_at_k(len(r["rewards"]), r["passed"], 1) for r in results) / rows if rows else 0.0,
        "eval/pass@k": sum(pass_at_k(len(r["rewards"]), r["passed"], k) for r in results) / rows if rows else 0.0,
        "eval/errors": float(errors),
        "eval/rows": float(rows),
        "eval/k": float(k),
    }


def read_rows(ctx: JobContext, dataset_id: str, max_rows: int | None) -> list[dict]:
    """The first max_rows rows of a dataset, laid out verified against its sha256."""
    from services.trainer.data import read_jsonl

    with ctx.db.session() as s:
        dataset = s.get(Dataset, dataset_id)
    data_path = ctx.blobs.materialize([StoredFile("dataset.jsonl", dataset.sha256, dataset.size_bytes)],
                                      ctx.work / "data" / dataset.id, what=f"dataset {dataset.id}") / "dataset.jsonl"
    return read_jsonl(data_path)[:max_rows]


def rollout_engine(ctx: JobContext):
    """A rollout engine in this process, on the job's rollout GPU if it holds one."""
    import torch

    from services.rollout.engine import Engine, EngineConfig

    rollout = [d for d in ctx.devices if d.role == "rollout" and d.kind == "gpu"]
    device = f"cuda:{rollout[0].index}" if rollout else ("cuda" if torch.cuda.is_available() else "cpu")
    return Engine(EngineConfig(device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32,
                               kv_cache_mb=256, max_loaded_adapters=1))


def weights(ctx: JobContext, engine, ckpt: Checkpoint | None) -> tuple[str, str | None]:
    """(model directory, adapter id or None) to sample a checkpoint (None: the base model) with: its files laid out
    verified, a LoRA adapter loaded into the engine under the checkpoint's id."""
    model_dir, adapter = ctx.job.model_path, None
    if ckpt is not None:
        target = ctx.work / "checkpoint" / ckpt.id
        ctx.blobs.materialize([StoredFile.from_json(f) for f in ckpt.files], target, what=f"checkpoint {ckpt.id}")
        if ckpt.kind == "full":
            model_dir = str(target)
        else:
            adapter = ckpt.id
            engine.load_adapter(adapter, model_dir, target)
    return model_dir, adapter


def score_rows(ctx: JobContext, engine, sandbox, model_dir: str, adapter: str | None, rows: list[dict],
               cfg: EvalSettings, on_row: Callable[[int], None] = lambda done: None,
               what: str = "") -> list[dict] | None:
    """Sample cfg.samples_per_row completions per row (all rows submitted at once) and score each in the sandbox;
    the per-row results, or None when the job's stop flag ended it (between rows). on_row(rows done) after each."""
    from models.chat import encode_chat_prompt
    from services.rollout.sampling import SamplingParams

    tokenizer = engine.base(model_dir).tokenizer
    handles = []
    for i, row in enumerate(rows):
        ids = (encode_chat_prompt(tokenizer, row["messages"]) if "messages" in row
               else tokenizer.encode(row["prompt"], add_special_tokens=True))
        params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, n=cfg.samples_per_row,
                                seed=cfg.sampling_seed + i)
        handles.append(engine.submit(model_dir, adapter, ids, params))
    results, logged = [], 0
    for i, (row, handle) in enumerate(zip(rows, handles)):
        if ctx.heartbeat.stop.is_set():
            for h in handles[i:]:
                h.cancel()
            return None
        completions = [seq.text for seq in handle.result().sequences]
        scores = sandbox.score([(c, row) for c in completions])
        rewards = [s.value for s in scores]
        errors = [s.error if s.value is None else "" for s in scores]
        passed = sum(r is not None and r >= cfg.pass_threshold for r in rewards)
        results.append({"row": i, "completions": completions, "rewards": rewards, "errors": errors,
                        "passed": passed})
        for j, e in enumerate(errors):
            if e and logged < MAX_LOGGED_ERRORS:
                logged += 1
                ctx.ledger.log(ctx.job.id, f"{what}row {i} completion {j}: the evaluator failed: {e}", "warning")
        on_row(i + 1)
    return results


def run(ctx: JobContext) -> RecipeOutcome:
    from services.evaluators.sandbox import Sandbox
    from services.evaluators.store import load_evaluator

    job, blobs, ledger = ctx.job, ctx.blobs, ctx.ledger
    cfg = EvalHyperparams.from_json(job.config)
    with ctx.db.session() as s:
        ckpt = s.get(Checkpoint, cfg.checkpoint_id) if cfg.checkpoint_id else None
    rows = read_rows(ctx, job.dataset_id, cfg.max_rows)
    code_dir = ctx.work / "evaluator"
    evaluator = load_evaluator(ctx.db, blobs, job.account_id, cfg.evaluator, code_dir)  # verified against its sha256
    engine = rollout_engine(ctx)
    try:
        model_dir, adapter = weights(ctx, engine, ckpt)
        what = f"checkpoint {ckpt.id}" if ckpt is not None else f"the base model {job.base_model}"
        ledger.log(job.id, f"evaluating {what} on {len(rows)} rows, {cfg.samples_per_row} samples each, with "
                           f"evaluator {evaluator.name}@{evaluator.version} ({evaluator.id})")
        ledger.progress(job.id, ctx.worker_id, total_steps=len(rows))
        scored = [0]  # rows done

        def on_row(done: int) -> None:
            scored[0] = done
            ledger.progress(job.id, ctx.worker_id, step=done)

        with Sandbox(code_dir, limits=ctx.settings.evaluator_limits()) as sandbox:
            results = score_rows(ctx, engine, sandbox, model_dir, adapter, rows, cfg, on_row)
        if results is None:
            return RecipeOutcome(step=scored[0], stopped=True)
    finally:
        engine.close()
    metrics = summarize(results, cfg.samples_per_row)
    out = ctx.work / "results"
    out.mkdir()
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    with blobs.saving(blobrefs.checker(ctx.db)) as save:  # a lost lease takes the new blob back
        files = [f.to_json() for f in save.put_tree(out)]
        row = ledger.add_checkpoint(job.id, ctx.worker_id, step=len(results), files=files, state=[], final=True,
                                    metrics=metrics, kind=RESULT_KIND)
    ledger.progress(job.id, ctx.worker_id, step=len(results), metrics=metrics)
    ledger.log(job.id, "evaluation: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
               + f"; per-row results in {row.id} (results.jsonl)")
    return RecipeOutcome(step=len(results), stopped=False, output_checkpoint_id=row.id)
