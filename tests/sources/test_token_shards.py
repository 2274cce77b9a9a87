"""TokenShardSource over real pre-tokenized files: Megatron .bin/.idx written in the documented
layout, numpy.save arrays and raw arrays, locally and on the loopback S3 server."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_file_rewritten_under_a_reader_is_refused,
    assert_a_killed_worker_resumes_exactly,
    assert_relanes,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks,
    closed_state,
)
from pipeline_kit import run
from token_files import documents, flat_with_eos, write_megatron

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, ensure_mixture, fetch, pack_sequences
from zephon.sources import MixtureSource, TokenShardSource

N = 120  # documents per dataset


def megatron_dir(root: Path, dtype: type = np.uint16) -> Path:
    """Three Megatron shards holding documents 0..N-1; shard 1's documents are two sequences."""
    root.mkdir(parents=True, exist_ok=True)
    docs = documents(0, N)
    write_megatron(root / "s0", [[d] for d in docs[:50]], dtype)
    write_megatron(root / "s1", [[d[:3], d[3:]] for d in docs[50:90]], dtype)
    write_megatron(root / "s2", [[d] for d in docs[90:]], dtype)
    return root


def npy_dir(root: Path) -> Path:
    """Two .npy shards of documents 0..N-1, each followed by the end-of-sequence id 0."""
    root.mkdir(parents=True, exist_ok=True)
    docs = documents(0, N)
    np.save(root / "a.npy", flat_with_eos(docs[:70]).astype(np.uint16))
    np.save(root / "b.npy", flat_with_eos(docs[70:]).astype(np.int32))
    return root


def every_document(src: TokenShardSource) -> list[np.ndarray]:
    total = src.total_chunks()
    assert total is not None
    return [p["tokens"] for pos in range(total) for p in src.read(src.chunk(pos).pointers)]


def expected_ids(payload_tokens: np.ndarray) -> int:
    """The document a delivered token array is (its first token encodes it)."""
    return int(payload_tokens[0]) // 500


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("shuffle", [False, True])
def test_megatron_shards_deliver_every_document_once_per_pass_with_its_tokens(tmp_path, shuffle):
    src = TokenShardSource(megatron_dir(tmp_path), chunk_size=7, shuffle=shuffle, passes=2, seed=3)
    assert src.num_samples() == N
    got = every_document(src)
    assert len(got) == 2 * N
    want = {d: doc for d, doc in enumerate(documents(0, N))}
    for tokens in got:
        assert tokens.dtype == np.int32
        np.testing.assert_array_equal(tokens, want[expected_ids(tokens)])
    assert Counter(expected_ids(t) for t in got) == Counter({d: 2 for d in range(N)})
    if shuffle:
        assert [expected_ids(t) for t in got[:N]] != list(range(N))


@pytest.mark.parametrize("shuffle", [False, True])
def test_empty_megatron_documents_are_read_as_empty_samples(tmp_path, shuffle):
    # Megatron's preprocess_data adds a document without sequences for an empty text (its
    # document index repeats); such a shard reads, every other document exactly.
    docs = documents(0, 6)
    shaped = [[docs[0]], [], [docs[1][:2], docs[1][2:]], [], [], [docs[2]], [docs[3]], []]
    write_megatron(tmp_path / "m", shaped[:6])
    # As many document entries as one per sequence would give, yet not one per sequence.
    shaped.append([docs[4][:1], docs[4][1:]])
    write_megatron(tmp_path / "n", shaped[6:])
    src = TokenShardSource(tmp_path, chunk_size=3, shuffle=shuffle, seed=1)
    assert src.num_samples() == len(shaped)
    assert src.token_total() == sum(d.size for d in docs[:5])
    got = every_document(src)
    assert sorted(t.tolist() for t in got) == sorted(
        np.concatenate(doc).tolist() if doc else [] for doc in shaped
    )
    pipeline = zephon.Pipeline(src, [fetch(), pack_sequences(16, pad_id=0)], lanes=1)
    packed = [t for r in pipeline for t in r.payload["tokens"].tolist() if t]
    assert Counter(packed) == Counter(np.concatenate(docs[:5]).tolist())


