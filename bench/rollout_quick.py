"""Quick throughput check of the rollout engine: generated tokens/s for a GRPO-shaped batch.

16 prompts x 8 samples (n=8), prompt lengths spread over 16..128 tokens, 128 new tokens per sample (end-of-sequence
ignored, so every run generates the same 16 * 8 * 128 tokens), on a Qwen3-architecture model with hidden 512 and 8
layers (8 query heads, 4 kv heads, head_dim 64, MLP 1536) with models.tiny-style random weights and the tiny
tokenizer (vocab 1024). All requests arrive at once; the engine core is stepped directly (no threads, no gRPC).
The full benchmark against HF generate and vLLM comes later; this shows where the engine stands and where a step's
time goes.

    python bench/rollout_quick.py [--threads N] [--deterministic] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

from models import load_pretrained
from models.tiny import QWEN3_H512_L8, build_tiny_model
from models.tokenizer import load_tokenizer
from services.rollout.engine_core import EngineConfig, EngineCore
from services.rollout.sampling import SamplingParams

PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 128
SHAPE = QWEN3_H512_L8


def build_model(out: Path) -> Path:
    build_tiny_model(out, overrides=SHAPE)
    return out


def run(model_dir: Path, args) -> None:
    model, tokenizer = load_pretrained(model_dir), load_tokenizer(model_dir)
    core = EngineCore(model, tokenizer, EngineConfig(deterministic=args.deterministic, kv_cache_mb=512))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(16, 128, PROMPTS).round().long().tolist()
    generated = [0]

    def sink(out):
        generated[0] += sum(len(d.tokens) for d in out.sequences)

    for i, length in enumerate(lengths):
        prompt = torch.randint(3, model.args.vocab_size, (length,), generator=generator).tolist()
        params = SamplingParams(n=SAMPLES, max_tokens=NEW_TOKENS, seed=i, temperature=1.0)
        core.add_request(f"r{i}", prompt, params, stop_ids=set(), sink=sink)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    while core.has_work():
        core.step()
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    expected = PROMPTS * SAMPLES * NEW_TOKENS
    assert generated[0] == expected, (generated[0], expected)
    print(f"threads={torch.get_num_threads()} deterministic={args.deterministic}: {generated[0]} tokens in "
          f"{elapsed:.1f} s over {core.num_steps} steps = {generated[0] / elapsed:.0f} generated tokens/s "
          f"(prefill {sum(lengths)} prompt tokens included in the time)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant mode")
    parser.add_argument("--profile", action="store_true", help="cProfile the engine steps")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run(build_model(Path(tmp)), args)


if __name__ == "__main__":
    main()
