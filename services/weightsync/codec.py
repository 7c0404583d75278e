"""Bit-exact weight-delta codec: ship the change between two weight versions, or a whole tensor set, compressed.

    delta = encode_delta(old, new)      # trainer: version v -> v+1
    apply_delta(base, delta)            # rollout: base must hold version v; afterwards it holds v+1, bit for bit
    blob = encode_full(tensors)         # adapters and first syncs: the whole set
    tensors = decode_full(blob)

Each tensor is coded on its own, with whichever method gives the fewest bytes: unchanged (a header), sparse (gap-coded
positions + arithmetic change of the bits), xor (old ^ new) or full (the new bits), each as zstd frames of byte
planes (codec_methods.py). Every tensor record carries the checksum of the parent tensor and of the result
(codec_checksum.py), so applying a delta to the wrong base is refused, and a crc32 of the record, so corruption is
caught before anything is decoded. The byte format is versioned and written down in docs/weight_delta.md.

apply_delta ordering: parse every record and check its crc32 -> check names, dtypes and shapes against base -> per
tensor: decode the payload, checksum the base and compare with the parent checksum, and verify the result's checksum
(for sparse records from the base checksum plus the change, so nothing is written yet) -> only when every tensor has
passed, write. A refused delta leaves base untouched.

Tensors are CPU tensors of any dtype with 1-, 2-, 4- or 8-byte elements; bytes are little-endian (x86, ARM).
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from services.weightsync.codec_checksum import change_checksum, checksum, checksum_and_take
from services.weightsync.codec_methods import (
    PayloadError,
    decode_planes,
    decode_sparse,
    encode_planes,
    encode_sparse,
    uint_dtype,
)

MAGIC = b"TYWD"
FORMAT_VERSION = 1
KIND_DELTA, KIND_FULL = 1, 2
UNCHANGED, SPARSE, XOR, FULL = 0, 1, 2, 3
METHOD_NAMES = {UNCHANGED: "unchanged", SPARSE: "sparse", XOR: "xor", FULL: "full"}
# xor and full cost a zstd pass over the whole tensor, so on large tensors they are tried only where the sparse
# candidate compresses less than DENSE_TRY_RATIO (many or large changes); otherwise sparse was smaller in every case
# we measured (docs/weight_delta.md). Small tensors, where the sparse streams' fixed costs can lose to one xor frame,
# try all three. exhaustive=True tries all three everywhere.
DENSE_TRY_RATIO = 8
DENSE_TRY_BYTES = 1 << 20

# Stable dtype codes of the format; never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bool: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 4, torch.int32: 5, torch.int64: 6,
    torch.float16: 7, torch.bfloat16: 8, torch.float32: 9, torch.float64: 10, torch.float8_e4m3fn: 11,
    torch.float8_e5m2: 12, torch.float8_e4m3fnuz: 13, torch.float8_e5m2fnuz: 14, torch.uint16: 15,
    torch.uint32: 16, torch.uint64: 17,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_FILE_HEAD = struct.Struct("<4sHBBI")  # magic, version, kind, flags (0), records
_BODY_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_NAME_LEN = struct.Struct("<H")
_META = struct.Struct("<BBB")  # dtype code, method, ndim
_CHECKSUMS = struct.Struct("<QQ")  # parent (0 in a full set), result


class DeltaFormatError(ValueError):
    """The bytes are not a valid delta or tensor set of this format: truncated, corrupt, or another version."""


class BaseMismatchError(ValueError):
    """The base given to apply_delta is not the version the delta was computed from."""


@dataclass(frozen=True)
class RecordInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    method: str
    parent_checksum: int
    checksum: int
    payload_bytes: int


@dataclass(frozen=True)
class _Record:
    info: RecordInfo
    method: int
    payload: memoryview


# encoding ----------------------------------------------------------------------------------------------------------

def iter_encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, level: int = 1,
                      exhaustive: bool = False) -> Iterator[bytes]:
    """The delta from old to new as a stream of byte chunks (the file header, then one record per tensor, in the
    order of new). old and new must hold the same names with the same dtypes and shapes."""
    if set(old) != set(new):
        raise ValueError(f"old and new must hold the same tensors; only in old: {sorted(set(old) - set(new))}, "
                         f"only in new: {sorted(set(new) - set(old))} (ship a changed set with encode_full)")
    cctx = zstandard.ZstdCompressor(level=level)
    yield _FILE_HEAD.pack(MAGIC, FORMAT_VERSION, KIND_DELTA, 0, len(new))
    for name, n_t in new.items():
        o_t = old[name]
        _check_tensor(name, o_t)
        _check_tensor(name, n_t)
        if o_t.dtype != n_t.dtype or o_t.shape != n_t.shape:
            raise ValueError(f"tensor {name!r}: old is {o_t.dtype} {tuple(o_t.shape)}, new is {n_t.dtype} "
                             f"{tuple(n_t.shape)}; a delta needs both alike (ship it with encode_full)")
        o, n = _bits(o_t), _bits(n_t)
        parent, result = checksum(o.view(np.uint8)), checksum(n.view(np.uint8))
        idx = np.flatnonzero(o != n)
        if idx.size == 0:
            yield _record(name, n_t, UNCHANGED, parent, result, b"")
            continue
        candidates = [(SPARSE, encode_sparse(cctx, idx, np.take(o, idx), np.take(n, idx)))]
        if exhaustive or n.nbytes <= DENSE_TRY_BYTES or len(candidates[0][1]) * DENSE_TRY_RATIO > n.nbytes:
            candidates.append((XOR, encode_planes(cctx, o ^ n)))
            candidates.append((FULL, encode_planes(cctx, n)))
        method, payload = min(candidates, key=lambda c: len(c[1]))
        yield _record(name, n_t, method, parent, result, payload)


def encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, level: int = 1,
                 exhaustive: bool = False) -> bytes:
    return b"".join(iter_encode_delta(old, new, level=level, exhaustive=exhaustive))


def iter_encode_full(tensors: Mapping[str, torch.Tensor], *, level: int = 1) -> Iterator[bytes]:
    """A whole tensor set (for example a LoRA adapter) as a stream of byte chunks."""
    cctx = zstandard.ZstdCompressor(level=level)
    yield _FILE_HEAD.pack(MAGIC, FORMAT_VERSION, KIND_FULL, 0, len(tensors))
    for name, t in tensors.items():
        _check_tensor(name, t)
        n = _bits(t)
        yield _record(name, t, FULL, 0, checksum(n.view(np.uint8)), encode_planes(cctx, n))


def encode_full(tensors: Mapping[str, torch.Tensor], *, level: int = 1) -> bytes:
    return b"".join(iter_encode_full(tensors, level=level))


# decoding ----------------------------------------------------------------------------------------------------------

def apply_delta(base: dict[str, torch.Tensor], delta, *, inplace: bool = True) -> dict[str, torch.Tensor]:
    """Turn base (the delta's parent version) into the new version. inplace=True writes into base's tensors and
    returns base; inplace=False leaves base alone and returns new tensors that share no memory with it. Raises
    BaseMismatchError or DeltaFormatError, with base untouched, when any tensor fails its checks."""
    records = _read(delta, KIND_DELTA)
    names = [r.info.name for r in records]
    if set(names) != set(base):
        raise BaseMismatchError(f"the delta covers other tensors than base; missing from base: "
                                f"{sorted(set(names) - set(base))}, not in the delta: {sorted(set(base) - set(names))}")
    dctx = zstandard.ZstdDecompressor()
    plans = []
    for rec in records:
        info = rec.info
        t = base[info.name]
        _check_tensor(info.name, t)
        if t.dtype != info.dtype or tuple(t.shape) != info.shape:
            raise BaseMismatchError(f"tensor {info.name!r}: base is {t.dtype} {tuple(t.shape)}, the delta is for "
                                    f"{info.dtype} {info.shape}")
        try:
            plan, have, result = _decode(dctx, rec, _bits(t))
        except PayloadError as e:
            raise DeltaFormatError(f"tensor {info.name!r}: corrupt {info.method} payload: {e}") from None
        if have != info.parent_checksum:
            raise BaseMismatchError(f"tensor {info.name!r}: base checksum {have:#018x} is not the delta's parent "
                                    f"({info.parent_checksum:#018x}); apply it to the version it was computed from")
        if result != info.checksum:
            raise DeltaFormatError(f"tensor {info.name!r}: the decoded tensor fails its checksum ({result:#018x}, "
                                   f"expected {info.checksum:#018x}); the delta is corrupt")
        plans.append((info.name, t, plan))
    out = base if inplace else {}
    for name, t, plan in plans:
        target = t if inplace else t.detach().clone(memory_format=torch.contiguous_format)
        if plan is not None:
            _write(target, plan)
        out[name] = target
    return out


def decode_full(data) -> dict[str, torch.Tensor]:
    """The tensors of an encode_full blob, each checked against its checksum."""
    dctx = zstandard.ZstdDecompressor()
    out = {}
    for rec in _read(data, KIND_FULL):
        info = rec.info
        numel, es = _numel(info.shape), info.dtype.itemsize
        try:
            bits = decode_planes(dctx, rec.payload, numel, es)
        except PayloadError as e:
            raise DeltaFormatError(f"tensor {info.name!r}: corrupt full payload: {e}") from None
        if checksum(bits.view(np.uint8)) != info.checksum:
            raise DeltaFormatError(f"tensor {info.name!r}: the decoded tensor fails its checksum; the data is corrupt")
        out[info.name] = torch.from_numpy(bits.view(np.uint8)).view(info.dtype).reshape(info.shape)
    return out


def describe(data) -> list[RecordInfo]:
    """What a delta or tensor set holds, per tensor (name, dtype, shape, method, checksums, payload size)."""
    return [r.info for r in _read(data, None)]


def tensor_checksum(t: torch.Tensor) -> int:
    """The checksum the format records for t (codec_checksum.py)."""
    _check_tensor("tensor", t)
    return checksum(_bits(t).view(np.uint8))


# internals ---------------------------------------------------------------------------------------------------------

def _check_tensor(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"tensor {name!r} is on {t.device}; the codec works on CPU tensors")
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which the codec does not support; supported: "
                         f"{', '.join(str(d) for d in DTYPE_CODES)}")


def _bits(t: torch.Tensor) -> np.ndarray:
    """1-D unsigned view of t's bits (shares memory when t is contiguous)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().view(uint_dtype(t.element_size()))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _record(name: str, t: torch.Tensor, method: int, parent: int, result: int, payload: bytes) -> bytes:
    name_b = name.encode()
    if len(name_b) > 0xFFFF or t.dim() > 255:
        raise ValueError(f"tensor {name[:80]!r}: names are limited to 65535 bytes and tensors to 255 dimensions")
    body = b"".join((_NAME_LEN.pack(len(name_b)), name_b, _META.pack(DTYPE_CODES[t.dtype], method, t.dim()),
                     struct.pack(f"<{t.dim()}Q", *t.shape), _CHECKSUMS.pack(parent, result), payload))
    return b"".join((_BODY_LEN.pack(len(body)), body, _CRC.pack(zlib.crc32(body))))


def _read(data, kind: int | None) -> list[_Record]:
    mv = memoryview(data).cast("B")
    if len(mv) < _FILE_HEAD.size:
        raise DeltaFormatError(f"truncated: {len(mv)} bytes is shorter than the {_FILE_HEAD.size}-byte file header")
    magic, version, file_kind, _, count = _FILE_HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise DeltaFormatError(f"not a Trainyard weight delta or tensor set (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise DeltaFormatError(f"format version {version} is not supported; this codec reads version {FORMAT_VERSION}")
    if kind is not None and file_kind != kind:
        want = {KIND_DELTA: "a delta (decode it with decode_full)", KIND_FULL: "a full tensor set (apply it with "
                "apply_delta)"}
        raise DeltaFormatError(f"expected {'a delta' if kind == KIND_DELTA else 'a full tensor set'}, got "
                               f"{want.get(file_kind, f'kind {file_kind}')}")
    records, seen, off = [], set(), _FILE_HEAD.size
    for i in range(count):
        where = f"record {i + 1} of {count} at byte {off}"
        if off + _BODY_LEN.size > len(mv):
            raise DeltaFormatError(f"truncated: {where} is missing")
        (body_len,) = _BODY_LEN.unpack_from(mv, off)
        body_at, end = off + _BODY_LEN.size, off + _BODY_LEN.size + body_len + _CRC.size
        if end > len(mv):
            raise DeltaFormatError(f"truncated: {where} needs {end - off} bytes, {len(mv) - off} are left")
        body = mv[body_at:body_at + body_len]
        if zlib.crc32(body) != _CRC.unpack_from(mv, end - _CRC.size)[0]:
            raise DeltaFormatError(f"corrupt: {where} fails its crc32")
        rec = _parse_body(body, where)
        if rec.info.name in seen:
            raise DeltaFormatError(f"corrupt: {where} repeats tensor {rec.info.name!r}")
        seen.add(rec.info.name)
        records.append(rec)
        off = end
    if off != len(mv):
        raise DeltaFormatError(f"{len(mv) - off} unexpected bytes after the last of {count} records")
    return records


def _parse_body(body: memoryview, where: str) -> _Record:
    try:
        (name_len,) = _NAME_LEN.unpack_from(body)
        at = _NAME_LEN.size + name_len
        name = bytes(body[_NAME_LEN.size:at]).decode()
        code, method, ndim = _META.unpack_from(body, at)
        at += _META.size
        shape = struct.unpack_from(f"<{ndim}Q", body, at)
        at += 8 * ndim
        parent, result = _CHECKSUMS.unpack_from(body, at)
        at += _CHECKSUMS.size
    except (struct.error, UnicodeDecodeError) as e:
        raise DeltaFormatError(f"corrupt: {where} has a malformed header ({e})") from None
    if code not in CODE_DTYPES or method not in METHOD_NAMES:
        raise DeltaFormatError(f"corrupt: {where} has unknown dtype code {code} or method {method}")
    if method == UNCHANGED and (at != len(body) or parent != result):
        raise DeltaFormatError(f"corrupt: {where} is marked unchanged but carries a payload or another checksum")
    info = RecordInfo(name=name, dtype=CODE_DTYPES[code], shape=tuple(shape), method=METHOD_NAMES[method],
                      parent_checksum=parent, checksum=result, payload_bytes=len(body) - at)
    return _Record(info=info, method=method, payload=body[at:])


def _decode(dctx: zstandard.ZstdDecompressor, rec: _Record, bits: np.ndarray):
    """-> (what to write, checksum of the base, checksum of the result); writes nothing."""
    numel, es = bits.size, bits.dtype.itemsize
    if rec.method == UNCHANGED:
        have = checksum(bits.view(np.uint8))
        return None, have, have
    if rec.method == SPARSE:
        idx, diff = decode_sparse(dctx, rec.payload, numel, es)
        have, old = checksum_and_take(bits, idx)
        new = old + diff  # wraps in the element's width
        return (idx, new), have, (have + change_checksum(idx, old, new)) & ((1 << 64) - 1)
    new = decode_planes(dctx, rec.payload, numel, es)
    if rec.method == XOR:
        new ^= bits
    return new, checksum(bits.view(np.uint8)), checksum(new.view(np.uint8))


def _write(target: torch.Tensor, plan) -> None:
    contiguous = target.is_contiguous()
    bits = _bits(target) if contiguous else _bits(target).copy()
    if isinstance(plan, tuple):
        idx, new = plan
        bits[idx] = new
    else:
        bits[...] = plan
    if not contiguous:
        target.copy_(torch.from_numpy(bits.view(np.uint8)).view(target.dtype).reshape(target.shape))
