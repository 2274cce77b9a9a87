"""Lanes on Ray actors (``workers="ray"``) on a real local Ray cluster (``ray_cluster``): the text,
mixture and fine-tuning pipelines deliver the inline stream and resume across kinds; an actor
killed mid-run is named with its lane, actor id and node, and the last state resumes exactly; a
SIGKILLed training process resumes exactly; after ``close()`` and after garbage collection no
actor of ours is alive. Checked without Ray: ``ray_options`` is validated when planning, and
``import zephon`` never imports Ray."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from chat_kit import OURS, bpe
from pipeline_kit import fingerprint_item, run
from text_pipelines_kit import mixture_pipeline, text_pipeline
from worker_kit import finishes_within, script_env, wait_until

import zephon
from zephon.errors import (
    OperatorError,
    PipelineChangeWarning,
    PlanError,
    RelaneWarning,
    WorkerLostError,
    ZephonError,
)
from zephon.ops import (
    batch,
    fetch,
    filter_records,
    pack_sequences,
    tokenize_chat,
    training_collate,
)
from zephon.ops.basic import map_transform
from zephon.ops.shuffle import shuffle
from zephon.runtime.workers.kinds import open_lanes
from zephon.runtime.workers.ray_lanes import RayLane
from zephon.runtime.workers.stopping import close_lanes
from zephon.sources import JsonlSource, MixtureSource
from zephon.sources.memory import RangeSource

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

#: Generous: an actor's start (a fresh Python importing zephon) on a busy 2-core machine.
DEADLINE = 60.0


def text(**kw: Any) -> zephon.Pipeline:
    return text_pipeline(240, **{"lanes": 2, **kw})


def mixture(**kw: Any) -> zephon.Pipeline:
    return mixture_pipeline(160, lanes=2, **kw)


def _chats(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    words = ["hello", "world", "how", "are", "you", "fine", "thanks", "quick", "fox"]

    def say() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, 10)))

    with path.open("w") as f:
        for _ in range(n):
            turns = [{"role": r, "content": say()} for _ in range(2) for r in ("user", "assistant")]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def sft(tmp: Path, **kw: Any) -> zephon.Pipeline:
    source = MixtureSource(
        {
            "short": JsonlSource(_chats(tmp / "short.jsonl", 40, 1), dataset_id=1, chunk_size=8),
            "long": JsonlSource(_chats(tmp / "long.jsonl", 40, 2), dataset_id=2, chunk_size=8),
        },
        {"short": 0.6, "long": 0.4},
        chunk_size=10,
        seed=3,
    )
    ops = [
        fetch(),
        tokenize_chat(bpe(), template=OURS, max_len=40, split_long_samples=True),
        pack_sequences(32, open_bins=4, extra_fields={"loss_mask": 0}),
        batch(3, collate=training_collate()),
    ]
    return zephon.Pipeline(source, ops, lanes=2, epoch_chunks=2, micro_batch=4, **kw)


def stream(loader: zephon.Loader) -> list[tuple]:
    with loader:
        return run(loader)


def actor_states() -> dict[str, str]:
    """The state of every Ray lane's actor (of any driver) by id, as Ray's control store knows
    it: ``ALIVE``, ``DEAD``, or on its way (placed, started)."""
    import ray._private.state as ray_state

    return {
        actor_id: actor["State"]
        for actor_id, actor in ray_state.actors().items()
        if actor["ActorClassName"] == "LaneActor"
    }


def our_actors(*, dead_too: bool = False) -> list[str]:
    """Ids of the Ray lanes' actors not dead yet (``dead_too``: all of them)."""
    return [a for a, state in actor_states().items() if dead_too or state != "DEAD"]


def lanes_of(loader: zephon.Loader) -> list[Any]:
    return [lane.feed.runner for lane in loader.lanes]


