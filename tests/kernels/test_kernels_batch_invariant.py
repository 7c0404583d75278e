"""batch_invariant_mode (kernels/batch_invariant.py): a sequence's logits are bitwise the same whatever else is in the
batch and however its positions were computed (full prefill, chunked prefill, decode against a KVCache), and equal
the trainer's logprobs; plus probes of where plain torch on CPU is not batch-invariant.

Named reference: the sequence's own full forward, alone, under the mode. Tolerance: none (torch.equal, float32 and
bfloat16, CPU). The probes print what plain torch does on the machine that runs them (run with -s;
docs/deterministic.md records one machine's table) and assert only what the mode guarantees: a BLAS that rounds
differently elsewhere changes the printed table, never the outcome.
"""
# Shapes: B batch, T tokens, L sequence length, V vocab, M GEMM rows, K contraction, N GEMM columns.

import threading

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import attention, reference_attention
from kernels import native
from kernels.batch_invariant import (
    SUM_CHUNK,
    batch_invariant_mode,
    invariant_einsum,
    invariant_grouped_mm,
    invariant_matmul,
    is_active,
)
from kernels.moe import PermState, unpermute
from kernels.norm import rms_norm
from models import KVCache, load_pretrained
from models.lora import LoraConfig, apply_lora
from models.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")
PAD = 0
SEQ_LEN = 150  # several of the attention kernel's key blocks (16) and query tiles (16 positions)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {f: build_tiny_model(tmp_path_factory.mktemp(f"tiny_{f}"), family=f) for f in FAMILIES}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {f: load_pretrained(d) for f, d in model_dirs.items()}


def _ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------- probes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_linear_row_alone_vs_in_batch(dtype):
    """x[i] @ W^T alone vs (X @ W^T)[i] for M rows: MKL picks its kernel by M (and by each thread's share of M)."""
    W = torch.randn(1536, 512, dtype=dtype)
    X = torch.randn(257, 512, dtype=dtype)
    table = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for mode in (False, True):
            with batch_invariant_mode(mode):
                alone = torch.cat([F.linear(X[i : i + 1], W) for i in range(0, 257, 16)])
                table[threads, mode] = [
                    M for M in (1, 2, 5, 7, 9, 64, 257) if not torch.equal(F.linear(X[:M], W)[::16], alone[: -(-M // 16)])
                ]
    print(f"\n{dtype}: M whose rows differ from the row computed alone, (threads, mode) -> {table}")
    assert table[1, True] == table[2, True] == []


def test_probe_gemm_invariant_across_thread_counts_and_row_chunks():
    """Under the mode a row's bits depend neither on the thread count (MKL splits M differently per count) nor on
    whether a long GEMM ran in row chunks (M > 2 * GEMM_ROW_CHUNK)."""
    W, X = torch.randn(384, 128), torch.randn(1100, 128)
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with batch_invariant_mode():
            out[threads] = [F.linear(X[:M], W) for M in (1, 5, 13, 64, 1100)]
            out[threads].append(F.linear(X[-20:], W))
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))
    full = out[1][-2]
    assert all(torch.equal(rows, full[: rows.shape[0]]) for rows in out[1][:-2])
    assert torch.equal(out[1][-1], full[-20:])


@pytest.mark.parametrize("heads,kv_heads,D,Dv", [(4, 2, 32, 32), (4, 4, 48, 32)])
def test_probe_attention_decode_vs_prefill(heads, kv_heads, D, Dv):
    """kernels.attention (sdpa backend): row p of a causal prefill vs the same query decoded against keys 0..p."""
    L = 137
    q, k, v = torch.randn(2, heads, L, D), torch.randn(2, kv_heads, L, D), torch.randn(2, kv_heads, L, Dv)
    differ = {}
    for mode in (False, True):
        with batch_invariant_mode(mode):
            full = attention(q, k, v, causal=True, q_offset=0, backend="sdpa")
            chunk = attention(q[:, :, 70:], k, v, causal=True, q_offset=70, backend="sdpa")
            rows = [p for p in (0, 1, 63, 64, 65, 100, L - 1)
                    if not torch.equal(attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], causal=True,
                                                 q_offset=p, backend="sdpa")[:, :, 0], full[:, :, p])]
            differ[mode] = (rows, not torch.equal(chunk, full[:, :, 70:]))
    print(f"\nH={heads} K={kv_heads} D={D} Dv={Dv}: (decoded rows that differ, chunked prefill differs) "
          f"plain {differ[False]}, mode {differ[True]}")
    assert differ[True] == ([], False)