def test_empty_megatron_documents_read_alike_from_a_bucket_copy(tmp_path, bucket):
    docs = documents(0, 3)
    (tmp_path / "local").mkdir()
    write_megatron(tmp_path / "local" / "m", [[], [docs[0]], [], [docs[1], docs[2]], []])
    uri = bucket.upload(tmp_path / "local", "tok")
    for shuffle in (False, True):
        here = TokenShardSource(tmp_path / "local", chunk_size=2, shuffle=shuffle, seed=5)
        there = TokenShardSource(
            uri, cache_dir=tmp_path / "cache", chunk_size=2, shuffle=shuffle, seed=5
        )
        want = [t.tolist() for t in every_document(here)]
        assert [t.tolist() for t in every_document(there)] == want
        assert sorted(map(len, want)) == [0, 0, 0, docs[0].size, docs[1].size + docs[2].size]


def test_decreasing_megatron_document_indices_are_refused(tmp_path):
    idx = write_megatron(tmp_path / "m", [[d] for d in documents(0, 3)])
    data = bytearray(idx.read_bytes())
    docs_at = 9 + 8 + 1 + 8 + 8 + 3 * 12  # header, lengths and pointers of three sequences
    data[docs_at + 8 : docs_at + 16] = np.int64(2).tobytes()
    data[docs_at + 16 : docs_at + 24] = np.int64(1).tobytes()
    idx.write_bytes(bytes(data))
    with pytest.raises(FetchError, match=r"m\.idx.*document indices decrease"):
        TokenShardSource(tmp_path).num_samples()


def test_npy_files_cut_at_the_eos_id_keep_it_at_the_end_of_each_document(tmp_path):
    src = TokenShardSource(npy_dir(tmp_path), eos_id=0, chunk_size=16)
    got = every_document(src)
    assert len(got) == N
    for d, (tokens, doc) in enumerate(zip(got, documents(0, N), strict=True)):
        np.testing.assert_array_equal(tokens, np.append(doc, 0), err_msg=f"document {d}")


def test_tokens_after_the_last_eos_are_a_last_document(tmp_path):
    np.save(tmp_path / "x.npy", np.array([5, 6, 0, 7, 0, 8, 9], dtype=np.int64))
    got = every_document(TokenShardSource(tmp_path / "x.npy", eos_id=0))
    assert [t.tolist() for t in got] == [[5, 6, 0], [7, 0], [8, 9]]


def test_fixed_windows_over_a_raw_file_keep_a_shorter_last_window(tmp_path):
    values = np.arange(1, 104, dtype="<u4")
    (tmp_path / "tokens.bin").write_bytes(values.tobytes())
    src = TokenShardSource(tmp_path, dtype=np.uint32, window=10, chunk_size=3)
    got = every_document(src)
    assert [t.size for t in got] == [10] * 10 + [3]
    np.testing.assert_array_equal(np.concatenate(got), values.astype(np.int32))


@pytest.mark.parametrize("dtype", [">u2", ">i4", ">u8"])
def test_a_raw_file_of_a_big_endian_dtype_is_read_in_that_byte_order(tmp_path, dtype):
    values = np.array([5, 300, 0, 70, 1, 0, 9], dtype=dtype)
    values.tofile(tmp_path / "tokens.bin")  # written as the dtype says: big-endian
    got = every_document(TokenShardSource(tmp_path, dtype=dtype, eos_id=0))
    assert [t.tolist() for t in got] == [[5, 300, 0], [70, 1, 0], [9]]
    # Without a byte order, raw files are little-endian.
    values.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "tokens.bin")
    got = every_document(TokenShardSource(tmp_path, dtype=dtype[1:], eos_id=0))
    assert [t.tolist() for t in got] == [[5, 300, 0], [70, 1, 0], [9]]


def test_the_field_name_is_settable(tmp_path):
    src = TokenShardSource(megatron_dir(tmp_path), field="input_ids")
    (payload,) = src.read(src.chunk(0).pointers[:1])
    assert list(payload) == ["input_ids"]


def test_sample_ids_name_the_shard_and_the_pointer_is_checked(tmp_path):
    src = TokenShardSource(megatron_dir(tmp_path), chunk_size=N)
    rows = src.chunk(0).pointers
    assert rows[:, 1].tolist() == [0] * 50 + [1] * 40 + [2] * 30
    bad = rows[:1].copy()
    bad[0, 1] = 2
    with pytest.raises(FetchError, match="lives in file #0"):
        src.read(bad)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_a_document_asked_twice_in_one_read_is_two_arrays(tmp_path, dtype):
    # A mixture that repeats a small component asks for its documents several times in one
    # read: an in-place change of one copy (a map_transform's tokens += offset) must not
    # reach the others.
    np.save(tmp_path / "x.npy", np.array([1, 2, 0, 3, 4, 0, 5, 0], dtype=dtype))
    src = TokenShardSource(tmp_path, eos_id=0)
    rows = src.chunk(0).pointers
    out = src.read(rows[[0, 1, 0, 2, 1]])
    for payload in out:
        payload["tokens"] += 100
    assert [p["tokens"].tolist() for p in out] == [
        [101, 102, 100],
        [103, 104, 100],
        [101, 102, 100],
        [105, 100],
        [103, 104, 100],
    ]


