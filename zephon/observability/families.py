"""A loader's counters (``Loader.stats()``) as metric families with Prometheus names: counters end
in ``_total``, units are in the names (``_seconds``, ``_bytes``), and every sample has a ``rank``
label. Pure data: any sink (Prometheus, OpenTelemetry, a log) renders them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Labels = dict[str, str]


@dataclass
class Family:
    """One metric: its name, ``"counter"`` or ``"gauge"``, a help text and its samples."""

    name: str
    kind: str
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)


# name, kind, help, the stats key (one value per rank)
_SCALARS = (
    (
        "zephon_records_delivered_total",
        "counter",
        "Real records handed to the training loop.",
        "delivered",
    ),
    ("zephon_tombstones_total", "counter", "Tombstones processed at delivery.", "tombstones"),
    (
        "zephon_records_replayed_total",
        "counter",
        "Records re-run and swallowed by restores.",
        "replayed",
    ),
    ("zephon_chunks_evicted_total", "counter", "Chunks finished and forgotten.", "evicted_chunks"),
    (
        "zephon_contract_violations_total",
        "counter",
        "Tolerated operator contract violations.",
        "violations",
    ),
    (
        "zephon_records_skipped_total",
        "counter",
        "Records dropped by on_error='skip'.",
        "skipped",
    ),
    (
        "zephon_chunks_inflight",
        "gauge",
        "Chunks tracked over this rank's lanes.",
        "inflight_chunks",
    ),
    (
        "zephon_chunks_inflight_max",
        "gauge",
        "The most chunks tracked at once.",
        "max_inflight_chunks",
    ),
    ("zephon_chunk_table_bytes", "gauge", "Memory held by the chunk tables.", "bytes_held"),
)

# name, kind, help, the key in ``trainer_wait`` (``runtime.workers.trainer_wait``)
_TRAINER = (
    (
        "zephon_trainer_wait_seconds_total",
        "counter",
        "Seconds the training loop waited inside next() for batches that were not ready.",
        "seconds",
    ),
    (
        "zephon_trainer_steps_total",
        "counter",
        "Items (batches or records) handed to the training loop since the first next().",
        "steps",
    ),
    (
        "zephon_trainer_wait_recent_seconds",
        "gauge",
        "Seconds the training loop waited inside next() over its latest steps.",
        "recent_seconds",
    ),
    (
        "zephon_trainer_wait_recent_steps",
        "gauge",
        "How many latest steps zephon_trainer_wait_recent_seconds covers.",
        "recent_steps",
    ),
    (
        "zephon_trainer_elapsed_seconds",
        "gauge",
        "Seconds since the first next() (until the end of the stream).",
        "elapsed",
    ),
)

# name, kind, help, the key in a component's ``mixture_components`` entry
_COMPONENTS = (
    (
        "zephon_component_samples_total",
        "counter",
        "Delivered samples per mixture component.",
        "samples",
    ),
    (
        "zephon_component_tokens_total",
        "counter",
        "Delivered tokens per mixture component.",
        "tokens",
    ),
    (
        "zephon_component_dropped_samples_total",
        "counter",
        "Samples dropped for the mixture per component.",
        "dropped_samples",
    ),
    (
        "zephon_component_dropped_tokens_total",
        "counter",
        "Tokens dropped for the mixture per component.",
        "dropped_tokens",
    ),
    (
        "zephon_mixture_share",
        "gauge",
        "Realized share of delivered tokens (or samples) per component.",
        "share",
    ),
    ("zephon_mixture_target_share", "gauge", "Target share per component.", "target"),
)

_OPERATORS = (
    (
        "zephon_operator_busy_seconds_total",
        "counter",
        "Seconds spent inside each operator.",
        "seconds",
    ),
    (
        "zephon_operator_records_in_total",
        "counter",
        "Records each operator received.",
        "records_in",
    ),
    (
        "zephon_operator_items_out_total",
        "counter",
        "Records and tombstones each operator emitted.",
        "items_out",
    ),
    (
        "zephon_packing_fill",
        "gauge",
        "Fraction of each packer's row tokens that are real tokens (the rest is padding).",
        "fill",
    ),
    ("zephon_packed_rows_total", "counter", "Rows each packer emitted.", "rows"),
    (
        "zephon_packed_real_tokens_total",
        "counter",
        "Real (not padding) tokens in the rows each packer emitted.",
        "real_tokens",
    ),
    (
        "zephon_packed_row_tokens_total",
        "counter",
        "Tokens, padding included, in the rows each packer emitted.",
        "row_tokens",
    ),
)

# Per data set (``stats()["sources"]``, labelled ``source``: its dataset root).
_SOURCES = (
    (
        "zephon_source_read_bytes_total",
        "counter",
        "Bytes each source read from remote storage (ranged reads and shard downloads).",
        "read_bytes",
    ),
    (
        "zephon_shard_cache_hits_total",
        "counter",
        "Opens of a remote shard its node-local cache already held.",
        "cache_hits",
    ),
    (
        "zephon_shard_cache_misses_total",
        "counter",
        "Opens of a remote shard its node-local cache had to fetch.",
        "cache_misses",
    ),
)

_LANES = (
    (
        "zephon_lane_items_delivered_total",
        "counter",
        "Items (records or batches) each lane handed over.",
        "delivered",
    ),
    (
        "zephon_lane_buffered_items",
        "gauge",
        "Items waiting in each lane's current item list.",
        "buffered",
    ),
    (
        "zephon_lane_queued_item_lists",
        "gauge",
        "Item lists each lane's worker has ready beyond it.",
        "queued",
    ),
    ("zephon_lane_ended", "gauge", "1 once a lane's stream ended.", "ended"),
)


# name, kind, help of the families made from more than one stats value
_SHARE_ERROR = (
    "zephon_mixture_share_error",
    "gauge",
    "Realized minus target share per component.",
)
_REPLAY_DONE = (
    "zephon_lane_replay_done_records",
    "gauge",
    "Records each restoring lane has replayed so far.",
)
_REPLAY_ALL = ("zephon_lane_replay_records", "gauge", "Records each restoring lane replays in all.")


def catalogue() -> list[tuple[str, str, str]]:
    """Every family ``metric_families`` may return, as ``(name, kind, help)``, in its order: what
    a sink that declares its instruments up front (OpenTelemetry) declares."""
    tables = (_SCALARS, _TRAINER, _COMPONENTS, (_SHARE_ERROR,), _OPERATORS, _SOURCES, _LANES)
    out = [row[:3] for table in tables for row in table]
    return [*out, _REPLAY_DONE, _REPLAY_ALL]


# The labels metric_families gives samples itself.
OWN_LABELS = frozenset({"rank", "component", "operator", "source", "lane"})


def extra_labels(labels: Mapping[str, Any] | None, owner: str, what: str = "labels") -> Labels:
    """``labels`` to add to every sample of a loader (``{"loader": "eval"}``), as strings; a
    ValueError when one would overwrite a label of the samples' own."""
    extra = {str(k): str(v) for k, v in (labels or {}).items()}
    clash = sorted(set(extra) & OWN_LABELS)
    if clash:
        raise ValueError(f"{owner}: {what} may not name {clash}, which the metrics carry already")
    return extra