@pytest.mark.parametrize("name", ["text", "mixture", "sft"])
def test_ray_lanes_deliver_the_inline_stream_and_resume_across_kinds(name, ray_cluster, tmp_path):
    make = {"text": text, "mixture": mixture, "sft": lambda **kw: sft(tmp_path, **kw)}[name]
    full = stream(iter(make()))
    assert len(full) > 10
    assert stream(iter(make(workers="ray"))) == full
    # A state taken on Ray lanes is an ordinary one: inline lanes continue it, and Ray lanes
    # continue an inline state.
    step = len(full) // 3
    loader = iter(make(workers="ray"))
    head = run(loader, step)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert head + stream(make().iter(state=state)) == full
    inline = iter(make())
    head = run(inline, step + 1)
    state = json.loads(json.dumps(inline.state_dict()))
    inline.close()
    assert head + stream(make(workers="ray").iter(state=state)) == full


def _job_state(workers: str) -> tuple[dict, list[list[tuple]]]:
    """Two ranks of 2 lanes each (one after the other), 3 global steps each: the merged job state
    and what each rank delivered."""
    states, heads = [], []
    for rank in range(2):
        loader = iter(text(lanes=4, rank=rank, world_size=2, workers=workers))
        heads.append(run(loader, 6))
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    return zephon.merge_states(states), heads


def test_rank_states_on_ray_lanes_merge_resume_on_one_rank_and_relane(ray_cluster):
    on_ray, ray_heads = _job_state("ray")
    inline, inline_heads = _job_state("inline")
    assert ray_heads == inline_heads
    rest = stream(text(lanes=4).iter(state=inline))
    assert rest
    assert stream(text(lanes=4).iter(state=on_ray)) == rest
    assert stream(text(lanes=4, workers="ray").iter(state=on_ray)) == rest
    with pytest.warns(RelaneWarning):
        relaned = stream(text(lanes=3).iter(state=on_ray))
    with pytest.warns(RelaneWarning):
        assert stream(text(lanes=3, workers="ray").iter(state=on_ray)) == relaned


def test_a_killed_actor_is_named_and_the_last_state_resumes_exactly(ray_cluster):
    import ray

    full = stream(iter(text()))
    loader = iter(text(workers="ray", timeout=DEADLINE))
    head = run(loader, 5)
    state = json.loads(json.dumps(loader.state_dict()))
    victim = lanes_of(loader)[1]
    node = ray._private.state.actors(victim.actor_id)["Address"]["NodeID"]
    ray.kill(victim.actor)
    with finishes_within(DEADLINE), pytest.raises(WorkerLostError) as caught:
        while True:
            next(loader)
    message = str(caught.value)
    assert f"lane {victim.lane_id}" in message and victim.actor_id in message
    assert f"on node {node}" in message and "ray.kill" in message
    loader.close()
    assert head + stream(text().iter(state=state)) == full
    assert head + stream(text(workers="ray").iter(state=state)) == full


def with_block(payload: dict) -> dict:
    """64 KiB of float32 per record (an item list of 16 is far more than Ray copies inline), and
    a warning at record 3."""
    if payload["idx"] == 3:
        warnings.warn("record 3 carries an odd block", UserWarning, stacklevel=1)
    return {**payload, "block": np.full(16384, payload["idx"], dtype=np.float32)}


def blocks(workers: str) -> zephon.Pipeline:
    ops = [fetch(), map_transform(with_block)]
    return zephon.Pipeline(RangeSource(64, chunk_size=16), ops, lanes=2, workers=workers)


def test_arrays_come_from_the_object_store_and_warnings_reach_the_training_process(ray_cluster):
    with pytest.warns(UserWarning, match="record 3 carries an odd block"):
        inline = stream(iter(blocks("inline")))
    with (
        pytest.warns(UserWarning, match="record 3 carries an odd block"),
        iter(blocks("ray")) as loader,
    ):
        records = list(loader)
    assert [fingerprint_item(r) for r in records] == inline
    # Mapped from Ray's shared memory rather than copied: read-only.
    assert not any(r.payload["block"].flags.writeable for r in records)