def test_a_pickled_source_reads_the_same_documents(tmp_path):
    src = TokenShardSource(npy_dir(tmp_path), eos_id=0, chunk_size=9, shuffle=True)
    again = pickle.loads(pickle.dumps(src))
    for pos in (0, 5, 13):
        a = src.read(src.chunk(pos).pointers)
        b = again.read(again.chunk(pos).pointers)
        assert [x["tokens"].tolist() for x in a] == [x["tokens"].tolist() for x in b]


# --------------------------------------------------------------------------- errors


def test_ids_outside_int32_are_refused_naming_the_document(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 2, 2**40, 0], dtype=np.int64))
    src = TokenShardSource(tmp_path, eos_id=0)
    with pytest.raises(FetchError, match=r"big\.npy.*document 0 holds a token id outside int32"):
        src.read(src.chunk(0).pointers)


def test_an_id_outside_int32_fails_only_the_document_holding_it(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 2, 0, 2**40, 0, 3, 0], dtype=np.int64))
    src = TokenShardSource(tmp_path, eos_id=0)
    rows = src.chunk(0).pointers
    assert [p["tokens"].tolist() for p in src.read(rows[[0, 2]])] == [[1, 2, 0], [3, 0]]
    with pytest.raises(FetchError, match=r"document 1 holds a token id outside int32"):
        src.read(rows)


@pytest.mark.parametrize(
    "dtype, bad", [(np.int8, -3), (np.int16, -20000), (np.int32, -1), (np.int64, -(2**40))]
)
def test_negative_ids_of_a_signed_shard_are_refused_naming_the_document(tmp_path, dtype, bad):
    # A vocabulary written with a signed dtype too small for it wraps its high ids to negative
    # ones: never token ids.
    np.save(tmp_path / "signed.npy", np.array([1, 2, 0, 3, bad, 0, 4, 0], dtype=dtype))
    src = TokenShardSource(tmp_path, eos_id=0)
    rows = src.chunk(0).pointers
    assert [p["tokens"].tolist() for p in src.read(rows[[0, 2]])] == [[1, 2, 0], [4, 0]]
    named = rf"signed\.npy.*document 1 holds a negative token id \({bad}\)"
    for asked in (rows, rows[[2, 1]], rows[1:2]):
        with pytest.raises(FetchError, match=named):
            src.read(asked)


def test_negative_ids_of_a_signed_shard_in_a_bucket_are_refused_naming_the_document(
    tmp_path, bucket
):
    (tmp_path / "local").mkdir()
    np.save(tmp_path / "local" / "signed.npy", np.array([1, 2, 0, 3, -7, 0, 4, 0], np.int16))
    src = TokenShardSource(bucket.upload(tmp_path / "local", "tok"), eos_id=0)
    rows = src.chunk(0).pointers
    assert [p["tokens"].tolist() for p in src.read(rows[[0, 2]])] == [[1, 2, 0], [4, 0]]
    with pytest.raises(FetchError, match=r"signed\.npy.*document 1 holds a negative token id"):
        src.read(rows)


def test_negative_ids_of_a_signed_megatron_shard_are_refused(tmp_path):
    write_megatron(tmp_path / "m", [[np.array([5, 6])], [np.array([7, -8])]], np.int32)
    src = TokenShardSource(tmp_path)
    rows = src.chunk(0).pointers
    assert src.read(rows[:1])[0]["tokens"].tolist() == [5, 6]
    with pytest.raises(FetchError, match=r"m\.idx.*document 1 holds a negative token id \(-8\)"):
        src.read(rows)


