"""Trainer-vs-rollout KL: how far the rollout's sampled-token logprobs are from the trainer's logprobs of the same
tokens, per model family, in the rollout's default (fast, batch-dependent) mode in bf16 and fp32, and in
deterministic mode (batch-invariant numerics, where both sides must agree bitwise: asserted).

Models: each family's tiny model (models/tiny.py's TINY_CONFIGS: dense Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA +
MoE; hidden 128, 4 layers, vocab 1024, the tiny tokenizer), weights drawn by models.tiny._init_weights (N(0, 0.02)
matrices, unit norms), with two changes that make the next-token distributions realistic. As built, the
distributions are nearly uniform (mean entropy 6.5 nats of log 1024 = 6.93; 5.4 for DeepSeek-V3), where any logit
perturbation gives a meaninglessly small KL. (1) The unembedding is untied (its own N(0, 0.02) draw,
tie_word_embeddings false): with tied embeddings a token's logit contains its own embedding, so once the logits are
scaled up every sample repeats its current token (95% of the dense model's sampled tokens, measured). (2) The final
RMSNorm gain (`model.norm.weight`, which scales all logits like an inverse temperature; trained models carry gains of
several units there) is set per family so that the fp32 model's mean next-token entropy over random-token contexts
is --entropy nats (default 2.0), rounded to a bf16 value (gains ~19-21). The entropy column is the exact mean entropy
of the trainer's full distribution at the sampled positions (~1.9-2.1 nats).

Workload (GRPO-shaped): --prompts random-token prompts (lengths 16..64, linspace) x --samples samples each,
temperature 1, no top-k / top-p, --max-tokens new tokens (a sample may stop earlier on the end-of-sequence token),
all submitted at once to services.rollout.engine.Engine (EngineConfig(dtype, deterministic)), so its decode steps
batch every sample together, while the trainer scores them all in one padded forward.

Trainer side: the logprobs the trainer's Forward / ForwardBackward computes for an RL loss
(services/trainer/engine/forward_backward.py;
bitwise in deterministic mode, to float32 rounding in the default mode, where datums are packed): every sample is a
datum with tokens = prompt + completion[:-1] and target_tokens = prompt[1:] + completion, all datums right-padded
with 0 into one [B, T] batch, and
services.trainer.engine.logprobs.target_logprobs(model, tokens, targets, deterministic=)
with gradients enabled on a model loaded by models.load_pretrained in the same dtype as the rollout
(deterministic= matches the rollout's mode). Extra rows:
- "bf16 -> fp32 trainer": the bf16 default-mode samples scored by a float32 trainer model (what SessionManager
  loads today: load_pretrained's default dtype), so it adds the bf16 rounding of the weights to the numerics.
- "bf16 + replay" (MoE families): the bf16 default-mode samples scored by the same formula as target_logprobs but
  with the rollout's recorded router ids replayed (models.moe.RouterReplay), which removes expert-choice flips.

Per row, over every sampled token (lp_r = rollout logprob, lp_t = trainer logprob, both of the raw distribution):
k1 = mean(lp_r - lp_t) and k3 = mean(exp(r) - 1 - r) with r = lp_t - lp_r, both estimators of KL(rollout ||
trainer) on tokens drawn from the rollout (k3 >= 0 per token; k1 is unbiased but noisy, its standard error is
printed); max and mean |lp_r - lp_t|; the fraction of tokens whose two logprobs are bitwise equal; the mean entropy.

    .venv/bin/python bench/rollout_kl.py [--families qwen3,qwen3_moe,deepseek_v3] [--entropy 2.0] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models import load_pretrained, save_pretrained
from models.families import family_for_config
from models.moe import MoE, RouterReplay
from models.tiny import FINAL_NORM_GAIN, TINY_CONFIGS, _init_weights, build_tiny_model, tiny_config
from models.tokenizer import load_tokenizer
from services.rollout.engine import Engine, EngineConfig
from services.rollout.sampling import SampledSequence, SamplingParams
from services.trainer.engine.logprobs import target_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")


# ------------------------------------------------------------------------------------------------------ models


def entropy_at_scale(logits_NV: torch.Tensor, scale: float) -> float:
    logp = torch.log_softmax(logits_NV * scale, dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


@torch.no_grad()
def build_model(out: Path, family: str, entropy: float, seed: int = 0) -> tuple[Path, float]:
    """The family's tiny model directory (models.tiny: tokenizer files, config, models.tiny._init_weights' draws) with
    an untied unembedding and the final-norm gain set so the fp32 model's mean next-token entropy over random-token
    contexts is `entropy` nats; returns (directory, gain)."""
    build_tiny_model(out, seed=seed, family=family)  # the tokenizer files; the weights are replaced below
    config = {**tiny_config(len(load_tokenizer(out)), family), "tie_word_embeddings": False}
    spec = family_for_config(config)
    model = spec.CausalLM(spec.ModelArgs.from_hf_config(config))
    _init_weights(model, seed)
    tokens = torch.randint(3, config["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(seed + 1))
    logits_NV = model(tokens).float().flatten(0, 1)  # linear in the final-norm gain
    lo, hi = 0.0, 64.0  # the entropy falls as the logits scale up: bisect the scale
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy_at_scale(logits_NV, mid) > entropy else (lo, mid)
    gain = float(torch.tensor(FINAL_NORM_GAIN * (lo + hi) / 2).to(torch.bfloat16))
    model.model.norm.weight.fill_(gain)
    save_pretrained(model, out)
    return out, gain


def make_prompts(vocab_size: int, prompts: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(16, 64, prompts).round().long().tolist()
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------------ rollout


@dataclass
class Sample:
    prompt: list[int]
    seq: SampledSequence


def rollout(model_dir: Path, dtype: torch.dtype, deterministic: bool, prompts: list[list[int]], samples: int,
            max_tokens: int, router_ids: bool = False) -> list[Sample]:
    """Every prompt's samples from the engine, all requests submitted at once."""
    engine = Engine(EngineConfig(dtype=dtype, deterministic=deterministic, kv_cache_mb=64))
    try:
        engine.base(str(model_dir))
        handles = [engine.submit(str(model_dir), None, prompt,
                                 SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, seed=i,
                                                return_router_ids=router_ids))
                   for i, prompt in enumerate(prompts)]
        return [Sample(prompt, seq) for prompt, h in zip(prompts, handles) for seq in h.result().sequences]
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------------ trainer