def test_ray_lanes_ask_ahead_only_what_max_inflight_bytes_allows(ray_cluster):
    # Each item list holds 16 records of 64 KiB: a bound of 1.5 lists lets two calls be
    # outstanding (the second once the first is below the bound) where prefetch would allow
    # three; the stream is the inline one all the same.
    one_list = 16 * 65536
    with pytest.warns(UserWarning, match="record 3"):
        inline = stream(iter(blocks("inline")))
    ops = [fetch(), map_transform(with_block)]
    pipeline = zephon.Pipeline(
        RangeSource(64, chunk_size=16),
        ops,
        lanes=2,
        workers="ray",
        prefetch=3,
        max_inflight_bytes=3 * one_list // 2,
    )
    with pytest.warns(UserWarning, match="record 3"), iter(pipeline) as loader:
        got = [fingerprint_item(next(loader))]
        lanes = lanes_of(loader)
        ahead = []
        for record in loader:
            got.append(fingerprint_item(record))
            ahead += [lane.queued_bytes() for lane in lanes]
    assert got == inline
    assert max(ahead) == 2 * one_list  # never the three lists prefetch alone allows


def explode_on_13(payload: dict) -> dict:
    if payload["idx"] == 13:
        raise ValueError("thirteen")
    return payload


def test_an_operator_error_on_a_ray_lane_is_the_one_inline_lanes_raise(ray_cluster):
    def error(workers: str) -> OperatorError:
        ops = [fetch(), map_transform(explode_on_13)]
        pipeline = zephon.Pipeline(RangeSource(40, chunk_size=8), ops, lanes=2, workers=workers)
        with pytest.raises(OperatorError) as caught, iter(pipeline) as loader:
            list(loader)
        return caught.value

    inline, on_ray = error("inline"), error("ray")
    assert "explode_on_13" in str(on_ray) and "thirteen" in str(on_ray)
    assert (str(on_ray), on_ray.operator, on_ray.cursor) == (
        str(inline),
        inline.operator,
        inline.cursor,
    )


class LoggedTokens:
    """Tokens made of a record's idx; each read logged with the reading process's pid."""

    def __init__(self, log: str):
        self.log = log

    def __call__(self, payload: dict) -> dict:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {payload['idx']}\n")
        idx = payload["idx"]
        return {"tokens": np.arange(idx, idx + 1 + idx * 7919 % 97, dtype=np.int32)}


def packed(log: str, **kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        map_transform(LoggedTokens(log)),
        pack_sequences(128, open_bins=8, pad_id=0),
        batch(4),
    ]
    source = RangeSource(600, chunk_size=64, shuffle=True, seed=5)
    return zephon.Pipeline(source, ops, lanes=2, epoch_chunks=4, **kw)


def reads(log: Path) -> list[tuple[int, int]]:
    """(pid, idx) of every read ``LoggedTokens`` logged, in order."""
    pairs = [line.split() for line in log.read_text().splitlines()]
    return [(int(pid), int(idx)) for pid, idx in pairs]


def test_the_loader_reads_the_first_lane_while_the_actors_start(ray_cluster, tmp_path):
    full = stream(iter(packed(str(tmp_path / "inline.log"))))
    log = tmp_path / "ray.log"
    assert stream(iter(packed(str(log), workers="ray"))) == full
    read = reads(log)
    assert len(read) == len({idx for _, idx in read}) == 600, "no sample was read twice"
    readers = [pid for pid, _ in read]
    assert readers[0] == os.getpid(), "the training process read the first lane's first samples"
    assert len(set(readers) - {os.getpid()}) == 2, "both lanes' actors read the rest"
    # With a timeout nothing could interrupt an operator stuck in the loader's thread: the
    # actors read everything.
    log = tmp_path / "timeout.log"
    assert stream(iter(packed(str(log), workers="ray", timeout=DEADLINE))) == full
    assert os.getpid() not in {pid for pid, _ in reads(log)}


def test_close_and_garbage_collection_leave_no_actor_of_ours_alive(ray_cluster):
    # With a timeout the actors read from the start (without, the training process may read
    # these few samples itself before any actor could).
    loader = iter(text(workers="ray", timeout=DEADLINE))
    next(loader)
    ids = [lane.actor_id for lane in lanes_of(loader)]
    assert set(ids) <= set(our_actors())
    loader.close()
    assert wait_until(lambda: not set(ids) & set(our_actors()), DEADLINE)
    with pytest.raises(ZephonError, match="closed"):
        next(loader)

    loader = iter(text(workers="ray", timeout=DEADLINE))
    next(loader)
    ids = [lane.actor_id for lane in lanes_of(loader)]
    del loader
    gc.collect()
    assert wait_until(lambda: not set(ids) & set(our_actors()), DEADLINE)


