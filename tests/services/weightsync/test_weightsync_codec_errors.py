"""Weight-delta codec refusals: wrong base, truncated or corrupt bytes, bad input; a refused delta writes nothing."""
import struct
import zlib

import numpy as np
import pytest
import torch
import zstandard

from services.weightsync.codec import (
    BaseMismatchError,
    DeltaFormatError,
    apply_delta,
    decode_full,
    describe,
    encode_delta,
    encode_full,
)
from services.weightsync.codec_methods import PayloadError, decode_sparse, encode_sparse


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def snapshot(d: dict) -> dict:
    return {k: bits(v) for k, v in d.items()}


@pytest.fixture
def versions():
    gen = torch.Generator().manual_seed(0)
    v1 = {"a": (torch.randn(300, 40, generator=gen) * 0.02).to(torch.bfloat16),
          "b": torch.randn(1000, generator=gen), "c": torch.randint(-5, 5, (77,), generator=gen)}
    v2 = {"a": (v1["a"].float() + 1e-4 * torch.randn(300, 40, generator=gen)).to(torch.bfloat16),
          "b": v1["b"] + torch.where(torch.rand(1000, generator=gen) < 0.5, 1e-3, 0.0),
          "c": v1["c"].clone()}
    v2["c"][3] = 100
    return v1, v2


def test_wrong_base_is_refused_and_nothing_is_written(versions):
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    base = {k: v.clone() for k, v in v1.items()}
    base["c"][0] += 1  # the last tensor is off by one element; "a" and "b" would decode fine
    before = snapshot(base)
    with pytest.raises(BaseMismatchError, match=r"tensor 'c'.*not the delta's parent"):
        apply_delta(base, delta)
    assert snapshot(base) == before


def test_applying_twice_is_refused(versions):
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    base = {k: v.clone() for k, v in v1.items()}
    apply_delta(base, delta)
    with pytest.raises(BaseMismatchError, match="parent"):
        apply_delta(base, delta)  # base now holds v2, not v1
    assert snapshot(base) == snapshot(v2)


def test_other_version_as_base_is_refused(versions):
    v1, v2 = versions
    v3 = {k: v.clone() for k, v in v2.items()}
    v3["b"][500] = 7.0
    with pytest.raises(BaseMismatchError):
        apply_delta({k: v.clone() for k, v in v1.items()}, encode_delta(v2, v3))


def test_swapped_blocks_are_a_wrong_base():
    """A base holding the right values in the wrong place (two 4 KiB blocks swapped, as with misordered experts)."""
    experts = torch.randn(2, 1024)
    v2 = experts.clone()
    v2[0, 5] += 1
    swapped = experts.flip(0).contiguous()
    with pytest.raises(BaseMismatchError):
        apply_delta({"experts": swapped}, encode_delta({"experts": experts}, {"experts": v2}))


def test_names_dtypes_and_shapes_must_match(versions):
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    with pytest.raises(BaseMismatchError, match=r"missing from base: \['c'\]"):
        apply_delta({k: v1[k].clone() for k in ("a", "b")}, delta)
    with pytest.raises(BaseMismatchError, match=r"not in the delta: \['extra'\]"):
        apply_delta({**{k: v.clone() for k, v in v1.items()}, "extra": torch.zeros(1)}, delta)
    with pytest.raises(BaseMismatchError, match="tensor 'b': base is torch.float64"):
        apply_delta({**v1, "b": v1["b"].double()}, delta)
    with pytest.raises(BaseMismatchError, match=r"tensor 'a': base is torch.bfloat16 \(40, 300\)"):
        apply_delta({**v1, "a": v1["a"].t().contiguous()}, delta)


def test_every_truncation_is_a_clear_error(versions):
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    base = {k: v.clone() for k, v in v1.items()}
    before = snapshot(base)
    cuts = sorted(set(range(64)) | set(range(len(delta) - 64, len(delta))) | set(range(0, len(delta), 97)))
    for cut in cuts:
        with pytest.raises(DeltaFormatError, match="truncated|crc32|unexpected bytes"):
            apply_delta(base, delta[:cut])
    assert snapshot(base) == before


def test_flipped_bytes_fail_the_crc(versions):
    v1, v2 = versions
    delta = bytearray(encode_delta(v1, v2))
    base = {k: v.clone() for k, v in v1.items()}
    before = snapshot(base)
    for pos in range(12, len(delta), 13):
        corrupt = bytearray(delta)
        corrupt[pos] ^= 0x40
        with pytest.raises(DeltaFormatError):
            apply_delta(base, bytes(corrupt))
    assert snapshot(base) == before


def _records(blob: bytes) -> list[tuple[int, int]]:
    """(body offset, body length) of each record."""
    out, off = [], 12
    for _ in range(struct.unpack_from("<I", blob, 8)[0]):
        (n,) = struct.unpack_from("<Q", blob, off)
        out.append((off + 8, n))
        off += 8 + n + 4
    return out


