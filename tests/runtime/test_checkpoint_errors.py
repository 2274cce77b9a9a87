"""Damaged or foreign checkpoints raise the documented errors, never a stream from elsewhere."""

from __future__ import annotations

import copy
import errno
import json
import os
import pathlib
import stat

import numpy as np
import pytest
from pipeline_kit import RunningTotal, WindowShuffle

import zephon
from zephon.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zephon.ops.basic import fetch
from zephon.plan import digest
from zephon.runtime.checkpoint.format import seal
from zephon.runtime.checkpoint.schema import check_pairs, encode_pairs
from zephon.sources.memory import RangeSource


def make(n=100, lanes=2, **kw):
    return zephon.Pipeline(
        RangeSource(n, chunk_size=8), [fetch(), WindowShuffle(3)], lanes=lanes, **kw
    )


@pytest.fixture
def state():
    loader = iter(make())
    for _ in range(17):
        next(loader)
    return loader.state_dict()


def test_state_is_small_json(state):
    assert json.loads(json.dumps(state)) == state
    assert len(json.dumps(state)) < 16 * 1024


def test_altered_state_is_corrupt(state):
    bad = copy.deepcopy(state)
    bad["lane_states"][0]["start"] += 1
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        make().iter(state=bad)


def test_unknown_version_is_corrupt(state):
    bad = dict(state, version=99)
    with pytest.raises(CheckpointCorruptError, match="version 99"):
        make().iter(state=bad)


def test_not_a_state_is_corrupt():
    with pytest.raises(CheckpointCorruptError):
        make().iter(state={"hello": 1})
    with pytest.raises(CheckpointCorruptError):
        make().iter(state=[1, 2])


def test_state_from_another_source_is_a_mismatch(state):
    with pytest.raises(CheckpointMismatchError, match="source"):
        make(n=101).iter(state=state)


def test_state_with_other_lanes_is_a_mismatch_without_relane(state):
    with pytest.raises(CheckpointMismatchError, match=r"lanes \(checkpoint 2, pipeline 3\)"):
        make(lanes=3, relane=False).iter(state=state)


def test_state_with_other_lanes_relanes_with_one_warning(state, caplog):
    with pytest.warns(zephon.RelaneWarning, match="2 lanes onto 3 lanes") as shown:
        loader = make(lanes=3).iter(state=state)
    assert len(shown) == 1
    assert "batches differ" in caplog.text
    loader.close()


def test_state_from_another_rank_or_world_size_is_a_mismatch(state):
    with pytest.raises(CheckpointMismatchError, match="world_size"):
        make(rank=0, world_size=2).iter(state=state)
    other = make(rank=1, world_size=2)
    loader = iter(other)
    next(loader)
    with pytest.raises(CheckpointMismatchError, match="rank"):
        make(rank=0, world_size=2).iter(state=loader.state_dict())


def test_state_from_other_operators_is_a_mismatch(state):
    p = zephon.Pipeline(RangeSource(100, chunk_size=8), [fetch(), WindowShuffle(4)], lanes=2)
    with pytest.raises(CheckpointMismatchError, match="operators"):
        p.iter(state=state)


def test_load_after_iteration_started_is_refused(state):
    loader = iter(make())
    next(loader)
    with pytest.raises(CheckpointError, match="before the first next"):
        loader.load_state_dict(state)


def test_save_and_load_checkpoint_roundtrip(tmp_path, state):
    path = tmp_path / "ckpt" / "loader.json"
    zephon.save_checkpoint(path, state)
    assert zephon.load_checkpoint(path) == state
    assert not [p for p in path.parent.iterdir() if p.name != "loader.json"]  # no temp files left


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_checkpoint_file_gets_the_permissions_of_any_new_file(tmp_path, state, umask):
    # Other processes of a job (another user on a shared filesystem, an evaluation job) read
    # the files save_checkpoint and save_rank_state write, as they would a torch.save file.
    old = os.umask(umask)
    try:
        zephon.save_checkpoint(tmp_path / "loader.json", state)
        path = zephon.save_rank_state(str(tmp_path / "job"), state)
    finally:
        os.umask(old)
    assert oct(stat.S_IMODE((tmp_path / "loader.json").stat().st_mode)) == oct(0o666 & ~umask)
    assert oct(stat.S_IMODE(os.stat(path).st_mode)) == oct(0o666 & ~umask)


def test_truncated_checkpoint_file_is_corrupt(tmp_path, state):
    path = tmp_path / "loader.json"
    zephon.save_checkpoint(path, state)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CheckpointCorruptError):
        zephon.load_checkpoint(path)


def test_a_checkpoint_file_nested_too_deep_is_corrupt(tmp_path):
    path = tmp_path / "loader.json"
    path.write_text('{"format": "zephon-checkpoint", "state": ' + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointCorruptError, match="is not readable JSON"):
        zephon.load_checkpoint(path)


