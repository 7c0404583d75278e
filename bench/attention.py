"""Forward + backward time of the sdpa attention backend against the reference backend (baseline) on packed rows.

    .venv/bin/python bench/attention.py

Each configuration is one packed training row (B = 1) of documents with seeded random lengths, causal, through
kernels.attention.attention(backend=...). Times are the best of --reps calls after one warm-up call (the minimum,
as other work on a shared machine only ever adds time; the two backends take turns); the speedup column is
reference time / sdpa time. The last column is the largest |sdpa - reference| over out, dq, dk, dv, relative to
that tensor's largest entry.
"""

import argparse
import time

import torch

from kernels.attention import Packing, attention

# name, total tokens T, query heads H, kv heads K, head dim D, value head dim Dv, dtype
CONFIGS = [
    ("gqa fp32", 4096, 8, 2, 128, 128, torch.float32),
    ("gqa bf16", 4096, 8, 2, 128, 128, torch.bfloat16),
    ("mla fp32", 2048, 8, 8, 192, 128, torch.float32),
    ("mla bf16", 2048, 8, 8, 192, 128, torch.bfloat16),
]


def document_lengths(total: int, gen: torch.Generator, longest: int = 1024) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=gen)), total - sum(lengths)))
    return lengths


def time_backends(backends, q, k, v, grad_out, packing, reps):
    """Best time and last result per backend; the backends take turns, so a burst of other load on a shared
    machine hits both sides alike."""
    def step(backend):
        q.grad = k.grad = v.grad = None
        out = attention(q, k, v, causal=True, q_offset=0, packing=packing, backend=backend)
        out.backward(grad_out)
        return [out.detach(), q.grad, k.grad, v.grad]

    best, results = dict.fromkeys(backends, float("inf")), {}
    for backend in backends:
        step(backend)
    for _ in range(reps):
        for backend in backends:
            start = time.perf_counter()
            results[backend] = step(backend)
            best[backend] = min(best[backend], time.perf_counter() - start)
    return best, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device cpu ({torch.get_num_threads()} threads), torch {torch.__version__}, causal packed rows, B=1")
    print(f"{'config':10}{'T':>6}{'docs':>6}{'H/K':>6}{'D/Dv':>9}{'reference s':>13}{'sdpa s':>9}{'speedup':>9}"
          f"{'max rel diff':>14}")
    for name, T, H, K, D, Dv, dtype in CONFIGS:
        gen = torch.Generator().manual_seed(0)
        lengths = document_lengths(T, gen)
        packing = Packing.from_lengths(lengths)
        q, k, v = (torch.randn(1, n, T, d, generator=gen).to(dtype).requires_grad_()
                   for n, d in ((H, D), (K, D), (K, Dv)))
        grad_out = torch.randn(1, H, T, Dv, generator=gen).to(dtype)
        best, results = time_backends(("reference", "sdpa"), q, k, v, grad_out, packing, args.reps)
        (ref_s, sdpa_s), (ref, got) = best.values(), results.values()
        diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref))
        print(f"{name:10}{T:>6}{len(lengths):>6}{f'{H}/{K}':>6}{f'{D}/{Dv}':>9}{ref_s:>13.3f}{sdpa_s:>9.3f}"
              f"{ref_s / sdpa_s:>8.1f}x{diff:>14.2e}")


if __name__ == "__main__":
    main()
