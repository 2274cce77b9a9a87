"""The command line's view of a running job: ``zephon top`` and ``zephon explain`` read a
metrics endpoint (``serve_metrics``); ``zephon report`` draws a ``MetricsLog`` file."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from zephon.errors import ZephonError
from zephon.observability.explain import explain
from zephon.observability.families import stats_from_families
from zephon.observability.log import read_metrics_log


def scrape(url: str, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """Per rank, the ``stats()`` fields a metrics endpoint exports (``url`` may leave out
    ``http://`` and ``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8")
    except urllib.error.HTTPError as exc:  # the endpoint's body says why (serve_metrics's does)
        with exc:
            why = exc.read(2000).decode("utf-8", "replace").strip()
        said = f"HTTP {exc.code} {exc.reason}" + (f": {why}" if why else "")
        raise ZephonError(f"cannot read metrics from {url}: {said}") from None
    except OSError as exc:
        raise ZephonError(f"cannot read metrics from {url}: {exc}") from None
    per_rank: dict[str, list[tuple[str, list[tuple[dict[str, str], float]]]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("zephon_"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created",)):
                continue
            labels = dict(sample.labels)
            rank = labels.pop("rank", "0")
            fams = per_rank.setdefault(rank, [])
            if not fams or fams[-1][0] != sample.name:
                fams.append((sample.name, []))
            fams[-1][1].append((labels, float(sample.value)))
    if not per_rank:
        raise ZephonError(f"{url} serves no Zephon metrics")
    return {rank: stats_from_families(fams) for rank, fams in sorted(per_rank.items())}


def explain_endpoint(url: str) -> str:
    """``explain`` for every rank a running job's endpoint serves."""
    return "\n\n".join(f"rank {rank}:\n{explain(stats)}" for rank, stats in scrape(url).items())


def top(url: str, *, once: bool = False, interval: float = 2.0) -> None:
    """A live view of a running job's loader (lanes, operators, mixture, throughput), redrawn
    every ``interval`` seconds until Ctrl-C; with ``once``, one frame."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    before: tuple[float, dict[str, dict[str, Any]]] | None = None
    if once:
        console.print(_frame(url, scrape(url), None))
        return
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                now = (time.monotonic(), scrape(url))
                live.update(_frame(url, now[1], before and (now[0] - before[0], before[1])))
                live.refresh()
                before = now
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


def _waited(stats: dict[str, Any]) -> str:
    """How long the training loop waited for batches: of its latest steps, and overall."""
    waits = stats.get("trainer_wait") or {}
    elapsed, seconds = waits.get("elapsed"), waits.get("seconds")
    if not elapsed or seconds is None:
        return ""
    text = f" · trainer waited {seconds / elapsed:.0%} of {elapsed:,.0f} s"
    steps, recent = waits.get("recent_steps"), waits.get("recent_seconds")
    if steps and recent is not None:
        text += f" ({recent:.2f} s over the last {steps:,.0f} steps)"
    return text


def _frame(url: str, ranks: dict[str, dict[str, Any]], earlier: tuple[float, dict] | None) -> Any:
    from rich.console import Group
    from rich.table import Table

    parts: list[Any] = []
    for rank, stats in ranks.items():
        delivered = stats.get("delivered", 0)
        rate = ""
        if earlier is not None and earlier[0] > 0:
            was = earlier[1].get(rank, {}).get("delivered", delivered)
            rate = f", {(delivered - was) / earlier[0]:,.0f} records/s"
        head = Table(
            title=f"zephon · {url} · rank {rank}: {delivered:,.0f} records{rate}{_waited(stats)}"
        )
        for col in ("lane", "delivered", "buffered", "queued", "ended"):
            head.add_column(col, justify="right")
        for lane, v in sorted((stats.get("lanes") or {}).items(), key=lambda kv: int(kv[0])):
            head.add_row(
                lane,
                f"{v.get('delivered', 0):,.0f}",
                f"{v.get('buffered', 0):.0f}",
                f"{v.get('queued', 0):.0f}",
                "yes" if v.get("ended") else "",
            )
        parts.append(head)
        ops = Table(title="operators")
        for col in ("operator", "busy s", "share", "in", "out", "fill"):
            ops.add_column(col, justify="right" if col != "operator" else "left")
        rows = stats.get("operators") or {}
        total = sum(v.get("seconds", 0.0) for v in rows.values()) or 1.0
        for name, v in sorted(rows.items(), key=lambda kv: -kv[1].get("seconds", 0.0)):
            seconds = v.get("seconds", 0.0)
            ops.add_row(
                name,
                f"{seconds:.2f}",
                f"{seconds / total:.0%}",
                f"{v.get('records_in', 0):,.0f}",
                f"{v.get('items_out', 0):,.0f}",
                "" if v.get("fill") is None else f"{v['fill']:.1%}",  # a packer's
            )
        parts.append(ops)
        mix = stats.get("mixture_components") or {}
        if mix:
            table = Table(title="mixture")
            for col in ("component", "share", "target", "samples", "tokens"):
                table.add_column(col, justify="right" if col != "component" else "left")
            for comp, v in sorted(mix.items()):
                target = v.get("target")
                table.add_row(
                    comp,
                    f"{v.get('share', 0.0):.1%}",
                    "" if target is None else f"{target:.1%}",
                    f"{v.get('samples', 0):,.0f}",
                    f"{v.get('tokens', 0):,.0f}",
                )
            parts.append(table)
        parts.append(explain(stats))
    return Group(*parts)


def report(path: str, out: str | None = None) -> Path:
    """Plots of a ``MetricsLog`` file as one PNG (``out``, else beside the log): delivered
    records per second, mixture shares against their targets, records replayed by restores, the
    share of its time the training loop waited inside ``next()``, each packer's fill, and each
    operator's share of the busy time, over the run's elapsed time. Returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    lines = read_metrics_log(path)
    if len(lines) < 2:
        raise ZephonError(f"{path} holds {len(lines)} line(s): a report needs at least two")
    target = Path(out) if out else Path(path).with_suffix(".png")
    fig, axes = plt.subplots(2, 3, figsize=(18, 8), constrained_layout=True)
    for rank in sorted({line["rank"] for line in lines}):
        mine = [line for line in lines if line["rank"] == rank]
        t = [line["elapsed"] for line in mine]
        stats = [line["stats"] for line in mine]
        delivered = [s.get("delivered", 0) for s in stats]
        k = max(1, len(t) // 20)  # each rate over k lines: steady when lines come in bursts
        rates = [
            (delivered[i] - delivered[i - k]) / max(t[i] - t[i - k], 1e-9) for i in range(k, len(t))
        ]
        axes[0][0].plot(t[k:], rates, label=f"rank {rank}")
        for comp in sorted({c for s in stats for c in s.get("mixture_components") or {}}):
            shares = [(s.get("mixture_components") or {}).get(comp, {}) for s in stats]
            line = axes[0][1].plot(t, [v.get("share", float("nan")) for v in shares],
                                   label=f"{comp} (rank {rank})")  # fmt: skip
            targets = [v.get("target") for v in shares]
            if any(x is not None for x in targets):
                axes[0][1].plot(t, [float("nan") if x is None else x for x in targets],
                                linestyle="--", color=line[0].get_color())  # fmt: skip
        axes[1][0].plot(t, [s.get("replayed", 0) for s in stats], label=f"rank {rank}")
        waits = [s.get("trainer_wait") or {} for s in stats]
        waited = [
            (w2.get("seconds", 0.0) - w1.get("seconds", 0.0))
            / max(w2.get("elapsed", 0.0) - w1.get("elapsed", 0.0), 1e-9)
            for w1, w2 in zip(waits[:-k], waits[k:])
        ]
        axes[0][2].plot(t[k:], waited, label=f"rank {rank}")
        for name in sorted({n for s in stats for n, v in (s.get("operators") or {}).items()
                            if "fill" in v}):  # fmt: skip
            fills = [(s.get("operators") or {}).get(name, {}).get("fill") for s in stats]
            axes[1][2].plot(t, [float("nan") if f is None else f for f in fills],
                            label=f"{name} (rank {rank})")  # fmt: skip
        last = stats[-1].get("operators") or {}
        total = sum(v.get("seconds", 0.0) for v in last.values()) or 1.0
        names = list(last)
        shares = [last[n].get("seconds", 0.0) / total for n in names]
        # An operator's label can be long (a tokenizer's special ids); the bar needs its name.
        axes[1][1].barh([n if len(n) <= 24 else n[:23] + "…" for n in names], shares)
    for ax, title, ylabel in (
        (axes[0][0], "throughput", "records/s"),
        (axes[0][1], "mixture share (dashed: target)", "share"),
        (axes[0][2], "training loop waiting in next()", "share of its time"),
        (axes[1][0], "records replayed by restores", "records"),
        (axes[1][1], "operators' share of busy time (last line)", ""),
        (axes[1][2], "packing fill (real tokens / row tokens)", "fill"),
    ):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if ax is not axes[1][1]:
            ax.set_xlabel("elapsed s")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
