"""Specification of zephon.sources.permutation: keyed bijections on [0, n) and key derivation."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon.sources import permutation
from zephon.sources.permutation import derive_key, mix64, permute

M64 = (1 << 64) - 1
SIZES = [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    13,
    16,
    17,
    31,
    32,
    33,
    64,
    97,
    100,
    127,
    128,
    129,
    1000,
    1021,
    4096,
]


# -- a scalar reference implementation of the documented algorithm ------------------------------


def ref_mix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_absorb(h: int, value: int) -> int:
    h = ref_mix64(h ^ (1 if value < 0 else 2))
    value = abs(value)
    while True:
        h = ref_mix64(h ^ (value & M64))
        value >>= 64
        if not value:
            return h


def ref_derive_key(seed: int, index: int, purpose: str) -> int:
    h = int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:8], "little")
    return ref_absorb(ref_absorb(h, seed), index)


def ref_encrypt(x: int, bits: int, key: int) -> int:
    hi_w, lo_w = (bits + 1) // 2, bits // 2
    for r in range(4):
        rk = ref_mix64((key + (r + 1) * 0x9E3779B97F4A7C15) & M64)
        hi, lo = x >> lo_w, x & ((1 << lo_w) - 1)
        x = (lo << hi_w) | ((hi ^ ref_mix64(lo ^ rk)) & ((1 << hi_w) - 1))
        hi_w, lo_w = lo_w, hi_w
    return x


def ref_permute_one(i: int, n: int, key: int) -> int:
    if n <= 1:
        return i
    bits = (n - 1).bit_length()
    y = ref_encrypt(i, bits, key)
    while y >= n:
        y = ref_encrypt(y, bits, key)
    return y


# -- the specification -----------------------------------------------------------------------


def test_mix64_matches_the_reference_splitmix_step():
    for x in [0, 1, 2, 12345, M64, 1 << 63]:
        assert mix64(x) == ref_mix64(x)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 10, 17, 64, 100])
@pytest.mark.parametrize("key", [0, 1, 0xDEADBEEF, M64])
def test_permute_equals_the_scalar_reference_so_orders_never_change(n, key):
    expected = [ref_permute_one(i, n, key) for i in range(n)]
    assert permute(np.arange(n), n, key).tolist() == expected


@pytest.mark.parametrize("seed", [0, 7, -3, 1 << 70])
@pytest.mark.parametrize("index", [0, 1, 5, 1 << 65])
@pytest.mark.parametrize("purpose", ["samples", "chunks"])
def test_derive_key_equals_the_reference_mixing(seed, index, purpose):
    assert derive_key(seed, index, purpose) == ref_derive_key(seed, index, purpose)


@pytest.mark.parametrize("n", SIZES)
def test_permute_is_a_bijection_for_assorted_sizes(n):
    for key in (0, 1, 99):
        out = permute(np.arange(n), n, key)
        assert out.dtype == np.int64
        assert sorted(out.tolist()) == list(range(n))


@given(n=st.integers(0, 3000), key=st.integers(0, M64))
def test_permute_is_a_bijection_for_any_size_and_key(n, key):
    assert np.array_equal(np.sort(permute(np.arange(n), n, key)), np.arange(n))


@given(n=st.integers(1, 500), key=st.integers(0, M64), data=st.data())
def test_vectorized_result_equals_element_by_element(n, key, data):
    picks = data.draw(st.lists(st.integers(0, n - 1), max_size=40))
    arr = np.array(picks, dtype=np.int64)
    together = permute(arr, n, key)
    one_by_one = [int(permute(np.array([i]), n, key)[0]) for i in picks]
    assert together.tolist() == one_by_one


def test_permute_keeps_the_shape_of_its_input():
    grid = np.arange(12).reshape(3, 4)
    out = permute(grid, 12, 5)
    assert out.shape == (3, 4)
    assert out.ravel().tolist() == permute(np.arange(12), 12, 5).tolist()


@pytest.mark.parametrize("n", [10, 100, 1000, 4097])
def test_different_keys_give_different_orders(n):
    orders = {
        tuple(permute(np.arange(n), n, derive_key(3, q, "samples")).tolist()) for q in range(20)
    }
    assert len(orders) == 20
    assert tuple(range(n)) not in orders


def test_each_item_lands_anywhere_with_roughly_equal_odds():
    # 8 positions x 1200 keys: a broken round function shows up as a badly skewed histogram.
    n, trials = 8, 1200
    where = Counter(int(permute(np.array([0]), n, derive_key(1, k, "t"))[0]) for k in range(trials))
    expected = trials / n
    chi2 = sum((where[i] - expected) ** 2 / expected for i in range(n))
    assert chi2 < 35  # 7 degrees of freedom: p < 1e-4 for a fair permutation


def test_derived_keys_differ_by_seed_index_and_purpose():
    keys = {
        derive_key(seed, index, purpose)
        for seed in (0, 1, -1, 1 << 64)
        for index in (0, 1, 2, 1 << 64)
        for purpose in ("samples", "chunks", "mixture-slot:a")
    }
    assert len(keys) == 4 * 4 * 3
    assert derive_key(5, 2, "samples") == derive_key(5, 2, "samples")
    assert all(0 <= k <= M64 for k in keys)


def test_cycle_walking_re_encrypts_only_the_indices_still_out_of_range(monkeypatch):
    sizes: list[int] = []
    walked_in_range: list[bool] = []
    real = permutation._feistel

    def counting(x, bits, round_keys):
        if sizes:
            walked_in_range.append(bool((x < n).any()))
        sizes.append(len(x))
        return real(x, bits, round_keys)

    monkeypatch.setattr(permutation, "_feistel", counting)
    n = (1 << 20) + 1  # the worst case: the domain is almost twice n
    start = np.arange(5000, dtype=np.int64) * 200
    out = permute(start, n, 42)
    assert ((out >= 0) & (out < n)).all()
    assert sizes[0] == len(start)
    assert len(sizes) > 1 and not any(walked_in_range)
    assert all(later <= earlier for earlier, later in itertools.pairwise(sizes))
    assert sum(sizes) < 3 * len(start)  # about 2 encryptions per index on average


def test_huge_domains_permute_a_chunk_without_materializing_the_domain():
    n = 1 << 61
    idx = np.arange(n - 1024, n, dtype=np.int64)
    out = permute(idx, n, 7)
    assert len(set(out.tolist())) == 1024
    assert ((out >= 0) & (out < n)).all()
    assert int(out.min()) < n // 2  # spread over the domain, not kept near the inputs


def test_out_of_range_indices_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="outside"):
        permute(np.array([5]), 5, 0)
    with pytest.raises(ValueError, match="outside"):
        permute(np.array([-1]), 5, 0)
    with pytest.raises(ValueError, match="n must be"):
        permute(np.array([], dtype=np.int64), -1, 0)
    with pytest.raises(TypeError, match="integers"):
        permute(np.array([0.5]), 5, 0)
