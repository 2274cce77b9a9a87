"""Ranks whose data ends at different global steps (a filter keeps more on one rank than on the
other) stop together through the torch dataset, so none is left waiting in a collective; gloo on
127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from net_kit import run_ranks

pytest.importorskip("torch.distributed")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    from zephon.integrations.torch import as_torch_dataset
    from integrations.test_torch_end_together import make

    url, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    together = {{"default": None, "off": False}}[mode]
    dataset = as_torch_dataset(make(), end_together=together)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    steps = 0
    for batch in loader:
        dist.barrier()  # what a training step does: every rank must be there
        steps += 1
    print(json.dumps({{"steps": steps, "dropped": dataset.stats()["dropped_at_end"]}}))
    dist.destroy_process_group()
""").format(tests=TESTS)


def keep(payload: dict) -> bool:
    # Lane 0 (rank 0) reads the first half of each chunk pair, lane 1 the second: rank 1 keeps less.
    return payload["idx"] % 64 < 40 or payload["idx"] % 3 == 0


def make():
    import zephon
    from zephon.ops import batch, fetch, filter_records
    from zephon.sources import RangeSource

    return zephon.Pipeline(
        RangeSource(1024, chunk_size=32), [fetch(), filter_records(keep), batch(4)], lanes=2
    )


def _run(script: Path, mode: str, timeout: float) -> list[tuple[int, str, str]] | None:
    """Each rank's exit status, output and errors; None when they did not finish in time."""
    try:
        return run_ranks(script, 2, mode, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_ranks_with_unequal_data_stop_at_the_same_step(tmp_path: Path) -> None:
    import zephon

    counts = [
        len(list(zephon.Pipeline(make().source, make().ops, lanes=2, rank=r, world_size=2)))
        for r in range(2)
    ]
    assert counts[0] != counts[1]  # the data really ends at different steps
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    finished = _run(script, "default", timeout=120)
    assert finished is not None, "the ranks did not finish"
    assert [code for code, _, _ in finished] == [0, 0], [err[-3000:] for _, _, err in finished]
    ranks = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in finished]
    assert [r["steps"] for r in ranks] == [min(counts)] * 2
    assert sum(r["dropped"] for r in ranks) == max(counts) - min(counts)  # what the other had
    # Without the agreement, the rank with more data is left in its next collective: it waits
    # (NCCL) or fails when the other rank leaves (gloo notices the closed connection).
    alone = _run(script, "off", timeout=30)
    assert alone is None or sorted(code for code, _, _ in alone) != [0, 0]


RELANED = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from zephon.integrations.torch import as_torch_dataset
    from integrations.test_torch_end_together import indexable

    url, rank, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    dataset = as_torch_dataset(indexable(lanes=2))
    with open(path) as f:
        dataset.load_state_dict(json.load(f))
    steps = 0
    for batch in dataset:
        dist.barrier()
        steps += 1
    print(json.dumps({{"steps": steps, "dropped": dataset.stats()["dropped_at_end"]}}))
    dist.destroy_process_group()
""").format(tests=TESTS)


def indexable(lanes: int, **kw):
    """A plan whose item counts are known (1 -> 1): its ranks end together by themselves
    (``uneven_end="carry"``), unless the job was re-laned."""
    import zephon
    from zephon.ops import batch, fetch
    from zephon.sources import RangeSource

    return zephon.Pipeline(RangeSource(203, chunk_size=8), [fetch(), batch(3)], lanes=lanes, **kw)


def test_ranks_resuming_a_relaned_job_stop_at_the_same_step(tmp_path: Path) -> None:
    import warnings

    import zephon

    loader = indexable(lanes=4, rank=0, world_size=1).iter()
    for _ in range(8):
        next(loader)
    state = loader.state_dict()
    loader.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zephon.RelaneWarning)
        counts = [
            sum(1 for _ in indexable(lanes=2, rank=r, world_size=2).iter(state=state))
            for r in range(2)
        ]
    assert counts[0] != counts[1]  # after the re-laning the lanes run to their own ends
    (tmp_path / "state.json").write_text(json.dumps(state))
    script = tmp_path / "rank.py"
    script.write_text(RELANED)
    finished = _run(script, str(tmp_path / "state.json"), timeout=120)
    assert finished is not None, "the ranks did not finish"
    assert [code for code, _, _ in finished] == [0, 0], [err[-3000:] for _, _, err in finished]
    ranks = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in finished]
    assert [r["steps"] for r in ranks] == [min(counts)] * 2
    assert sum(r["dropped"] for r in ranks) == max(counts) - min(counts)
