"""The distributed trainer on CPU ranks: per-rank memory, step time and communication volume against world size.

    .venv/bin/python bench/distributed.py                 # worlds 1,2,4,8; dense (FSDP) and MoE (FSDP, FSDP x EP)
    .venv/bin/python bench/distributed.py --worlds 1,2,4 --steps 3

What runs: the real engine (services/trainer/engine) on N gloo ranks (tests/services/trainer/parallel/ranks.py's
run_ranks: forkserver processes, one torch thread each, a FileStore rendezvous), full-parameter training, float32:
TrainingEngine.load(model_dir, lora=None, parallel=ParallelDims(dp_shard=N[, ep=...])), then per step one
engine.loss_call (cross_entropy over this rank's share of a fixed global batch, split_for_ranks, the call's global
batch_scale) and engine.step (AdamW). The global batch is the same for every N (G datums of T tokens), so the
work per rank falls as 1/N; each rank's share is one micro-batch (micro_batch_tokens >= G * T).
Models: random-init directories written by models/tiny.py's build_tiny_model with larger configs (CONFIGS).
Before the runs, check_counter_rank checks the accounting (CollectiveCounter, held_bytes) on 3 ranks against
collectives and a sharded AdamW state whose byte counts are known by hand; the benchmark stops if it disagrees.

Measured per rank:
- held bytes: parameters + gradients + AdamW state actually held by the rank: for every parameter its local shard
  (DTensor.to_local(); numel * element_size), its gradient's local shard right after the loss call (before the
  step clears it), and every tensor in optimizer.state (exp_avg, exp_avg_sq: local shards; the per-parameter step
  counters: 0-dim tensors every rank holds whole). Target: falls as 1/N within 10%: ratio = held(N) / (held(1) / N)
  should be <= 1.10; "over ideal B" is held(N) - held(1) / N in bytes. What stays above 1/N: AdamW's 0-dim step
  counters (one float32 per parameter tensor, every rank holds them all), and uneven torch.chunk shards (a
  dimension 0 not divisible by N: to_local() holds the real rows, so the first ranks hold more; the max rank is
  reported and "min/max rank" shows the spread). FSDP2 shards every parameter, norms and router included, so
  nothing else is replicated; under EP the experts are split by ep and sharded over efsdp = N / ep.
- peak RSS (getrusage ru_maxrss, KiB -> MiB) and its rise over the RSS when the rank function started (the
  forkserver-inherited torch runtime is in the former, not in the latter); and the peak of live tensor storage
  allocated during one step (kernels.memory.TensorMemoryTracker: activations, gathered parameters, gradients and
  the optimizer state's first allocation included).
- step time: the median of --steps timed steps (loss call + optimizer step, between barriers) after one warm-up
  step and one counted step; the slowest rank's median is reported. 2 cores run all N ranks, so time does not fall
  with N here: the column shows the per-rank overhead of sharding, not a speedup.
- communication: every collective the step issues, counted at the dispatcher (CollectiveCounter, a
  TorchDispatchMode seeing the c10d ops that torch.distributed's Python API and FSDP2 call, and the functional
  collectives DTensor.full_tensor uses), one step after the warm-up. Counted from the real tensors and split sizes
  passed, per collective kind, as the bytes a rank sends to other ranks under the usual algorithms: all-gather
  (N-1)/N x output bytes, reduce-scatter (N-1)/N x input bytes, all-reduce 2 (N-1)/N x bytes (ring), all_to_all the
  input rows bound for other ranks (exact, from the splits). Why not the loopback interface's byte counters
  (/proc/net/dev): they are machine-wide (other jobs on this machine use gloo over 127.0.0.1 too), count TCP/IP
  headers and gloo's control messages, and cannot tell one collective kind from another.
- formula: FSDP2 with reshard_after_forward (the decoder layers; the root keeps its parameters after forward)
  all-gathers every unit's parameters in the forward and each decoder layer's again in the backward, and
  reduce-scatters every unit's gradients once per backward: per micro-batch and rank, all-gather
  (N-1)/N x (P + P_layers) bytes and reduce-scatter (N-1)/N x P bytes, with each unit's own shard-group size
  (under EP the experts' group is efsdp = N / ep, and their bytes are P_experts / ep). EP's all_to_all: each MoE
  layer sends a rank's tokens x top_k rows of D floats out and back in the forward, and the reverse in the
  backward: 4 x rows x D x 4 bytes x (ep-1)/ep under uniform routing (the real routing is not uniform).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MIB = 2**20
_COMMON = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
           "head_dim": 64, "intermediate_size": 1024}
CONFIGS = {  # family -> build_tiny_model overrides (vocab 1024, the tiny tokenizer's)
    "qwen3": dict(_COMMON),
    "qwen3_moe": {**_COMMON, "num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 256, "mlp_only_layers": []},
}
# (label, family, ep for world N)
SETUPS = [("dense fsdp", "qwen3", lambda n, e: 1), ("moe fsdp", "qwen3_moe", lambda n, e: 1),
          ("moe fsdp x ep", "qwen3_moe", lambda n, e: min(n, e))]


# -- accounting (checked on known collectives by check_counter_rank before every run) -------------------------------
def local_nbytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds of t: a DTensor's local shard, a plain tensor whole, None 0."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def held_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"params", "grads", "optim"}: the bytes of the parameters, their gradients and the optimizer state this rank
    holds (local shards; see the module docstring)."""
    optim = 0
    for state in optimizer.state.values():
        optim += sum(local_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": sum(local_nbytes(p) for p in params), "grads": sum(local_nbytes(p.grad) for p in params),
            "optim": optim}


