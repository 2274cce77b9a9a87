"""Specification of zephon.integrations.torch: tensors out, exact resume through the
StatefulDataLoader protocol, and torch never imported by ``import zephon``."""

from __future__ import annotations

import collections
import functools
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from worker_kit import script_env

import zephon
from zephon.errors import CheckpointMismatchError, PlanError
from zephon.ops import batch, fetch, map_transform, shuffle
from zephon.sources import RangeSource


def test_import_zephon_never_imports_torch():
    code = (
        "import sys, zephon, zephon.sources, zephon.ops, zephon.integrations; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def make_sample(idx: int) -> dict[str, Any]:
    return {
        "idx": idx,
        "tokens": np.arange(idx, idx + 3, dtype=np.int32),
        "weight": np.float32(idx) / 2,
        "name": f"s{idx}",
    }


def pipeline(n: int = 45, *, shuffled: bool = False, batch_size: int | None = 4) -> zephon.Pipeline:
    src = RangeSource(n, make=make_sample, chunk_size=7, shuffle=shuffled, seed=3, passes=2)
    ops: list[Any] = [fetch()]
    if shuffled:
        ops.append(shuffle(5, seed=1))
    if batch_size:
        ops.append(batch(batch_size))
    return zephon.Pipeline(src, ops, lanes=2, epoch_chunks=2)


def plain(value: Any) -> Any:
    """Tensors and arrays as (dtype, nested lists) so streams compare with ``==``."""
    if hasattr(value, "numpy"):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def contains(tree: Any, part: Any) -> bool:
    """True when ``part`` equals ``tree`` or a value nested in it."""
    if tree == part:
        return True
    if isinstance(tree, dict):
        return any(contains(v, part) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(contains(v, part) for v in tree)
    return False


# --------------------------------------------------------------------------- tensors


def test_to_tensors_converts_numeric_arrays_recursively_and_leaves_the_rest():
    torch = pytest.importorskip("torch")
    from zephon.integrations.torch import to_tensors

    Pair = collections.namedtuple("Pair", "a b")
    shared = np.arange(4, dtype=np.int64)
    frozen = np.arange(3, dtype=np.float32)
    frozen.flags.writeable = False
    out = to_tensors(
        {
            "shared": shared,
            "frozen": frozen,
            "reversed": np.arange(5, dtype=np.int16)[::-1],
            "flags": np.array([True, False]),
            "big_endian": np.arange(3, dtype=">i4"),
            "scalar": np.float64(2.5),
            "words": np.array(["a", "b"]),
            "nested": [np.zeros(2, dtype=np.uint8), (np.ones(1), "x"), Pair(np.ones(2), 7)],
            "py": 3,
            "text": "hi",
        }
    )
    assert isinstance(out["shared"], torch.Tensor) and out["shared"].dtype == torch.int64
    shared[0] = 99
    assert out["shared"][0].item() == 99  # from_numpy shares memory
    assert out["frozen"].tolist() == [0.0, 1.0, 2.0]
    assert out["reversed"].tolist() == [4, 3, 2, 1, 0]
    assert out["flags"].dtype == torch.bool
    assert out["big_endian"].tolist() == [0, 1, 2]
    assert out["scalar"].dim() == 0 and out["scalar"].item() == 2.5
    assert isinstance(out["words"], np.ndarray)
    assert isinstance(out["nested"][0], torch.Tensor)
    assert isinstance(out["nested"][1], tuple) and out["nested"][1][1] == "x"
    assert type(out["nested"][2]) is Pair and isinstance(out["nested"][2].a, torch.Tensor)
    assert (out["py"], out["text"]) == (3, "hi")


def test_a_plain_dataloader_yields_the_pipeline_payloads_as_tensors():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from zephon.integrations.torch import as_torch_dataset

    expected = [b.payload for b in pipeline()]
    got = list(DataLoader(as_torch_dataset(pipeline()), batch_size=None, num_workers=0))
    assert len(got) == len(expected) > 0
    for tensors, payload in zip(got, expected, strict=True):
        assert isinstance(tensors["tokens"], torch.Tensor)
        assert tensors["tokens"].dtype == torch.int32 and tensors["tokens"].shape == (
            len(payload["idx"]),
            3,
        )
        assert tensors["tokens"].tolist() == payload["tokens"].tolist()
        assert tensors["idx"].dtype == torch.int64  # an int column collates to an int64 array
        assert tensors["idx"].tolist() == payload["idx"].tolist()
        assert tensors["name"] == payload["name"]  # strings stay lists
        assert tensors["weight"].dtype == torch.float32  # numpy scalars keep their dtype
        assert tensors["weight"].tolist() == payload["weight"].tolist()


def test_records_without_batch_yield_their_payloads():
    torch = pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    got = list(as_torch_dataset(pipeline(10, batch_size=None)))
    assert sorted(p["idx"] for p in got) == sorted(list(range(10)) * 2)
    assert all(isinstance(p["tokens"], torch.Tensor) for p in got)


# --------------------------------------------------------------------------- state


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("k", [0, 1, 9, -1])
def test_the_state_protocol_resumes_exactly(shuffled, k):
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    full = [plain(p) for p in as_torch_dataset(pipeline(shuffled=shuffled))]
    assert len(full) == 24
    k = len(full) if k < 0 else k
    ds = as_torch_dataset(pipeline(shuffled=shuffled))
    it = iter(ds)
    head = [plain(next(it)) for _ in range(k)]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = as_torch_dataset(pipeline(shuffled=shuffled))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # loaded, not yet iterated
    assert head + [plain(p) for p in resumed] == full
    assert [plain(p) for p in resumed] == full  # the loaded state is used once


def test_a_second_iter_starts_a_fresh_loader():
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(pipeline())
    it = iter(ds)
    first = [plain(next(it)) for _ in range(5)]
    full = [plain(p) for p in ds]
    assert full[:5] == first and len(full) == 24
    assert [plain(p) for p in ds] == full


def test_state_before_iterating_and_after_the_end():
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(pipeline())
    start = ds.state_dict()
    again = as_torch_dataset(pipeline())
    again.load_state_dict(start)
    full = [plain(p) for p in again]
    assert len(full) == 24
    end = again.state_dict()
    done = as_torch_dataset(pipeline())
    done.load_state_dict(end)
    assert list(done) == []


def test_a_state_from_another_pipeline_is_refused():
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    state = as_torch_dataset(pipeline(45)).state_dict()
    other = as_torch_dataset(pipeline(46))
    other.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError):
        iter(other)


def _tripled(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "weight": payload["idx"] * 3}


def _quintupled(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "weight": payload["idx"] * 5}


def mapped(fn: Any) -> zephon.Pipeline:
    src = RangeSource(45, make=make_sample, chunk_size=7)
    ops = [fetch(), map_transform(fn), shuffle(5, seed=1), batch(4)]
    return zephon.Pipeline(src, ops, lanes=2, epoch_chunks=2)


@pytest.mark.parametrize("where", ["dataset", "load_state_dict"])
def test_a_state_with_changed_operators_resumes_when_allowed(where):
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(mapped(_tripled))
    it = iter(ds)
    head = [plain(next(it)) for _ in range(5)]
    state = ds.state_dict()
    ds.close()
    refused = as_torch_dataset(mapped(_quintupled))
    refused.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match="allow_changes=True"):
        iter(refused)
    if where == "dataset":
        resumed = as_torch_dataset(mapped(_quintupled), allow_changes=True)
        resumed.load_state_dict(state)
    else:
        resumed = as_torch_dataset(mapped(_quintupled))
        resumed.load_state_dict(state, allow_changes=True)
    with pytest.warns(zephon.PipelineChangeWarning, match="parameter 'fn'"):
        rest = [plain(p) for p in resumed]
    idx = [i for batch in head + rest for i in batch["idx"][2]]
    assert sorted(idx) == list(range(45))
    assert all(w == 5 * i for batch in rest for i, w in zip(batch["idx"][2], batch["weight"][2]))


