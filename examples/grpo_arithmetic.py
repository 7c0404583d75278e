"""GRPO on single-digit additions ("3+4=" -> "7") with the Training API, from the tiny random-weight model.

    python examples/grpo_arithmetic.py                    # embedded stack; about 2 minutes on 2 CPU cores
    python examples/grpo_arithmetic.py --steps 40 --out /tmp/curve.csv

A model with random weights almost never writes a number and stops, so pure RL would see no reward at all. The run
therefore starts with a short SFT warm-up on the answer format, using half of the 100 problems a+b (a, b in 0..9),
and then runs GRPO on the other half only: the problems whose rewards are reported were never seen in supervised
training. The warm-up teaches the format (a number, then the end-of-turn token), not the sums: the tiny model does
not generalize from one half to the other (greedy accuracy on the GRPO half after the warm-up is about 0.02), so
what GRPO then learns, it learns from the reward alone. It learns the answers of its own 50 problems; this is not a
claim that the model learned addition in general.

The session is full-parameter (--rank N trains a LoRA adapter instead): on this random-weight model LoRA learns the
format far more slowly, since the embeddings, tied to the output layer, stay frozen under LoRA. After the warm-up,
save_state and create_training_client_from_state carry the weights to a new session with a fresh optimizer (see the
comment in main). Each GRPO step
  1. saves the weights and gets a sampling client pinned to them (save_weights_and_get_sampling_client),
  2. samples a group of completions per prompt (temperature 1) with their sampling logprobs,
  3. scores each with reward_fn (1.0 when the completion's first number is the right sum, else 0.0),
  4. turns rewards into group-normalized advantages (reward - group mean) / (group std + 1e-6),
  5. trains on datums with target_tokens, logprobs, advantages and a mask on the completion tokens through the
     built-in "grpo" loss (forward_backward), then optim_step.
It prints the mean reward per step, greedy accuracy on the GRPO problems before and after, and writes the curve to
--out (default examples/results/grpo_reward_curve.csv; elapsed_s counts from the script's start). The sampling seeds
are fixed, so a rerun gives the same curve up to small floating-point differences.

Services: by default the example starts its own embedded stack (SQLite, local processes; see _common.py). With
TRAINYARD_TRAINER_URL set it uses that stack instead (TRAINYARD_API_KEY, TRAINYARD_ROLLOUT_URL).
"""
from __future__ import annotations

import csv
import random
import re
import sys
from pathlib import Path

import numpy as np

from _common import EXAMPLES, Timer, parser, service_client
from trainyard import types

NUMBER = re.compile(r"-?\d+")
MASKED = ("grpo", "dr_grpo", "dapo", "gspo")  # the built-in losses that take a mask


def reward_fn(completion: str, row: dict) -> float:
    """1.0 when the first number in the completion equals row["answer"], else 0.0."""
    match = NUMBER.search(completion)
    return 1.0 if match is not None and int(match.group()) == row["answer"] else 0.0


def problems(seed: int) -> tuple[list[dict], list[dict]]:
    """The 100 problems a+b, split in two disjoint halves: SFT warm-up, and GRPO (held out from SFT)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(rows)
    return rows[:50], rows[50:]


def sft_datum(tokenizer, row: dict) -> types.Datum:
    p = tokenizer.encode(row["prompt"], add_special_tokens=False)
    a = tokenizer.encode(str(row["answer"]), add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = p + a
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)})


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float, mask: bool = True) -> types.Datum:
    """One sampled completion as a policy-gradient datum: the prompt's positions have advantage 0 and, for the losses
    that take one (grpo, dr_grpo, dapo, gspo), mask 0, so the loss covers the completion's tokens only."""
    pad = [0.0] * (len(prompt) - 1)
    n = len(seq.tokens)
    inputs = {"target_tokens": prompt[1:] + seq.tokens, "logprobs": pad + list(seq.logprobs),
              "advantages": pad + [advantage] * n}
    if mask:
        inputs["mask"] = pad + [1.0] * n
    return types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]), loss_fn_inputs=inputs)


