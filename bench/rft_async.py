"""Managed RFT, sync vs async: the arithmetic task ("3+4=" -> "7") on the tiny model, the same budget in every mode
(the same steps, prompts per step and samples per prompt), through the job's RL loop (services/trainer/rl/loop.py,
its rollout in a process of its own that hot-loads every version).

As in examples/grpo_arithmetic.py, the random-weight model first gets a short SFT warm-up on the answer format (half
of the 100 problems; the engine's summed NLL, full-parameter) so that the reward (builtin:first_number: the first
number of the completion is the sum) is not always 0; RL then runs on all 100 problems. Every mode starts from the
same warm-up weights and the same seeds.

Modes: sync (sample batch k at version k, then train), async with max_staleness 1 and 2 (sampling of the next
batches overlaps training; partial rollouts). Each mode runs --repeats times, in the order sync, s1, s2, s2, s1, sync,
... so that a change in the machine's load during the run falls on every mode alike. Reported per mode: median and
mean wall time per step over its runs (steps 2..N: the first step includes loading the rollout), the speed-up over
sync, the reward curve, staleness and the trainer-vs-rollout k3 KL per step. Writes bench/results/rft_async.csv (one
row per mode, run and step; the reward curves are the same seeds in every run of a mode, up to the async modes'
timing-dependent staleness).

    .venv/bin/python bench/rft_async.py [--steps 30] [--prompts 16] [--group 8] [--threads 1] [--repeats 2]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from models.tiny import build_tiny_model
from models.tokenizer import load_tokenizer
from services.common.methods.rft import RftHyperparams
from services.rollout.weights import BASE_FILES
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.rl.loop import run_rft
from services.trainer.rl.rewards import builtin
from services.trainer.sft import Metrics

RESULTS = Path(__file__).resolve().parent / "results"


def warm_up(base: Path, out: Path, steps: int, seed: int) -> Path:
    """SFT on the answer format of 50 of the 100 problems; the weights as a model directory."""
    tok = load_tokenizer(base)
    rows = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(rows)
    engine = TrainingEngine.load(base, lora=None, seed=seed, optimizer=AdamW(learning_rate=1e-3))
    seqs = []
    for prompt, answer in rows[:50]:
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append((p, a))
    T = max(len(p) + len(a) for p, a in seqs) - 1
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    targets = torch.full((len(seqs), T), -100, dtype=torch.int64)
    for i, (p, a) in enumerate(seqs):
        full = p + a
        ids[i, :len(full) - 1] = torch.tensor(full[:-1])
        targets[i, len(p) - 1:len(full) - 1] = torch.tensor(a)
    n = int((targets != -100).sum())
    for _ in range(steps):
        (engine.nll_sum(ids, targets) / n).backward()
        engine.step(AdamW(learning_rate=1e-3))
    engine.save_weights(out, base_model=str(base))
    for name in BASE_FILES:
        if (base / name).exists() and not (out / name).exists():
            shutil.copy(base / name, out / name)
    return out


def run_mode(model: Path, data: Path, work: Path, args, mode: str, staleness: int, run: int) -> list[dict]:
    hp = RftHyperparams.from_request(dict(
        evaluator="builtin:first_number", full_parameter=True, steps=args.steps, prompts_per_step=args.prompts,
        group_size=args.group, max_tokens=4, learning_rate=args.lr, mode=mode, max_staleness=staleness,
        checkpoint_every=10**6, seed=args.seed))
    rows = []
    for ev in run_rft(model, data, hp, reward=builtin(hp.evaluator), stop=threading.Event(), work_dir=work,
                      torch_threads=args.threads):
        if isinstance(ev, Metrics):
            m = ev.metrics
            rows.append({"mode": mode if mode == "sync" else f"async-s{staleness}", "run": run, "step": ev.step,
                         "step_s": round(m["time/step_s"], 4), "wait_rollout_s": round(m["time/wait_rollout_s"], 4),
                         "reward_mean": round(m["reward/mean"], 4), "staleness_mean": round(m["staleness/mean"], 3),
                         "staleness_max": m["staleness/max"],
                         "kl_k3_rollout_trainer": float(f"{m.get('kl/k3_rollout_trainer', 0.0):.4g}"),
                         "clip_fraction": round(m.get("train/clip_fraction", 0.0), 4),
                         "rollout_tokens_per_s": round(m["rollout/tokens_per_s"], 1),
                         "train_tokens_per_s": round(m.get("train/tokens_per_s", 0.0), 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and of the rollout each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    p.add_argument("--out", type=Path, default=RESULTS / "rft_async.csv")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="rft-bench-"))
    try:
        base = build_tiny_model(tmp / "base")
        model = warm_up(base, tmp / "warm", args.warmup_steps, args.seed)
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                                for a in range(10) for b in range(10)))
        rows = []
        modes = [("sync", 1), ("async", 1), ("async", 2)]
        for run in range(args.repeats):
            for mode, s in (modes if run % 2 == 0 else modes[::-1]):
                t0 = time.perf_counter()
                rows += run_mode(model, data, tmp / f"work-{mode}-{s}-{run}", args, mode, s, run)
                print(f"{mode} s={s} run {run}: {time.perf_counter() - t0:.1f}s, load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    sync_med = statistics.median(r["step_s"] for r in rows if r["mode"] == "sync" and r["step"] > 1)
    print(f"\n{args.repeats} run(s) per mode; reward, staleness and KL columns: run 0")
    print("| mode | median s/step | mean s/step | speed-up vs sync (median) | reward first 5 -> last 5 | "
          "staleness mean / max | k3 KL mean |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode and r["run"] == 0]
        times = [r["step_s"] for r in rows if r["mode"] == mode and r["step"] > 1]
        med = statistics.median(times)
        print(f"| {mode} | {med:.3f} | {statistics.mean(times):.3f} | {sync_med / med:.2f}x | "
              f"{statistics.mean(r['reward_mean'] for r in rs[:5]):.3f} -> "
              f"{statistics.mean(r['reward_mean'] for r in rs[-5:]):.3f} | "
              f"{statistics.mean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs):.0f} | "
              f"{statistics.mean(r['kl_k3_rollout_trainer'] for r in rs):.2e} |")
    print(f"\ncurves: {args.out}")


if __name__ == "__main__":
    main()