def _resumed_retiring_the_even_samples() -> tuple[list[int], Any]:
    """The samples of the first 3 batches, and a dataset resumed after them with the even
    samples retired at its load."""
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(mapped(_tripled))
    it = iter(ds)
    head = [i for _ in range(3) for i in plain(next(it))["idx"][2]]
    state = ds.state_dict()
    ds.close()
    resumed = as_torch_dataset(mapped(_tripled))
    resumed.load_state_dict(state, retire=[(0, 0, i) for i in range(0, 45, 2)])
    return head, resumed


def test_load_state_dict_retires_samples():
    head, resumed = _resumed_retiring_the_even_samples()
    rest = [i for batch in resumed for i in plain(batch)["idx"][2]]
    assert sorted(head + rest) == sorted(set(head) | {i for i in range(45) if i % 2})
    assert resumed.state_dict()["retired"]  # kept in the dataset's later states


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_stateful_dataloader_state_skips_steps():
    make_loader = functools.partial(stateful_loader, num_workers=0)
    full = [plain(p) for p in make_loader()]
    loader = make_loader()
    it = iter(loader)
    for _ in range(4):
        next(it)
    skipped = zephon.skip_steps(loader.state_dict(), 3)  # 3 global steps of 2 lanes
    restored = make_loader()
    restored.load_state_dict(skipped)
    assert [plain(p) for p in restored] == full[4 + 3 * 2 :]


