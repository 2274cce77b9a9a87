"""The torch dataset run by one DataLoader worker process (``num_workers=1``) on the ranks of a
real torch.distributed job (gloo, 127.0.0.1): the worker runs its own rank's lanes however it
was started, a worker that cannot end the ranks together says so instead of waiting for ever in
a collective, and the StatefulDataLoader's state merges into a job state and skips steps."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from net_kit import run_ranks

pytest.importorskip("torch.distributed")
pytest.importorskip("torchdata.stateful_dataloader")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4  # the job's lanes
WORLD = 2

RANK = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    import zephon
    from zephon.integrations.torch import as_torch_dataset, job_state
    from integrations.test_torch_worker_ranks import even, filtered


    def main():
        url, rank, mode, context = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size={world})
        make = filtered if mode == "filtered" else even
        dataloader = StatefulDataLoader(
            as_torch_dataset(make()), batch_size=None, num_workers=1,
            multiprocessing_context=context,
        )
        out = {{}}
        try:
            if mode == "checkpoint":
                it = iter(dataloader)
                out["head"] = [next(it)["idx"].tolist() for _ in range(3 * {per})]
                out["job"] = job_state(dataloader)
                out["skipped"] = zephon.skip_steps(dataloader.state_dict(), 1)
                del it
            else:
                out["seen"] = [b["idx"].tolist() for b in dataloader]
        except Exception as exc:
            out["error"] = type(exc).__name__ + ": " + str(exc)
        print(json.dumps(out))
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
""").format(tests=TESTS, world=WORLD, per=N // WORLD)


def even(**kw):
    """Items every lane knows the count of: the ranks end together by themselves."""
    import zephon
    from zephon.ops import batch, fetch
    from zephon.sources import RangeSource

    return zephon.Pipeline(RangeSource(120, chunk_size=10), [fetch(), batch(2)], lanes=N, **kw)


def keep(payload):
    return payload["idx"] % 3 != 0


def filtered(**kw):
    """A filter: the ranks' counts are unknown, so the dataset would end them together."""
    import zephon
    from zephon.ops import batch, fetch, filter_records
    from zephon.sources import RangeSource

    ops = [fetch(), filter_records(keep), batch(2)]
    return zephon.Pipeline(RangeSource(110, chunk_size=10), ops, lanes=N, **kw)


def _ranks(tmp_path: Path, mode: str, context: str) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    done = run_ranks(script, WORLD, mode, context, timeout=120)
    assert [code for code, _, _ in done] == [0] * WORLD, [err[-3000:] for _, _, err in done]
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]


def _items(pipeline) -> list[list[int]]:
    return [[r.payload["idx"] for r in b] for b in pipeline]


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def test_a_spawned_dataloader_worker_runs_the_lanes_of_its_own_rank(tmp_path: Path) -> None:
    # A worker started by "spawn" (or "forkserver") has no process group of its own: the rank
    # it runs is the training process's, not rank 0 of 1 on every rank.
    ranks = _ranks(tmp_path, "all", "spawn")
    assert [r.get("error") for r in ranks] == [None] * WORLD
    assert [r["seen"] for r in ranks] == [_items(even(rank=r, world_size=WORLD)) for r in (0, 1)]


def test_a_dataloader_worker_refuses_to_end_the_ranks_together_instead_of_hanging(
    tmp_path: Path,
) -> None:
    # A forked worker inherits the training process's group, which it cannot use: the first
    # all-reduce of end_together waited for ever there.
    for rank in _ranks(tmp_path, "filtered", "fork"):
        assert rank["error"].startswith("PlanError: ")
        assert "DataLoader worker" in rank["error"]
        assert "num_workers=0" in rank["error"]


def test_a_one_worker_stateful_dataloader_merges_into_a_job_state_and_skips_steps(
    tmp_path: Path,
) -> None:
    ranks = _ranks(tmp_path, "checkpoint", "fork")
    assert [r.get("error") for r in ranks] == [None] * WORLD
    full = [_items(even(rank=r, world_size=WORLD)) for r in range(WORLD)]
    assert [r["head"] for r in ranks] == [stream[:6] for stream in full]
    # each rank's dataloader state, with the same job state in its worker's snapshot
    job = ranks[0]["job"]
    worker = [r["job"]["_snapshot"]["_worker_snapshots"]["worker_0"] for r in ranks]
    merged = [w["dataset_state"] for w in worker]
    assert merged[0] == merged[1] and merged[0]["format"] == "zephon-job-state"
    single = _items(even(rank=0, world_size=1))
    assert _items(even(rank=0, world_size=1).iter(state=merged[0])) == single[12:]
    skipped = ranks[0]["skipped"]["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]
    assert _items(even(rank=0, world_size=WORLD).iter(state=skipped)) == full[0][6 + 2 :]
    # the one-worker StatefulDataLoader of a run on one rank loads the job state as its own
    from torchdata.stateful_dataloader import StatefulDataLoader

    from zephon.integrations.torch import as_torch_dataset

    again = StatefulDataLoader(
        as_torch_dataset(even(rank=0, world_size=1)), batch_size=None, num_workers=1
    )
    again.load_state_dict(job)
    assert [b["idx"].tolist() for b in again] == single[12:]
