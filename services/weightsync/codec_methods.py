"""Per-tensor payload coders of the weight-delta codec (docs/weight_delta.md has the byte layouts).

Everything works on 1-D little-endian unsigned views of a tensor's bits (`<u1`, `<u2`, `<u4`, `<u8` for 1-, 2-, 4- and
8-byte elements), so every dtype round-trips bit for bit, NaN payloads and -0.0 included.

- sparse: the positions that changed, gap-coded, and the arithmetic change of their bits (new - old in the element's
  width, as sign, "more than one step" flag and remainder). A trained weight moves by a ulp or two, so the change is
  tiny even when the XOR of the bits is not (0x3fff -> 0x4000 is +1 but XORs 15 bits).
- xor: old ^ new over the whole tensor; full: the new bits. Both as byte planes.

Multi-byte streams are stored as byte planes (all low bytes, then the next byte, ...): zstd's Huffman stage sees one
kind of byte at a time, and the high planes of small numbers are runs of zeros. Planes are split and joined with
shifts rather than a transposing copy, which is an order of magnitude slower in numpy.
"""
from __future__ import annotations

import struct

import numpy as np
import zstandard

ESCAPE_FRACTION = 64  # a gap width is used while at most 1 gap in 64 needs an escape


class PayloadError(ValueError):
    """A payload does not decode (truncated, corrupt or inconsistent); codec.py adds the tensor name."""


def uint_dtype(elem_size: int) -> np.dtype:
    return np.dtype(f"<u{elem_size}")


def split_planes(v: np.ndarray) -> np.ndarray:
    """[n] unsigned -> [width, n] uint8, plane k holding byte k (little-endian) of every element."""
    width = v.dtype.itemsize
    if width == 1:
        return v.view(np.uint8)
    out = np.empty((width, v.size), dtype=np.uint8)
    for k in range(width):
        out[k] = v >> (8 * k) if k else v
    return out


def join_planes(buf, width: int, count: int) -> np.ndarray:
    """Inverse of split_planes on the decompressed bytes."""
    planes = np.frombuffer(buf, dtype=np.uint8)
    if planes.size != width * count:
        raise PayloadError(f"expected {width * count} bytes of planes, got {planes.size}")
    if width == 1:
        return planes
    planes = planes.reshape(width, count)
    out = planes[width - 1].astype(uint_dtype(width))
    for k in range(width - 2, -1, -1):
        out <<= 8
        out |= planes[k]
    return out