def stateful_loader(num_workers: int) -> Any:
    """A StatefulDataLoader around the torch dataset of the shuffled pipeline."""
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(pipeline(shuffled=True))
    return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)


def test_a_state_taken_before_the_first_batch_keeps_the_samples_retired_at_the_load():
    # a checkpoint right after the resume that retired them (a preemption before the first
    # batch): resumed from it, the retired samples stay out without retire= again
    from zephon.integrations.torch import as_torch_dataset

    head, resumed = _resumed_retiring_the_even_samples()
    saved = resumed.state_dict()
    assert saved["retired"]
    again = as_torch_dataset(mapped(_tripled))
    again.load_state_dict(saved)
    rest = [i for batch in again for i in plain(batch)["idx"][2]]
    assert sorted(head + rest) == sorted(set(head) | {i for i in range(45) if i % 2})


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_restores_in_a_new_loader():
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from zephon.integrations.torch import as_torch_dataset

    def make_loader() -> Any:
        ds = as_torch_dataset(pipeline(shuffled=True))
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=0)

    full = [plain(p) for p in make_loader()]
    assert len(full) == 24
    for k in (0, 6, 24):
        loader = make_loader()
        it = iter(loader)
        head = [plain(next(it)) for _ in range(k)]
        state = loader.state_dict()
        # the dataset's own state travels in the loader's (no naive fast-forward on restore)
        assert contains(state, loader.dataset.state_dict())
        restored = make_loader()
        restored.load_state_dict(state)
        assert head + [plain(p) for p in restored] == full
        assert [plain(p) for p in restored] == full  # the next epoch starts over


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_one_dataloader_worker_checkpoints_through_the_stateful_dataloader():
    # The dataset object in the training process never iterates with num_workers=1: its own
    # state is a fresh start, the worker's comes back through StatefulDataLoader.state_dict().
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    make_loader = functools.partial(stateful_loader, num_workers=1)
    full = [plain(p) for p in make_loader()]
    assert len(full) == 24
    loader = make_loader()
    it = iter(loader)
    head = [plain(next(it)) for _ in range(7)]
    fresh = as_torch_dataset(pipeline(shuffled=True)).state_dict()
    assert loader.dataset.state_dict() == fresh
    state = loader.state_dict()
    del it
    restored = make_loader()
    restored.load_state_dict(state)
    assert head + [plain(p) for p in restored] == full


def test_torch_dataloader_workers_are_refused(monkeypatch):
    pytest.importorskip("torch")
    import zephon.integrations.torch as zt

    class Info:
        num_workers = 2

    monkeypatch.setattr(zt, "get_worker_info", lambda: Info())
    with pytest.raises(PlanError, match="num_workers=0"):
        iter(zt.as_torch_dataset(pipeline()))


def test_as_torch_dataset_needs_a_pipeline():
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    with pytest.raises(TypeError, match="Pipeline"):
        as_torch_dataset([1, 2, 3])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- stats


def test_stats_are_available_before_during_and_after_the_stream():
    pytest.importorskip("torch")
    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(pipeline())
    before = ds.stats()
    assert before["delivered"] == 0 and before["eviction_path"] == "monotone"
    it = iter(ds)
    for _ in range(3):
        next(it)
    assert ds.stats()["delivered"] == 12  # three batches of four records
    rest = list(it)
    assert len(rest) == 21
    after = ds.stats()  # the last loader's, kept once the stream ended
    assert after["delivered"] == 90 and after["inflight_chunks"] == 0
    assert ds.stats() == after

    resumed = as_torch_dataset(pipeline())
    resumed.load_state_dict(ds.state_dict())
    assert resumed.stats()["delivered"] == 90  # the loaded state's counters, before iterating


# --------------------------------------------------------------------------- DataLoader arguments


