"""Training API: fused GRPO (one ForwardBackward, loss_fn="grpo") vs forward_backward_custom (two passes), per step.

Both paths run through the real trainer service: services.trainer.app.build's gRPC server in this process (SQLite,
a blob store, one account, the model registered as a shared base) and the SDK's TrainingClient
(trainyard.training) over a real channel, one LoRA session per path on the same base, created with the same seed.

- fused: TrainingClient.forward_backward(data, "grpo"): one forward and one backward on the trainer.
- custom: TrainingClient.forward_backward_custom(data, grpo_loss): a Forward for the logprobs, GRPO computed here in
  torch with autograd (grpo_loss below, the loss a user would write), then a ForwardBackward with loss_fn
  "cross_entropy" and weights = -dloss/dlogprobs.

Workload: a GRPO-shaped batch of --groups groups x --samples samples (default 2 x 8 = 16 datums): each group one
random prompt of 64..128 tokens, each sample a random completion of 64..128 tokens (128..256 tokens a datum); mask 1
on the completion's targets only; the group's rewards ~ N(0, 1) standardized within the group as the per-token
advantage of each sample; sampling logprobs = the base model's own logprobs + N(0, 0.1^2) noise (so ratios sit
near 1 and some clip). Model: Qwen3 architecture, hidden 512, 8 layers, 8/4 heads of 64, MLP 1536, tied
embeddings, models.tiny's random init and tokenizer (vocab 1024), float32; LoRA rank 32 on every attention and MLP
projection. The trainer packs each call's datums into micro-batches of its default 2048 tokens.

Measured:
- time: wall seconds of one step from the SDK call to its result (forward_backward(...).result() vs
  forward_backward_custom(...).result()); each is followed by an untimed OptimStep (Adam, lr 1e-5). --rounds rounds,
  the two paths alternating which goes first; per path the median, and the median over rounds of each round's
  custom/fused ratio (a burst of load from other jobs on the shared machine moves the ratio less than either time).
  The same for the process's CPU seconds per step (time.process_time: the trainer's and the client's threads),
  which time slices lost to other jobs do not inflate. Also the trainer's own seconds per call
  (SessionManager.forward, timed in the handler thread) and what the custom step spends outside the trainer (its
  client-side loss and backward, serialization, transport).
- memory: kernels.memory.TensorMemoryTracker's peak of live tensor storage allocated in the trainer during a call
  (entered in the gRPC handler thread around SessionManager.forward; parameters and the frozen base are not
  counted, gradients and activations are), one separate untimed step per path; custom's peak is the larger of its
  two calls'.
- agreement: before the timed rounds both sessions take the same fused step (so LoRA B is no longer 0 and every
  adapter gradient is live), then one step each way from equal weights: the logprobs both calls return, the loss,
  the gradients (read from the trainer's session in this process) and the weights after an OptimStep are compared.

    .venv/bin/python bench/training_api_losses.py [--groups 2] [--samples 8] [--rounds 9] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kernels.memory import TensorMemoryTracker
from models.tiny import QWEN3_H512_L8, build_tiny_model
from services.common import registry
from services.common.auth import create_account
from services.common.db import Database, migrate
from services.common.schema import SHARED_SCOPE
from services.trainer import app as trainer_app
from services.trainer.sessions import SessionManager
from trainyard import types
from trainyard.training import ServiceClient

MODEL_NAME = "qwen3-h512-l8"
SHAPE = QWEN3_H512_L8
LORA_RANK = 32
CLIP_LO, CLIP_HI = 0.8, 1.2  # the trainer's grpo defaults
ADAM = types.AdamParams(learning_rate=1e-5)
MIB = 2**20
# Gradients of the two paths may differ by float32 rounding: the fused loss multiplies the call's gradients by
# c = 1/G at the end, the custom path folds 1/G into the weights (exact when G is a power of two).
GRAD_TOLERANCE = 1e-5


def build_model(out: Path) -> Path:
    """The benchmark's model directory: the tiny tokenizer, SHAPE's random weights in float32."""
    build_tiny_model(out, overrides=SHAPE)
    return out


class MeasuredSessions(SessionManager):
    """The trainer's SessionManager, kept reachable from the benchmark (to read a session's gradients), recording
    each Forward / ForwardBackward(Stream) call's wall seconds in the trainer (`durations`) and, while `tracking`,
    its peak tensor memory, measured in the thread that runs it (the tracker is a TorchDispatchMode, which is per
    thread)."""

    instances: list[MeasuredSessions] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracking = False
        self.peaks: list[int] = []
        self.durations: list[float] = []
        MeasuredSessions.instances.append(self)

    def _measured(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            if not self.tracking:
                return fn(*args, **kwargs)
            with TensorMemoryTracker() as tracker:
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.peaks.append(tracker.peak_bytes)
        finally:
            self.durations.append(time.perf_counter() - start)

    def forward(self, *args, **kwargs):  # unary and streamed calls alike
        return self._measured(super().forward, *args, **kwargs)


class Platform:
    """The Training API in this process: SQLite, a blob store, one account, the model registered as a shared base,
    the trainer's gRPC server as services.trainer.app.build makes it (with MeasuredSessions as its SessionManager),
    and an SDK ServiceClient connected to it."""

    def __init__(self, root: Path, model_dir: Path, threads: int, micro_batch_tokens: int = 2048):
        url = f"sqlite:///{root / 'trainyard.db'}"
        migrate(url)
        self.db = Database(url)
        account, _, secret = create_account(self.db, "bench")
        self.account_id = account.id
        with self.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, MODEL_NAME, str(model_dir))
        trainer_app.SessionManager = MeasuredSessions
        try:  # no SaveWeights here, so the weight-sync service is never dialed (gRPC channels connect lazily)
            self.server = trainer_app.build(trainer_app.TrainerSettings(
                data_dir=root, database_url=url, host="127.0.0.1", trainer_port=0, weightsync_url="127.0.0.1:9",
                grpc_workers=8, shutdown_grace_s=0, torch_threads=threads, micro_batch_tokens=micro_batch_tokens))
        finally:
            trainer_app.SessionManager = SessionManager
        self.server.start()
        self.sessions = MeasuredSessions.instances[-1]
        self.client = ServiceClient(base_url=f"127.0.0.1:{self.server.port}", api_key=secret,
                                    rollout_url="127.0.0.1:9")

    def lora_client(self, seed: int = 0):
        return self.client.create_lora_training_client(MODEL_NAME, rank=LORA_RANK, seed=seed).result()

    def grads(self, tc) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.sessions.get(self.account_id, tc.model_id).params]

    def weights(self, tc) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.sessions.get(self.account_id, tc.model_id).params]

    def peak(self, call) -> int:
        """The largest per-call peak of the trainer's Forward / ForwardBackward calls that call() makes."""
        self.sessions.peaks, self.sessions.tracking = [], True
        try:
            call()
        finally:
            self.sessions.tracking = False
        return max(self.sessions.peaks)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.db.dispose()


