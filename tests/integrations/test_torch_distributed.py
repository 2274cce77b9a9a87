"""Two ranks as real processes under torch.distributed (gloo, CPU): each takes its rank from the
initialized process group, and together they cover the dataset exactly once (or, by default,
end at the same global step)."""

from __future__ import annotations

import json
import textwrap

import pytest
from net_kit import run_ranks

pytest.importorskip("torch.distributed")

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    import zephon
    from zephon.ops import batch, fetch
    from zephon.sources import RangeSource

    dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    source = RangeSource(500, chunk_size=16, shuffle=True, seed=2)
    pipeline = zephon.Pipeline(source, [fetch(), batch(8)], lanes=2, uneven_end="allow")
    plan = pipeline.compile()
    seen = [r.payload["idx"] for b in pipeline for r in b]
    even = len(list(zephon.Pipeline(source, [fetch(), batch(8)], lanes=2)))  # the default
    print(json.dumps({"rank": plan.rank, "world": plan.world_size, "seen": seen, "even": even}))
    dist.barrier()
    dist.destroy_process_group()
""")


def test_two_torch_ranks_split_the_dataset_disjointly_and_completely(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(WORKER)
    done = run_ranks(script, 2, timeout=120)
    assert [code for code, _, _ in done] == [0, 0], [err[-3000:] for _, _, err in done]
    results = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]
    assert sorted((r["rank"], r["world"]) for r in results) == [(0, 2), (1, 2)]
    a, b = (set(r["seen"]) for r in results)
    assert not a & b
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(500))
    # one chunk holds 4 samples: by default the rank with the full lane stops with the other
    assert [len(r["seen"]) for r in results] != [r["even"] * 8 for r in results]
    assert results[0]["even"] == results[1]["even"] == min(-(-len(r["seen"]) // 8) for r in results)