def test_an_actor_without_room_on_the_cluster_times_out_saying_so(ray_cluster):
    pipeline = text(workers="ray", timeout=3.0, ray_options={"resources": {"no-such-thing": 1}})
    before = set(our_actors(dead_too=True))
    with finishes_within(DEADLINE), pytest.raises(ZephonError, match="not started yet"):
        stream(iter(pipeline))
    ids = set(our_actors(dead_too=True)) - before
    assert len(ids) == 2
    assert wait_until(lambda: not set(ids) & set(our_actors()), DEADLINE)


class StallOnZero:
    """Record 0 (lane 0's first) waits for the file ``release``, which no one creates."""

    def __init__(self, release: str):
        self.release = release

    def __call__(self, payload: dict) -> dict:
        if payload["idx"] == 0:
            wait_until(lambda: os.path.exists(self.release), 10 * DEADLINE)
        return payload


def test_an_actor_stuck_in_an_operator_times_out_and_close_ends_it(ray_cluster, tmp_path):
    ops = [fetch(), map_transform(StallOnZero(str(tmp_path / "release")))]
    pipeline = zephon.Pipeline(RangeSource(64, chunk_size=8), ops, lanes=2, workers="ray")
    pipeline.timeout = 2.0
    plan = pipeline.compile()
    lanes = open_lanes(plan, [(lane, {}) for lane in plan.rank_lanes])
    assert all(isinstance(lane, RayLane) for lane in lanes)
    ids = {cast(RayLane, lane).actor_id for lane in lanes}
    try:
        # Started (the timeout also covers an actor's start: that case is the no-room test's).
        assert wait_until(lambda: all(actor_states().get(a) == "ALIVE" for a in ids), DEADLINE)
        with finishes_within(DEADLINE), pytest.raises(ZephonError) as caught:
            next(lanes[0])
    finally:
        with finishes_within(DEADLINE):
            close_lanes(lanes)  # the stuck actor does not stop when asked: it is killed
    message = str(caught.value)
    assert "produced nothing for 2 s, the pipeline's timeout" in message
    assert f"lane 0 (Ray actor {cast(RayLane, lanes[0]).actor_id} on node " in message
    assert wait_until(lambda: not ids & set(our_actors()), DEADLINE)


CRASH_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    import ray
    import zephon
    from pipeline_kit import fingerprint_item
    from test_ray_lanes import text

    out_dir = sys.argv[1]
    ray.init(address={address!r}, log_to_driver=False)
    # A timeout has the actors read from the start: they are busy when the process is killed.
    loader = iter(text(workers="ray", timeout=60.0))
    with open(os.path.join(out_dir, "delivered.txt"), "w") as log:
        for step, item in enumerate(loader, 1):
            log.write(repr(fingerprint_item(item)) + "\\n")
            if step % 4 == 0:  # the step inside the checkpoint: one atomic write
                log.flush()
                zephon.save_checkpoint(
                    os.path.join(out_dir, "ckpt.json"),
                    {{"step": step, "loader": loader.state_dict()}},
                )
            if step == 14:
                ids = [lane.feed.runner.actor_id for lane in loader.lanes]
                tmp = os.path.join(out_dir, "actors.tmp")
                with open(tmp, "w") as f:
                    json.dump(ids, f)
                os.replace(tmp, os.path.join(out_dir, "actors.json"))
                threading.Event().wait(600)  # killed here, mid-run, its actors busy ahead
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL")
def test_a_sigkilled_training_process_resumes_exactly_and_its_actors_end(ray_cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CRASH_SCRIPT.format(here=os.path.dirname(__file__), address=ray_cluster))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=script_env())
    try:
        ready = tmp_path / "actors.json"
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 2 * DEADLINE)
        assert proc.poll() is None, "the training script died early"
        ids = json.loads(ready.read_text())
        assert set(ids) <= set(our_actors())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: not set(ids) & set(our_actors()), DEADLINE), (
        "the actors outlived the killed training process"
    )
    saved = zephon.load_checkpoint(tmp_path / "ckpt.json")
    step, state = saved["step"], saved["loader"]
    logged = (tmp_path / "delivered.txt").read_text().splitlines()[:step]
    full = [repr(x) for x in stream(iter(text()))]
    assert logged + [repr(x) for x in stream(text(workers="ray").iter(state=state))] == full


