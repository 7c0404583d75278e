"""Weight-delta codec: bit-exact round trips for every dtype and method, method choice, full tensor sets.

"Equal" always means equal bits (NaN payloads and -0.0 included), never torch.equal on values.
"""
import numpy as np
import pytest
import torch
import zstandard

from services.weightsync import codec_methods
from services.weightsync.codec import (
    DTYPE_CODES,
    FULL,
    SPARSE,
    XOR,
    apply_delta,
    decode_full,
    describe,
    encode_delta,
    encode_full,
    iter_encode_delta,
    iter_encode_full,
)

ALL_DTYPES = list(DTYPE_CODES)
SIZES = [1, 3, 7, 1023, 4097]  # odd sizes leave a partial 8-byte word at the end


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Any bit pattern of the dtype (NaNs with payloads, infinities, subnormals, -0.0); bools stay 0/1."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def roundtrip(old: dict, new: dict, **kw) -> tuple[bytes, dict]:
    delta = encode_delta(old, new, **kw)
    base = {k: v.clone() for k, v in old.items()}
    out = apply_delta(base, delta)
    assert out is base
    for k, t in new.items():
        assert same_bits(base[k], t), k
    return delta, base


def methods(delta: bytes) -> dict[str, str]:
    return {i.name: i.method for i in describe(delta)}


def change_some(t: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """A copy with about frac of the elements replaced by random bit patterns (through the byte view, which every
    dtype supports)."""
    rows = t.clone().reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())
    pick = torch.rand(t.numel(), generator=gen) < frac
    rows[pick] = random_bits((int(pick.sum()),), t.dtype, gen).view(torch.uint8).reshape(-1, t.element_size())
    return rows.reshape(-1).view(t.dtype).reshape(t.shape)


def flip_low_bit(t: torch.Tensor) -> torch.Tensor:
    b = t.clone().reshape(-1).view(torch.uint8)
    b[:: t.element_size()] ^= 1  # little-endian: byte 0 of each element holds bit 0
    return b.view(t.dtype).reshape(t.shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_random_changes_roundtrip_every_dtype(dtype, n):
    gen = torch.Generator().manual_seed(n)
    old = random_bits((n,), dtype, gen)
    new = change_some(old, 0.1, gen)
    new.view(torch.uint8)[-1] ^= 1  # the partial last word always changes
    roundtrip({"w": old}, {"w": new})
    roundtrip({"w": old}, {"w": new}, exhaustive=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_each_method_roundtrips_every_dtype(dtype):
    gen = torch.Generator().manual_seed(1)
    old = random_bits((4097,), dtype, gen)
    old2 = random_bits((64, 65), dtype, gen)
    big = random_bits((200_000,), dtype, gen)
    cases = {
        "unchanged": (old, old.clone()),
        "sparse": (big, torch.where(torch.rand(big.shape, generator=gen) < 0.02, flip_low_bit(big), big)),
        "xor": (old2, flip_low_bit(old2)),  # one constant XOR, random arithmetic signs
        "full": (old, torch.zeros_like(old)),  # zstd of zeros beats any diff of random bits
    }
    delta, _ = roundtrip({k: v[0] for k, v in cases.items()}, {k: v[1] for k, v in cases.items()}, exhaustive=True)
    assert methods(delta) == {k: k for k in cases}


def test_adversarial_float_bit_patterns():
    f32 = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38, 1.0])
    nan_payloads = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x7FFFFFFF], dtype=torch.int64)
    old32 = torch.cat([f32, nan_payloads.to(torch.int32).view(torch.float32)])
    new32 = old32.clone()
    bits = new32.view(torch.int32)
    bits[0] = torch.tensor(-0.0).view(torch.int32)  # 0.0 -> -0.0 compares equal as floats, not as bits
    bits[1] = 0
    bits[4] = 0x7FC00002  # NaN -> NaN with another payload
    bits[8] ^= 1
    bits[2] = torch.tensor(-float("inf")).view(torch.int32)
    cases = {"f32": (old32, new32)}
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        o = f32.to(dtype)
        n = o.clone().reshape(-1).view(torch.uint8)
        n ^= torch.arange(n.numel(), dtype=torch.uint8) % 3  # touches NaN, inf and signed-zero encodings
        cases[str(dtype)] = (o, n.view(dtype))
    old = {k: v[0] for k, v in cases.items()}
    new = {k: v[1] for k, v in cases.items()}
    roundtrip(old, new)
    roundtrip(old, new, exhaustive=True)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64], ids=str)
