"""The batch-invariant GEMM kernel (kernels/native.py, kernels/csrc/invariant.c) against torch's GEMM (MKL sgemm for
float32, oneDNN for bfloat16) on a linear layer's shapes: x [M, K] times a weight [N, K] transposed, as F.linear.
Prints GFLOP/s of both and the kernel's time over torch's, per dtype, M and thread count (best of --seconds of
repeats each).

    .venv/bin/python bench/invariant_gemm.py [--k 512] [--n 1536] [--ms 1,16,128,1024] [--threads 1,2]
"""
import argparse
import os
import time

import torch

from kernels import native


def best_seconds(fn, seconds: float) -> float:
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--ms", default="1,16,128,1024")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, kernel build {native.isa()} (bf16: {native.bf16_dot()}), "
          f"K={args.k} N={args.n}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'dtype':6s} {'thr':>3s} {'M':>5s} {'torch GFLOP/s':>14s} {'kernel GFLOP/s':>15s} {'kernel/torch time':>18s}")
    for dtype in (torch.float32, torch.bfloat16):
        W = torch.randn(args.n, args.k).to(dtype)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for M in (int(m) for m in args.ms.split(",")):
                x = torch.randn(M, args.k).to(dtype)
                t_torch = best_seconds(lambda: torch.nn.functional.linear(x, W), args.seconds)
                t_kernel = best_seconds(lambda: native.gemm(x, W.t()), args.seconds)
                flop = 2 * M * args.k * args.n
                print(f"{str(dtype)[6:]:6s} {threads:3d} {M:5d} {flop / t_torch / 1e9:14.1f} "
                      f"{flop / t_kernel / 1e9:15.1f} {t_kernel / t_torch:17.2f}x", flush=True)


if __name__ == "__main__":
    main()