SHUTDOWN_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    import ray
    import zephon
    from test_ray_lanes import stream, text

    full = stream(iter(text()))
    ray.init(address={address!r}, log_to_driver=False)
    loader = iter(text(workers="ray", timeout=60.0))
    delivered = 0
    for _ in range(3):
        next(loader)
        delivered += 1
    ray.shutdown()  # the actors this process started end with its connection
    try:
        while True:  # what the lanes had taken over before goes on, then a lane says why not
            next(loader)
            delivered += 1
    except zephon.errors.WorkerLostError as exc:
        print("raised:", exc)
    print("initialized:", ray.is_initialized())
    loader.close()
    rest = stream(text().iter(state=loader.state_dict()))
    print("resumes:", rest == full[delivered:] and len(rest) > 0)
""")


def run_script(script: Path) -> subprocess.CompletedProcess:
    """Run a training script that connects to the module's cluster; it must exit cleanly."""
    out = subprocess.run(
        [sys.executable, str(script)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=2 * DEADLINE,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_a_loader_whose_process_left_ray_says_so_and_starts_no_cluster(ray_cluster, tmp_path):
    # ray.shutdown() while a loader still runs: Ray's own get would start a new local cluster
    # and then fail on an object of the old one, naming neither the lane nor what to do.
    script = tmp_path / "left.py"
    script.write_text(SHUTDOWN_SCRIPT.format(here=os.path.dirname(__file__), address=ray_cluster))
    out = run_script(script)
    assert re.search(r"raised: lane [01] \(Ray actor \w+\) cannot go on", out.stdout)
    assert "disconnected from Ray (ray.shutdown())" in out.stdout
    assert "initialized: False" in out.stdout
    assert "resumes: True" in out.stdout


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_cpu": 1}, r"unknown key\(s\) 'num_cpu': it accepts num_cpus"),
        ({"num_cpus": -1}, r"ray_options\['num_cpus'\] must be a number of CPUs >= 0"),
        ({"resources": {"GPU": "one"}}, r"ray_options\['resources'\] must be a mapping"),
        ({"scheduling_strategy": "PACK"}, r"'scheduling_strategy'\] must be one of"),
        ({"runtime_env": "env"}, r"ray_options\['runtime_env'\] must be a mapping"),
        ({"memory": 0}, r"Pipeline: ray_options\['memory'\] must be >= 1, got 0"),
    ],
)
def test_ray_options_are_checked_when_planning(options, message):
    with pytest.raises(PlanError, match=message):
        text(workers="ray", ray_options=options).compile()


def test_ray_options_need_ray_lanes_and_stay_out_of_the_fingerprint():
    with pytest.raises(PlanError, match="workers='ray' only, got workers='process'"):
        text(workers="process", ray_options={"num_cpus": 1}).compile()
    placed = text(workers="ray", ray_options={"num_cpus": 0.5, "scheduling_strategy": "SPREAD"})
    assert placed.compile().ray_options == {"num_cpus": 0.5, "scheduling_strategy": "SPREAD"}
    assert placed.fingerprint == text().fingerprint
    assert "Ray actor placed with {'num_cpus': 0.5" in placed.compile().describe()


def test_importing_zephon_never_imports_ray():
    code = "import sys, zephon; zephon.Pipeline; print('ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=script_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def _small_or_odd(payload: dict) -> bool:
    return payload["idx"] % 2 == 1 or payload["idx"] < 40


def _large_or_odd(payload: dict) -> bool:
    return payload["idx"] % 2 == 1 or payload["idx"] >= 40