@pytest.mark.parametrize("dtype, eos_id", [(np.uint16, 70000), (np.int8, 200), (np.uint8, 256)])
def test_an_eos_id_the_shard_dtype_cannot_hold_is_refused_naming_the_file(tmp_path, dtype, eos_id):
    # It can match no token, so the whole shard would be one document.
    np.save(tmp_path / "narrow.npy", np.array([5, 6, 7, 8], dtype=dtype))
    with pytest.raises(FetchError, match=rf"narrow\.npy.*eos_id {eos_id} .*{np.dtype(dtype)}"):
        TokenShardSource(tmp_path, eos_id=eos_id).num_samples()
    (tmp_path / "narrow.npy").unlink()
    np.array([5, 6, 7, 8], dtype=dtype).tofile(tmp_path / "narrow.bin")
    with pytest.raises(FetchError, match=rf"narrow\.bin.*eos_id {eos_id} .*{np.dtype(dtype)}"):
        TokenShardSource(tmp_path, eos_id=eos_id, dtype=dtype).num_samples()


def test_a_truncated_index_is_a_fetch_error_naming_it(tmp_path):
    idx = megatron_dir(tmp_path) / "s1.idx"
    idx.write_bytes(idx.read_bytes()[:-5])
    with pytest.raises(FetchError, match=r"s1\.idx.*truncated or damaged"):
        TokenShardSource(tmp_path).num_samples()


def test_an_index_pointing_before_the_start_of_the_bin_is_a_fetch_error_naming_it(tmp_path):
    idx = write_megatron(tmp_path / "m", [[d] for d in documents(0, 4)])
    data = bytearray(idx.read_bytes())
    pointers_at = 9 + 8 + 1 + 8 + 8 + 4 * 4  # header, then four int32 sequence lengths
    data[pointers_at + 16 : pointers_at + 24] = np.int64(-4).tobytes()  # sequence 2's pointer
    idx.write_bytes(bytes(data))
    with pytest.raises(FetchError, match=r"m\.idx.*a sequence lies outside the \.bin"):
        TokenShardSource(tmp_path).num_samples()


def test_a_flat_file_without_a_cut_is_refused(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(5))
    with pytest.raises(FetchError, match=r"x\.npy.*needs eos_id= .* or window="):
        TokenShardSource(tmp_path).num_samples()


def test_float_arrays_are_not_token_files(tmp_path):
    np.save(tmp_path / "x.npy", np.ones(5))
    with pytest.raises(FetchError, match="not integer token ids"):
        TokenShardSource(tmp_path, window=2).num_samples()


def test_a_shard_rewritten_since_it_was_indexed_is_refused_on_read(tmp_path):
    src = TokenShardSource(megatron_dir(tmp_path), chunk_size=10)
    assert_a_file_rewritten_under_a_reader_is_refused(
        src, tmp_path / "s0.bin", flip=0, match=r"s0\.bin.*changed since it was indexed"
    )


# --------------------------------------------------------------------------- pipelines


def pipeline(root: Path, **kw: Any) -> zephon.Pipeline:
    src = TokenShardSource(root, chunk_size=8, shuffle=True, seed=1, pad_id=0, eos_id=0)
    ops = [fetch(), pack_sequences(64), batch(2)]
    return zephon.Pipeline(src, ops, **kw)


def delivered_tokens(items: list[Any]) -> Counter:
    out: Counter = Counter()
    for item in items:
        tokens = np.asarray(item.payload["tokens"]).ravel()
        out.update(tokens[tokens != 0].tolist())
    return out


def all_tokens() -> Counter:
    return Counter(np.concatenate(documents(0, N)).tolist())


def test_packing_takes_the_pad_id_the_source_publishes(tmp_path):
    items = list(pipeline(megatron_dir(tmp_path)))
    assert delivered_tokens(items) == all_tokens()
    assert items[0].payload["tokens"].shape == (2, 64)


def test_packing_without_any_pad_id_is_a_plan_error(tmp_path):
    src = TokenShardSource(megatron_dir(tmp_path))
    with pytest.raises(PlanError, match="pass pad_id="):
        iter(zephon.Pipeline(src, [fetch(), pack_sequences(64), batch(2)]))


def test_the_plan_error_without_a_pad_id_names_the_source_not_a_tokenizer(tmp_path):
    # There is no tokenizer to blame: the source was given no pad_id=.
    src = TokenShardSource(megatron_dir(tmp_path))
    with pytest.raises(PlanError) as error:
        iter(zephon.Pipeline(src, [fetch(), pack_sequences(64), batch(2)]))
    assert "TokenShardSource publishes none" in str(error.value)
    assert "given no pad_id=" in str(error.value)
    assert "tokenizer of TokenShardSource" not in str(error.value)