def test_a_state_nested_too_deep_for_its_checksum_is_corrupt():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(CheckpointCorruptError, match="not plain JSON data"):
        make().iter(state={"format": "zephon-loader-state", "version": 3, "layout": deep})


def test_flipped_byte_in_checkpoint_file_is_corrupt(tmp_path, state):
    path = tmp_path / "loader.json"
    zephon.save_checkpoint(path, state)
    raw = bytearray(path.read_bytes())
    i = raw.index(b'"start":') + 8
    raw[i] = ord("7") if raw[i] != ord("7") else ord("3")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        zephon.load_checkpoint(path)


def test_count_pairs_are_the_same_before_and_after_a_json_round_trip():
    counts = {"code": 3, 7: 2, ("nested", 1): 5}
    pairs = encode_pairs(counts)
    assert json.loads(json.dumps(pairs)) == pairs
    assert dict(check_pairs(pairs, "mixture.samples")) == counts


class _RowsAt:
    """A ``make`` that holds its data: a source's description then identifies every row."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __call__(self, idx: int) -> object:
        return self.rows[idx]


def _holding(rows: list) -> zephon.Pipeline:
    return zephon.Pipeline(RangeSource(len(rows), make=_RowsAt(rows), chunk_size=64), [fetch()])


def test_a_source_holding_its_data_keeps_the_checkpoint_small() -> None:
    # Its description names every row by digest (about 200 KB packed); a checkpoint carries a
    # bounded part of it.
    rows = [{"tokens": np.arange(i, i + 3, dtype=np.int32)} for i in range(10_000)]
    loader = iter(_holding(rows))
    next(loader)
    state = loader.state_dict()
    assert len(json.dumps(state)) < 32 * 1024
    changed: list[dict[str, np.ndarray]] = [dict(r) for r in rows]
    changed[5_000] = {"tokens": np.arange(7, dtype=np.int64)}
    with pytest.raises(CheckpointMismatchError, match=r"source field 'make'") as raised:
        _holding(changed).iter(state=state)
    assert "'10000 items, sha256 " in str(raised.value)  # the long list, by length and digest


def test_a_carry_state_its_operator_cannot_restore_is_refused_at_load_naming_it():
    def running(n: int = 100) -> zephon.Pipeline:
        return zephon.Pipeline(
            RangeSource(n, chunk_size=8), [fetch(), RunningTotal()], lanes=2, epoch_chunks=2
        )

    loader = iter(running())
    for _ in range(40):
        next(loader)
    state = loader.state_dict()
    loader.close()
    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    carry = body["lane_states"][1]["carry"]
    assert carry == [{"total": carry[0]["total"]}], "the state must carry a running total"
    carry[0] = {"sum": 3}  # RunningTotal reads "total": a KeyError inside the operator
    with pytest.raises(
        CheckpointCorruptError,
        match=r"lane_states\[1\]\.carry\[0\] is not a carry state operator 'RunningTotal' "
        r"restores \(KeyError: 'total'\)",
    ):
        running().iter(state=seal(body))


def test_carry_states_are_in_a_window_exactly_when_it_starts_after_the_first_epoch():
    def running() -> zephon.Pipeline:
        return zephon.Pipeline(
            RangeSource(100, chunk_size=8), [fetch(), RunningTotal()], lanes=2, epoch_chunks=2
        )

    def resealed(steps: int, carry: object) -> dict:
        loader = iter(running())
        for _ in range(steps):
            next(loader)
        body = {k: v for k, v in loader.state_dict().items() if k != "checksum"}
        loader.close()
        body["lane_states"][0]["carry"] = carry
        return seal(body)

    # Past the first epoch: without its carry state the lane would restart RunningTotal at 0.
    with pytest.raises(CheckpointCorruptError, match=r"lane_states\[0\]\.carry must be the list"):
        running().iter(state=resealed(40, None))
    with pytest.raises(CheckpointCorruptError, match=r"lane_states\[0\]\.carry must be null"):
        running().iter(state=resealed(1, [{"total": 5}]))


@pytest.mark.parametrize(
    ("field", "value"),
    [("tag_counts", [[[["x"]], 1]]), ("mixture", {"samples": [[[{}], 1]], "tokens": []})],
)
def test_count_pairs_with_a_nested_key_are_corrupt_on_load_and_merge(state, field, value):
    body = {k: v for k, v in state.items() if k != "checksum"}
    body[field] = value
    with pytest.raises(CheckpointCorruptError, match=r"\[0\]\[0\] must be a component name or id"):
        make().iter(state=seal(body))
    with pytest.raises(CheckpointCorruptError, match=r"\[0\]\[0\] must be a component name or id"):
        zephon.merge_states([seal(body)])


def test_merging_the_state_of_one_rank_of_a_huge_job_names_a_few_missing_lanes():
    # One rank of a job of 500,000 ranks and a million lanes, sealed again with a matching
    # fingerprint: the error names what is missing without listing every lane and rank.
    loader = iter(make(lanes=2))
    next(loader)
    body = {k: v for k, v in loader.state_dict().items() if k != "checksum"}
    loader.close()
    lanes, world = 1_000_000, 500_000
    body.update(lanes=lanes, world_size=world, layout=[{"lanes": lanes}])
    body["pipeline"] = {**body["pipeline"], "lanes": lanes}
    identity = {k: v for k, v in body["pipeline"].items() if k != "described"}
    body["fingerprint"] = digest(identity)
    with pytest.raises(
        CheckpointError, match=r"lanes \[2, 3, 4, 5, 6, 7, 8\] and 999991 more of the job's"
    ) as e:
        zephon.merge_states([seal(body)])
    assert len(str(e.value)) < 400


class _ScaledTotal(RunningTotal):
    """Restores its carry state with what ``setup`` set: only a set-up copy can."""

    def setup(self, ctx) -> None:
        self.scale = 1

    def restore_carry(self, state: dict) -> None:
        self._total = state["total"] * self.scale


def test_a_carry_state_of_an_operator_with_setup_is_left_to_its_set_up_copy():
    def running() -> zephon.Pipeline:
        return zephon.Pipeline(
            RangeSource(100, chunk_size=8), [fetch(), _ScaledTotal()], lanes=2, epoch_chunks=2
        )

    full = [item.payload["total"] for item in running()]
    loader = iter(running())
    head = [next(loader).payload["total"] for _ in range(40)]
    state = loader.state_dict()
    loader.close()
    assert state["lane_states"][0]["carry"] is not None
    assert head + [item.payload["total"] for item in running().iter(state=state)] == full


def test_a_checkpoint_file_handed_over_the_wrong_way_says_the_right_way(tmp_path, state):
    path = tmp_path / "loader.json"
    zephon.save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=r"got str.*zephon\.load_checkpoint"):
        make().iter(state=str(path))
    with pytest.raises(CheckpointError, match=r"save_checkpoint file.*zephon\.load_checkpoint"):
        make().iter(state=json.loads(path.read_text()))
    plain = tmp_path / "state.json"
    plain.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"state\.json holds a loader state itself.*json"):
        zephon.load_checkpoint(plain)
    torch_file = tmp_path / "ckpt.pt"
    torch_file.write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    with pytest.raises(CheckpointError, match=r"ckpt\.pt looks like a torch\.save file"):
        zephon.load_checkpoint(torch_file)


def test_a_file_uri_names_the_local_file(tmp_path, state, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = (tmp_path / "ckpt" / "loader.json").as_uri()
    zephon.save_checkpoint(uri, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no directory "file:"
    assert zephon.load_checkpoint(uri) == zephon.load_checkpoint(tmp_path / "ckpt/loader.json")


@pytest.mark.parametrize("uri", ["s3://bucket/run/loader.json", "gs://bucket/run/loader.json"])
def test_a_uri_made_a_path_object_is_refused_not_written_beside_the_job(
    tmp_path, state, monkeypatch, uri
):
    # pathlib.Path("s3://bucket/key") is "s3:/bucket/key": taken for a local path, the
    # checkpoint would go to a directory named "s3:" under the working directory.
    monkeypatch.chdir(tmp_path)
    path = pathlib.Path(uri)
    with pytest.raises(ValueError, match=r"save_checkpoint: .*s3:/|save_checkpoint: .*gs:/"):
        zephon.save_checkpoint(path, state)
    with pytest.raises(ValueError, match=r"pass the URI as a string"):
        zephon.save_rank_state(path.parent, state)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"load_checkpoint: .*pass the URI as a string"):
        zephon.load_checkpoint(path)
    assert list(tmp_path.iterdir()) == []
    # A file URI made a path ("file:/...") still names the local file.
    local = pathlib.Path((tmp_path / "ckpt" / "loader.json").as_uri())
    zephon.save_checkpoint(local, state)
    assert zephon.load_checkpoint(local) == state
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EOPNOTSUPP, errno.EACCES])
def test_a_directory_that_cannot_be_synced_still_gets_its_checkpoint(
    tmp_path, state, monkeypatch, refusal
):
    # Some network and FUSE filesystems refuse fsync on a directory; the file itself is
    # written, synced and renamed into place by then, so the save goes on.
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(refusal, os.strerror(refusal))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    zephon.save_checkpoint(tmp_path / "loader.json", state)
    assert zephon.load_checkpoint(tmp_path / "loader.json") == state
    path = zephon.save_rank_state(str(tmp_path / "job"), state)
    assert zephon.load_checkpoint(path) == state


def test_a_failed_file_sync_still_fails_the_save(tmp_path, state, monkeypatch):
    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error"):
        zephon.save_checkpoint(tmp_path / "loader.json", state)
    assert list(tmp_path.iterdir()) == []