def test_empty_scalar_and_single_element(shape, dtype):
    gen = torch.Generator().manual_seed(2)
    old = random_bits(shape, dtype, gen)
    changed = old.clone().reshape(-1).view(torch.uint8)
    if changed.numel():
        changed[0] ^= 0x10
    new = changed.view(dtype).reshape(shape)
    delta, _ = roundtrip({"t": old}, {"t": new})
    assert methods(delta)["t"] == "unchanged" if old.numel() == 0 else len(delta) < 100
    roundtrip({"t": old}, {"t": new}, exhaustive=True)
    assert same_bits(decode_full(encode_full({"t": new}))["t"], new)


def test_all_changed_and_none_changed():
    gen = torch.Generator().manual_seed(3)
    old = random_bits((5000,), torch.bfloat16, gen)
    new = (old.view(torch.int16) + 1).view(torch.bfloat16)  # every element one step up
    delta, _ = roundtrip({"a": old, "b": old}, {"a": new, "b": old.clone()})
    infos = {i.name: i for i in describe(delta)}
    assert infos["b"].method == "unchanged" and infos["b"].payload_bytes == 0
    assert infos["a"].payload_bytes < 200  # constant change: positions and values compress to almost nothing


def test_unchanged_tensor_costs_a_header():
    old = {"model.layers.0.mlp.down_proj.weight": torch.randn(256, 256).to(torch.bfloat16)}
    delta = encode_delta(old, {k: v.clone() for k, v in old.items()})
    assert len(delta) < 100


def test_per_tensor_method_is_the_smallest_candidate():
    gen = torch.Generator().manual_seed(4)
    old = random_bits((20000,), torch.bfloat16, gen)
    new = {"sparse": change_some(old, 0.01, gen), "xor": flip_low_bit(old), "full": torch.zeros_like(old)}
    olds = {k: old for k in new}
    delta = encode_delta(olds, new, exhaustive=True)
    cctx = zstandard.ZstdCompressor(level=1)
    o = old.view(torch.int16).numpy().view("<u2")
    for info in describe(delta):
        n = new[info.name].view(torch.int16).numpy().view("<u2")
        idx = np.flatnonzero(o != n)
        sizes = {"sparse": len(codec_methods.encode_sparse(cctx, idx, o[idx], n[idx])),
                 "xor": len(codec_methods.encode_planes(cctx, o ^ n)), "full": len(codec_methods.encode_planes(cctx, n))}
        assert info.method == min(sizes, key=sizes.get) == info.name
        assert info.payload_bytes == sizes[info.name]


def test_default_policy_tries_dense_methods_only_when_sparse_compresses_poorly():
    gen = torch.Generator().manual_seed(5)
    old = random_bits((1_000_000,), torch.bfloat16, gen)  # 2 MB: above DENSE_TRY_BYTES
    # Low-bit flips everywhere: sparse still reaches ~16x, so by default xor is not tried; exhaustive finds it.
    assert methods(encode_delta({"w": old}, {"w": flip_low_bit(old)}))["w"] == "sparse"
    assert methods(encode_delta({"w": old}, {"w": flip_low_bit(old)}, exhaustive=True))["w"] == "xor"
    # Everything rewritten: sparse compresses poorly, so the dense candidates are tried and full wins.
    assert methods(encode_delta({"w": old}, {"w": torch.zeros_like(old)}))["w"] == "full"


@pytest.mark.parametrize("positions, numel, width, escapes", [
    ([0, 1, 2, 99], 100, 1, 0),
    (list(range(7, 30_000, 300)), 30_000, 2, 0),  # every gap needs a second byte
    (list(range(0, 300_000, 70_000)), 300_000, 4, 0),
    (list(range(2000)) + [299_999], 300_000, 1, 1),  # one rare long gap: an escape, not a wider stream
    ([5, 1 << 33, (1 << 33) + 1], 1 << 34, 4, 1),  # a gap past 2^32 (tensors of 4G+ elements)
    ([(1 << 34) - 1], 1 << 34, 4, 1),
])
def test_sparse_gap_widths_and_escapes(positions, numel, width, escapes):
    idx = np.array(positions, dtype=np.int64)
    old = np.arange(idx.size, dtype="<u2")
    new = old + np.uint16(3)
    payload = codec_methods.encode_sparse(zstandard.ZstdCompressor(level=1), idx, old, new)
    assert (payload[8], int.from_bytes(payload[9:17], "little")) == (width, escapes)  # header: count, width, escapes
    got_idx, diff = codec_methods.decode_sparse(zstandard.ZstdDecompressor(), memoryview(payload), numel, 2)
    assert got_idx.tolist() == positions and (diff == 3).all()


