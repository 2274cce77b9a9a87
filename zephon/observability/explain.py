"""The loader's bottleneck named in words, from what its counters measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zephon.observability.sources import stats_source

_SHARE_SLACK = 0.02  # a component this far from its target share is called out
# Of the training loop's recent time, the share spent waiting in next() below which the loader
# keeps up, and from which it is what the training loop waits for.
_KEEPS_UP = 0.05
_BOTTLENECK = 0.25


def explain(source: Any, *, workers: str | None = None, prefetch: int | None = None) -> str:
    """Where the time goes and what to change, for a ``Loader``, the torch dataset (or a
    DataLoader around it) or a ``stats()`` dict: whether the loader is the bottleneck at all (how
    long the training loop waited inside ``next()`` over its latest steps), the operator that
    takes most of the lanes' busy time and its share, whether the lanes are ahead of the
    training loop (their prefetched item lists ready) or behind it (nothing ready), and what to
    do; how full the packers' rows are; with the numbers behind each sentence."""
    if isinstance(source, Mapping):
        stats = source
    else:
        read = stats_source(source)  # a DataLoader's dataset's, too
        stats = read.read()
        workers = workers or getattr(read.plan, "workers", None)
        prefetch = prefetch or getattr(read.plan, "prefetch", None)
    verdict = _trainer(stats)
    lines = [verdict[1], _operators(stats), _lanes(stats, workers, prefetch, verdict[0])]
    lines += _packing(stats)
    lines += _mixture(stats)
    for key, what in (
        ("violations", "tolerated contract violations"),
        ("skipped", "records skipped on errors"),
    ):
        if stats.get(key):
            lines.append(f"{stats[key]} {what} so far (see stats()).")
    return "\n".join(line for line in lines if line)


def _trainer(stats: Mapping[str, Any]) -> tuple[str | None, str]:
    """Whether the training loop waits for the loader (``"keeps up"``, ``"mostly"``,
    ``"bottleneck"``; None before a step was measured) and the sentence that says so, from its
    waits over the latest steps against its own time per step (outside ``next()``) over the
    run."""
    waits = stats.get("trainer_wait") or {}
    steps, recent = waits.get("steps") or 0, int(waits.get("recent_steps") or 0)
    if not steps or not recent:
        return None, ""
    recent_seconds, seconds = waits["recent_seconds"], waits["seconds"]
    own = max(waits["elapsed"] - seconds, 0.0) / steps
    share = recent_seconds / (recent_seconds + own * recent) if recent_seconds > 0 else 0.0
    said = (
        f"the trainer waited {_duration(recent_seconds)} in the last {recent} steps "
        f"({_duration(recent_seconds / recent)} a step, {share:.0%} of its time; "
        f"{_duration(seconds)} in all)"
    )
    if share < _KEEPS_UP:
        return "keeps up", (
            f"The loader keeps up: {said}. The training loop, not the loader, sets the pace: a "
            "faster loader would not make training faster."
        )
    if share < _BOTTLENECK:
        return "mostly", f"The loader mostly keeps up: {said}."
    return "bottleneck", f"The loader is the bottleneck: {said}."


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 0.01:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds * 1e3:.2f} ms"


def _packing(stats: Mapping[str, Any]) -> list[str]:
    return [
        f"{name} fills {v['fill']:.1%} of its rows' tokens with real tokens "
        f"({1 - v['fill']:.1%} padding, over {v.get('rows', 0):,.0f} rows)."
        for name, v in (stats.get("operators") or {}).items()
        if isinstance(v.get("fill"), float)
    ]


def _operators(stats: Mapping[str, Any]) -> str:
    ops = {name: float(v.get("seconds", 0.0)) for name, v in (stats.get("operators") or {}).items()}
    total = sum(ops.values())
    if not ops or total <= 0:
        return "No operator time measured yet (the lanes report it as their chunks finish)."
    name, seconds = max(ops.items(), key=lambda kv: kv[1])
    rest = ", ".join(
        f"{n} {s / total:.0%}" for n, s in sorted(ops.items(), key=lambda kv: -kv[1]) if n != name
    )
    tail = f" (then {rest})" if rest else ""
    return (
        f"{name} takes {seconds / total:.0%} of the operators' busy time: "
        f"{seconds:.2f} s of {total:.2f} s{tail}."
    )


def _lanes(
    stats: Mapping[str, Any], workers: str | None, prefetch: int | None, verdict: str | None
) -> str:
    """Where the lanes run and what they have ready; who sets the pace only when the training
    loop's waits were not measured (``verdict``), as they say it better than a snapshot."""
    lanes = stats.get("lanes") or {}
    running = {k: v for k, v in lanes.items() if not v.get("ended")}
    if not lanes:
        return ""
    slowest = _slowest(stats)
    if workers == "inline":
        return (
            f"{len(lanes)} lane(s) run inline, inside the training loop's next(): every second "
            "an operator takes is a second the training loop waits. Run them on "
            f"workers='process' (or 'thread' when {slowest} releases the GIL) to overlap them "
            "with training."
        )
    if not running:
        return f"All {len(lanes)} lanes have ended."
    n = len(running)
    ready = [k for k, v in running.items() if v.get("queued", 0) or v.get("buffered", 0)]
    full = [k for k, v in running.items() if prefetch and v.get("queued", 0) >= prefetch]
    if verdict is not None:
        lists = f" ({len(full)} with all {prefetch} prefetched item lists)" if prefetch else ""
        advice = (
            f" Add lanes or worker processes, or make {slowest} faster."
            if verdict == "bottleneck"
            else ""
        )
        return f"Right now {len(ready)} of {n} running lanes have items ready{lists}.{advice}"
    if len(full) * 2 >= n:
        return (
            f"The lanes are ahead: {len(full)} of {n} running lanes have all {prefetch} "
            "prefetched item lists ready, so the training loop, not the loader, sets the pace."
        )
    if len(ready) * 2 < n:
        return (
            f"The lanes are behind: {n - len(ready)} of {n} running lanes have nothing ready for "
            f"the training loop. Add lanes or worker processes, or make {slowest} faster."
        )
    return (
        f"{len(ready)} of {n} running lanes have items ready: the loader keeps up, with little "
        "to spare."
    )


def _slowest(stats: Mapping[str, Any]) -> str:
    ops = stats.get("operators") or {}
    if not ops:
        return "the slowest operator"
    return max(ops.items(), key=lambda kv: float(kv[1].get("seconds", 0.0)))[0]


def _mixture(stats: Mapping[str, Any]) -> list[str]:
    out = []
    for comp, v in (stats.get("mixture_components") or {}).items():
        share, target = v.get("share"), v.get("target")
        if (
            isinstance(share, float)
            and isinstance(target, (int, float))
            and abs(share - target) > _SHARE_SLACK
        ):
            out.append(
                f"Component {comp} is at {share:.1%} of delivered {v.get('share_of', 'samples')}, "
                f"against a target of {target:.1%}."
            )
    return out
