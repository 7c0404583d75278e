"""Peak temporary memory and time of chunked logprobs against the naive computation (baseline), forward + backward.

    .venv/bin/python bench/logprobs_memory.py                # N=8192 tokens, V=131072, D=1024, float32, CPU

Both sides compute the same thing (kernels/logprobs.py: logprobs of targets under softmax(h W^T), summed into a
loss, gradients w.r.t. h and W). Memory is what kernels.memory.TensorMemoryTracker counts: tensor storages allocated
during the call and alive at once (inputs and parameters excluded; the [V, D] weight gradient included on both
sides). Device-independent, so the CPU figures are the ones a GPU run would allocate. Times are wall-clock of one
call each after a small warm-up, with the tracker on (its per-op cost is negligible at these sizes).
"""

import argparse
import time

import torch

from kernels.logprobs import chunked_logprobs, default_chunk_size, logprobs_reference
from kernels.memory import TensorMemoryTracker

MIB = 2**20


def run(fn, hidden_ND, unembed_VD, targets_N):
    hidden_ND.grad = unembed_VD.grad = None
    with TensorMemoryTracker() as mem:
        start = time.perf_counter()
        logprobs_N = fn(hidden_ND, None, 0.0, unembed_VD, targets_N)
        forward_s, forward_peak = time.perf_counter() - start, mem.peak_bytes
        logprobs_N.sum().backward()
        total_s = time.perf_counter() - start
    result = (logprobs_N.detach(), hidden_ND.grad, unembed_VD.grad)
    return result, forward_peak, mem.peak_bytes, forward_s, total_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: kernels.logprobs.default_chunk_size")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    N, V, D = args.tokens, args.vocab, args.hidden
    chunk = args.chunk_size or default_chunk_size(V)
    gen = torch.Generator().manual_seed(0)
    hidden_ND = torch.randn(N, D, generator=gen).requires_grad_()
    unembed_VD = (torch.randn(V, D, generator=gen) * D**-0.5).requires_grad_()
    targets_N = torch.randint(0, V, (N,), generator=gen)

    for fn in (logprobs_reference, chunked_logprobs):  # warm-up: first-call costs (allocator, BLAS setup) out
        small = hidden_ND[:64].detach().requires_grad_()
        kw = {"chunk_size": 16} if fn is chunked_logprobs else {}
        fn(small, None, 0.0, unembed_VD, targets_N[:64], **kw).sum().backward()
    chunked = run(lambda *a: chunked_logprobs(*a, chunk_size=chunk), hidden_ND, unembed_VD, targets_N)
    naive = run(logprobs_reference, hidden_ND, unembed_VD, targets_N)
    diffs = [(c - n).abs().max().item() for c, n in zip(chunked[0], naive[0])]

    print(f"device cpu ({torch.get_num_threads()} threads), float32, N={N} tokens, V={V}, D={D}, chunk={chunk}")
    print(f"{'':24}{'naive':>14}{'chunked':>14}{'chunked/naive':>16}")
    for label, i in (("peak MiB, forward", 1), ("peak MiB, fwd+bwd", 2)):
        print(f"{label:24}{naive[i] / MIB:>14.1f}{chunked[i] / MIB:>14.1f}{chunked[i] / naive[i]:>16.4f}")
    for label, i in (("time s, forward", 3), ("time s, fwd+bwd", 4)):
        print(f"{label:24}{naive[i]:>14.2f}{chunked[i]:>14.2f}{chunked[i] / naive[i]:>16.2f}")
    print(f"[N, V] float32 logits alone: {N * V * 4 / MIB:.1f} MiB")
    print("max abs diff chunked vs naive: logprobs {:.2e}, d hidden {:.2e}, d unembed {:.2e}".format(*diffs))


if __name__ == "__main__":
    main()
