"""Training API: streaming forward_backward vs accumulate-then-compute, latency after the last datum arrives.

Datums arrive one at a time, every --interval seconds (a slow producer, e.g. a rollout finishing one sample at a
time); the metric is the latency from the moment the client has the last datum to the moment it has the result.

- stream: TrainingClient.forward_backward_stream(datums as they arrive, "grpo", micro_batch_tokens=M): each datum
  goes out on a ForwardBackwardStream as soon as it arrives, and the trainer computes each micro-batch as soon as it
  is complete, so after the last arrival only the last micro-batch (one or two datums) and the call's end remain.
- accumulate: the client waits for every datum, then TrainingClient.forward_backward(all of them, "grpo",
  micro_batch_tokens=M): the whole batch's compute comes after the last arrival.

Platform, model and datums are bench/training_api_losses.py's (the trainer's gRPC server in this process, the SDK
over a real channel; Qwen3 hidden 512 / 8 layers / vocab 1024, LoRA rank 32, float32): --groups x --samples
GRPO-shaped datums of 128..256 tokens (default 4 x 8 = 32). M defaults to 320 tokens, so a micro-batch holds one
datum or two (two datums of 127..255 tokens fit when their sum is <= 320; three never do). Each path has its own
LoRA session, both created with the same seed; every round runs both paths (alternating which goes first), compares
their results bitwise (the logprobs and metrics returned, the gradients, read from the trainer's session in this
process, and the weights after an OptimStep that both sessions then take), so the two sessions stay identical from
round to round. Reported per path: the median latency, the median call time (stream: from its first datum's arrival
to the result; accumulate: the ForwardBackward call), and the median over rounds of each round's
accumulate/stream latency ratio. For the stream to keep up, the interval must exceed the trainer's time per datum
(printed: the accumulate call's time / datums); below that, datums queue and the stream's latency grows with the
backlog.

    .venv/bin/python bench/training_api_stream.py [--interval 0.75] [--groups 4] [--samples 8] [--rounds 5]
        [--micro-batch-tokens 320] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from training_api_losses import ADAM, LORA_RANK, MODEL_NAME, Platform, build_model, grpo_batch

from trainyard import types


def arrivals(data: list[types.Datum], interval: float, times: list[float]):
    """The datums, each yielded when it 'arrives' (start + (i + 1) * interval); times gets each arrival's clock."""
    start = time.perf_counter()
    for i, d in enumerate(data):
        delay = start + (i + 1) * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        times.append(time.perf_counter())
        yield d


def run_stream(tc, data, interval: float, mbt: int) -> tuple[types.ForwardBackwardOutput, float, float]:
    """(result, latency after the last arrival, seconds from the first arrival to the result)."""
    times: list[float] = []
    out = tc.forward_backward_stream(arrivals(data, interval, times), "grpo", micro_batch_tokens=mbt).result()
    done = time.perf_counter()
    return out, done - times[-1], done - times[0]


def run_accumulate(tc, data, interval: float, mbt: int) -> tuple[types.ForwardBackwardOutput, float, float]:
    """(result, latency after the last arrival, seconds of the ForwardBackward call)."""
    times: list[float] = []
    held = list(arrivals(data, interval, times))
    start = time.perf_counter()
    out = tc.forward_backward(held, "grpo", micro_batch_tokens=mbt).result()
    done = time.perf_counter()
    return out, done - times[-1], done - start


def same_output(a: types.ForwardBackwardOutput, b: types.ForwardBackwardOutput) -> bool:
    return a.metrics == b.metrics and len(a.loss_fn_outputs) == len(b.loss_fn_outputs) and all(
        torch.equal(x["logprobs"].to_torch(), y["logprobs"].to_torch())
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs))