def metric_families(stats: Mapping[str, Any], *, rank: int = 0) -> list[Family]:
    """The families of one rank's ``stats()``; a value the stats do not hold is left out."""
    base = {"rank": str(rank)}
    out: list[Family] = []

    def add(name: str, kind: str, help: str, samples: Iterable[tuple[Labels, Any]]) -> None:
        kept = [({**base, **labels}, float(v)) for labels, v in samples if _is_number(v)]
        if kept:
            out.append(Family(name, kind, help, kept))

    for name, kind, help, key in _SCALARS:
        add(name, kind, help, [({}, stats.get(key))])
    waits = stats.get("trainer_wait") or {}
    for name, kind, help, key in _TRAINER:
        add(name, kind, help, [({}, waits.get(key))])
    components = stats.get("mixture_components") or {}
    for name, kind, help, key in _COMPONENTS:
        add(name, kind, help, [({"component": str(c)}, v.get(key)) for c, v in components.items()])
    add(
        *_SHARE_ERROR,
        [
            ({"component": str(c)}, v["share"] - v["target"])
            for c, v in components.items()
            if _is_number(v.get("share")) and _is_number(v.get("target"))
        ],
    )
    operators = stats.get("operators") or {}
    for name, kind, help, key in _OPERATORS:
        add(name, kind, help, [({"operator": op}, v.get(key)) for op, v in operators.items()])
    sources = stats.get("sources") or {}
    for name, kind, help, key in _SOURCES:
        add(name, kind, help, [({"source": str(s)}, v.get(key)) for s, v in sources.items()])
    lanes = stats.get("lanes") or {}
    for name, kind, help, key in _LANES:
        add(name, kind, help, [({"lane": str(lane)}, v.get(key)) for lane, v in lanes.items()])
    replays = [(str(lane), v["replay"]) for lane, v in lanes.items() if v.get("replay")]
    add(*_REPLAY_DONE, [({"lane": lane}, r.get("done")) for lane, r in replays])
    add(*_REPLAY_ALL, [({"lane": lane}, r.get("of")) for lane, r in replays])
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value  # bools count (1/0); NaN does not


def stats_from_families(families: Iterable[tuple[str, list[tuple[Labels, float]]]]) -> dict:
    """The ``stats()`` fields ``metric_families`` exports, rebuilt from scraped families
    (``(name, samples)`` pairs, counters with their ``_total`` names) of one rank: what
    ``explain`` and ``zephon top`` read from a running job's endpoint."""
    by_name = {name: samples for name, samples in families}
    stats: dict[str, Any] = {}
    for name, _, _, key in _SCALARS:
        for _, value in by_name.get(name, [])[:1]:
            stats[key] = value
    waits = {key: v for name, _, _, key in _TRAINER for _, v in by_name.get(name, [])[:1]}
    if waits:
        stats["trainer_wait"] = waits
    tables = (
        ("mixture_components", "component", _COMPONENTS),
        ("operators", "operator", _OPERATORS),
        ("lanes", "lane", _LANES),
        ("sources", "source", _SOURCES),
    )
    for field_name, label, table in tables:
        rows: dict[str, dict[str, Any]] = {}
        for name, _, _, key in table:
            for labels, value in by_name.get(name, []):
                rows.setdefault(labels[label], {})[key] = value
        if rows:
            stats[field_name] = rows
    return stats