def _filtered_and_shuffled(keep: Any, **kw: Any) -> zephon.Pipeline:
    ops = [fetch(), filter_records(keep), shuffle(7, seed=4), batch(3)]
    return zephon.Pipeline(RangeSource(240, chunk_size=6), ops, lanes=2, epoch_chunks=4, **kw)


def test_a_change_resumed_by_position_on_ray_lanes_is_the_inline_stream(ray_cluster):
    # behind a shuffle, a new filter restarts each lane's epoch with what it consumed taken
    # out at fetch: the actors do it as the lanes of the training process do
    loader = iter(_filtered_and_shuffled(_small_or_odd))
    run(loader, 5)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    streams = []
    for workers in ("inline", "ray"):
        with pytest.warns(PipelineChangeWarning):
            changed = _filtered_and_shuffled(_large_or_odd, workers=workers)
            streams.append(stream(changed.iter(state=state, allow_changes=True)))
    assert streams[0] == streams[1] and streams[0]


class _Guarded:
    """A map function that opened a lock in ``__init__``: no pickler can carry it to an actor."""

    def __init__(self) -> None:
        self.guard = threading.Lock()

    def __call__(self, payload: dict) -> dict:
        return payload

    def describe(self) -> dict:
        return {"guarded": True}


def test_a_pipeline_ray_cannot_serialize_is_refused_naming_the_operator_and_attribute(
    ray_cluster,
):
    ops = [fetch(), map_transform(_Guarded()), batch(4)]
    pipeline = zephon.Pipeline(RangeSource(40, chunk_size=8), ops, lanes=2, workers="ray")
    with pytest.raises(PlanError) as refused, pipeline.iter() as loader:
        next(loader)
    message = str(refused.value)
    assert "operator 'map_transform(_Guarded)' (#1), in its attribute fn.guard," in message
    assert "cannot pickle '_thread.lock' object" in message
    assert len(message) < 600, "Ray's dump of the whole plan is left out"
    assert not our_actors()


MAIN_SCRIPT = textwrap.dedent("""
    import sys, warnings
    import numpy as np
    import ray
    import zephon
    from zephon.ops import batch, fetch, map_transform
    from zephon.ops.base import Operator, OpTraits
    from zephon.sources.memory import RangeSource


    class Doubled(Operator):
        # defined in the driver script: Ray carries it by value, as cloudpickle does
        traits = OpTraits(preserves_cursor_order=True)

        def __init__(self):
            self.table = np.arange(100) * 2

        def process_many(self, records):
            out = []
            for rec in records:
                out.append(rec.with_payload(int(self.table[rec.payload["idx"]])))
            return out


    def odd_row(payload):
        if payload == 14:
            warnings.warn("row 14 looks odd", UserWarning)
        return payload


    def rows(workers):
        ops = [fetch(), Doubled(), map_transform(odd_row), batch(4)]
        pipeline = zephon.Pipeline(
            RangeSource(40, chunk_size=8), ops, lanes=2, workers=workers, timeout=60.0
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pipeline.iter() as loader:
                got = [np.asarray(b.payload).tolist() for b in loader]
        return got, [w.category.__name__ + ": " + str(w.message) for w in caught]


    if __name__ == "__main__":
        ray.init(address={address!r}, log_to_driver=False)
        inline, on_ray = rows("inline"), rows("ray")
        print("same rows:", inline[0] == on_ray[0])
        print("inline warned:", inline[1])
        print("ray warned:", on_ray[1])
""")


def test_operators_of_the_driver_script_run_on_ray_and_their_warnings_arrive(ray_cluster, tmp_path):
    # The actors' ``__main__`` is Ray's worker, not the script: a warning raised by an operator
    # of the script still reaches the script's filters, as it does from process lanes.
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT.format(address=ray_cluster))
    out = run_script(script)
    assert "same rows: True" in out.stdout
    assert "inline warned: ['UserWarning: row 14 looks odd']" in out.stdout
    assert "ray warned: ['UserWarning: row 14 looks odd']" in out.stdout, out.stdout