def trainer_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The datums of an RL forward (tokens = prompt + completion[:-1], targets = the next tokens), right-padded with
    0 into one batch, as the trainer's deterministic mode runs a micro-batch
    (services/trainer/engine/forward_backward.py)."""
    rows = [s.prompt + s.seq.tokens for s in samples]
    T = max(len(r) for r in rows) - 1
    tokens_BT = torch.zeros(len(rows), T, dtype=torch.int64)
    targets_BT = torch.zeros(len(rows), T, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens_BT[i, :len(r) - 1] = torch.tensor(r[:-1])
        targets_BT[i, :len(r) - 1] = torch.tensor(r[1:])
    return tokens_BT, targets_BT


def completion_values(samples: list[Sample], values_BT: torch.Tensor) -> torch.Tensor:
    """The completion positions of each row, concatenated: [total sampled tokens]."""
    return torch.cat([values_BT[i, len(s.prompt) - 1:len(s.prompt) - 1 + len(s.seq.tokens)]
                      for i, s in enumerate(samples)])


def trainer_logprobs(model: torch.nn.Module, samples: list[Sample], deterministic: bool) -> torch.Tensor:
    """target_logprobs over the padded batch, gradients on (an RL loss backpropagates through it)."""
    tokens_BT, targets_BT = trainer_batch(samples)
    with torch.enable_grad():
        logprobs_BT = target_logprobs(model, tokens_BT, targets_BT, deterministic=deterministic)
    return completion_values(samples, logprobs_BT.detach())


def replay_logprobs(model: torch.nn.Module, samples: list[Sample], layers: list[int]) -> torch.Tensor:
    """target_logprobs' formula with the rollout's router ids replayed (ids [P + G - 1, L, K] cover exactly the
    trainer's input positions; padding positions take experts 0..K-1, their outputs are never read)."""
    tokens_BT, targets_BT = trainer_batch(samples)
    B, T = tokens_BT.shape
    first = samples[0].seq.router_ids
    ids_BTLK = torch.arange(first.shape[-1], dtype=first.dtype).expand(B, T, *first.shape[1:]).clone()
    for i, s in enumerate(samples):
        ids_BTLK[i, :s.seq.router_ids.shape[0]] = s.seq.router_ids
    with torch.no_grad():
        logits_BTV = model(tokens_BT, routing=RouterReplay.from_stacked(layers, ids_BTLK)).float()
        logprobs_BT = torch.gather(F.log_softmax(logits_BTV, -1), -1, targets_BT[..., None])[..., 0]
    return completion_values(samples, logprobs_BT)


@torch.no_grad()
def mean_entropy(model: torch.nn.Module, samples: list[Sample]) -> float:
    """Mean entropy (nats) of the model's full next-token distribution at the sampled positions."""
    tokens_BT, _ = trainer_batch(samples)
    logp_BTV = torch.log_softmax(model(tokens_BT).float(), dim=-1)
    return float(completion_values(samples, -(logp_BTV.exp() * logp_BTV).sum(-1)).mean())


# ------------------------------------------------------------------------------------------------------ stats


@dataclass
class Row:
    family: str
    gain: float  # the final-norm gain the family's model was built with
    mode: str
    tokens: int
    entropy: float
    k1: float
    k1_se: float
    k3: float
    max_abs: float
    mean_abs: float
    bitwise: float  # fraction of tokens whose logprobs are bitwise equal


def kl_stats(lp_rollout: torch.Tensor, lp_trainer: torch.Tensor) -> dict[str, float]:
    """k1, its standard error, k3, max / mean |diff| and the bitwise-equal fraction, in float64 (both inputs are
    float32 values)."""
    lp_r, lp_t = lp_rollout.double(), lp_trainer.double()
    d = lp_r - lp_t
    r = -d
    k3 = torch.expm1(r) - r
    return {"k1": float(d.mean()), "k1_se": float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else 0.0,
            "k3": float(k3.mean()), "max_abs": float(d.abs().max()), "mean_abs": float(d.abs().mean()),
            "bitwise": float((lp_rollout.float() == lp_trainer.float()).double().mean())}


def rollout_logprobs(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([lp for s in samples for lp in s.seq.logprobs], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------------ main


def run_family(family: str, model_dir: Path, gain: float, args) -> None:
    """Every mode's rows for one family, printed as they are measured."""
    prompts = make_prompts(len(load_tokenizer(model_dir)), args.prompts)
    trainers: dict[str, torch.nn.Module] = {}

    def trainer(dtype: str) -> torch.nn.Module:
        if dtype not in trainers:
            trainers[dtype] = load_pretrained(model_dir, DTYPES[dtype])
        return trainers[dtype]

    def add(mode: str, samples: list[Sample], lp_t: torch.Tensor, entropy_model: torch.nn.Module) -> Row:
        lp_r = rollout_logprobs(samples)
        row = Row(family, gain, mode, lp_r.numel(), mean_entropy(entropy_model, samples), **kl_stats(lp_r, lp_t))
        print_row(row)
        return row

    moe = family in MOE_FAMILIES
    for dtype in args.dtypes.split(","):
        for deterministic in (False, True):
            record = moe and dtype == "bf16" and not deterministic
            samples = rollout(model_dir, DTYPES[dtype], deterministic, prompts, args.samples, args.max_tokens,
                              router_ids=record)
            mode = f"{dtype} {'deterministic' if deterministic else 'default'}"
            model = trainer(dtype)
            row = add(mode, samples, trainer_logprobs(model, samples, deterministic), model)
            if deterministic:  # the contract: bitwise equal, so every estimator is exactly 0
                assert row.bitwise == 1.0 and row.k1 == 0.0 and row.k3 == 0.0 and row.max_abs == 0.0, row
            if dtype == "bf16" and not deterministic:
                add("bf16 -> fp32 trainer", samples, trainer_logprobs(trainer("fp32"), samples, False), model)
                if record:
                    add("bf16 + replay", samples, replay_logprobs(model, samples, moe_layers(model)), model)


def moe_layers(model: torch.nn.Module) -> list[int]:
    """The MoE layers in order, as the engine lists them (EngineCore.moe_layers): the router ids' layer axis."""
    return [int(i) for i, layer in model.model.layers.items() if isinstance(layer.mlp, MoE)]


HEADER = (f"{'family':12s} {'gain':>6s} {'mode':21s} {'tokens':>6s} {'entropy':>7s} {'k1':>10s} {'k1 s.e.':>8s} "
          f"{'k3':>9s} {'max|d|':>9s} {'mean|d|':>9s} {'bitwise':>7s}")


def print_row(row: Row) -> None:
    print(f"{row.family:12s} {row.gain:6g} {row.mode:21s} {row.tokens:6d} {row.entropy:7.3f} {row.k1:10.2e} "
          f"{row.k1_se:8.1e} {row.k3:9.2e} {row.max_abs:9.2e} {row.mean_abs:9.2e} {row.bitwise:7.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(TINY_CONFIGS))
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--entropy", type=float, default=2.0, help="target mean entropy (nats) for the final-norm gain")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu, {args.threads} threads, torch {torch.__version__}; {args.prompts} prompts x {args.samples} samples, "
          f"temperature 1, max {args.max_tokens} new tokens; load average {os.getloadavg()[0]:.2f} at start",
          flush=True)
    print("per sampled token: d = lp_rollout - lp_trainer, k1 = mean(d), k3 = mean(exp(r) - 1 - r) with r = -d,\n"
          "bitwise = share of tokens with d exactly 0; entropy: mean nats of the trainer's distribution; gain: the "
          "final-norm gain")
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model_dir, gain = build_model(Path(tmp) / family, family, args.entropy)
            run_family(family, model_dir, gain, args)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
