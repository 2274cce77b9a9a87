"""A real torch.distributed job (gloo, CPU) checkpoints on two processes, builds the job state on
every rank with one call, and continues on one process and on four with the same global steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from net_kit import free_port

pytest.importorskip("torch.distributed")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4  # the job's lanes
STEPS_BEFORE = 3  # global steps before the checkpoint

RANK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    import zephon
    from zephon.integrations.torch import job_state
    from integrations.test_torch_elastic import make, item, uneven

    url, mode, path = sys.argv[1], sys.argv[4], sys.argv[5]
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    per = {N} // world
    if mode == "checkpoint":
        loader = iter(make())
        head = [item(next(loader)) for _ in range({steps} * per)]
        job = job_state(loader)            # every rank gets the same job state
        out = {{"head": head, "job": job}}
    elif mode == "every-step":             # through the end of the pass: lanes end unevenly
        loader = iter(uneven())
        jobs = [job_state(loader)]
        for _ in range({uneven_steps}):
            for _ in range(per):
                next(loader, None)
            jobs.append(job_state(loader))
        out = {{"jobs": jobs}}
    elif mode == "mid-step":               # one item into a global step of per items
        import warnings
        loader = iter(make())
        next(loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                job_state(loader)
                error = ""
            except zephon.CheckpointError as exc:
                error = type(exc).__name__ + ": " + str(exc)
        warned = [str(w.message) for w in caught if w.category is zephon.MidStepWarning]
        out = {{"warned": warned, "error": error}}
    elif mode == "resume-then-save":       # a job state taken again before the first batch
        from zephon.integrations.torch import as_torch_dataset
        with open(path) as f:
            job = json.load(f)
        dataset = as_torch_dataset(make())
        dataset.load_state_dict(job)
        try:
            again = job_state(dataset)
        except zephon.CheckpointError as exc:
            again = type(exc).__name__ + ": " + str(exc)
        out = {{"again": again, "tail": [x["idx"].tolist() for x in dataset]}}
    else:
        with open(path) as f:
            job = json.load(f)
        out = {{"tail": [item(x) for x in make().iter(state=job)]}}
    print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
""").format(tests=TESTS, N=N, steps=STEPS_BEFORE, uneven_steps=16)


def make(**kw):
    import zephon
    from zephon.ops import batch, fetch, shuffle
    from zephon.sources import RangeSource

    source = RangeSource(600, chunk_size=16, shuffle=True, seed=4)
    return zephon.Pipeline(source, [fetch(), shuffle(8, seed=1), batch(4)], lanes=N, **kw)


def uneven(**kw):
    """11 chunks of 10 on the 4 lanes: lanes 0..2 hold 3 chunks, lane 3 holds 2, and each lane
    runs to its end (``uneven_end="allow"``)."""
    import zephon
    from zephon.ops import batch, fetch
    from zephon.sources import RangeSource

    source = RangeSource(110, chunk_size=10)
    return zephon.Pipeline(source, [fetch(), batch(2)], lanes=N, uneven_end="allow", **kw)


def item(batch):
    return [r.payload["idx"] for r in batch]


def _run_job(script: Path, world: int, mode: str, path: str = "") -> list[dict]:
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, str(r), str(world), mode, path],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
    assert [proc.returncode for proc in procs] == [0] * world
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _steps(streams: list[list], world: int) -> list[Counter]:
    per = N // world
    n = min(len(s) for s in streams) // per
    return [
        Counter(tuple(x) for s in streams for x in s[k * per : (k + 1) * per]) for k in range(n)
    ]


def test_a_two_process_job_continues_on_one_and_on_four_processes(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    reference = _steps([[item(b) for b in make(rank=r, world_size=2)] for r in range(2)], 2)
    # the guarantee holds until the first lane ends
    shortest = min(len(list(make(rank=g, world_size=N))) for g in range(N))
    first = _run_job(script, 2, "checkpoint")
    assert first[0]["job"] == first[1]["job"]
    assert _steps([r["head"] for r in first], 2) == reference[:STEPS_BEFORE]
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(first[0]["job"]))
    for world in (1, 4):
        tails = [r["tail"] for r in _run_job(script, world, "resume", str(job_file))]
        resumed = _steps(tails, world)
        limit = shortest - STEPS_BEFORE
        assert len(resumed) >= limit
        assert resumed[:limit] == reference[STEPS_BEFORE:shortest], f"world {world}"