def grpo_batch(platform: Platform, groups: int, samples: int, seed: int = 0) -> list[types.Datum]:
    """GRPO-shaped datums (see the module docstring); the sampling logprobs come from a Forward on a fresh adapter
    (LoRA B = 0: the base model's logprobs) plus noise."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 1024
    rows = []  # (tokens, targets, mask, advantages)
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(64, 129, (1,), generator=gen)),), generator=gen)
        rewards = torch.randn(samples, generator=gen)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s in range(samples):
            completion = torch.randint(3, vocab, (int(torch.randint(64, 129, (1,), generator=gen)),), generator=gen)
            seq = torch.cat([prompt, completion])
            mask = (torch.arange(len(seq) - 1) >= len(prompt) - 1).float()
            rows.append((seq[:-1], seq[1:], mask, torch.full((len(seq) - 1,), float(advantages[s]))))
    probe = platform.lora_client(seed=seed)
    out = probe.forward([types.Datum(types.ModelInput.from_ints(t.tolist()), {"target_tokens": y})
                         for t, y, _, _ in rows], "cross_entropy").result()
    probe.close()
    data = []
    for (tokens, targets, mask, adv), o in zip(rows, out.loss_fn_outputs):
        q = o["logprobs"].to_torch() + 0.1 * torch.randn(len(tokens), generator=gen)
        data.append(types.Datum(types.ModelInput.from_ints(tokens.tolist()),
                                {"target_tokens": targets, "logprobs": q, "advantages": adv, "mask": mask}))
    return data


def grpo_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO as a user writes it for forward_backward_custom: the mean over datums of
    -(1/n_i) sum_t m * min(r * A, clamp(r, lo, hi) * A), r = exp(lp - q), n_i = sum(m); in float64."""
    per_datum, clipped, tokens = [], 0.0, 0.0
    for d, lp in zip(data, logprobs):
        q, adv, m = (d.loss_fn_inputs[k].to_torch().double() for k in ("logprobs", "advantages", "mask"))
        ratio = torch.exp(lp.double() - q)
        unclipped, clip = ratio * adv, ratio.clamp(CLIP_LO, CLIP_HI) * adv
        per_datum.append(-(m * torch.minimum(unclipped, clip)).sum() / m.sum().clamp(min=1.0))
        clipped += float((m * (clip < unclipped)).sum())
        tokens += float(m.sum())
    return torch.stack(per_datum).mean(), {"clip_fraction": clipped / max(tokens, 1.0)}


