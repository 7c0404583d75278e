"""Cost of kernels.batch_invariant.batch_invariant_mode: prefill and decode-step throughput, mode off vs on; and
(--engine) the rollout engine's deterministic mode against its default mode end to end.

Model level: two random Qwen3-shaped models (--dtype, default float32, CPU): the tiny test model's shape
(models/tiny.py: hidden 128, 4 layers, 4/2 heads, vocab 1024) and a hidden-512 / 8-layer one (8/4 heads of 64,
intermediate 1536, vocab 8192). For each batch size B: one prefill of B prompts of --prompt-len tokens into a
KVCache, then --decode-steps single-token decode steps.

Engine level (--engine): bench/rollout.py's GRPO workload and model (16 prompts x 8 samples, prompts of 16..128
tokens, its "varied" / "fixed" max_tokens; Qwen3 hidden 512, 8 layers) through services.rollout.engine.Engine, one
engine per mode (EngineConfig.deterministic off and on) in this process, every request submitted at once, timed until
every sample's last token is back; per dtype in --dtypes.

Mode off and on run back to back, --reps rounds, alternating which goes first. Reported: the best tokens per second of
each, and the on/off time ratio (the mode's slowdown) as the median over rounds of each round's ratio, which a burst
of load from other jobs on the shared machine moves less than it moves either time.

    .venv/bin/python bench/deterministic.py [--batches 16,64,128] [--prompt-len 64] [--decode-steps 8] [--reps 7]
    .venv/bin/python bench/deterministic.py --engine [--dtypes bf16,fp32] [--workloads varied] [--reps 5]
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@torch.no_grad()
def run_once(model: CausalLM, prompts_BT: torch.Tensor, decode_steps: int, deterministic: bool) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) for one prefill + decode_steps greedy steps."""
    B, T = prompts_BT.shape
    cache = KVCache.allocate(model.args, B, T + decode_steps, model.lm_head.weight.dtype, "cpu")
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


def engine_level(args) -> None:
    """bench/rollout.py's workload through one Engine per mode, alternating; see the module docstring."""
    spec = importlib.util.spec_from_file_location("bench_rollout", Path(__file__).with_name("rollout.py"))
    rollout = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)  # bench/rollout.py's model and workloads, exactly
    SAMPLES, build_model, make_workloads = rollout.SAMPLES, rollout.build_model, rollout.make_workloads
    from models.tokenizer import load_tokenizer
    from services.rollout.engine import Engine, EngineConfig
    from services.rollout.sampling import SamplingParams

    print(f"cpu, {args.threads} threads, torch {torch.__version__}, engine level (bench/rollout.py's workload), "
          f"{args.reps} rounds; load average at start {os.getloadavg()[0]:.2f}")
    print("best tokens/s of the rounds; det/fast = median over rounds of the time ratio (fast/det speed = its inverse)")
    print(f"{'dtype':5s} {'workload':8s} {'tokens':>7s} {'fast tok/s':>11s} {'det tok/s':>10s} {'det/fast':>9s}  "
          f"per-round ratios")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen3-h512-l8")
        workloads = [w for w in make_workloads(len(load_tokenizer(model_dir))) if w.name in args.workloads.split(",")]
        for dtype in args.dtypes.split(","):
            engines = {det: Engine(EngineConfig(dtype=DTYPES[dtype], kv_cache_mb=512, deterministic=det))
                       for det in (False, True)}
            try:
                def run(det: bool, w) -> float:
                    start = time.perf_counter()
                    handles = [engines[det].submit(str(model_dir), None, prompt,
                                                   SamplingParams(n=SAMPLES, max_tokens=m, seed=i))
                               for i, (prompt, m) in enumerate(zip(w.prompts, w.max_tokens))]
                    for handle, m in zip(handles, w.max_tokens):
                        assert all(len(s.tokens) == m for s in handle.result().sequences)
                    return time.perf_counter() - start

                for det in (False, True):  # load the model, warm up
                    engines[det].base(str(model_dir))
                    run(det, type(workloads[0])("warm-up", workloads[0].prompts[:2], [8, 8]))
                for w in workloads:
                    times = {False: [], True: []}
                    for round_ in range(args.reps):
                        for det in (False, True) if round_ % 2 == 0 else (True, False):
                            times[det].append(run(det, w))
                    ratios = [on / off for off, on in zip(times[False], times[True])]
                    print(f"{dtype:5s} {w.name:8s} {w.tokens:7d} {w.tokens / min(times[False]):11.0f} "
                          f"{w.tokens / min(times[True]):10.0f} {statistics.median(ratios):8.2f}x  "
                          f"{' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
            finally:
                for engine in engines.values():
                    engine.close()
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--batches", default="16,64,128")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model level: the models' dtype")
    parser.add_argument("--engine", action="store_true", help="engine level instead (bench/rollout.py's workload)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="engine level: dtypes to run")
    parser.add_argument("--workloads", default="varied", help="engine level: bench/rollout.py's workloads to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_level(args)
        return
    load = os.getloadavg()[0]
    print(f"cpu, {args.threads} threads, torch {torch.__version__}, {DTYPES[args.dtype]}, prompt {args.prompt_len} "
          f"tokens, {args.decode_steps} decode steps, {args.reps} rounds; load average at start {load:.2f}")
    print("best tokens/s of the rounds; on/off = median over rounds of the time ratio")
    print(f"{'model':14s} {'B':>4s} {'prefill tok/s off':>18s} {'on':>9s} {'on/off':>7s}   "
          f"{'decode tok/s off':>17s} {'on':>9s} {'on/off':>7s}")
    for name in args.models.split(","):
        model = build(CONFIGS[name]).to(DTYPES[args.dtype])
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