def test_a_dataloader_that_batches_again_adds_a_dimension_as_documented():
    # torch does not tell a dataset how it is batched, so this is documented, not detected.
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from zephon.integrations.torch import as_torch_dataset

    ds = as_torch_dataset(pipeline())
    assert next(iter(DataLoader(ds)))["tokens"].shape == (1, 4, 3)  # batch_size=1, the default
    assert next(iter(DataLoader(ds, batch_size=2)))["tokens"].shape == (2, 4, 3)
    assert next(iter(DataLoader(ds, batch_size=None)))["tokens"].shape == (4, 3)


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_the_documented_arguments_do_not_warn():
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from torch.utils.data import DataLoader

    from zephon.integrations.torch import as_torch_dataset

    # pytest turns warnings into errors here: none may be raised
    assert len(list(DataLoader(as_torch_dataset(pipeline()), batch_size=None))) == 24
    loader = stateful.StatefulDataLoader(
        as_torch_dataset(pipeline()), batch_size=None, num_workers=0
    )
    assert len(list(loader)) == 24


def keep_two_of_three(payload: dict) -> bool:
    return payload["idx"] % 3 != 0


def test_ending_ranks_together_without_a_process_group_says_what_to_do():
    # rank 0 of 2 given by hand (another launcher), a plan whose item counts are unknown: the
    # dataset would end its ranks together over torch.distributed, which is not initialized.
    from zephon.integrations.torch import as_torch_dataset

    ops = [fetch(), zephon.ops.filter_records(keep_two_of_three), batch(4)]
    pipeline = zephon.Pipeline(RangeSource(100), ops, lanes=2, rank=0, world_size=2)
    with pytest.raises(zephon.ZephonError, match=r"init_process_group.*end_together=False"):
        next(iter(as_torch_dataset(pipeline)))
    alone = as_torch_dataset(pipeline, end_together=False)
    assert sum(1 for _ in alone) == len(list(pipeline)) > 0


def test_process_lanes_in_a_dataloader_worker_are_refused_with_what_to_do():
    # A DataLoader worker is a daemonic process, which multiprocessing forbids to start
    # processes: the refusal must say so and what to use, before any sample is read.
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from zephon.integrations.torch import as_torch_dataset

    def process_pipeline() -> zephon.Pipeline:
        src = RangeSource(400, chunk_size=7, shuffle=True, seed=3)
        return zephon.Pipeline(src, [fetch(), batch(4)], lanes=2, workers="process")

    assert list(process_pipeline())  # the fork server of this process is warm
    loader = DataLoader(as_torch_dataset(process_pipeline()), batch_size=None, num_workers=1)
    with pytest.raises(PlanError, match=r"daemonic.*num_workers=0.*workers='thread'"):
        list(loader)


_LEFT_MID_STREAM = """
import zephon
from torchdata.stateful_dataloader import StatefulDataLoader
from zephon.integrations.torch import as_torch_dataset
from zephon.ops import batch, fetch, shuffle
from zephon.sources import RangeSource

if __name__ == "__main__":
    source = RangeSource(400, chunk_size=7, shuffle=True, seed=3)
    pipeline = zephon.Pipeline(source, [fetch(), shuffle(5, seed=1), batch(4)], lanes=2)
    loader = StatefulDataLoader(as_torch_dataset(pipeline), batch_size=None, num_workers=0)
    batches = iter(loader)
    for step in range(3):  # a training run that stops at its last step, mid-stream
        next(batches)
    print("trained")
"""


def test_a_script_that_ends_mid_stream_exits_without_a_traceback():
    pytest.importorskip("torchdata.stateful_dataloader")
    done = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-c", _LEFT_MID_STREAM],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "trained\n", "")


def test_to_tensors_copies_arrays_torch_cannot_share_and_leaves_dtypes_it_has_not():
    torch = pytest.importorskip("torch")
    from zephon.integrations.torch import to_tensors

    # A field of a packed record array: its strides are no multiple of its item size.
    records = np.zeros(3, dtype=[("a", "<i4"), ("b", "<i8")])
    records["b"] = [5, 6, 7]
    extended = np.arange(2, dtype=np.longdouble)
    out = to_tensors({"field": records["b"], "extended": extended})
    assert out["field"].dtype == torch.int64 and out["field"].tolist() == [5, 6, 7]
    assert out["extended"] is extended  # torch has no tensor of this dtype
