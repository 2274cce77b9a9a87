"""Keyed, vectorized bijections on ``[0, n)``: how sources shuffle without materializing an order.

A permutation of ``n`` items is a 4-round Feistel network on ``b`` bits (``2**b >= n``, the halves
``ceil(b/2)`` and ``floor(b/2)`` bits wide, alternating) with cycle-walking: an index that lands at
``>= n`` is encrypted again until it falls inside ``[0, n)``. Each round function is the splitmix64
finalizer of ``lo ^ round_key``. Everything is uint64 numpy arithmetic, so permuting a chunk costs
O(chunk) work and memory whatever ``n`` is. Keys come from ``derive_key`` — a fixed 64-bit mixing of
(seed, index, purpose) — never from Python's ``hash()``, so orders are equal in every process and
every release; changing any constant here changes every shuffled stream.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

__all__ = ["MAX_N", "derive_key", "mix64", "permute"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_ROUNDS = 4

#: The largest domain ``permute`` accepts (indices must fit in int64 with room to spare).
MAX_N = 1 << 62


def mix64(x: int) -> int:
    """The splitmix64 step of a 64-bit integer: a fixed bijection of ``[0, 2**64)`` with good
    avalanche, the one mixing function every key and round function here is built from."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    # Same as mix64 on a 1-d uint64 array; array arithmetic wraps modulo 2**64 without warnings.
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=256)
def _purpose_tag(purpose: str) -> int:
    return int.from_bytes(hashlib.sha256(purpose.encode("utf-8")).digest()[:8], "little")


def _absorb(h: int, value: int) -> int:
    # Fold an arbitrary Python int (sign and every 64-bit limb) into the running state.
    h = mix64(h ^ (1 if value < 0 else 2))
    value = abs(value)
    while True:
        h = mix64(h ^ (value & _MASK64))
        value >>= 64
        if not value:
            return h


def derive_key(seed: int, index: int, purpose: str | int) -> int:
    """A 64-bit key for one use of a seed: ``purpose`` names the use (``"samples"``, ``"chunks"``,
    …) and ``index`` the pass or chunk. Pure function of its arguments, equal in every process."""
    h = _purpose_tag(purpose) if isinstance(purpose, str) else mix64(int(purpose) & _MASK64)
    h = _absorb(h, int(seed))
    return _absorb(h, int(index))


def _round_keys(key: int) -> list[int]:
    return [mix64((key + (r + 1) * _GOLDEN) & _MASK64) for r in range(_ROUNDS)]


def _feistel(x: np.ndarray, bits: int, round_keys: list[int]) -> np.ndarray:
    # One encryption of uint64 values < 2**bits. Each round maps (hi, lo) to (lo, hi ^ F(lo)), which
    # is invertible whatever F is; the halves trade widths each round so odd ``bits`` work too.
    hi_w = (bits + 1) // 2
    lo_w = bits - hi_w
    for rk in round_keys:
        lo_mask = np.uint64((1 << lo_w) - 1)
        hi_mask = np.uint64((1 << hi_w) - 1)
        hi = x >> np.uint64(lo_w)
        lo = x & lo_mask
        f = _mix64_array(lo ^ np.uint64(rk))
        x = (lo << np.uint64(hi_w)) | ((hi ^ f) & hi_mask)
        hi_w, lo_w = lo_w, hi_w
    return x


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of ``indices`` under the bijection of ``[0, n)`` selected by ``key``, as int64 of
    the same shape; equal to applying it element by element, and a permutation of ``[0, n)`` when
    ``indices`` is ``arange(n)``. Raises ValueError for an index outside ``[0, n)``."""
    n = int(n)
    if n < 0 or n > MAX_N:
        raise ValueError(f"permute: n must be in [0, 2**62], got {n}")
    arr = np.asarray(indices)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"permute: indices must be integers, got dtype {arr.dtype}")
    flat = arr.astype(np.int64, copy=False).ravel()
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= n):
        bad = flat[(flat < 0) | (flat >= n)][0]
        raise ValueError(f"permute: index {int(bad)} is outside [0, {n})")
    if n <= 1 or flat.size == 0:
        return flat.copy().reshape(arr.shape)
    bits = (n - 1).bit_length()
    round_keys = _round_keys(int(key) & _MASK64)
    y = _feistel(flat.astype(np.uint64), bits, round_keys)
    # Cycle-walking: the cycle through any x < n returns below n, so each walk ends; expected
    # walks are short because 2**bits < 2*n. Only the elements still out of range are re-encrypted.
    out = np.flatnonzero(y >= np.uint64(n))
    while out.size:
        z = _feistel(y[out], bits, round_keys)
        y[out] = z
        out = out[z >= np.uint64(n)]
    return y.astype(np.int64).reshape(arr.shape)
