"""Cost of kernels.batch_invariant.batch_invariant_mode: prefill and decode-step throughput, mode off vs on.

Two random Qwen3-shaped models (float32, CPU): the tiny test model's shape (models/tiny.py: hidden 128, 4 layers,
4/2 heads, vocab 1024) and a hidden-512 / 8-layer one (8/4 heads of 64, intermediate 1536, vocab 8192). For each
batch size B: one prefill of B prompts of --prompt-len tokens into a KVCache, then --decode-steps single-token decode
steps. Mode off and on run back to back, --reps rounds, alternating which goes first. Reported: the best tokens per
second of each, and the on/off time ratio (the mode's slowdown) as the median over rounds of each round's ratio,
which a burst of load from other jobs on the shared machine moves less than it moves either time.

    .venv/bin/python bench/deterministic.py [--batches 16,64,128] [--prompt-len 64] [--decode-steps 8] [--reps 7]
"""

import argparse
import os
import time

import torch

from kernels.batch_invariant import batch_invariant_mode
from models.kv_cache import KVCache
from models.llama import CausalLM, ModelArgs
from models.tiny import tiny_config

CONFIGS = {
    "tiny-qwen3": tiny_config(1024, "qwen3"),
    "qwen3-h512-l8": {
        **tiny_config(8192, "qwen3"), "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536, "tie_word_embeddings": False,
    },
}


def build(config: dict, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelArgs.from_hf_config(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else torch.randn_like(param) * 0.02)
    return model.eval()


@torch.no_grad()
def run_once(model: CausalLM, prompts_BT: torch.Tensor, decode_steps: int, deterministic: bool) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) for one prefill + decode_steps greedy steps."""
    B, T = prompts_BT.shape
    cache = KVCache.allocate(model.args, B, T + decode_steps, torch.float32, "cpu")
    with batch_invariant_mode(deterministic):
        start = time.perf_counter()
        logits_BTV = model(prompts_BT, cache=cache)
        prefill_s = time.perf_counter() - start
        token_B1 = logits_BTV[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode_steps):
            token_B1 = model(token_B1, cache=cache)[:, -1:].argmax(-1)
        decode_s = (time.perf_counter() - start) / decode_steps
    return prefill_s, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--batches", default="16,64,128")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"cpu, {args.threads} threads, torch {torch.__version__}, float32, prompt {args.prompt_len} tokens, "
          f"{args.decode_steps} decode steps, {args.reps} rounds; load average at start {load:.2f}")
    print("best tokens/s of the rounds; on/off = median over rounds of the time ratio")
    print(f"{'model':14s} {'B':>4s} {'prefill tok/s off':>18s} {'on':>9s} {'on/off':>7s}   "
          f"{'decode tok/s off':>17s} {'on':>9s} {'on/off':>7s}")
    for name in args.models.split(","):
        model = build(CONFIGS[name])
        generator = torch.Generator().manual_seed(1)
        for B in (int(b) for b in args.batches.split(",")):
            prompts_BT = torch.randint(3, model.args.vocab_size, (B, args.prompt_len), generator=generator)
            run_once(model, prompts_BT[:, :8], 1, False)  # warm-up
            run_once(model, prompts_BT[:, :8], 1, True)
            times = {False: [], True: []}  # mode -> [(prefill s, decode s per step)] per round
            for round_ in range(args.reps):
                for deterministic in (False, True) if round_ % 2 == 0 else (True, False):
                    times[deterministic].append(run_once(model, prompts_BT, args.decode_steps, deterministic))
            off, on = torch.tensor(times[False]), torch.tensor(times[True])
            (p_off, d_off), (p_on, d_on) = off.min(0).values.tolist(), on.min(0).values.tolist()
            p_ratio, d_ratio = (on / off).median(0).values.tolist()
            tokens = B * args.prompt_len
            print(f"{name:14s} {B:4d} {tokens / p_off:18.0f} {tokens / p_on:9.0f} {p_ratio:6.2f}x   "
                  f"{B / d_off:17.0f} {B / d_on:9.0f} {d_ratio:6.2f}x", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
