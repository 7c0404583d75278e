"""Trainer-vs-rollout KL in the default (fast, batch-dependent) bf16 mode, bounded; zero in deterministic mode.

Model: the tiny dense Qwen3 (models/tiny.py's shape, tokenizer and N(0, 0.02) draws) with an untied unembedding and
final-norm gain GAIN, so the next-token entropy at the sampled positions is ~2 nats rather than the near-uniform
~6.5 of the plain random init (bench/rollout_kl.py calibrates that gain; it gives 20.75 for this model). Workload:
4 random-token prompts x 4 samples, temperature 1, 32 new tokens, all submitted at once to the bf16 Engine. Trainer:
services.trainer.engine.logprobs.target_logprobs on the right-padded batch of prompt + completion, bf16 model.

Tolerance: k3 = mean(exp(r) - 1 - r), r = lp_trainer - lp_rollout over the ~500 sampled tokens, must stay
<= K3_BOUND = 2.5e-3. Measured 5.6e-4 here (torch 2.13.0 CPU, one thread; seven other sampling seeds gave 5.9e-4 ..
7.2e-4), so the bound is ~4x the measurement: room for another CPU's kernels and for default mode's
timing-dependent batches, while staying at the scale of bf16 rounding (the bench's full 8 x 8 x 64 workload measured
k3 5.9e-4 on this model, bench/RESULTS.md "Trainer-vs-rollout KL"). A rollout whose distribution differs from the
trainer's by more than rounding fails: decoding each new token at position + 1 (its RoPE off by one) measured
k3 6.3e-2.
Deterministic mode (bf16 too): the rollout's logprobs are bitwise the trainer's (deterministic=True), so every
estimator is exactly 0.
"""
import shutil

import pytest
import torch

from models import load_pretrained, save_pretrained
from models.families import family_for_config
from models.tiny import _init_weights, tiny_config
from services.rollout.engine import Engine, EngineConfig
from services.rollout.sampling import SamplingParams
from services.trainer.engine.logprobs import target_logprobs

from rollout_reference import SMALL_POOL_MB

GAIN = 20.75
K3_BOUND = 2.5e-3
PROMPTS, SAMPLES, MAX_TOKENS = 4, 4, 32


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("peaked") / "model"
    shutil.copytree(tiny_model_dir, out)  # tokenizer and generation config; weights and config.json replaced
    config = {**tiny_config(1024, "qwen3"), "tie_word_embeddings": False}
    family = family_for_config(config)
    model = family.CausalLM(family.ModelArgs.from_hf_config(config))
    _init_weights(model, seed=0)
    with torch.no_grad():
        model.model.norm.weight.fill_(GAIN)
    save_pretrained(model, out)
    return out


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (16, 24, 32, 40)]


def _rollout(model_dir, deterministic: bool, seed: int = 0) -> list[tuple[list[int], list[int], list[float]]]:
    engine = Engine(EngineConfig(dtype=torch.bfloat16, deterministic=deterministic, kv_cache_mb=SMALL_POOL_MB))
    try:
        handles = [(prompt, engine.submit(str(model_dir), None, prompt, SamplingParams(
            n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, seed=seed + i)))
            for i, prompt in enumerate(_prompts())]
        return [(prompt, s.tokens, s.logprobs) for prompt, h in handles for s in h.result().sequences]
    finally:
        engine.close()


def _trainer(model, samples, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rollout logprobs, trainer logprobs, trainer entropy) over every sampled token. The trainer's batch is a
    micro-batch of the trainer's deterministic mode (services/trainer/engine/forward_backward.py): tokens = prompt +
    completion[:-1], targets shifted by one, right-padded with 0."""
    rows = [prompt + tokens for prompt, tokens, _ in samples]
    T = max(len(r) for r in rows) - 1
    tokens_BT = torch.zeros(len(rows), T, dtype=torch.int64)
    targets_BT = torch.zeros(len(rows), T, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens_BT[i, :len(r) - 1], targets_BT[i, :len(r) - 1] = torch.tensor(r[:-1]), torch.tensor(r[1:])
    logprobs_BT = target_logprobs(model, tokens_BT, targets_BT, deterministic=deterministic).detach()
    with torch.no_grad():
        logp_BTV = torch.log_softmax(model(tokens_BT).float(), dim=-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    spans = [slice(len(prompt) - 1, len(prompt) - 1 + len(tokens)) for prompt, tokens, _ in samples]
    lp_t = torch.cat([logprobs_BT[i, s] for i, s in enumerate(spans)])
    entropy = torch.cat([entropy_BT[i, s] for i, s in enumerate(spans)])
    lp_r = torch.tensor([lp for _, _, logprobs in samples for lp in logprobs], dtype=torch.float32)
    return lp_r, lp_t, entropy


@pytest.fixture(scope="module")
def bf16_model(peaked_model_dir):
    return load_pretrained(peaked_model_dir, torch.bfloat16)


def test_default_mode_bf16_kl_is_bounded(peaked_model_dir, bf16_model):
    samples = _rollout(peaked_model_dir, deterministic=False)
    lp_r, lp_t, entropy = _trainer(bf16_model, samples, deterministic=False)
    r = (lp_t - lp_r).double()
    k3 = float((torch.expm1(r) - r).mean())
    print(f"bf16 default: {lp_r.numel()} tokens, entropy {float(entropy.mean()):.3f}, k3 {k3:.3e}, "
          f"max |d| {float(r.abs().max()):.3e}")
    assert lp_r.numel() >= PROMPTS * SAMPLES * MAX_TOKENS // 2
    assert 1.0 < float(entropy.mean()) < 3.0  # a peaked distribution, or the bound would say little
    assert k3 <= K3_BOUND


def test_deterministic_mode_bf16_logprobs_are_bitwise_the_trainer(peaked_model_dir, bf16_model):
    samples = _rollout(peaked_model_dir, deterministic=True)
    lp_r, lp_t, _ = _trainer(bf16_model, samples, deterministic=True)
    assert torch.equal(lp_r, lp_t)
    r = (lp_t - lp_r).double()
    assert float((torch.expm1(r) - r).mean()) == 0.0 and float(r.mean()) == 0.0
