"""Loading a crafted state costs a bounded amount of memory: packed fields that inflate hugely, or
that declare more than the snapshot's chunks hold, are refused with ``CheckpointCorruptError``
through every way in (``load_checkpoint`` + ``pipeline.iter``, ``zephon inspect``,
``merge_states``, the torch dataset), at a peak RSS close to a valid state's. Each case runs in a
fresh process, which reports its peak as Linux counts it for the process image (``VmHWM``; its
``ru_maxrss`` would include the RSS of the test process it was forked from)."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon
from zephon.compact import MAX_UNPACKED, pack_ints, pack_json, unpack_ints, unpack_json
from zephon.errors import CheckpointCorruptError
from zephon.runtime.checkpoint.format import seal

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
BOMB_BYTES = 64 * MIB  # what a crafted field inflates to: a few times that as Python objects

# The pipeline of the states below, as the child process builds it: a shuffle whose snapshots
# (``held``) carry packed cursors, a packed state and packed open offsets.
PIPELINE = """
import zephon
from zephon.ops import batch, fetch, shuffle
from zephon.sources.memory import RangeSource

def make(n=2000):
    return zephon.Pipeline(
        RangeSource(n, chunk_size=32), [fetch(), shuffle(64, seed=1), batch(4)],
        lanes=2, epoch_chunks=16, micro_batch=16,
    )
"""
namespace: dict[str, Any] = {}
exec(PIPELINE, namespace)
make = namespace["make"]

CHILD = (
    PIPELINE
    + """
import json, sys
from zephon.errors import CheckpointCorruptError, CheckpointError
how, path = sys.argv[1:3]
try:
    if how == "load":
        make().iter(state=zephon.load_checkpoint(path)).close()
    elif how == "merge":
        zephon.merge_states([zephon.load_checkpoint(path)])
    elif how == "torch":
        from zephon.integrations.torch import as_torch_dataset
        dataset = as_torch_dataset(make())
        dataset.load_state_dict(zephon.load_checkpoint(path))
        next(iter(dataset))
        dataset.close()
    else:
        from zephon.cli import main
        if main(["inspect", path]):  # one line on stderr, as for a corrupt state
            raise CheckpointCorruptError("zephon inspect refused it")
    outcome = "accepted"
except CheckpointCorruptError as exc:
    outcome = "corrupt"
    print(exc, file=sys.stderr)
except CheckpointError as exc:
    outcome = "refused"
with open("/proc/self/status") as status:  # VmHWM: this process image's own peak, in KiB
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps({"outcome": outcome, "peak": peak}))
"""
)


def zeros_bomb(n_bytes: int, prefix: bytes = b"") -> str:
    """``prefix`` then zeros, ``n_bytes`` in all, packed like ``compact`` packs: a field of a few
    tens of KB that inflates to ``n_bytes``."""
    packer = zlib.compressobj(9)
    parts = [packer.compress(prefix)]
    block = bytes(MIB)
    parts += [packer.compress(block) for _ in range((n_bytes - len(prefix)) // MIB)]
    parts.append(packer.flush())
    return base64.b64encode(b"".join(parts)).decode("ascii")


def json_bomb(n_bytes: int) -> str:
    """Packed JSON of an object holding a list of ``n_bytes / 2`` zeros."""
    packer = zlib.compressobj(9)
    parts = [packer.compress(b'{"block": null, "next": 0, "pad": [0')]
    block = b",0" * (MIB // 2)
    parts += [packer.compress(block) for _ in range(n_bytes // MIB)]
    parts.append(packer.compress(b"]}"))
    parts.append(packer.flush())
    return base64.b64encode(b"".join(parts)).decode("ascii")


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    loader = iter(make())
    for _ in range(40):
        next(loader)
    taken = loader.state_dict()
    loader.close()
    assert taken["lane_states"][0]["held"] is not None, "the state must carry a snapshot"
    return taken


def _holder(state: dict[str, Any]) -> int:
    return next(i for i, e in enumerate(state["lane_states"][0]["held"]["ops"]) if e is not None)


def edited(state: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """``state`` with one packed field of lane 0's snapshot replaced, and sealed again."""
    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    held = body["lane_states"][0]["held"]
    if field == "open":
        held["open"] = value
    else:
        held["ops"][_holder(state)][field] = value
    return seal(body)