def fused_step(tc, data):
    return tc.forward_backward(data, "grpo").result()


def custom_step(tc, data):
    return tc.forward_backward_custom(data, grpo_loss).result()


def agreement(platform: Platform, fused_tc, custom_tc, data) -> dict[str, float]:
    """From equal weights: one step each way; differences of logprobs, loss, gradients and post-step weights."""
    for tc in (fused_tc, custom_tc):  # the same fused warm-up step on both: LoRA B moves off 0
        fused_step(tc, data)
        tc.optim_step(ADAM).result()
    w0 = platform.weights(fused_tc)
    assert all(torch.equal(a, b) for a, b in zip(w0, platform.weights(custom_tc))), "sessions differ before the check"
    f_out, c_out = fused_step(fused_tc, data), custom_step(custom_tc, data)
    gf, gc = platform.grads(fused_tc), platform.grads(custom_tc)
    for tc in (fused_tc, custom_tc):
        tc.optim_step(ADAM).result()
    wf, wc = platform.weights(fused_tc), platform.weights(custom_tc)
    gf_flat, gc_flat = torch.cat([g.flatten() for g in gf]), torch.cat([g.flatten() for g in gc])
    step = torch.cat([(a - b).flatten() for a, b in zip(wf, w0)])
    lp_equal = all(torch.equal(a["logprobs"].to_torch(), b["logprobs"].to_torch())
                   for a, b in zip(f_out.loss_fn_outputs, c_out.loss_fn_outputs))
    return {
        "logprobs_bitwise": float(lp_equal),
        "loss_fused": f_out.metrics["loss:sum"], "loss_custom": c_out.metrics["loss"],
        "clip_fused": f_out.metrics["clip_fraction:mean"], "clip_custom": c_out.metrics["clip_fraction"],
        "grad_rel_l2": float((gf_flat - gc_flat).norm() / gf_flat.norm()),
        "grad_max_abs": float((gf_flat - gc_flat).abs().max()), "grad_max": float(gf_flat.abs().max()),
        "weight_max_abs": max(float((a - b).abs().max()) for a, b in zip(wf, wc)),
        "step_max_abs": float(step.abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-training-api-") as tmp:
        root = Path(tmp)
        platform = Platform(root / "platform", build_model(root / "model"), args.threads)
        try:
            data = grpo_batch(platform, args.groups, args.samples)
            tokens = sum(d.model_input.length for d in data)
            fused_tc, custom_tc = platform.lora_client(seed=1), platform.lora_client(seed=1)
            check = agreement(platform, fused_tc, custom_tc, data)

            peak_fused = platform.peak(lambda: fused_step(fused_tc, data))
            fused_tc.optim_step(ADAM).result()
            peak_custom = platform.peak(lambda: custom_step(custom_tc, data))
            custom_calls = list(platform.sessions.peaks)
            custom_tc.optim_step(ADAM).result()

            times = {"fused": [], "custom": []}
            cpu = {"fused": [], "custom": []}  # CPU seconds of this process (trainer and client) per step
            trainer_s = {"fused": [], "custom": []}  # per round: the trainer's seconds of each call of the step
            paths = {"fused": (fused_tc, fused_step), "custom": (custom_tc, custom_step)}
            for r in range(args.rounds):
                for name in ("fused", "custom") if r % 2 == 0 else ("custom", "fused"):
                    tc, step = paths[name]
                    platform.sessions.durations = []
                    start, cpu_start = time.perf_counter(), time.process_time()
                    step(tc, data)
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - cpu_start)
                    trainer_s[name].append(list(platform.sessions.durations))
                    tc.optim_step(ADAM).result()
        finally:
            platform.close()

    ratios = [c / f for f, c in zip(times["fused"], times["custom"])]
    tf, tcm = statistics.median(times["fused"]), statistics.median(times["custom"])
    print(f"cpu, {args.threads} torch thread(s), torch {torch.__version__}, float32; load average at start "
          f"{load_start:.2f}")
    print(f"model {MODEL_NAME} (Qwen3, hidden 512, 8 layers, vocab 1024), LoRA rank {LORA_RANK}; {len(data)} datums "
          f"({args.groups} groups x {args.samples}), {tokens} tokens, micro-batches of 2048 tokens; "
          f"{args.rounds} rounds")
    print(f"{'path':8s} {'calls':>22s} {'median s/step':>14s} {'min':>7s} {'max':>7s} {'peak MiB':>9s}")
    print(f"{'fused':8s} {'ForwardBackward(grpo)':>22s} {tf:14.2f} {min(times['fused']):7.2f} "
          f"{max(times['fused']):7.2f} {peak_fused / MIB:9.1f}")
    print(f"{'custom':8s} {'Forward + FB(ce)':>22s} {tcm:14.2f} {min(times['custom']):7.2f} "
          f"{max(times['custom']):7.2f} {peak_custom / MIB:9.1f}")
    print(f"custom/fused time: median of per-round ratios {statistics.median(ratios):.3f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); ratio of medians {tcm / tf:.3f}x")
    cpu_ratios = [c / f for f, c in zip(cpu["fused"], cpu["custom"])]
    print(f"CPU seconds per step (medians): fused {statistics.median(cpu['fused']):.2f}, custom "
          f"{statistics.median(cpu['custom']):.2f}; custom/fused median of per-round ratios "
          f"{statistics.median(cpu_ratios):.3f}x (rounds: {', '.join(f'{x:.2f}' for x in cpu_ratios)})")
    fb = statistics.median(d[0] for d in trainer_s["fused"])
    fwd, fb_ce = (statistics.median(d[i] for d in trainer_s["custom"]) for i in (0, 1))
    rest = statistics.median(t - sum(d) for t, d in zip(times["custom"], trainer_s["custom"]))
    print(f"trainer seconds per call (medians): fused ForwardBackward(grpo) {fb:.2f}; custom Forward {fwd:.2f} + "
          f"ForwardBackward(cross_entropy) {fb_ce:.2f}; custom outside the trainer (client loss, transport) "
          f"{rest:.2f}")
    print(f"peak memory fused/custom {peak_fused / peak_custom:.6f}: fused {peak_fused:,} bytes, custom "
          f"{peak_custom:,} bytes (its calls: {', '.join(f'{p:,}' for p in custom_calls)})")
    print(f"agreement from equal weights: logprobs bitwise equal: {bool(check['logprobs_bitwise'])}; loss fused "
          f"{check['loss_fused']:.9g} vs custom {check['loss_custom']:.9g}; clip fraction {check['clip_fused']:.4f} vs "
          f"{check['clip_custom']:.4f}")
    print(f"  gradients: relative L2 diff {check['grad_rel_l2']:.2e}, max abs diff {check['grad_max_abs']:.2e} "
          f"(largest |grad| {check['grad_max']:.2e}); weights after OptimStep: max abs diff "
          f"{check['weight_max_abs']:.2e} (largest step {check['step_max_abs']:.2e}); gradients within "
          f"{GRAD_TOLERANCE:.0e} relative L2: {check['grad_rel_l2'] <= GRAD_TOLERANCE}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
