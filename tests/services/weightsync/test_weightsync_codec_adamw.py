"""Weight-delta codec end to end on real AdamW steps of the tiny Qwen3 model, and its checksum against a reference."""
import itertools

import numpy as np
import pytest
import torch

from models.llama import CausalLM, ModelArgs
from models.tiny import tiny_config
from services.weightsync.codec import apply_delta, describe, encode_delta, tensor_checksum
from services.weightsync.codec_checksum import _K, B, _m_table, change_checksum, checksum


def train_versions(lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of float32 master weights after each of `steps` AdamW steps on random tokens (version 0 is
    the initial model)."""
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config(tiny_config(1024)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    versions = [{n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}]
    for _ in range(steps):
        ids_BT = torch.randint(0, 1024, (2, 33), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(ids_BT[:, :-1]).flatten(0, 1), ids_BT[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        versions.append({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
    return versions


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-3])
def test_rollout_follows_a_training_run_bit_exactly(lr):
    """Versions 0 -> 1 -> 2 -> 3 shipped as deltas; the rollout's copy matches the trainer's bf16 weights each time."""
    versions = train_versions(lr, steps=3)
    rollout = {k: v.clone() for k, v in versions[0].items()}
    raw = sum(t.numel() * 2 for t in rollout.values())
    for v_old, v_new in itertools.pairwise(versions):
        delta = encode_delta(v_old, v_new)
        apply_delta(rollout, delta)
        assert same_bits(rollout, v_new)
    changed = sum(int((versions[2][k].view(torch.int16) != versions[3][k].view(torch.int16)).sum()) for k in rollout)
    if lr == 1e-6:  # ~2% of elements change at this rate; norms (1.0 in bf16) cannot move by 1e-6
        assert changed / (raw / 2) < 0.05 and raw / len(delta) > 30
        assert "unchanged" in {i.method for i in describe(delta)}


def test_float32_master_weights_delta_is_bit_exact():
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config(tiny_config(1024)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(torch.randint(0, 1024, (1, 16))).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = {k: v.clone() for k, v in old.items()}
    apply_delta(base, encode_delta(old, new))
    assert same_bits(base, new)


def reference_checksum(buf: bytes) -> int:
    """The documented definition with Python integers (docs/weight_delta.md)."""
    buf += b"\0" * (-len(buf) % 8)
    total = 0
    for t in range(len(buf) // 8):
        w = int.from_bytes(buf[8 * t:8 * t + 8], "little")
        total += (int(_K[t % B]) + int(_m_table(t // B + 1)[t // B])) * w
    return total % (1 << 64)


def splitmix64_ref(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_checksum_tables_follow_the_documented_definition():
    assert [int(k) for k in _K[:4]] == [splitmix64_ref(j) | 1 for j in range(4)]
    assert int(_K[B - 1]) == splitmix64_ref(B - 1) | 1
    m = _m_table(3)
    assert [int(v) for v in m] == [splitmix64_ref(r + (1 << 63)) & ~1 for r in range(3)]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096, 4097, 8 * B * 3 + 5, 8 * B * 130 + 13])
def test_checksum_matches_reference(n):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert checksum(buf) == reference_checksum(buf.tobytes())


@pytest.mark.parametrize("elem_size", [1, 2, 4, 8])
def test_change_checksum_is_the_checksum_difference(elem_size):
    rng = np.random.default_rng(elem_size)
    n = 8 * B * 3 + 3
    old = rng.integers(0, 256, n * elem_size, dtype=np.uint8).view(f"<u{elem_size}")
    idx = np.sort(rng.choice(n, 500, replace=False)).astype(np.int64)
    new = old.copy()
    new[idx] = rng.integers(0, 256, idx.size * elem_size, dtype=np.uint8).view(f"<u{elem_size}")
    got = (checksum(old.view(np.uint8)) + change_checksum(idx, old[idx], new[idx])) % (1 << 64)
    assert got == checksum(new.view(np.uint8))


def test_checksum_sees_single_bit_flips_anywhere():
    t = torch.randn(3, 1000).to(torch.bfloat16)
    base = tensor_checksum(t)
    flat = t.view(torch.uint8).reshape(-1)
    for pos in range(0, flat.numel(), 37):
        for bit in (0, 7):
            flat[pos] ^= 1 << bit
            assert tensor_checksum(t) != base
            flat[pos] ^= 1 << bit
    assert tensor_checksum(t) == base