def test_a_job_state_taken_again_before_the_first_batch_of_its_resume_is_the_same(
    tmp_path: Path,
) -> None:
    # a checkpoint right after a resume, before any rank moved: each dataset still holds the
    # job state it was given, and job_state() gives it back
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(_run_job(script, 2, "checkpoint")[0]["job"]))
    job = json.loads(job_file.read_text())
    resumed = _run_job(script, 2, "resume-then-save", str(job_file))
    for r, rank in enumerate(resumed):
        assert rank["again"] == job
        # the dataset ends the ranks together: the rank with more items stops with the other
        everything = [item(x) for x in make(rank=r, world_size=2).iter(state=job)]
        assert rank["tail"] == everything[: len(rank["tail"])]
    assert len(resumed[0]["tail"]) == len(resumed[1]["tail"]) > 0


def test_job_state_at_every_global_step_through_the_end_of_the_pass_resumes_exactly(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    full = [[item(b) for b in uneven(rank=r, world_size=2)] for r in range(2)]
    assert (len(full[0]), len(full[1])) == (30, 25)  # rank 1 runs out 3 global steps early
    ranks = _run_job(script, 2, "every-step")
    assert ranks[0]["jobs"] == ranks[1]["jobs"]
    every = sorted(x for stream in full for x in stream)
    for k, job in enumerate(ranks[0]["jobs"]):
        heads = [stream[: 2 * k] for stream in full]
        same = [[item(b) for b in uneven(rank=r, world_size=2).iter(state=job)] for r in range(2)]
        assert [h + t for h, t in zip(heads, same)] == full, f"global step {k}"
        for world in (1, 4):
            tails = [
                [item(b) for b in uneven(rank=r, world_size=world).iter(state=job)]
                for r in range(world)
            ]
            delivered = [x for stream in heads + tails for x in stream]
            assert sorted(delivered) == every, f"global step {k}, world_size={world}"


def test_job_state_inside_a_global_step_warns_and_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    for rank in _run_job(script, 2, "mid-step"):
        assert len(rank["warned"]) == 1 and "inside a global step" in rank["warned"][0]
        assert rank["error"].startswith("CheckpointError: ")
        assert "inside a global step" in rank["error"]


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_job_state_takes_a_stateful_dataloader_in_a_one_process_group() -> None:
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    import zephon
    from zephon.integrations.torch import as_torch_dataset, job_state

    dataloader = StatefulDataLoader(as_torch_dataset(make()), batch_size=None, num_workers=0)
    it = iter(dataloader)
    seen = [next(it)["idx"].tolist() for _ in range(5)]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        job = job_state(dataloader)
    finally:
        dist.destroy_process_group()
    full = [item(b) for b in make(rank=0, world_size=1)]
    resumed = [item(b) for b in make(rank=0, world_size=1).iter(state=job["dataset_state"])]
    assert seen + resumed == full
    assert job["dataset_state"]["format"] == "zephon-job-state"
    # The job state has the dataloader's shape: the StatefulDataLoader it came from loads it.
    again = StatefulDataLoader(as_torch_dataset(make()), batch_size=None, num_workers=0)
    again.load_state_dict(job)
    assert [b["idx"].tolist() for b in again] == full[len(seen) :]
    with pytest.raises(zephon.ZephonError, match="init_process_group"):
        job_state(dataloader)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_states_saved_per_rank_merge_for_another_world_size(
    tmp_path: Path,
) -> None:
    # the torch page's loop saves dataloader.state_dict() on each rank; to come back on another
    # number of ranks those states are merged, or saved into a shared directory and read back
    from torchdata.stateful_dataloader import StatefulDataLoader

    import zephon
    from zephon.integrations.torch import as_torch_dataset

    per = N // 2
    states = []
    for rank in range(2):
        dataset = as_torch_dataset(make(rank=rank, world_size=2), end_together=False)
        dataloader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
        it = iter(dataloader)
        for _ in range(STEPS_BEFORE * per):
            next(it)
        states.append(json.loads(json.dumps(dataloader.state_dict())))
        zephon.save_rank_state(str(tmp_path), states[-1])
    reference = _steps([[item(b) for b in make(rank=r, world_size=2)] for r in range(2)], 2)
    for job in (zephon.merge_states(states), zephon.load_job_state(str(tmp_path))):
        tails = [[item(b) for b in make(rank=r, world_size=N).iter(state=job)] for r in range(N)]
        resumed = _steps(tails, N)
        assert resumed[:5] == reference[STEPS_BEFORE : STEPS_BEFORE + 5]