def test_corrupt_payload_with_a_valid_crc_never_yields_a_wrong_tensor(versions):
    """Damage the crc cannot see (crc recomputed): zstd, the payload checks or the result checksum refuse it before
    anything is written. zstd streams hold a few bits that do not affect the output; such a flip still decodes to
    exactly the new version."""
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    assert {i.name: i.method for i in describe(delta)}["a"] == "sparse"
    body_at, body_len = _records(delta)[0]
    refused = 0
    for pos in range(body_at + body_len - 2000, body_at + body_len):
        corrupt = bytearray(delta)
        corrupt[pos] ^= 0x01
        body = bytes(corrupt[body_at:body_at + body_len])
        struct.pack_into("<I", corrupt, body_at + body_len, zlib.crc32(body))
        base = {k: v.clone() for k, v in v1.items()}
        try:
            apply_delta(base, bytes(corrupt))
        except DeltaFormatError as e:
            assert "tensor 'a'" in str(e)
            assert snapshot(base) == snapshot(v1)
            refused += 1
        else:
            assert snapshot(base) == snapshot(v2)
    assert refused > 1900


def test_wrong_magic_version_kind_and_trailing_bytes(versions):
    v1, v2 = versions
    delta = encode_delta(v1, v2)
    with pytest.raises(DeltaFormatError, match="not a Trainyard weight delta"):
        apply_delta(v1, b"PK\x03\x04" + delta[4:])
    with pytest.raises(DeltaFormatError, match="format version 2 is not supported"):
        apply_delta(v1, delta[:4] + struct.pack("<H", 2) + delta[6:])
    with pytest.raises(DeltaFormatError, match="full tensor set"):
        apply_delta(v1, encode_full(v2))
    with pytest.raises(DeltaFormatError, match="decode it with decode_full|expected a full tensor set"):
        decode_full(delta)
    with pytest.raises(DeltaFormatError, match="3 unexpected bytes"):
        apply_delta({k: v.clone() for k, v in v1.items()}, delta + b"xyz")
    with pytest.raises(DeltaFormatError, match="truncated"):
        decode_full(encode_full(v2)[:-1])


def test_corrupt_full_set_is_refused():
    blob = bytearray(encode_full({"w": torch.randn(4096)}))
    body_at, body_len = _records(bytes(blob))[0]
    blob[body_at + body_len - 5] ^= 0xFF
    struct.pack_into("<I", blob, body_at + body_len, zlib.crc32(bytes(blob[body_at:body_at + body_len])))
    with pytest.raises(DeltaFormatError, match="tensor 'w'"):
        decode_full(bytes(blob))


def test_encode_rejects_mismatched_or_unsupported_input():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match=r"only in old: \['x'\], only in new: \['y'\]"):
        encode_delta({"x": a}, {"y": a})
    with pytest.raises(ValueError, match="tensor 'x': old is torch.float32 \\(4,\\), new is torch.float64"):
        encode_delta({"x": a}, {"x": a.double()})
    with pytest.raises(ValueError, match="tensor 'x': old is torch.float32 \\(4,\\), new is torch.float32 \\(2, 2\\)"):
        encode_delta({"x": a}, {"x": a.reshape(2, 2)})
    with pytest.raises(ValueError, match="complex64, which the codec does not support"):
        encode_full({"x": torch.zeros(2, dtype=torch.complex64)})


def test_sparse_payload_checks():
    """Inconsistent sparse payloads (as a buggy writer would produce them, crc intact) fail with a reason."""
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    idx = np.array([3, 4, 300, 9000], dtype=np.int64)
    old = np.array([1, 2, 3, 4], dtype="<u2")
    payload = encode_sparse(cctx, idx, old, old + np.array([1, 0xFFFF, 7, 1], dtype="<u2"))
    got, diff = decode_sparse(dctx, memoryview(payload), 10_000, 2)
    assert got.tolist() == idx.tolist() and diff.tolist() == [1, 0xFFFF, 7, 1]

    def patched(fmt: str, offset: int, value: int) -> memoryview:
        out = bytearray(payload)
        struct.pack_into(fmt, out, offset, value)
        return memoryview(bytes(out))

    cases = [
        (memoryview(payload[:40]), 10_000, "shorter than its header"),
        (memoryview(payload), 9000, "outside the tensor"),
        (patched("<Q", 0, 10_001), 10_000, "bad sparse header"),
        (patched("<B", 8, 3), 10_000, "bad sparse header"),
        (patched("<Q", 17, 0), 10_000, "large-step flags"),
        (patched("<Q", 25, 1 << 40), 10_000, "shorter than its frames"),
        (patched("<Q", 0, 3), 10_000, "declares"),  # count no longer matches the frames' sizes
    ]
    for data, numel, message in cases:
        with pytest.raises(PayloadError, match=message):
            decode_sparse(dctx, data, numel, 2)
    repeat = encode_sparse(cctx, np.array([3, 3], dtype=np.int64), old[:2], old[:2] + np.uint16(1))
    with pytest.raises(PayloadError, match="repeat"):
        decode_sparse(dctx, memoryview(repeat), 10, 2)