def greedy_accuracy(sampler, tokenizer, rows: list[dict]) -> float:
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(tokenizer.encode(r["prompt"], add_special_tokens=False)), 1,
                              params) for r in rows]
    return float(np.mean([reward_fn(f.result().sequences[0].text, r) for f, r in zip(futures, rows)]))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], steps=80)
    p.add_argument("--warmup-steps", type=int, default=20, help="SFT steps on the warm-up half before GRPO")
    p.add_argument("--prompts", type=int, default=50, help="prompts per GRPO step (50: every GRPO problem)")
    p.add_argument("--group-size", type=int, default=16, help="completions sampled per prompt")
    p.add_argument("--lr", type=float, default=2e-4, help="Adam learning rate of the GRPO steps")
    p.add_argument("--warmup-lr", type=float, default=1e-3, help="Adam learning rate of the warm-up steps")
    p.add_argument("--loss", default="grpo", choices=["grpo", "dr_grpo", "dapo", "ppo", "importance_sampling"],
                   help="built-in policy-gradient loss")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank; 0: full-parameter training")
    p.add_argument("--out", type=Path, default=EXAMPLES / "results" / "grpo_reward_curve.csv",
                   help="CSV file for the reward curve")
    args = p.parse_args(argv)
    timer = Timer()
    warmup_rows, rl_rows = problems(args.seed)
    rng = random.Random(args.seed + 1)

    with service_client(args.work_dir) as service:
        tc = (service.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed) if args.rank else
              service.create_training_client(args.base_model, seed=args.seed)).result()
        tokenizer = tc.get_tokenizer()

        # 1. SFT warm-up on the answer format (problems disjoint from GRPO's).
        warmup = [sft_datum(tokenizer, r) for r in warmup_rows]
        for step in range(args.warmup_steps):
            fb = tc.forward_backward(warmup, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=args.warmup_lr))
            print(f"warm-up {step + 1}/{args.warmup_steps}: loss {fb.result().metrics['loss:mean']:.3f}")
        # GRPO goes on from the warm-up's weights with a fresh optimizer: Adam's second moments from the SFT steps
        # (sums over every answer token) are far larger than GRPO's gradients (means over the batch), and would
        # shrink its steps for a hundred steps or more.
        state = tc.save_state("grpo-warmup").result()
        tc.close()
        tc = service.create_training_client_from_state(state.path).result()

        # 2. GRPO on the held-out half.
        sampler = tc.save_weights_and_get_sampling_client("grpo-start").result()
        acc_before = greedy_accuracy(sampler, tokenizer, rl_rows)
        print(f"greedy accuracy on the {len(rl_rows)} GRPO problems before GRPO: {acc_before:.2f}")
        order: list[dict] = []
        curve = []
        for step in range(args.steps):
            if len(order) < args.prompts:
                order += rng.sample(rl_rows, len(rl_rows))
            batch_rows, order = order[:args.prompts], order[args.prompts:]
            if step:
                sampler = tc.save_weights_and_get_sampling_client(f"grpo-{step}").result()
            prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in batch_rows]
            seed = (args.seed * 1000 + step) * 1000  # a seed per request: the run is reproducible
            futures = [sampler.sample(types.ModelInput.from_ints(pr), args.group_size,
                                      types.SamplingParams(max_tokens=4, temperature=1.0, seed=seed + i))
                       for i, pr in enumerate(prompts)]
            data, rewards, signal = [], [], 0
            for row, prompt, fut in zip(batch_rows, prompts, futures):
                seqs = fut.result().sequences
                r = np.array([reward_fn(s.text, row) for s in seqs])
                rewards.append(r)
                adv = (r - r.mean()) / (r.std() + 1e-6)
                if r.std() == 0:
                    continue  # all equal: no signal from this group
                signal += 1
                data += [rl_datum(prompt, s, float(a), mask=args.loss in MASKED) for s, a in zip(seqs, adv)]
            mean_reward = float(np.mean(rewards))
            metrics = {}
            if data:
                fb = tc.forward_backward(data, args.loss)
                tc.optim_step(types.AdamParams(learning_rate=args.lr))
                metrics = fb.result().metrics
            curve.append({"step": step, "mean_reward": round(mean_reward, 4), "groups_with_signal": signal,
                          "datums": len(data), "loss": float(f"{metrics.get('loss:mean', 0.0):.3g}"),
                          "kl_sample_train": float(f"{metrics.get('kl_sample_train:mean', 0.0):.3g}"),
                          "clip_fraction": round(metrics.get("clip_fraction:mean", 0.0), 4),
                          "elapsed_s": round(timer.seconds, 1)})
            print(f"step {step:3d}  mean reward {mean_reward:.3f}  groups with signal {signal}/{len(prompts)}  "
                  f"kl(sampler, trainer) {curve[-1]['kl_sample_train']:+.1e}  [{timer}]")

        sampler = tc.save_weights_and_get_sampling_client("grpo-final").result()
        acc_after = greedy_accuracy(sampler, tokenizer, rl_rows)
        print(f"greedy accuracy on the {len(rl_rows)} GRPO problems after GRPO: {acc_after:.2f}")
        for row in rl_rows[:4]:
            out = sampler.sample(types.ModelInput.from_ints(tokenizer.encode(row["prompt"], add_special_tokens=False)),
                                 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
            print(f"  {row['prompt']}{out.sequences[0].text!r}  (answer {row['answer']})")
        tc.close()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    k = min(5, len(curve))
    first, last = np.mean([c["mean_reward"] for c in curve[:k]]), np.mean([c["mean_reward"] for c in curve[-k:]])
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; greedy accuracy "
          f"{acc_before:.2f} -> {acc_after:.2f}; curve written to {args.out}; done in {timer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
