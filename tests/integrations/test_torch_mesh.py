"""Data parallelism inside a parallel mesh: on a 2 x 2 DeviceMesh (data-parallel x tensor-parallel,
gloo on 127.0.0.1), the two tensor-parallel ranks of a data-parallel group get identical batches,
the job state gathers over the data-parallel group only, and it resumes on 1 and on 4
data-parallel ranks with the same global steps."""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from net_kit import free_port, run_ranks

pytest.importorskip("torch.distributed")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4  # the job's lanes
STEPS = 3  # global steps before the checkpoint

# A rank of a job of {world} processes on a (dp, tp) mesh of shape {shape}: its loader, on the
# data-parallel rank, then what the script goes on to do with it.
MESH_RANK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import zephon
    from zephon.integrations.torch import job_state
    from zephon.ranks import from_device_mesh
    from integrations.test_torch_mesh import make, item

    url, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size={world})
    mesh = init_device_mesh("cpu", {shape}, mesh_dim_names=("dp", "tp"))
    dp = from_device_mesh(mesh, "dp")
    loader = iter(make(rank=dp.rank, world_size=dp.world_size))
""")
ENDS = textwrap.dedent("""
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
""")

RANK = (
    MESH_RANK.format(tests=TESTS, world=4, shape=(2, 2))
    + textwrap.dedent("""
    head = [item(next(loader)) for _ in range({steps} * ({n} // dp.world_size))]
    job = job_state(loader, group=dp.group)
    both = from_device_mesh(mesh, ("dp", "tp"))
    print(json.dumps({{"dp": [dp.rank, dp.world_size], "head": head, "job": job,
                       "both": [both.rank, both.world_size, dist.get_world_size(both.group)]}}))
""").format(steps=STEPS, n=N)
    + ENDS
)


def make(**kw):
    import zephon
    from zephon.ops import batch, fetch, shuffle
    from zephon.sources import RangeSource

    source = RangeSource(600, chunk_size=16, shuffle=True, seed=4)
    return zephon.Pipeline(source, [fetch(), shuffle(8, seed=1), batch(4)], lanes=N, **kw)


def item(batch):
    return [r.payload["idx"] for r in batch]


def _steps(streams: list[list], world: int, limit: int) -> list[Counter]:
    per = N // world
    return [
        Counter(tuple(x) for s in streams for x in s[k * per : (k + 1) * per]) for k in range(limit)
    ]


def test_tensor_parallel_peers_share_batches_and_the_job_resumes_on_other_dp_sizes(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    done = run_ranks(script, 4, timeout=240)
    assert [code for code, _, _ in done] == [0] * 4, [err[-3000:] for _, _, err in done]
    ranks = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]
    # mesh [[0, 1], [2, 3]]: global ranks 0 and 1 are data-parallel rank 0, 2 and 3 rank 1
    assert [r["dp"] for r in ranks] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert ranks[0]["head"] == ranks[1]["head"] != ranks[2]["head"] == ranks[3]["head"]
    assert all(r["job"] == ranks[0]["job"] for r in ranks)
    assert [r["both"] for r in ranks] == [[0, 4, 4], [1, 4, 4], [2, 4, 4], [3, 4, 4]]

    job = ranks[0]["job"]
    reference = _steps([[item(b) for b in make(rank=0, world_size=1)]], 1, STEPS + 10)
    assert _steps([ranks[0]["head"], ranks[2]["head"]], 2, STEPS) == reference[:STEPS]
    for world in (1, 4):
        tails = [
            [item(b) for b in make(rank=r, world_size=world).iter(state=job)] for r in range(world)
        ]
        assert _steps(tails, world, 10) == reference[STEPS:], f"resumed on {world} dp ranks"


def test_dp_dims_must_name_dimensions_of_the_mesh() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zephon.errors import PlanError
    from zephon.ranks import from_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        named = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        assert from_device_mesh(named, "dp").world_size == 1
        for bad in ("pp", ("dp", "dp"), ()):
            with pytest.raises(PlanError, match=r"must name distinct dimensions.*\['dp', 'tp'\]"):
                from_device_mesh(named, bad)
        with pytest.raises(PlanError, match="mesh_dim_names"):
            from_device_mesh(init_device_mesh("cpu", (1,)), "dp")
    finally:
        dist.destroy_process_group()


PEERS = (
    MESH_RANK.format(tests=TESTS, world=2, shape=(1, 2))
    + textwrap.dedent("""
    next(loader)
    try:
        job_state(loader)                  # over the whole job: both tensor-parallel peers
        error = ""
    except zephon.CheckpointError as exc:
        error = type(exc).__name__ + ": " + str(exc)
    print(json.dumps({"error": error, "own": job_state(loader, group=dp.group)["format"]}))
""")
    + ENDS
)


def test_job_state_over_the_whole_mesh_says_to_gather_over_the_data_parallel_group(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(PEERS)
    done = run_ranks(script, 2, timeout=120)
    assert [code for code, _, _ in done] == [0] * 2, [err[-3000:] for _, _, err in done]
    for _, out, _ in done:
        rank = json.loads(out.strip().splitlines()[-1])
        assert rank["error"].startswith("CheckpointError: job_state gathered the states of 2 ")
        assert "data-parallel rank(s) [0]" in rank["error"]
        assert "group=" in rank["error"] and "from_device_mesh" in rank["error"]
        assert rank["own"] == "zephon-job-state"  # over the data-parallel group it merges
