"""The record model and children helpers work through their public import paths from outside
the repository.

The script below is written to a temporary directory and run there with the same interpreter, so
``import zephon`` resolves to the installed package (an editable install in development), never to
the checkout on ``sys.path`` by accident.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import pickle

    import numpy as np

    from zephon.types import (
        ContributorRef,
        SampleBatch,
        SampleCursor,
        SampleMeta,
        SampleRecord,
        WorkChunk,
    )
    from zephon.ops.children import pack_meta, spawn_child, tombstone_meta, tombstones_for_record

    # SampleCursor
    root = SampleCursor(7, 2, (0, 5, 42))
    child = root.child(1)
    assert child == SampleCursor(7, 2, (0, 5, 42), lineage=(1,))
    assert repr(child) == "SampleCursor(7, 2, (0, 5, 42), lineage=(1,))"
    assert child.base_offset == (7, 2)
    assert child.sort_key == (7, 2, (1,), (0, 5, 42))
    assert child.sample_id == (0, 5, 42) and child.lineage == (1,)
    assert root < root.child(0) < root.child(0).child(0) < child
    assert hash(child) == hash(SampleCursor(7, 2, (0, 5, 42), (1,)))
    assert pickle.loads(pickle.dumps(child)) == child
    assert (child == (7, 2, (0, 5, 42), (1,))) is False
    for bad, field in (((-1, 0, (0, 0, 0)), "chunk_id"), ((0, 0, (0, 0)), "sample_id")):
        try:
            SampleCursor(*bad)
        except (TypeError, ValueError) as exc:
            assert field in str(exc), exc
        else:
            raise AssertionError(f"{bad} was accepted")
    try:
        child < 3
    except TypeError:
        pass
    else:
        raise AssertionError("ordering against an int did not raise")

    # ContributorRef and SampleMeta
    ref = ContributorRef(child, True)
    assert ref == ContributorRef(child, True) and hash(ref) == hash(ContributorRef(child, True))
    assert ref.base_offset == (7, 2)
    meta = SampleMeta(root, lane_id=1, component="web")
    assert meta.contributors is None
    assert meta.contribution_refs() == (ContributorRef(root, True),)
    try:
        meta.lane_id = 2
    except AttributeError:
        pass
    else:
        raise AssertionError("SampleMeta is mutable")

    # SampleRecord and SampleBatch
    record = SampleRecord(meta, {"text": "hello"})
    assert record.cursor == root and not record.is_tombstone
    assert record.contribution_refs() == meta.contribution_refs()
    batch = SampleBatch([record, SampleRecord(SampleMeta(child), {"text": "x"})], {"text": []})
    assert len(batch) == 2 and [r.cursor for r in batch] == [root, child]
    assert isinstance(batch.records, tuple)

    # WorkChunk
    chunk = WorkChunk(3, np.array([[0, 5, 42]], dtype=np.int64))
    assert chunk.position == 3 and len(chunk) == 1 and chunk.pointers.dtype == np.int64

    # children helpers
    kids = [spawn_child(meta, i, is_last_child=i == 2, tags={"split"}) for i in range(3)]
    assert [k.cursor.lineage for k in kids] == [(0,), (1,), (2,)]
    assert [k.contribution_refs()[0].is_last_child for k in kids] == [False, False, True]
    assert all(k.lane_id == 1 and k.component == "web" and "split" in k.tags for k in kids)
    other = SampleMeta(SampleCursor(7, 3, (0, 5, 43)).child(0))
    packed = pack_meta(
        kids[2].cursor.child(0),
        [*kids[2].contribution_refs(), *other.contribution_refs()],
        lane_id=1,
        component_sample_counts={"web": 2},
    )
    assert [r.base_offset for r in packed.contribution_refs()] == [(7, 2), (7, 3)]
    assert packed.component_sample_counts == {"web": 2}
    split_packed = [spawn_child(packed, i, is_last_child=i == 1) for i in range(2)]
    assert not any(r.is_last_child for r in split_packed[0].contribution_refs())
    assert all(r.is_last_child for r in split_packed[1].contribution_refs())
    tomb = tombstone_meta(ContributorRef(SampleCursor(10, 5, (0, 0, 0)), True), 1)
    assert tomb.is_tombstone and tomb.cursor.base_offset == (10, 5)
    tombs = tombstones_for_record(SampleRecord(packed, {"tokens": []}))
    assert [t.cursor.base_offset for t in tombs] == [(7, 2), (7, 3)]
    assert all(t.payload is None and t.is_tombstone for t in tombs)
    assert tombstones_for_record(SampleRecord(kids[0], "x")) == []

    import zephon
    print(zephon.__file__)
    """
)


def test_public_api_works_from_outside_the_repository(tmp_path: Path):
    assert not tmp_path.resolve().is_relative_to(REPO), "tmp_path must be outside the checkout"
    script = tmp_path / "use_zephon.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    imported_from = Path(result.stdout.strip().splitlines()[-1]).resolve()
    assert not imported_from.is_relative_to(tmp_path.resolve())