def _group_of(pg) -> tuple[int, int]:
    """(rank in group, group size) of a c10d op's ProcessGroup argument (a TorchScript-boxed ProcessGroup)."""
    import torch.distributed as dist

    if not isinstance(pg, dist.ProcessGroup):
        pg = dist.ProcessGroup.unbox(pg)
    return pg.rank(), pg.size()


def _named_group(name: str) -> tuple[int, int]:
    import torch.distributed.distributed_c10d as c10d

    pg = c10d._resolve_process_group(name)
    return pg.rank(), pg.size()


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run under it: {kind: [calls, bytes sent to other ranks]} (module docstring: the
    algorithms' byte counts). Sees the c10d ops (torch.distributed's API, FSDP2) and the functional collectives
    (_c10d_functional: DTensor redistribution, full_tensor). Unknown collectives are refused (KeyError), so none is
    silently left out."""

    def __init__(self):
        super().__init__()
        self.sent: dict[str, list] = {}

    def _add(self, kind: str, nbytes: float) -> None:
        entry = self.sent.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d":
            self._count_c10d(name, args)
        elif ns == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):  # not collectives
            self._count_functional(name, args)
        return func(*args, **kwargs)

    def _count_c10d(self, name: str, args) -> None:
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            _, n = _group_of(args[2])
            self._add("all_gather", _nbytes(args[0]) * (n - 1) / n)
        elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            _, n = _group_of(args[2])
            self._add("reduce_scatter", _nbytes(args[1]) * (n - 1) / n)
        elif name in ("allreduce_", "allreduce_coalesced_"):
            _, n = _group_of(args[1])
            self._add("all_reduce", 2 * _nbytes(args[0]) * (n - 1) / n)
        elif name == "alltoall_base_":
            out, x, pg, _, in_splits = args[:5]
            rank, n = _group_of(pg)
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            splits = list(in_splits) or [x.shape[0] // n] * n
            self._add("all_to_all", (sum(splits) - splits[rank]) * row)
        elif name in ("barrier", "monitored_barrier_"):
            self._add("barrier", 0)
        else:
            raise KeyError(f"CollectiveCounter does not count c10d.{name}")

    def _count_functional(self, name: str, args) -> None:
        if name in ("all_reduce", "all_reduce_"):
            _, n = _named_group(args[2])
            self._add("all_reduce", 2 * _nbytes(args[0]) * (n - 1) / n)
        elif name == "all_gather_into_tensor":
            _, n = _named_group(args[2])
            self._add("all_gather", _nbytes(args[0]) * (n - 1))
        elif name == "reduce_scatter_tensor":
            _, n = _named_group(args[3])
            self._add("reduce_scatter", _nbytes(args[0]) * (n - 1) / n)
        else:
            raise KeyError(f"CollectiveCounter does not count _c10d_functional.{name}")


def fsdp_formula(unit_bytes: list[tuple[int, int, bool]], micro_batches: int = 1) -> dict[str, float]:
    """{"all_gather", "reduce_scatter"}: bytes a rank sends per step under FSDP2 (module docstring). unit_bytes:
    (full parameter bytes of the unit, its shard-group size, resharded after forward), one entry per unit; every
    parameter trainable."""
    ag = sum(b * (n - 1) / n * (2 if reshard else 1) for b, n, reshard in unit_bytes)
    rs = sum(b * (n - 1) / n for b, n, _ in unit_bytes)
    return {"all_gather": ag * micro_batches, "reduce_scatter": rs * micro_batches}


def all_to_all_formula(moe_layers: int, rows: int, top_k: int, hidden: int, ep: int, elem: int = 4) -> float:
    """Bytes a rank sends by EP's row all_to_alls per step under uniform routing (module docstring)."""
    return 4 * moe_layers * rows * top_k * hidden * elem * (ep - 1) / ep if ep > 1 else 0.0


