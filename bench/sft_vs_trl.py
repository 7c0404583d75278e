"""Managed LoRA SFT (services/trainer/sft.py on the training engine) against TRL's SFTTrainer with a PEFT LoRA: the
same model, data, sequence length, LoRA, optimizer and thread count on the CPU, in the same run; tokens per second and
peak memory side by side.

Model: bench/rollout.py's Qwen3 shape (models.tiny.QWEN3_H512_L8: hidden 512, 8 layers, 8 / 4 heads of 64, intermediate
1536; the tiny tokenizer), float32, random weights. Data: batch x steps prompt / completion rows of random words (one
epoch), loss on the completion only; "fixed": every row --seq-len tokens, "varied": lengths spread from --seq-len / 8 to
--seq-len. Both trainers get the same token ids (TRL a pre-tokenized dataset with a completion mask); each its own
batching: TRL pads a batch to its longest row, Trainyard packs a batch into one row. LoRA rank --rank, alpha 2 x rank,
dropout 0, on every attention and MLP projection; AdamW lr 1e-4 (betas 0.9 / 0.999, eps 1e-8, no weight decay), gradient
norm clipped at 1; batch --batch, no accumulation; --steps optimizer steps, the first --warmup untimed.

Each trainer runs in a child process of its own (so each peak is its own): tokens/s over the timed steps (tokens = every
input token of the steps' examples, counted as the data's mean length x batch x timed steps), peak RSS of the process
and its growth from just before training starts. Trainyard's process gets the allocator its worker runs with
(docker-compose.yml's training environment: jemalloc keeping the pages it frees); TRL runs as its users run it, with
its SFTConfig default (gradient checkpointing on) and with gradient checkpointing off, and once more with its default
on Trainyard's allocator ("trl-gc-jemalloc").

    .venv/bin/python bench/sft_vs_trl.py [--steps 12] [--warmup 2] [--batch 8] [--seq-len 256] [--threads 2]
                                         [--rank 16] [--rounds 3]

With --rounds R every side runs R times, the sides alternating, and the table shows each side's median tokens/s and
its largest peak (on a machine whose speed drifts, alternating keeps the ratios fair).

Needs TRL (`.venv/bin/pip install 'trl==1.16.0'`: it brings datasets; torch stays the installed 2.13.0).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def training_allocator() -> dict[str, str]:
    """The allocator settings of the worker in docker-compose.yml (where its library is installed)."""
    from trainyard.localstack import compose_services, preloadable

    env = compose_services()["worker"].get("environment") or {}
    if not preloadable(str(env.get("LD_PRELOAD", ""))):
        return {}
    return {k: str(env[k]) for k in ("LD_PRELOAD", "MALLOC_CONF") if k in env}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_data(model_dir: Path, out: Path, rows: int, seq_len: int, varied: bool, seed: int = 0) -> tuple[Path, float]:
    """JSONL prompt / completion rows of random words and their mean token length (at most seq_len: longer rows are
    truncated by both trainers). Fixed: every row reaches seq_len. Varied: lengths spread evenly from seq_len / 8 to
    seq_len, as real chat data is."""
    from models.chat import tokenize_sft_example
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 2][:2000]
    rng = random.Random(seed)
    lengths = []
    with open(out, "w") as f:
        for _ in range(rows):
            words_wanted = rng.randint(seq_len // 32, seq_len // 4) if varied else 2 * seq_len  # ~4 tokens a word
            prompt = " ".join(rng.choice(words) for _ in range(max(1, words_wanted // 8)))
            completion = " ".join(rng.choice(words) for _ in range(words_wanted))
            row = {"prompt": prompt, "completion": completion}
            lengths.append(len(tokenize_sft_example(tok, row, seq_len).input_ids))
            f.write(json.dumps(row) + "\n")
    return out, sum(lengths) / len(lengths)


def run_trainyard(args) -> dict:
    from services.common.methods.sft import SftHyperparams
    from services.trainer.sft import Metrics, Started, run_sft

    hp = SftHyperparams.from_request({
        "max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-4, "lora_rank": args.rank,
        "lora_alpha": 2.0 * args.rank, "lora_dropout": 0.0, "target_modules": list(TARGETS),
        "max_seq_len": args.seq_len, "eval_fraction": 0.0, "checkpoint_every": args.steps, "lr_scheduler": "linear",
        "max_grad_norm": 1.0, "weight_decay": 0.0, "seed": 0})
    stamps: dict[int, float] = {}
    before: list[float] = []
    with tempfile.TemporaryDirectory() as work:
        for event in run_sft(Path(args.model_dir), Path(args.data), hp, stop=threading.Event(), work_dir=Path(work)):
            if isinstance(event, Started):
                before.append(rss_mb())
                stamps[0] = time.perf_counter()
            elif isinstance(event, Metrics):
                stamps.setdefault(event.step, time.perf_counter())
    return {"seconds": stamps[args.steps] - stamps[args.warmup], "rss_before_mb": before[0], "peak_mb": peak_mb()}


def run_trl(args, gradient_checkpointing: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from models.chat import tokenize_sft_example
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model_dir)
    rows = [json.loads(line) for line in open(args.data)]
    examples = [tokenize_sft_example(tok, r, args.seq_len) for r in rows]
    dataset = Dataset.from_list([{"input_ids": e.input_ids, "completion_mask": e.loss_mask} for e in examples])
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    stamps: dict[int, float] = {}
    before: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            before.append(rss_mb())

        def on_step_end(self, _args, state, *a, **k):
            stamps[state.global_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out, use_cpu=True, bf16=False, max_steps=args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="linear", weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0,
            max_length=args.seq_len, packing=False, completion_only_loss=True, save_strategy="no", report_to=[],
            logging_steps=10_000, dataloader_num_workers=0, seed=0, gradient_checkpointing=gradient_checkpointing,
            disable_tqdm=True)
        peft_config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                 target_modules=list(TARGETS), task_type="CAUSAL_LM")
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                             peft_config=peft_config, callbacks=[Clock()])
        trainer.train()
    return {"seconds": stamps[args.steps] - stamps[args.warmup], "rss_before_mb": before[0], "peak_mb": peak_mb()}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.side == "trainyard":
        result = run_trainyard(args)
    else:
        result = run_trl(args, gradient_checkpointing=args.side in ("trl-gc", "trl-gc-jemalloc"))
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default="trainyard,trl-gc,trl,trl-gc-jemalloc")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every side, alternating; medians reported")
    parser.add_argument("--data-lengths", default="fixed,varied", help="fixed: every row seq-len tokens; varied: "
                        "seq-len / 8 .. seq-len")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    from models.tiny import QWEN3_H512_L8, build_tiny_model

    print(f"cpu, {args.threads} threads, float32; LoRA r={args.rank} alpha={2 * args.rank} on {', '.join(TARGETS)}; "
          f"batch {args.batch}, max {args.seq_len} tokens, {args.steps} steps ({args.warmup} untimed), median of "
          f"{args.rounds} alternating round(s); load average {os.getloadavg()[0]:.2f}")
    labels = {"trainyard": "trainyard (managed SFT, engine)", "trl-gc": "TRL SFTTrainer (default: grad ckpt)",
              "trl": "TRL SFTTrainer (grad ckpt off)", "trl-gc-jemalloc": "TRL default, Trainyard's allocator"}
    allocator = training_allocator()
    print(f"Trainyard's allocator (the worker's): {allocator or 'the default (jemalloc is not installed)'}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "qwen3-h512-l8", overrides=QWEN3_H512_L8)
        for kind in args.data_lengths.split(","):
            data, mean_len = make_data(model_dir, Path(tmp) / f"{kind}.jsonl", rows=args.batch * args.steps,
                                       seq_len=args.seq_len, varied=kind == "varied")
            tokens = mean_len * args.batch * (args.steps - args.warmup)  # one epoch: each row once
            runs: dict[str, list[dict]] = {}
            for _ in range(args.rounds):  # sides alternate, so a slow spell of the machine hits each alike
                for side in args.sides.split(","):
                    cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(model_dir), "--data",
                           str(data), "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
                           str(args.batch), "--seq-len", str(args.seq_len), "--rank", str(args.rank), "--threads",
                           str(args.threads)]
                    env = {**os.environ, "PYTHONPATH": str(ROOT)}
                    if side in ("trainyard", "trl-gc-jemalloc"):
                        env |= allocator
                    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
                    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if out.returncode != 0 or line is None:
                        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
                    runs.setdefault(side, []).append(json.loads(line[len("RESULT "):]))
            # Per side: the median time of its rounds, and its largest peak.
            results = {side: {"seconds": statistics.median(r["seconds"] for r in rs),
                              "peak_mb": max(r["peak_mb"] for r in rs),
                              "rss_before_mb": min(r["rss_before_mb"] for r in rs)} for side, rs in runs.items()}
            base = results.get("trainyard")
            print(f"\n{kind} lengths (mean {mean_len:.0f} tokens)")
            print(f"{'trainer':36s} {'tokens/s':>9s} {'peak RSS MB':>12s} {'growth MB':>10s} {'trainyard speedup':>18s}")
            for side, r in results.items():
                tps = tokens / r["seconds"]
                speed = f"{(tokens / base['seconds']) / tps:.2f}x" if base and side != "trainyard" else ""
                print(f"{labels[side]:36s} {tps:9.0f} {r['peak_mb']:12.0f} {r['peak_mb'] - r['rss_before_mb']:10.0f} "
                      f"{speed:>18s}", flush=True)


if __name__ == "__main__":
    main()