def decompress(dctx: zstandard.ZstdDecompressor, frame, size: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise PayloadError(f"zstd: {e}") from None
    if declared != size:
        raise PayloadError(f"a zstd frame declares {declared} bytes where {size} are expected")
    try:
        out = dctx.decompress(frame)
    except zstandard.ZstdError as e:
        raise PayloadError(f"zstd: {e}") from None
    if len(out) != size:
        raise PayloadError(f"a zstd frame gave {len(out)} bytes where {size} are expected")
    return out


# sparse ---------------------------------------------------------------------------------------------------------

# count, gap width, gap escapes, changes larger than one step, then the byte lengths of the gap, escape, sign and
# step frames (the remainder frame runs to the end of the payload)
_SPARSE_HEAD = struct.Struct("<QBQQQQQQ")


def encode_sparse(cctx: zstandard.ZstdCompressor, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> bytes:
    """idx: ascending int64 positions that changed; old/new: their bits before and after.

    Positions: gaps (first position, then differences) in the narrowest of 1/2/4 bytes that leaves at most one gap
    in ESCAPE_FRACTION at the escape value (all ones); escaped gaps follow in full as u64. Values: the change
    new - old in the element's width, signed, as three streams: sign bits, one bit per change "moved more than one
    step", and |change| - 2 for those. Most trained weights move by exactly one step, so this costs about 2 bits
    per change where zstd's byte-wise Huffman coding of the raw change needs about 2.6.
    """
    gaps = np.empty_like(idx)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    width, escaped = _gap_width(gaps)
    esc = (1 << (8 * width)) - 1
    exc_frame = b""
    if escaped:
        exc_frame = cctx.compress(gaps[gaps >= esc].astype("<u8").tobytes())
        np.minimum(gaps, esc, out=gaps)
    gap_frame = cctx.compress(split_planes(gaps.astype(uint_dtype(width))))

    diff = new - old  # wraps in the element's width; never 0
    signed = diff.view(f"<i{diff.dtype.itemsize}")
    negative = signed < 0
    magnitude = np.abs(signed).view(diff.dtype)  # abs(-2^(w-1)) wraps to itself: 2^(w-1) as unsigned
    big = magnitude > 1
    rest = magnitude[big] - 2
    sign_frame = cctx.compress(np.packbits(negative, bitorder="little"))
    big_frame = cctx.compress(np.packbits(big, bitorder="little"))
    rest_frame = cctx.compress(split_planes(rest))
    head = _SPARSE_HEAD.pack(idx.size, width, escaped, rest.size, len(gap_frame), len(exc_frame), len(sign_frame),
                             len(big_frame))
    return b"".join((head, gap_frame, exc_frame, sign_frame, big_frame, rest_frame))


def _gap_width(gaps: np.ndarray) -> tuple[int, int]:
    """-> (narrowest width in bytes with few enough escapes, number of escapes)."""
    largest = int(gaps.max())
    for w in (1, 2, 4):
        esc = (1 << (8 * w)) - 1
        escaped = 0 if largest < esc else int(np.count_nonzero(gaps >= esc))
        if escaped * ESCAPE_FRACTION <= gaps.size:
            return w, escaped
    return 4, int(np.count_nonzero(gaps >= (1 << 32) - 1))


def decode_sparse(dctx: zstandard.ZstdDecompressor, payload: memoryview, numel: int,
                  elem_size: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (ascending int64 positions, wrapped difference new - old of their bits)."""
    if len(payload) < _SPARSE_HEAD.size:
        raise PayloadError("sparse payload shorter than its header")
    count, width, escaped, n_big, *lengths = _SPARSE_HEAD.unpack_from(payload)
    if width not in (1, 2, 4) or not 0 < count <= numel or escaped > count or n_big > count:
        raise PayloadError(f"bad sparse header (count {count}, gap width {width}, escapes {escaped}, "
                           f"large steps {n_big})")
    frames, at = [], _SPARSE_HEAD.size
    for n in lengths:
        frames.append(payload[at:at + n])
        at += n
    if at > len(payload):
        raise PayloadError("sparse payload shorter than its frames")
    gap_frame, exc_frame, sign_frame, big_frame = frames
    rest_frame = payload[at:]

    primary = join_planes(decompress(dctx, gap_frame, count * width), width, count)
    if count > 1 and not primary[1:].all():  # gaps after the first are >= 1 (escaped ones too)
        raise PayloadError("sparse positions repeat")
    idx = primary.astype(np.int64)
    if escaped:
        where = np.flatnonzero(primary == (1 << (8 * width)) - 1)
        exc = np.frombuffer(decompress(dctx, exc_frame, escaped * 8), dtype="<u8")
        if where.size != escaped or int(exc.min()) < (1 << (8 * width)) - 1 or int(exc.max()) >= numel:
            raise PayloadError("sparse gap escapes do not match their values")
        idx[where] = exc
    np.cumsum(idx, out=idx)
    if int(idx[-1]) >= numel:
        raise PayloadError(f"sparse position {int(idx[-1])} is outside the tensor ({numel} elements)")

    n_bytes = (count + 7) // 8
    utype = uint_dtype(elem_size)
    negative = np.unpackbits(np.frombuffer(decompress(dctx, sign_frame, n_bytes), dtype=np.uint8), count=count,
                             bitorder="little")
    big = np.unpackbits(np.frombuffer(decompress(dctx, big_frame, n_bytes), dtype=np.uint8), count=count,
                        bitorder="little")
    at_big = np.flatnonzero(big) if n_big else np.empty(0, dtype=np.int64)
    if at_big.size != n_big or (not n_big and big.any()):
        raise PayloadError(f"the large-step flags do not match the header's count ({n_big})")
    rest = join_planes(decompress(dctx, rest_frame, n_big * elem_size), elem_size, n_big)
    diff = big.astype(utype)
    diff += 1
    diff[at_big] = rest + utype.type(2)
    # conditional negate in the element's width: (x ^ m) + s with m = -s, s in {0, 1}
    sign = negative.astype(utype)
    diff ^= -sign
    diff += sign
    return idx, diff


# xor and full ----------------------------------------------------------------------------------------------------

def encode_planes(cctx: zstandard.ZstdCompressor, v: np.ndarray) -> bytes:
    return cctx.compress(split_planes(v))


def decode_planes(dctx: zstandard.ZstdDecompressor, payload: memoryview, numel: int, elem_size: int) -> np.ndarray:
    out = join_planes(decompress(dctx, payload, numel * elem_size), elem_size, numel)
    return out.copy() if elem_size == 1 else out  # frombuffer of bytes is read-only