def check_counter_rank() -> dict:
    """CollectiveCounter and held_bytes on collectives and shards whose byte counts are known by hand (run on 2 or
    more ranks before the benchmark; the driver asserts the result): {"got": ..., "want": ...}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, n = dist.get_rank(), dist.get_world_size()
    counter = CollectiveCounter()
    x = torch.ones(6, 5)  # 120 bytes
    rows_to = [rank + p + 1 for p in range(n)]  # rank r sends r + p + 1 rows of 5 floats to rank p
    rows_from = [p + rank + 1 for p in range(n)]
    with counter:
        out = torch.empty(6 * n, 5)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(torch.empty(6, 5), torch.ones(6 * n, 5))
        dist.all_reduce(x)
        dist.all_to_all_single(torch.empty(sum(rows_from), 5), torch.ones(sum(rows_to), 5), rows_from, rows_to)
        mesh = init_device_mesh("cpu", (n,))
        full = distribute_tensor(torch.arange(8 * n * 3, dtype=torch.float32).view(8 * n, 3), mesh, [Shard(0)],
                                 src_data_rank=None).full_tensor()  # funcol all_gather: 8 x 3 floats from each
    got = {k: v[1] for k, v in counter.sent.items()}
    want = {"all_gather": 120 * n * (n - 1) / n + 96 * (n - 1), "reduce_scatter": 120 * n * (n - 1) / n,
            "all_reduce": 2 * 120 * (n - 1) / n, "all_to_all": (sum(rows_to) - rows_to[rank]) * 20}
    opt = torch.optim.AdamW([p := torch.nn.Parameter(distribute_tensor(torch.ones(8 * n, 3), mesh, [Shard(0)]))])
    p.grad = distribute_tensor(torch.ones(8 * n, 3), mesh, [Shard(0)])
    opt.step()
    got["held"] = held_bytes([p], opt)
    want["held"] = {"params": 96, "grads": 96, "optim": 2 * 96 + 4}  # exp_avg, exp_avg_sq shards; step: 0-dim
    return {"got": got, "want": want, "gathered": bool(torch.equal(full, torch.arange(8 * n * 3.0).view(8 * n, 3)))}


# -- one rank --------------------------------------------------------------------------------------------------------
def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _datums(vocab: int, n: int, tokens: int):
    from services.trainer.engine.forward_backward import Datum
    from services.trainer.engine.losses import check_datum

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (tokens,), generator=g)
        inputs = {"target_tokens": torch.roll(ids, -1), "weights": torch.ones(tokens)}
        out.append(Datum(ids, check_datum("cross_entropy", inputs, tokens, vocab, f"data[{i}]")))
    return out


def _units(model, dims) -> list[tuple[int, int, bool]]:
    """(full bytes, shard-group size, resharded after forward) of every FSDP unit of the engine's model."""
    from models.moe import Experts

    ep, n = dims.ep, dims.dp_shard * dims.cp
    units = []
    for layer in model.model.layers.values():
        experts = {id(p) for m in layer.modules() if isinstance(m, Experts) and ep > 1 for p in m.parameters()}
        dense = sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in experts)
        units.append((dense, n, True))
        if experts:  # DTensor .numel(): the global size of the rank's held experts (split over ep already)
            units.append((sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) in experts),
                          n // ep, True))
    layer_params = {id(p) for p in model.model.layers.parameters()}
    units.append((sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in layer_params), n,
                  False))
    return units


