"""The sides the pipeline ratios time (``zephon.bench.pipeline.ratio_sides``) do the same work."""

from __future__ import annotations

import pytest

from zephon.bench import pipeline as pb


def test_every_side_delivers_the_same_batches_of_the_same_records():
    n = 1000  # not a multiple of the batch size: the last batch is short on every side
    sides = pb.ratio_sides(n)
    trivial = list(sides["trivial"]())
    bare = list(sides["bare"]())
    assert [b.payload for b in trivial] == bare == [32] * (n // 32) + [n % 32]
    default = [b.payload for b in sides["default"]()]
    bare_default = list(sides["bare_default"]())
    assert len(default) == len(bare_default) == len(bare)
    for ours, theirs in zip(default, bare_default, strict=True):
        assert ours.keys() == theirs.keys() == {"idx", "square"}
        assert (ours["idx"] == theirs["idx"]).all() and (ours["square"] == theirs["square"]).all()


def test_run_side_names_a_side_it_does_not_know():
    with pytest.raises(KeyError):
        pb.run_side("no such side", 10)