def test_fetch_pack_2048_batch_resumes_exactly_at_any_step(tmp_path):
    root = megatron_dir(tmp_path)

    def make(**kw: Any) -> zephon.Pipeline:
        src = TokenShardSource(root, chunk_size=16, shuffle=True, pad_id=0)
        return zephon.Pipeline(src, [fetch(), pack_sequences(2048), batch(1)], **kw)

    def every_step(items: int) -> range:
        assert items >= 2
        return range(items)

    assert_resumes_exactly(make, every_step)


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    assert_a_killed_worker_resumes_exactly(partial(pipeline, npy_dir(tmp_path)), 5)


def test_a_job_of_four_ranks_resumes_on_two_with_every_token_once(tmp_path):
    assert_resumes_on_two_ranks(
        partial(pipeline, megatron_dir(tmp_path)), delivered_tokens, all_tokens()
    )


def test_a_state_of_three_lanes_relanes_onto_two_with_every_token_once(tmp_path):
    root = npy_dir(tmp_path)
    loader = iter(pipeline(root, lanes=3))
    before = [next(loader) for _ in range(4)]
    state = closed_state(loader)
    assert_relanes(pipeline(root, lanes=2), state, before, delivered_tokens, all_tokens())


def test_a_rewritten_shard_is_a_checkpoint_mismatch_naming_it(tmp_path):
    root = megatron_dir(tmp_path)

    def rewrite() -> None:
        docs = documents(0, N)
        docs[95] = docs[95] + 1
        write_megatron(root / "s2", [[d] for d in docs[90:]])

    assert_a_changed_dataset_is_refused(partial(pipeline, root), rewrite, r"s2\.idx")


def test_a_copied_dataset_keeps_its_fingerprint(tmp_path):
    a = megatron_dir(tmp_path / "a")
    b = megatron_dir(tmp_path / "b")
    assert TokenShardSource(a).describe() == TokenShardSource(b).describe()


# --------------------------------------------------------------------------- mixtures


def test_a_token_mixture_uses_each_shard_sets_exact_mean_length(tmp_path):
    short = TokenShardSource(npy_dir(tmp_path / "n"), eos_id=0, dataset_id=1)
    long = TokenShardSource(megatron_dir(tmp_path / "m"), dataset_id=2)
    mix = MixtureSource({"a": short, "b": long}, {"a": 0.5, "b": 0.5}, by="tokens", chunk_size=8)
    total = sum(d.size for d in documents(0, N))
    assert mix.token_costs()["b"].tokens_per_sample == pytest.approx(total / N, abs=1e-6)
    assert mix.token_costs()["a"].tokens_per_sample == pytest.approx((total + N) / N, abs=1e-6)
    assert mix.token_costs()["a"].method == "exact"


def test_a_pre_tokenized_component_refuses_an_image_token_count(tmp_path):
    shards = TokenShardSource(megatron_dir(tmp_path / "m"), dataset_id=2)
    with pytest.raises(ValueError, match=r"component 'b' is pre-tokenized.*image_tokens="):
        MixtureSource({"b": shards}, {"b": 1.0}, by="tokens", image_tokens=lambda payload: 1)