def test_sparse_tensor_with_long_gaps_roundtrips():
    n = 2_000_000  # above DENSE_TRY_BYTES: sparse is the only candidate
    old = torch.zeros(n, dtype=torch.float8_e4m3fn)
    new = old.clone()
    new.view(torch.uint8)[[0, 1, 70_000, 1_999_999]] = 0x38
    delta, _ = roundtrip({"w": old}, {"w": new})
    assert methods(delta)["w"] == "sparse" and len(delta) < 200


def test_streaming_chunks_match_whole_blob():
    gen = torch.Generator().manual_seed(6)
    old = {f"w{i}": random_bits((100 + i,), torch.float32, gen) for i in range(4)}
    new = {k: change_some(v, 0.3, gen) for k, v in old.items()}
    chunks = list(iter_encode_delta(old, new))
    assert len(chunks) == 1 + len(new)
    assert b"".join(chunks) == encode_delta(old, new)
    assert b"".join(iter_encode_full(new)) == encode_full(new)


def test_not_inplace_leaves_base_alone_and_shares_no_memory():
    gen = torch.Generator().manual_seed(7)
    old = {"a": random_bits((64, 64), torch.bfloat16, gen), "b": random_bits((10,), torch.int32, gen)}
    new = {"a": change_some(old["a"], 0.05, gen), "b": old["b"].clone()}
    base = {k: v.clone() for k, v in old.items()}
    out = apply_delta(base, encode_delta(old, new), inplace=False)
    for k, t in old.items():
        assert same_bits(base[k], t) and same_bits(out[k], new[k])
        assert out[k].data_ptr() != base[k].data_ptr()


def test_inplace_into_non_contiguous_and_tied_tensors():
    gen = torch.Generator().manual_seed(8)
    storage = random_bits((48, 32), torch.bfloat16, gen)
    tied = random_bits((16, 16), torch.float32, gen)
    old = {"t": storage.t(), "tied_a": tied, "tied_b": tied}
    new_t = change_some(storage.t().contiguous(), 0.1, gen)
    new_tied = change_some(tied, 0.1, gen)
    new = {"t": new_t, "tied_a": new_tied, "tied_b": new_tied}
    base_storage, base_tied = storage.clone(), tied.clone()
    base = {"t": base_storage.t(), "tied_a": base_tied, "tied_b": base_tied}
    apply_delta(base, encode_delta({k: v.contiguous() for k, v in old.items()}, new))
    assert same_bits(base_storage.t().contiguous(), new_t) and same_bits(base_tied, new_tied)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_full_set_roundtrip(dtype):
    gen = torch.Generator().manual_seed(9)
    tensors = {"lora_A": random_bits((8, 33), dtype, gen), "lora_B": torch.zeros(33, 8, dtype=dtype),
               "scalar": random_bits((), dtype, gen), "empty": random_bits((0, 4), dtype, gen)}
    out = decode_full(encode_full(tensors))
    assert list(out) == list(tensors)
    for k, t in tensors.items():
        assert same_bits(out[k], t)
    assert {i.method for i in describe(encode_full(tensors))} == {"full"}


def test_full_set_compresses_an_adapter():
    gen = torch.Generator().manual_seed(10)
    adapter = {"A": (torch.randn(16, 2048, generator=gen) * 0.02).to(torch.bfloat16),
               "B": torch.zeros(2048, 16, dtype=torch.bfloat16)}
    blob = encode_full(adapter)
    raw = sum(t.numel() * 2 for t in adapter.values())
    assert len(blob) < 0.5 * raw  # B is zeros; A's exponent plane compresses


def test_method_codes_are_stable():
    assert (SPARSE, XOR, FULL) == (1, 2, 3)
    assert DTYPE_CODES[torch.bfloat16] == 8 and DTYPE_CODES[torch.float32] == 9
    assert DTYPE_CODES[torch.float8_e4m3fn] == 11