def test_probe_silu_sigmoid_tail_elements():
    """F.silu / sigmoid: the vectorized loop and the scalar tail round differently, and which elements fall in the
    tail depends on the tensor's size. Element 32 of 33 is in the tail; flipped, the same value is element 0."""
    x = torch.randn(4000, 33) * 4
    for op in (F.silu, torch.sigmoid):
        mismatches = {}
        for mode in (False, True):
            with batch_invariant_mode(mode):
                mismatches[mode] = sum(int(op(row)[-1] != op(row.flip(0))[0]) for row in x)
        print(f"\n{op.__name__}: tail vs head mismatches in 4000: plain {mismatches[False]}, mode {mismatches[True]}")
        assert mismatches[True] == 0


def test_probe_long_single_row_sum():
    """A single output row longer than torch's grain (32768) is reduced by all threads together (two-pass), so
    with 2 threads its sum differs from the same row among others; the mode sums in chunks of SUM_CHUNK."""
    X = torch.randn(4, 151_936)
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for mode in (False, True):
            with batch_invariant_mode(mode):
                out[threads, mode] = (X[:1].sum(-1), X.sum(-1)[:1], X[:1].mean(-1, keepdim=True), X.mean(-1)[:1])
    same = {key: torch.equal(a, b) and torch.equal(c[:, 0], d) for key, (a, b, c, d) in out.items()}
    print(f"\nsum/mean of one 151936-long row alone == among 4 rows, (threads, mode) -> {same}")
    assert same[1, True] and same[2, True]
    assert torch.equal(out[1, True][0], out[2, True][0])  # and the same bits at either thread count
    torch.testing.assert_close(out[1, True][0], X[:1].double().sum(-1).float(), rtol=1e-6, atol=1e-3)
    assert SUM_CHUNK < 32768


def test_probe_ops_the_mode_leaves_alone_are_invariant():
    """What passes through the mode unchanged, measured row-invariant at 1 and 2 threads: softmax, log_softmax and
    logsumexp over long rows (each row is done whole by one thread), rms_norm, and the MoE unpermute sum."""
    X = torch.randn(257, 4096)
    expert_out_NKD, weights_NK = torch.randn(1000, 2, 128), torch.rand(1000, 2)
    ops = {
        "softmax": lambda x: x.softmax(-1), "log_softmax": lambda x: x.log_softmax(-1),
        "logsumexp": lambda x: torch.logsumexp(x, -1), "rms_norm": lambda x: rms_norm(x, torch.ones(4096), 1e-6),
    }

    def moe_sum(n: int) -> torch.Tensor:  # unpermute of n tokens whose rows are already in assignment order
        identity = torch.arange(2 * n)
        state = PermState(identity, identity, torch.tensor([2 * n]), n, 2)
        return unpermute(expert_out_NKD[:n].flatten(0, 1), weights_NK[:n], state)

    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, op in ops.items():
            ref = op(X)
            assert all(torch.equal(op(X[s : s + M]), ref[s : s + M]) for M in (1, 2, 7, 64) for s in (0, 3)), name
        ref = moe_sum(1000)
        assert all(torch.equal(moe_sum(M), ref[:M]) for M in (1, 3, 100)), "unpermute"


# ----------------------------------------------------------------------------------------------------------- models