def same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def micro_batches(lengths: list[int], max_tokens: int) -> list[int]:
    """Datums per micro-batch under the trainer's greedy packing
    (services.trainer.engine.forward_backward.MicroBatcher)."""
    sizes, tokens, n = [], 0, 0
    for length in lengths:
        if n and tokens + length > max_tokens:
            sizes.append(n)
            tokens, n = 0, 0
        tokens, n = tokens + length, n + 1
        if tokens >= max_tokens:
            sizes.append(n)
            tokens, n = 0, 0
    return sizes + ([n] if n else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.75, help="seconds between datum arrivals")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mbt = args.micro_batch_tokens
    load_start = os.getloadavg()[0]
    rows = {"stream": [], "accumulate": []}  # (latency s, call s) per round
    checks = []  # per round: (outputs equal, gradients equal, weights equal after the step)
    with tempfile.TemporaryDirectory(prefix="bench-training-api-") as tmp:
        root = Path(tmp)
        platform = Platform(root / "platform", build_model(root / "model"), args.threads)
        try:
            data = grpo_batch(platform, args.groups, args.samples)
            lengths = [d.model_input.length for d in data]
            stream_tc, acc_tc = platform.lora_client(seed=1), platform.lora_client(seed=1)
            for tc in (stream_tc, acc_tc):  # warm-up (first-call costs), then a step so LoRA B is not 0
                tc.forward_backward(data[:2], "grpo", micro_batch_tokens=mbt).result()
                tc.optim_step(ADAM).result()
            for r in range(args.rounds):
                results = {}
                for name in ("stream", "accumulate") if r % 2 == 0 else ("accumulate", "stream"):
                    run, tc = (run_stream, stream_tc) if name == "stream" else (run_accumulate, acc_tc)
                    out, latency, call_s = run(tc, data, args.interval, mbt)
                    results[name] = out
                    rows[name].append((latency, call_s))
                grads_equal = same(platform.grads(stream_tc), platform.grads(acc_tc))
                for tc in (stream_tc, acc_tc):
                    tc.optim_step(ADAM).result()
                checks.append((same_output(results["stream"], results["accumulate"]), grads_equal,
                               same(platform.weights(stream_tc), platform.weights(acc_tc))))
                print(f"round {r + 1}: latency stream {rows['stream'][-1][0]:.3f} s, accumulate "
                      f"{rows['accumulate'][-1][0]:.3f} s; bitwise outputs/grads/weights {checks[-1]}", flush=True)
        finally:
            platform.close()

    sizes = micro_batches(lengths, mbt)
    ratios = [a[0] / s[0] for s, a in zip(rows["stream"], rows["accumulate"])]
    acc_call = statistics.median(c for _, c in rows["accumulate"])
    print(f"cpu, {args.threads} torch thread(s), torch {torch.__version__}, float32; load average at start "
          f"{load_start:.2f}")
    print(f"model {MODEL_NAME} (Qwen3, hidden 512, 8 layers, vocab 1024), LoRA rank {LORA_RANK}, loss grpo; "
          f"{len(data)} datums, {sum(lengths)} tokens ({min(lengths)}..{max(lengths)} per datum), one every "
          f"{args.interval:.3f} s; micro_batch_tokens {mbt}: {len(sizes)} micro-batches of "
          f"{min(sizes)}..{max(sizes)} datums ({sizes.count(1)} of one, last one {sizes[-1]}); {args.rounds} rounds")
    print(f"trainer time per datum (accumulate call / datums): {acc_call / len(data):.3f} s")
    print(f"{'path':11s} {'latency after last datum s':>27s} {'min':>7s} {'max':>7s} {'call s':>8s}")
    for name in ("stream", "accumulate"):
        lat = [x for x, _ in rows[name]]
        print(f"{name:11s} {statistics.median(lat):27.3f} {min(lat):7.3f} {max(lat):7.3f} "
              f"{statistics.median(c for _, c in rows[name]):8.2f}")
    print(f"accumulate/stream latency: median of per-round ratios {statistics.median(ratios):.1f}x "
          f"(rounds: {', '.join(f'{x:.1f}' for x in ratios)})")
    print(f"bitwise equal in every round: outputs {all(c[0] for c in checks)}, gradients "
          f"{all(c[1] for c in checks)}, weights after OptimStep {all(c[2] for c in checks)}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