def test_ensure_mixture_counts_the_tokens_of_each_document(tmp_path):
    a = TokenShardSource(npy_dir(tmp_path / "n"), eos_id=0, dataset_id=1, chunk_size=8)
    b = TokenShardSource(megatron_dir(tmp_path / "m"), dataset_id=2, chunk_size=8)
    mix = MixtureSource({"a": a, "b": b}, {"a": 0.5, "b": 0.5}, by="tokens", chunk_size=8)
    ops = [fetch(), ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens"), batch(4)]
    loader = iter(zephon.Pipeline(mix, ops))
    items = list(loader)
    lengths: Counter = Counter()
    for item in items:
        for rec in item:
            lengths[rec.meta.component] += rec.payload["tokens"].size
    stats = loader.stats()
    assert stats["mixture_tokens"] == dict(lengths)
    assert stats["mixture_components"]["a"]["share_of"] == "tokens"


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_delivered_documents_count_as_one_sample_of_their_tokens_each(tmp_path, workers):
    # fetch -> batch hands runs of documents over without making a record per document: the
    # counts the loader keeps, and each record the training loop asks for, are still exact.
    a = TokenShardSource(npy_dir(tmp_path / "n"), eos_id=0, dataset_id=1, chunk_size=5)
    b = TokenShardSource(megatron_dir(tmp_path / "m"), dataset_id=2, chunk_size=7)
    mix = MixtureSource({"a": a, "b": b}, {"a": 0.5, "b": 0.5}, chunk_size=6)
    lanes = 2 if workers == "process" else 1
    loader = zephon.Pipeline(mix, [fetch(), batch(4)], lanes=lanes, workers=workers).iter()
    with loader:
        items = list(loader)
        stats = loader.stats()
    samples: Counter = Counter()
    tokens: Counter = Counter()
    for item in items:
        for rec in item:
            n = rec.payload["tokens"].size
            assert rec.meta.component_sample_counts == {rec.meta.component: 1}
            assert rec.meta.component_token_counts == {rec.meta.component: n}
            samples[rec.meta.component] += 1
            tokens[rec.meta.component] += n
    assert sum(samples.values()) == 2 * N
    assert stats["mixture_samples"] == dict(samples)
    assert stats["mixture_tokens"] == dict(tokens)


# --------------------------------------------------------------------------- remote


def test_a_bucket_copy_delivers_the_local_documents_and_refuses_a_changed_block(tmp_path, bucket):
    local = megatron_dir(tmp_path / "local")
    np.save(local / "flat.npy", flat_with_eos(documents(N, 20)).astype(np.int32))
    uri = bucket.upload(local, "tok")
    kw: dict[str, Any] = {"eos_id": 0, "chunk_size": 6, "shuffle": True}
    here = TokenShardSource(local, **kw)
    there = TokenShardSource(uri, cache_dir=tmp_path / "cache", **kw)
    assert there.describe() == here.describe()
    want = [t.tolist() for t in every_document(here)]
    assert [t.tolist() for t in every_document(there)] == want
    data = bytearray((local / "s0.bin").read_bytes())
    data[2] ^= 1
    bucket.overwrite("tok/s0.bin", bytes(data))
    with pytest.raises(FetchError, match=r"s0\.bin.*no longer matches the digest"):
        every_document(there)


def test_a_mixture_of_token_shards_packs_with_their_pad_id(tmp_path):
    a = TokenShardSource(npy_dir(tmp_path / "n"), eos_id=0, pad_id=0, dataset_id=1)
    b = TokenShardSource(megatron_dir(tmp_path / "m"), eos_id=0, pad_id=0, dataset_id=2)
    mix = MixtureSource({"a": a, "b": b}, {"a": 0.5, "b": 0.5}, chunk_size=8)
    loader = iter(zephon.Pipeline(mix, [fetch(), pack_sequences(64), batch(2)]))
    items = list(loader)
    assert items and loader.stats()["mixture_tokens"]


def test_a_bucket_copy_resumes_exactly(tmp_path, bucket):
    uri = bucket.upload(megatron_dir(tmp_path / "local"), "tok-resume")

    def make() -> zephon.Pipeline:
        src = TokenShardSource(uri, chunk_size=8, shuffle=True, pad_id=0, cache_dir=tmp_path / "c")
        return zephon.Pipeline(src, [fetch(), pack_sequences(64), batch(2)], lanes=2)

    full = run(iter(make()))
    loader = iter(make())
    head = run(loader, 5)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert head + run(make().iter(state=state)) == full


def test_a_shard_rewritten_at_its_size_on_a_store_without_mtime_or_version_is_read_anew(
    tmp_path,
):
    # memory:// gives no mtime and no version: a new source digests the file again instead of
    # trusting the sidecar in the cache directory, whose digests name the old tokens.
    import fsspec

    memory = fsspec.filesystem("memory")
    uri = f"memory:///{tmp_path.name}/tokens.npy"
    for tokens in ([5, 6, 0, 7, 0], [8, 0, 9, 9, 0]):
        np.save(tmp_path / "tokens.npy", np.array(tokens, dtype=np.uint16))
        memory.pipe(f"/{tmp_path.name}/tokens.npy", (tmp_path / "tokens.npy").read_bytes())
        src = TokenShardSource(uri, eos_id=0, cache_dir=tmp_path / "c")
        assert [d.tolist() for d in every_document(src)] == [
            list(d) for d in np.split(tokens, np.flatnonzero(np.array(tokens) == 0)[:-1] + 1)
        ]