def _batch_logits(model, seq_1L: torch.Tensor, n_others: int, row: int, seed: int) -> torch.Tensor:
    """The sequence's logits computed at `row` of a right-padded batch of n_others + 1 sequences."""
    L = seq_1L.shape[1]
    lengths = torch.randint(L // 2, L + 12, (n_others + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths[row] = L
    batch = torch.full((n_others + 1, max(lengths)), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        batch[i, :n] = _ids((1, n), seed + 1 + i)[0]
    batch[row, :L] = seq_1L[0]
    return model(batch)[row, :L]


def _decode_logits(model, seq_1L: torch.Tensor, prefix: list[int], n_others: int) -> torch.Tensor:
    """Prefill the prefix in the given chunk lengths, then decode token by token, with n_others other rows."""
    L = seq_1L.shape[1]
    batch = torch.cat([seq_1L, _ids((n_others, L), 7)])
    cache = KVCache.allocate(model.args, batch.shape[0], L, model.lm_head.weight.dtype, "cpu")
    steps, start = [], 0
    for n in prefix:
        steps.append(model(batch[:, start : start + n], cache=cache)[0])
        start += n
    for t in range(start, L):
        steps.append(model(batch[:, t : t + 1], cache=cache)[0])
    return torch.cat(steps)


def _comparisons(model, seq_1L: torch.Tensor) -> dict[str, bool]:
    alone = model(seq_1L)[0]
    out = {f"batch of {n + 1}": torch.equal(_batch_logits(model, seq_1L, n, n // 2, n), alone) for n in (2, 5, 16)}
    out["prefill 9 + decode"] = torch.equal(_decode_logits(model, seq_1L, [9], 0), alone)
    out["chunked prefill 40+33+4 + decode, batch of 5"] = torch.equal(_decode_logits(model, seq_1L, [40, 33, 4], 4), alone)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_independent_of_batch_and_of_prefill_or_decode(models, family):
    seq_1L = _ids((1, SEQ_LEN), 11)
    with batch_invariant_mode():
        results = _comparisons(models[family], seq_1L)
    assert all(results.values()), results


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_bf16_logits_independent_of_batch_and_of_decode(model_dirs, family):
    """Measured beyond the float32 contract: a bf16 model under the mode (bf16 GEMMs, float32 attention inside)."""
    model = load_pretrained(model_dirs[family], dtype=torch.bfloat16)
    seq_1L = _ids((1, 100), 12)
    with batch_invariant_mode():
        alone = model(seq_1L)[0]
        assert torch.equal(_batch_logits(model, seq_1L, 4, 2, 4), alone)
        assert torch.equal(_decode_logits(model, seq_1L, [9], 0), alone)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_probe_comparisons_without_the_mode(models, family):
    """What plain torch gives for the same comparisons (printed: it depends on the machine's BLAS); the logits stay
    within float32 rounding of the mode's."""
    seq_1L = _ids((1, SEQ_LEN), 11)
    results = _comparisons(models[family], seq_1L)
    print(f"\n{family} without the mode, bitwise equal to the sequence alone: {results}")
    with batch_invariant_mode():
        invariant = models[family](seq_1L)
    torch.testing.assert_close(models[family](seq_1L), invariant, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_trainer_logprobs_equal_rollout_logprobs(models, family):
    """Rollout: prefill + batched decode, the sampled token's log_softmax from each step's logits (services/rollout
    sampling). Trainer: one full forward of the finished sequence, log_softmax, gather (services/trainer sessions)."""
    model = models[family]
    prompt_len, L, B = 12, 80, 4
    tokens = torch.cat([_ids((B, prompt_len), 3), torch.zeros(B, L - prompt_len, dtype=torch.long)], dim=1)
    with batch_invariant_mode():
        cache = KVCache.allocate(model.args, B, L, torch.float32, "cpu")
        logits = model(tokens[:, :prompt_len], cache=cache)[:, -1]
        rollout = []
        for t in range(prompt_len, L):
            logprobs_BV = torch.log_softmax(logits.float(), dim=-1)
            tokens[:, t] = torch.multinomial(logprobs_BV.exp(), 1, generator=torch.Generator().manual_seed(t))[:, 0]
            rollout.append(logprobs_BV.gather(1, tokens[:, t : t + 1])[:, 0])
            if t + 1 < L:
                logits = model(tokens[:, t : t + 1], cache=cache)[:, -1]
        rollout_BT = torch.stack(rollout, dim=1)
        for row in range(B):  # the trainer sees one sequence at a time, and all of them at once
            seq = tokens[row : row + 1]
            alone = torch.gather(F.log_softmax(model(seq).float(), dim=-1)[:, :-1], -1, seq[:, 1:, None])[0, :, 0]
            assert torch.equal(alone[prompt_len - 1 :], rollout_BT[row])
        batched = torch.gather(F.log_softmax(model(tokens).float(), -1)[:, :-1], -1, tokens[:, 1:, None])[..., 0]
        assert torch.equal(batched[:, prompt_len - 1 :], rollout_BT)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@torch.no_grad()
def test_lora_paths_are_batch_invariant(tmp_path, family):
    """LoRALinear (F.linear pairs) and ExpertsLoRA (grouped GEMMs) under the mode, with a non-zero adapter."""
    model = load_pretrained(build_tiny_model(tmp_path, family=family))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    seq_1L = _ids((1, 90), 5)
    with batch_invariant_mode():
        alone = model(seq_1L)[0]
        assert torch.equal(_batch_logits(model, seq_1L, 5, 2, 3), alone)
        assert torch.equal(_decode_logits(model, seq_1L, [20], 2), alone)


def test_gradients_flow_under_the_mode(models):
    """A trainer may backpropagate through its logprob pass under the mode: same loss and gradients as plain torch
    within float32 rounding (1e-5 relative to the largest entry)."""
    model = models["qwen3"]
    seq = _ids((2, 40), 2)
    grads = {}
    for mode in (False, True):
        model.zero_grad()
        with batch_invariant_mode(mode):
            logprobs = torch.gather(F.log_softmax(model(seq).float(), -1)[:, :-1], -1, seq[:, 1:, None])
            logprobs.sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-5 * g.abs().max().item())


def test_mode_is_thread_local():
    """Entering the mode on one thread (the rollout's engine thread) leaves other threads on plain torch."""
    W, x = torch.randn(384, 128), torch.randn(1, 128)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def engine():
        with batch_invariant_mode():
            inside.set()
            seen["engine"] = (is_active(), torch._C._len_torch_function_stack(), F.linear(x, W))
            outside.wait(10)

    thread = threading.Thread(target=engine)
    thread.start()
    inside.wait(10)
    seen["other"] = (is_active(), torch._C._len_torch_function_stack(), F.linear(x, W))
    outside.set()
    thread.join()
    assert seen["engine"][:2] == (True, 1) and seen["other"][:2] == (False, 0)
    assert torch.equal(seen["engine"][2], native.gemm(x, W.t()))  # the kernel's chain, not the BLAS call
    assert torch.equal(seen["other"][2], F.linear(x, W))


# ------------------------------------------------------------------------------------------------- op semantics


def test_rerouted_ops_keep_torch_semantics():
    """The invariant GEMMs are torch.matmul / einsum / _grouped_mm / F.linear with other rounding (1e-5)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)
    cases = [(r(7), r(7)), (r(5, 7), r(7)), (r(7), r(7, 3)), (r(2, 5, 7), r(7, 3)), (r(2, 1, 5, 7), r(3, 7, 4)),
             (r(5, 7), r(2, 7, 3))]
    for a, b in cases:
        torch.testing.assert_close(invariant_matmul(a, b), torch.matmul(a, b), rtol=1e-5, atol=1e-5)
    for eq, ops in (("ij,jk->ik", (r(5, 7), r(7, 3))), ("bij,bjk", (r(2, 5, 7), r(2, 7, 3))),
                    ("...ij,jk->...ik", (r(2, 3, 5, 7), r(7, 4))), ("ij,jk,kl->il", (r(4, 5), r(5, 6), r(6, 2))),
                    ("bhtd,bhsd->bhts", (r(2, 3, 4, 8), r(2, 3, 6, 8))), ("ij,ij->i", (r(5, 7), r(5, 7))),
                    ("ij,k->ik", (r(5, 7), r(3)))):
        torch.testing.assert_close(invariant_einsum(eq, *ops), torch.einsum(eq, *ops), rtol=1e-5, atol=1e-5)
    x, w = r(20, 16), r(3, 16, 8)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    ref = torch.cat([x[:5] @ w[0], x[5:] @ w[2]])
    torch.testing.assert_close(invariant_grouped_mm(x, w, offs=offs), ref, rtol=1e-5, atol=1e-5)
    with batch_invariant_mode():
        torch.testing.assert_close(torch._grouped_mm(x, w, offs=offs), ref, rtol=1e-5, atol=1e-5)
        lin = torch.nn.Linear(16, 5)
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-5, atol=1e-5)
        bias, m = r(5), r(16, 5)
        torch.testing.assert_close(torch.addmm(bias, x, m, beta=0.5, alpha=2.0), 0.5 * bias + 2.0 * (x @ m))


@pytest.mark.parametrize("case", ["causal", "gqa", "mla", "chunk", "decode", "noncausal", "packed", "bf16"])
def test_attention_accuracy_against_float64(case):
    """The mode's attention against the float64 reference: within 2e-6 absolute in float32 (inputs ~N(0, 1)) for head
    dims up to 96, and proportionally more for MLA's 192 (each score is one sequential float32 chain over the head dim:
    measured max 2.3e-6 over 200 seeds at D = 192, 1.3e-6 at D = 64); within bf16 rounding (2e-2) for bf16 inputs."""
    from kernels.attention import Packing

    H, K, T, S, D, Dv, offset, causal, packing, dtype = 4, 4, 33, 33, 64, 64, 0, True, None, torch.float32
    if case == "gqa":
        H, K = 8, 2
    elif case == "mla":
        D, Dv = 192, 128
    elif case == "chunk":
        T, S, offset = 4, 70, 66
    elif case == "decode":
        T, S, offset = 1, 150, 149
    elif case == "noncausal":
        T, S, causal = 5, 6, False
    elif case == "packed":
        T = S = 80
        packing = Packing.from_lengths([17, 1, 40, 22])
    elif case == "bf16":
        dtype = torch.bfloat16
    q, k, v = (torch.randn(1, h, n, d).to(dtype) for h, n, d in ((H, T, D), (K, S, D), (K, S, Dv)))
    truth = reference_attention(q.double(), k.double(), v.double(), causal=causal, q_offset=offset, packing=packing,
                                compute_dtype=torch.float64)
    with batch_invariant_mode():
        out = attention(q, k, v, causal=causal, q_offset=offset, packing=packing)
    assert out.dtype == dtype and out.shape == truth.shape
    err = (out.double() - truth).abs().max().item()
    print(f"\n{case}: max abs error {err:.3g}")
    assert err <= (2e-2 if dtype == torch.bfloat16 else 2e-6 * max(1.0, D / 96))
