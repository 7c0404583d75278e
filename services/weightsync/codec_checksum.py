"""The weight-delta codec's tensor checksum: a position-weighted sum of 64-bit words, updatable from a change list.

A tensor's bytes (little-endian, zero-padded to a multiple of 8) are read as u64 words w_t, t = 0..W-1. With
B = 512 and two fixed tables, K[j] = splitmix64(j) | 1 (odd) and M[r] = splitmix64(r + 2^63) & ~1 (even):

    checksum = sum_t (K[t % B] + M[t // B]) * w_t   (mod 2^64)

Every coefficient is odd, so any single changed word changes the sum; the M term makes it depend on where a block of
B words sits, so swapped experts or rows a multiple of B words apart are caught too. Two column/row reductions over a
[W/B, B] view compute it at memory speed (tens of GB/s). It is a checksum against accidents (a wrong base, a codec
bug), not a cryptographic hash.

It is linear in the words, so changing element i (elem_size bytes, lane = i % (8 / elem_size) of word i // (8 /
elem_size)) from o to n adds (K + M) * ((n - o) << (8 * elem_size * lane)). `change_checksum` sums that over a
change list, which lets apply_delta check the result before writing anything: checksum(base) + change == expected.
"""
from __future__ import annotations

import numpy as np

B = 512
_LOG_B = 9
_MASK64 = (1 << 64) - 1
_ROWS_PER_CHUNK = 128  # 512 KiB of words per step: both reductions read it from cache
_CHANGE_CHUNK = 1 << 16


def splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_K = splitmix64(np.arange(B, dtype=np.uint64)) | np.uint64(1)
_M = np.empty(0, dtype=np.uint64)


def _m_table(rows: int) -> np.ndarray:
    """M[0:rows], grown on demand (the table is a pure function of the row number)."""
    global _M
    if _M.size < rows:
        _M = splitmix64(np.arange(max(rows, 2 * _M.size), dtype=np.uint64) + np.uint64(1 << 63)) & ~np.uint64(1)
    return _M[:rows]


# Per element size: K shifted into each lane, indexed by i % (B * per_word), and the lane multipliers 2^(8*es*lane).
_K_LANES = {es: (_K[:, None] << (np.arange(8 // es, dtype=np.uint64) * np.uint64(8 * es))[None, :]).reshape(-1)
            for es in (1, 2, 4, 8)}
_LANE_MUL = {es: np.uint64(1) << (np.arange(8 // es, dtype=np.uint64) * np.uint64(8 * es)) for es in (1, 2, 4, 8)}


def checksum(buf: np.ndarray) -> int:
    """Checksum of a 1-D uint8 array (a tensor's bytes)."""
    return _checksum(buf, None, None)[0]


def checksum_and_take(bits: np.ndarray, idx: np.ndarray) -> tuple[int, np.ndarray]:
    """(checksum of bits' bytes, bits[idx]) in one pass over memory: each block's elements are picked while the
    block is in cache from the checksum. bits: 1-D unsigned element view; idx: ascending int64."""
    return _checksum(bits.view(np.uint8), bits, idx)


def _checksum(buf: np.ndarray, bits: np.ndarray | None, idx: np.ndarray | None) -> tuple[int, np.ndarray | None]:
    n_words, tail = divmod(buf.size, 8)
    words = buf[: n_words * 8].view("<u8")
    rows = n_words // B
    m = _m_table(rows + 1)
    taken = bounds = None
    if idx is not None:
        taken = np.empty(idx.size, dtype=bits.dtype)
        per_block = _ROWS_PER_CHUNK * B * (8 // bits.dtype.itemsize)  # elements per block
        bounds = np.searchsorted(idx, np.arange(1, -(-rows // _ROWS_PER_CHUNK) + 1, dtype=np.int64) * per_block)
    total, done = 0, 0
    if rows:
        grid = words[: rows * B].reshape(rows, B)
        col = np.zeros(B, dtype=np.uint64)
        row = np.empty(rows, dtype=np.uint64)
        for k, r in enumerate(range(0, rows, _ROWS_PER_CHUNK)):
            block = grid[r:r + _ROWS_PER_CHUNK]
            col += block.sum(axis=0, dtype=np.uint64)
            np.add.reduce(block, axis=1, dtype=np.uint64, out=row[r:r + _ROWS_PER_CHUNK])
            if idx is not None and bounds[k] > done:
                np.take(bits, idx[done:bounds[k]], out=taken[done:bounds[k]])
                done = int(bounds[k])
        total = int((_K * col).sum(dtype=np.uint64)) + int((m[:rows] * row).sum(dtype=np.uint64))
    rest = words[rows * B:]
    if rest.size:
        total += int(((_K[: rest.size] + m[rows]) * rest).sum(dtype=np.uint64))
    if tail:  # the last word, zero-padded: index n_words, which is in row `rows` at column rest.size
        last = np.zeros(8, dtype=np.uint8)
        last[:tail] = buf[n_words * 8:]
        total += (int(_K[rest.size]) + int(m[rows])) * int(last.view("<u8")[0])
    if idx is not None and done < idx.size:
        np.take(bits, idx[done:], out=taken[done:])
    return total & _MASK64, taken


def change_checksum(idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """checksum(after) - checksum(before) (mod 2^64) when the elements at idx (int64, ascending) change from old to
    new (unsigned arrays of the element width)."""
    if idx.size == 0:
        return 0
    es = old.dtype.itemsize
    per_word = 8 // es
    row_shift = _LOG_B + per_word.bit_length() - 1
    k_lanes, lane_mul = _K_LANES[es], _LANE_MUL[es]
    m = _m_table(int(idx[-1] >> row_shift) + 1)
    # Cache-sized pieces with reused scratch: fresh multi-MB temporaries would cost more in page faults than the math.
    step = min(idx.size, _CHANGE_CHUNK)
    pos = np.empty(step, dtype=np.int64)
    coef = np.empty(step, dtype=np.uint64)
    tmp = np.empty(step, dtype=np.uint64)
    total = 0
    for s in range(0, idx.size, step):
        i = idx[s:s + step]
        n = i.size
        p, c, t = pos[:n], coef[:n], tmp[:n]
        np.right_shift(i, row_shift, out=p)
        np.take(m, p, out=c)
        if per_word > 1:
            np.bitwise_and(i, per_word - 1, out=p)
            np.take(lane_mul, p, out=t)
            c *= t
        np.bitwise_and(i, B * per_word - 1, out=p)
        np.take(k_lanes, p, out=t)
        c += t
        np.subtract(new[s:s + step], old[s:s + step], out=t, dtype=np.uint64)
        c *= t
        total += int(c.sum(dtype=np.uint64))
    return total & _MASK64