def peak(how: str, path: Path) -> tuple[str, int]:
    """``(outcome, peak RSS in bytes)`` of a fresh process loading ``path`` ``how``."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = json.loads(done.stdout.strip().splitlines()[-1])
    return last["outcome"], last["peak"] * 1024


BOMBS = {
    "records": lambda: zeros_bomb(BOMB_BYTES),
    "state": lambda: json_bomb(BOMB_BYTES),
    "open": lambda: zeros_bomb(BOMB_BYTES),
    # a few MB of file: past MAX_UNPACKED before it is past 32 times its length
    "records, 4 MiB": lambda: zeros_bomb(BOMB_BYTES, np.random.default_rng(0).bytes(3 * MIB)),
}


@pytest.mark.parametrize("how", ["load", "inspect", "merge"])
@pytest.mark.parametrize("field", sorted(BOMBS))
def test_a_field_that_inflates_hugely_is_refused_at_a_valid_states_memory(
    state: dict[str, Any], tmp_path: Path, field: str, how: str
) -> None:
    valid = tmp_path / "valid.json"
    zephon.save_checkpoint(valid, state)
    outcome, baseline = peak(how, valid)
    assert outcome == "accepted"
    bomb = tmp_path / "bomb.json"
    zephon.save_checkpoint(bomb, edited(state, field.split(",")[0], BOMBS[field]()))
    assert bomb.stat().st_size < 6 * MIB
    outcome, used = peak(how, bomb)
    assert outcome == "corrupt"
    assert used - baseline < 64 * MIB, f"{(used - baseline) / MIB:.0f} MiB more than a valid state"


def test_the_torch_dataset_refuses_a_crafted_state_at_a_valid_states_memory(
    state: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    valid, bomb = tmp_path / "valid.json", tmp_path / "bomb.json"
    zephon.save_checkpoint(valid, state)
    zephon.save_checkpoint(bomb, edited(state, "open", BOMBS["open"]()))
    (outcome, baseline), (refused, used) = peak("torch", valid), peak("torch", bomb)
    assert (outcome, refused) == ("accepted", "corrupt")
    assert used - baseline < 64 * MIB, f"{(used - baseline) / MIB:.0f} MiB more than a valid state"


def test_a_packed_field_inflates_to_its_bound_and_no_further() -> None:
    assert len(unpack_ints(pack_ints(range(100_000)))) == 100_000  # 800 KB, about 9 times
    with pytest.raises(ValueError, match="expands past"):
        unpack_ints(zeros_bomb(8 * MIB))
    with pytest.raises(ValueError, match="expands past"):
        unpack_json(json_bomb(8 * MIB))
    assert unpack_json(pack_json({"a": [0] * 1000})) == {"a": [0] * 1000}  # short: 64 KiB
    # Never past MAX_UNPACKED, however long the field.
    noise = np.random.default_rng(0).bytes(MAX_UNPACKED + 8)
    with pytest.raises(ValueError, match=f"expands past {MAX_UNPACKED} bytes"):
        unpack_ints(base64.b64encode(zlib.compress(noise, 1)).decode("ascii"))


def test_a_packed_field_that_is_cut_short_or_followed_by_more_is_refused() -> None:
    packed = base64.b64decode(pack_ints([1, 2, 3]))
    for bad in (packed[:-3], packed + b"more"):
        with pytest.raises(ValueError, match="not packed integers"):
            unpack_ints(base64.b64encode(bad).decode("ascii"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("open", [6, 2**40], "offset past the 32 samples"),
        ("open", [6, 3, 6, 3], "offset twice"),
        ("records", [6, 2**40, 0], "names offset 1099511627776 of chunk"),
        ("records", [6, 3, 2**40], "ends inside a cursor"),
    ],
)
def test_a_snapshot_naming_more_than_its_chunks_hold_is_refused(
    state: dict[str, Any], field: str, value: list[int], message: str
) -> None:
    lane = state["lane_states"][0]
    chunk = unpack_ints(lane["held"]["open"])[0] if field == "open" else None
    if chunk is not None:  # a chunk of the snapshot, so that only the offsets are wrong
        value = [int(chunk) if i % 2 == 0 else v for i, v in enumerate(value)]
    else:
        value = [int(unpack_ints(lane["held"]["ops"][_holder(state)]["records"])[0]), *value[1:]]
    with pytest.raises(CheckpointCorruptError, match=message):
        make().iter(state=edited(state, field, pack_ints(value)))