RAISING_SCRIPT = textwrap.dedent("""
    import ray
    import zephon
    from zephon.ops import fetch
    from zephon.ops.base import Operator, OpTraits
    from zephon.sources.memory import RangeSource


    class NoShard(zephon.ZephonError):
        # the training script's own error, which it catches by its class (a ZephonError of its
        # own reaches the loop as itself; others come inside an OperatorError naming the operator)
        pass


    class ShardGone(zephon.ZephonError):
        def __init__(self, shard, why):
            super().__init__(f"shard {{shard}}: {{why}}")


    class OpensShards(Operator):
        traits = OpTraits(preserves_cursor_order=True)

        def __init__(self, error):
            self.error = error

        def start_epoch(self, lane_id, epoch):
            super().start_epoch(lane_id, epoch)
            if lane_id == 1:
                raise self.error(7, "gone") if self.error is ShardGone else self.error("shard 7")

        def process_many(self, records):
            return records


    def outcome(workers, error):
        pipeline = zephon.Pipeline(
            RangeSource(40, chunk_size=8), [fetch(), OpensShards(error)], lanes=2,
            workers=workers, timeout=60.0,
        )
        try:
            with pipeline.iter() as loader:
                list(loader)
        except NoShard as exc:
            return "caught NoShard: " + str(exc)
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc).splitlines()[0]


    if __name__ == "__main__":
        ray.init(address={address!r}, log_to_driver=False)
        for error in (NoShard, ShardGone):
            print(error.__name__, "inline:", outcome("inline", error))
            print(error.__name__, "ray:", outcome("ray", error))
""")


def test_an_error_class_of_the_driver_script_comes_back_from_ray_as_itself(ray_cluster, tmp_path):
    # An actor's ``__main__`` is Ray's worker: the script's error classes travel by value, and
    # an error that cannot be rebuilt in the training process still says what it was.
    script = tmp_path / "train.py"
    script.write_text(RAISING_SCRIPT.format(address=ray_cluster))
    out = run_script(script)
    assert "NoShard inline: caught NoShard: shard 7" in out.stdout
    assert "NoShard ray: caught NoShard: shard 7" in out.stdout, out.stdout
    assert "ShardGone inline: ShardGone: shard 7: gone" in out.stdout
    assert "ShardGone ray: ZephonError: ShardGone: shard 7: gone (unpicklable: " in out.stdout


FORKED_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os, sys
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    import ray
    import zephon
    from test_ray_lanes import text


    def read(out):
        # a torch DataLoader worker's life: forked from the training process, daemonic
        try:
            out.send("delivered %d" % sum(1 for _ in text(workers="ray")))
        except Exception as exc:
            out.send(type(exc).__name__ + ": " + str(exc))


    if __name__ == "__main__":
        ray.init(address={address!r}, log_to_driver=False)
        ours, theirs = mp.Pipe()
        child = mp.get_context("fork").Process(target=read, args=(theirs,), daemon=True)
        child.start()
        print("child:", ours.recv() if ours.poll(60) else "no answer", flush=True)
        child.join(5)
        if child.is_alive():
            child.kill()
        print("parent connected:", ray.is_initialized(), flush=True)
""")


def test_ray_lanes_in_a_process_forked_from_a_connected_one_are_refused(ray_cluster, tmp_path):
    # Ray's connection does not survive a fork (a torch DataLoader worker of a training process
    # that called ray.init): using it there crashed the training process and hung the worker.
    script = tmp_path / "train.py"
    script.write_text(FORKED_SCRIPT.format(here=os.path.dirname(__file__), address=ray_cluster))
    out_path = tmp_path / "out.txt"
    with out_path.open("w") as out:  # a file, not a pipe: a hung grandchild never holds it up
        done = subprocess.run(
            [sys.executable, str(script)],
            env=script_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=2 * DEADLINE,
        )
    printed = out_path.read_text()
    assert done.returncode == 0, printed[-2000:]
    assert "child: PlanError: workers='ray' cannot run in process " in printed, printed[-2000:]
    assert "forked from a process connected to Ray" in printed
    assert "parent connected: True" in printed
