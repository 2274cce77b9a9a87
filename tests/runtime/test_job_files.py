"""A job state through a shared directory (local or in a bucket): each rank saves its state,
any process reads them back as one job state, which resumes on another world size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pipeline_kit import fingerprint_item

import zephon
from zephon.errors import CheckpointCorruptError, CheckpointError
from zephon.ops import batch, fetch, shuffle
from zephon.runtime.checkpoint.format import seal
from zephon.sources import RangeSource

N = 4  # the job's lanes
STEPS = 5  # global steps before the checkpoint


def make(**kw: Any) -> zephon.Pipeline:
    source = RangeSource(600, chunk_size=16, shuffle=True, seed=4)
    return zephon.Pipeline(source, [fetch(), shuffle(8, seed=1), batch(4)], lanes=N, **kw)


def global_steps(world: int, state: dict | None = None, limit: int = 20) -> list[Counter]:
    per = N // world
    streams = [
        [fingerprint_item(x) for x in make(rank=r, world_size=world).iter(state=state)]
        for r in range(world)
    ]
    return [Counter(i for s in streams for i in s[k * per : (k + 1) * per]) for k in range(limit)]


def save_ranks(where: str, world: int, **kw: Any) -> None:
    for rank in range(world):
        loader = make(rank=rank, world_size=world).iter()
        for _ in range(STEPS * (N // world)):
            next(loader)
        zephon.save_rank_state(where, loader.state_dict(), **kw)
        loader.close()


@pytest.mark.parametrize("resume_on", [1, 2, 4])
def test_rank_states_saved_to_a_directory_resume_as_one_job_on_any_world_size(
    tmp_path: Path, resume_on: int
) -> None:
    where = str(tmp_path / "step-5")
    save_ranks(where, world=2)
    assert sorted(p.name for p in Path(where).iterdir()) == [
        "rank-00000-of-00002.json",
        "rank-00001-of-00002.json",
    ]
    job = zephon.load_job_state(where)
    assert global_steps(resume_on, job) == global_steps(1, limit=STEPS + 20)[STEPS:]


def test_a_missing_rank_is_named(tmp_path: Path) -> None:
    save_ranks(str(tmp_path), world=2)
    (tmp_path / "rank-00001-of-00002.json").unlink()
    with pytest.raises(CheckpointError, match=r"lacks the state of rank\(s\) \[1\] of 2"):
        zephon.load_job_state(str(tmp_path))


def test_states_of_two_world_sizes_in_one_directory_are_refused(tmp_path: Path) -> None:
    save_ranks(str(tmp_path), world=2)
    save_ranks(str(tmp_path), world=1)
    with pytest.raises(CheckpointError, match="jobs of 1, 2 ranks"):
        zephon.load_job_state(str(tmp_path))


def test_an_empty_directory_and_a_damaged_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no rank state"):
        zephon.load_job_state(str(tmp_path))
    save_ranks(str(tmp_path), world=2)
    damaged = tmp_path / "rank-00000-of-00002.json"
    envelope = json.loads(damaged.read_text())
    envelope["state"]["next_lane"] = 1
    damaged.write_text(json.dumps(envelope))
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000-of-00002\.json"):
        zephon.load_job_state(str(tmp_path))


def test_ranks_saved_at_different_steps_into_one_directory_name_it(tmp_path: Path) -> None:
    # rank 1 saved one global step later (a step-5 directory reused, or a path mixed up)
    where = tmp_path / "step-5"
    for rank, steps in ((0, STEPS), (1, STEPS + 1)):
        loader = make(rank=rank, world_size=2).iter()
        for _ in range(steps * (N // 2)):
            next(loader)
        zephon.save_rank_state(str(where), loader.state_dict())
        loader.close()
    with pytest.raises(CheckpointError) as refused:
        zephon.load_job_state(str(where))
    assert "rank 0 at step 5, rank 1 at step 6" in str(refused.value)
    assert f"directory {str(where)!r}" in str(refused.value)


def test_a_job_state_round_trips_through_a_bucket(bucket) -> None:
    where = f"s3://{bucket.name}/jobs/step-5"
    save_ranks(where, world=2)
    job = zephon.load_job_state(where)
    assert global_steps(2, job) == global_steps(1, limit=STEPS + 20)[STEPS:]


def test_a_bucket_that_fails_a_request_now_and_then_is_read_all_the_same(
    bucket, failing_proxy
) -> None:
    # Nothing above the S3 client retries these files: the client keeps its own attempts.
    where = f"s3://{bucket.name}/jobs/step-5"
    save_ranks(where, world=2)
    bucket.point_at(failing_proxy.endpoint)
    failing_proxy.fail = 2
    job = zephon.load_job_state(where)
    assert failing_proxy.failed == 2
    assert global_steps(2, job) == global_steps(1, limit=STEPS + 20)[STEPS:]


def test_a_resealed_malformed_rank_state_is_corrupt_naming_the_field(tmp_path: Path) -> None:
    save_ranks(str(tmp_path), world=2)
    path = tmp_path / "rank-00001-of-00002.json"
    body = {k: v for k, v in zephon.load_checkpoint(path).items() if k not in ("checksum", "rank")}
    zephon.save_checkpoint(path, seal(body))
    with pytest.raises(CheckpointCorruptError, match="must have exactly the fields"):
        zephon.load_job_state(str(tmp_path))


def test_a_rank_file_that_holds_no_rank_state_is_named(tmp_path: Path) -> None:
    save_ranks(str(tmp_path), world=2)
    path = tmp_path / "rank-00001-of-00002.json"
    rank_state = zephon.load_checkpoint(path)
    body = {k: v for k, v in rank_state.items() if k not in ("checksum", "rank")}
    zephon.save_checkpoint(path, seal(body))  # a field missing, sealed again
    with pytest.raises(CheckpointCorruptError, match=r"must have exactly(.|\n)*rank-00001-of"):
        zephon.load_job_state(str(tmp_path))
    job = zephon.merge_states(
        [zephon.load_checkpoint(tmp_path / "rank-00000-of-00002.json"), rank_state]
    )
    zephon.save_checkpoint(path, job)  # a merged job state saved under a rank's name
    with pytest.raises(CheckpointCorruptError, match=r"zephon-job-state(.|\n)*rank-00001-of"):
        zephon.load_job_state(str(tmp_path))


def test_a_checkpoint_file_saved_to_a_bucket_is_in_the_bucket(
    bucket, tmp_path: Path, monkeypatch
) -> None:
    import pyarrow.fs as pafs

    monkeypatch.chdir(tmp_path)  # where a URI taken for a local path would land
    loader = make().iter()
    for _ in range(STEPS):
        next(loader)
    state = loader.state_dict()
    loader.close()
    uri = f"s3://{bucket.name}/ckpt/step-5/loader.json"
    zephon.save_checkpoint(uri, state)
    assert list(tmp_path.iterdir()) == []
    info = bucket.fs.get_file_info(f"{bucket.name}/ckpt/step-5/loader.json")
    assert info.type == pafs.FileType.File
    assert zephon.load_checkpoint(uri) == state


def test_the_ranks_missing_from_a_large_job_are_named_a_few_and_counted(tmp_path: Path) -> None:
    pipeline = zephon.Pipeline(
        RangeSource(640, chunk_size=10), [fetch(), batch(2)], lanes=64, rank=0, world_size=64
    )
    with pipeline.iter() as loader:
        zephon.save_rank_state(str(tmp_path), loader.state_dict())
    with pytest.raises(CheckpointError) as refused:
        zephon.load_job_state(str(tmp_path))
    assert "rank(s) [1, 2, 3, 4, 5, 6, 7] and 56 more of 64" in str(refused.value)


def test_zephon_inspect_reads_a_checkpoint_in_a_bucket(bucket, capsys) -> None:
    import torch

    from zephon.cli import main

    loader = make().iter()
    next(loader)
    state = loader.state_dict()
    loader.close()
    uri = f"s3://{bucket.name}/ckpt/loader.json"
    zephon.save_checkpoint(uri, state)
    with bucket.fs.open_output_stream(f"{bucket.name}/ckpt/step-1.pt") as out:
        torch.save({"model": torch.zeros(2), "loader": state}, out)
    assert main(["inspect", uri]) == 0
    assert main(["inspect", f"s3://{bucket.name}/ckpt/step-1.pt"]) == 0
    shown = capsys.readouterr().out
    assert f"{uri}: Zephon loader state" in shown and "step-1.pt['loader']: Zephon" in shown