def bench_rank(model_dir: str, ep: int, batch: int, tokens: int, steps: int) -> dict:
    import torch.distributed as dist

    from kernels.memory import TensorMemoryTracker
    from models.moe import Experts
    from services.trainer.engine import AdamW, TrainingEngine
    from services.trainer.engine.forward_backward import LossRequest, run_call, split_for_ranks
    from services.trainer.engine.losses import batch_scale
    from services.trainer.engine.parallel import ParallelDims

    rss_start = _rss_kib()
    world = dist.get_world_size()
    settings = AdamW(learning_rate=1e-4)
    engine = TrainingEngine.load(model_dir, lora=None, seed=0, optimizer=settings, device="cpu",
                                 parallel=ParallelDims(dp_shard=world, ep=ep))
    datums = _datums(engine.model.args.vocab_size, batch, tokens)
    share = split_for_ranks(datums, engine.dp_size)[engine.dp_rank]
    req = LossRequest("cross_entropy", {}, micro_batch_tokens=batch * tokens)
    c = batch_scale(req.loss_fn, req.config, [d.inputs for d in datums])

    def one_step(modes=()) -> dict:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            call = engine.loss_call(req, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
            _, metrics = run_call(call, share)
            held = held_bytes(engine.params, engine.optimizer)
            engine.step(settings)
        held["optim"] = held_bytes(engine.params, engine.optimizer)["optim"]
        return {"held": held, "loss": metrics}

    first = one_step()  # warm-up (and the optimizer state's allocation)
    counter, tracker = CollectiveCounter(), TensorMemoryTracker()
    counted = one_step((tracker, counter))
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
    dims = engine.parallel
    moe = engine.model.args.moe_args() if hasattr(engine.model.args, "moe_args") else None
    moe_layers = sum(1 for layer in engine.model.model.layers.values()
                     if any(isinstance(m, Experts) for m in layer.modules()))
    return {"held": counted["held"], "held_first": first["held"], "times": times, "comm": counter.sent,
            "tensor_peak": tracker.peak_bytes, "rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "rss_start_kib": rss_start, "units": _units(engine.model, dims), "rows": sum(d.length for d in share),
            "top_k": moe.top_k if moe else 0, "hidden": engine.model.args.hidden_size, "moe_layers": moe_layers,
            "ep": dims.ep}


# -- driver ----------------------------------------------------------------------------------------------------------
def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="1,2,4,8")
    parser.add_argument("--setups", default=",".join(s[0] for s in SETUPS))
    parser.add_argument("--batch", type=int, default=16, help="datums per step (global, split over the ranks)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per datum")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up and the counted step")
    args = parser.parse_args()
    from models.tiny import build_tiny_model
    from tests.services.trainer.parallel.ranks import run_ranks

    worlds = [int(w) for w in args.worlds.split(",")]
    for out in run_ranks(check_counter_rank, 3):  # the accounting, on collectives of known size
        assert out["got"] == out["want"] and out["gathered"], out
    print("accounting self-check on 3 ranks (known collectives, a sharded AdamW state): passed")
    wanted = args.setups.split(",")
    print(f"torch {torch.__version__}, cpu, {os.cpu_count()} cores, one torch thread per rank, gloo; "
          f"load average {_load()}")
    print(f"global batch {args.batch} datums x {args.tokens} tokens, cross_entropy, AdamW, float32, full-parameter; "
          f"timed steps {args.steps}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        dirs = {}
        for label, family, ep_of in SETUPS:
            if label not in wanted:
                continue
            if family not in dirs:
                dirs[family] = str(build_tiny_model(Path(tmp) / family, family=family, overrides=CONFIGS[family]))
            experts = CONFIGS[family].get("num_experts", 0)
            for n in worlds:
                ep = ep_of(n, experts)
                if label.endswith("ep") and ep == 1:  # N=1: the "moe fsdp" run is its baseline
                    continue
                t0 = time.perf_counter()
                ranks = run_ranks(bench_rank, n, dirs[family], ep, args.batch, args.tokens, args.steps,
                                  timeout_s=900)
                results[(label, n)] = ranks
                print(f"  ran {label} N={n} ep={ep} in {time.perf_counter() - t0:.1f} s", flush=True)
    report(results, worlds, wanted)
    print(f"load average at end {_load()}")


def report(results: dict, worlds: list[int], wanted: list[str]) -> None:
    labels = [s[0] for s in SETUPS if s[0] in wanted]
    print("\nmemory per rank: parameters + gradients + AdamW state held (max over ranks); ideal = held(N=1) / N")
    print(f"{'setup':14} {'N':>2} {'ep':>2} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} {'total MiB':>9} "
          f"{'ideal MiB':>9} {'ratio':>6} {'over ideal B':>12} {'min/max rank':>12} {'tensor peak':>11} "
          f"{'RSS peak':>8} {'RSS rise':>8}")
    for label in labels:
        base = results.get((label, 1)) or results.get(("moe fsdp", 1) if "moe" in label else None)
        base_total = max(sum(r["held"].values()) for r in base) if base else None
        for n in worlds:
            ranks = results.get((label, n))
            if ranks is None:
                continue
            totals = [sum(r["held"].values()) for r in ranks]
            worst = ranks[totals.index(max(totals))]
            h = worst["held"]
            ideal = base_total / n if base_total else float("nan")
            print(f"{label:14} {n:>2} {worst['ep']:>2} {h['params'] / MIB:>10.3f} {h['grads'] / MIB:>9.3f} "
                  f"{h['optim'] / MIB:>9.3f} {max(totals) / MIB:>9.3f} {ideal / MIB:>9.3f} "
                  f"{max(totals) / ideal:>6.4f} {max(totals) - ideal:>12,.0f} {min(totals) / max(totals):>12.4f} "
                  f"{max(r['tensor_peak'] for r in ranks) / MIB:>11.1f} "
                  f"{max(r['rss_peak_kib'] for r in ranks) / 1024:>8.0f} "
                  f"{max(r['rss_peak_kib'] - r['rss_start_kib'] for r in ranks) / 1024:>8.0f}")
    print("\nstep time (loss call + AdamW step): median of the timed steps, slowest rank; ratio to N=1")
    print(f"{'setup':14} {'N':>2} {'tokens/rank':>11} {'median s':>9} {'min s':>7} {'vs N=1':>7}")
    for label in labels:
        t1 = None
        for n in worlds:
            ranks = results.get((label, n)) or (results.get(("moe fsdp", 1)) if n == 1 and "moe" in label else None)
            if ranks is None:
                continue
            med = max(statistics.median(r["times"]) for r in ranks)
            t1 = t1 or med
            print(f"{label:14} {n:>2} {max(r['rows'] for r in ranks):>11} {med:>9.3f} "
                  f"{min(min(r['times']) for r in ranks):>7.3f} {med / t1:>6.2f}x")
    print("\ncommunication per step and rank (bytes sent to other ranks, rank 0; measured = counted at the "
          "dispatcher, formula = module docstring)")
    print(f"{'setup':14} {'N':>2} {'kind':15} {'calls':>5} {'measured B':>13} {'formula B':>13} {'ratio':>6} "
          f"{'measured MiB':>12}")
    for label in labels:
        for n in worlds:
            ranks = results.get((label, n))
            if ranks is None or n == 1:
                continue
            r0 = ranks[0]
            formula = fsdp_formula([tuple(u) for u in r0["units"]])
            formula["all_to_all"] = all_to_all_formula(r0["moe_layers"], r0["rows"], r0["top_k"], r0["hidden"],
                                                       r0["ep"])
            for kind in sorted(set(r0["comm"]) | {k for k, v in formula.items() if v}):
                calls, got = r0["comm"].get(kind, (0, 0.0))
                want = formula.get(kind)
                ratio = f"{got / want:6.3f}" if want else "     -"
                want_s = f"{want:13,.0f}" if want is not None else f"{'-':>13}"
                print(f"{label:14} {n:>2} {kind:15} {calls:>5} {got:>13,.0f} {want_s} {ratio} {got / MIB:>12.3f}")
            if r0["ep"] > 1:  # routing imbalance: what each rank really sent
                sent = [r["comm"].get("all_to_all", (0, 0.0))[1] / MIB for r in ranks]
                print(f"{'':14} {'':>2} all_to_all per rank MiB: {' '.join(f'{s:.3f}' for s in sent)}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
