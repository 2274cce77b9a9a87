"""Metrics a monitoring stack scrapes, a JSON-lines log of them, the bottleneck in words, and the
command-line views of a running job, all against a real run (process lanes)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pipeline_kit import busy, run
from worker_kit import wait_until

import zephon
from zephon.cli import main
from zephon.observability import (
    MetricsLog,
    explain,
    metric_families,
    read_metrics_log,
    serve_metrics,
)
from zephon.ops import batch, fetch, map_transform, tokenize
from zephon.sources import ListSource, MixtureSource

prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def texts(dataset_id: int, n: int) -> ListSource:
    return ListSource(
        [{"text": f"doc {dataset_id}-{i} " + "word " * (i % 17)} for i in range(n)],
        dataset_id=dataset_id,
        chunk_size=32,
    )


def pipeline(**kw) -> zephon.Pipeline:
    source = MixtureSource(
        {"a": texts(0, 600), "b": texts(1, 600)}, {"a": 0.5, "b": 0.5}, chunk_size=32
    )
    return zephon.Pipeline(source, [fetch(), tokenize(), batch(4)], lanes=2, **kw)


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, list] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_scrape_during_a_run_on_process_lanes_matches_stats_and_the_stream():
    with pipeline(workers="process").iter() as loader, serve_metrics(loader) as server:
        delivered = 0
        for _, b in zip(range(30), loader):
            delivered += len(b)
        got = scrape(server.url)
        stats = loader.stats()
        assert got["zephon_records_delivered_total"] == [({"rank": "0"}, float(delivered))]
        assert stats["delivered"] == delivered
        lanes = {labels["lane"]: v for labels, v in got["zephon_lane_items_delivered_total"]}
        assert lanes == {"0": 15.0, "1": 15.0}  # one batch per lane in turn
        samples = {lb["component"]: v for lb, v in got["zephon_component_samples_total"]}
        assert sum(samples.values()) == delivered
        assert samples == {c: float(v["samples"]) for c, v in stats["mixture_components"].items()}
        ops = {lb["operator"] for lb, _ in got["zephon_operator_busy_seconds_total"]}
        assert ops == set(stats["operators"])
        assert {lb["component"] for lb, _ in got["zephon_mixture_target_share"]} == {"a", "b"}


def test_stats_may_be_read_from_another_thread_while_the_loader_runs():
    errors: list[BaseException] = []
    seen: list[int] = []
    with pipeline(workers="process").iter() as loader:
        done = threading.Event()

        def read() -> None:
            try:
                while not done.is_set():
                    seen.append(loader.stats()["delivered"])
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            total = sum(len(b) for b in loader)
        finally:
            done.set()
            reader.join()
    assert not errors
    assert total == 1200 and seen == sorted(seen) and seen[-1] <= total


def test_explain_names_the_slow_operator():
    source = texts(0, 400)
    slow = zephon.Pipeline(
        source,
        [fetch(), map_transform(busy, name="slow_map"), tokenize(), batch(4)],
        lanes=2,
        workers="inline",
    )
    with slow.iter() as loader:
        for _ in zip(range(60), loader):
            pass
        text = loader.explain()
        stats = loader.stats()
    line = text.splitlines()[1]  # after whether the loader is the bottleneck
    assert line.startswith("slow_map takes") and "of the operators' busy time" in line
    assert "inline" in text  # and says where the lanes run
    assert explain(stats).splitlines()[1] == line


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a UserWarning.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_explain_of_a_dataloader_around_the_torch_dataset_knows_where_its_lanes_run():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from zephon.integrations.torch import as_torch_dataset

    slow = zephon.Pipeline(texts(0, 400), [fetch(), map_transform(busy), batch(4)], lanes=2)
    dataset = as_torch_dataset(slow)
    dataloader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    steps = iter(dataloader)
    for _ in range(20):
        next(steps)
    said = explain(dataloader).splitlines()
    assert said[2] == explain(dataset).splitlines()[2]
    assert said[2].startswith("2 lane(s) run inline, inside the training loop's next()")
    dataset.close()


def test_the_metrics_log_holds_a_line_per_write_and_a_last_one_at_close(tmp_path: Path):
    path = tmp_path / "run.jsonl"
    with pipeline().iter() as loader, MetricsLog(loader, path) as log:
        for step, _ in enumerate(loader):
            if step % 50 == 0:
                log.write(step=step)
        final = loader.stats()
    lines = read_metrics_log(path)
    assert [line["step"] for line in lines] == [0, 50, 100, 150, 200, 250, None]
    assert json.loads(json.dumps(final)) == lines[-1]["stats"]
    assert all(line["rank"] == 0 for line in lines)


def test_the_metrics_log_thread_outlives_a_failed_read_and_close_closes_the_file(
    tmp_path: Path,
):
    from zephon.observability import StatsSource

    failing = threading.Event()  # set: reads fail, as stats() may while storage is down
    failing.set()
    failed_once = threading.Event()

    def read() -> dict:
        if failing.is_set():
            failed_once.set()
            raise OSError("the store did not answer")
        return {"delivered": 7}

    log = MetricsLog(StatsSource(read, 0, 1), tmp_path / "run.jsonl", interval=0.01)
    assert failed_once.wait(30)
    failing.clear()
    assert wait_until(lambda: read_metrics_log(tmp_path / "run.jsonl"), 30), "no line after it"
    failing.set()
    with pytest.raises(OSError, match="the store did not answer"):
        log.close()  # its last line fails
    assert log._file.closed
    assert not any(t.name == "zephon-metrics-log" for t in threading.enumerate())
    assert read_metrics_log(tmp_path / "run.jsonl")[0]["stats"] == {"delivered": 7}


def test_zephon_top_once_explain_and_report_run(tmp_path: Path, capsys):
    log = tmp_path / "run.jsonl"
    with (
        pipeline(workers="process").iter() as loader,
        serve_metrics(loader) as server,
        MetricsLog(loader, log) as metrics,
    ):
        for step, _ in enumerate(loader):
            if step % 25 == 0:
                metrics.write(step=step)
            if step == 100:
                address = f"{server.addr}:{server.port}"
                assert main(["top", address, "--once"]) == 0
                frame = capsys.readouterr().out
                assert "rank 0" in frame and "lane" in frame and "tokenize" in frame
                assert "trainer waited" in frame and "fill" in frame
                assert main(["explain", address]) == 0
                assert "of the operators' busy time" in capsys.readouterr().out
    assert main(["report", str(log), "-o", str(tmp_path / "report.png")]) == 0
    from PIL import Image

    with Image.open(tmp_path / "report.png") as png:
        png.load()
        assert png.format == "PNG" and png.size == (1800, 800)


def test_metric_names_follow_prometheus_conventions():
    with pipeline().iter() as loader:
        for _ in zip(range(10), loader):
            pass
        families = metric_families(loader.stats(), rank=3)
    for family in families:
        assert family.name.startswith("zephon_")
        assert family.name.endswith("_total") == (family.kind == "counter"), family.name
        assert all(labels["rank"] == "3" for labels, _ in family.samples)


def test_the_text_format_round_trips_through_the_prometheus_parser():
    from zephon.observability import Family
    from zephon.observability.server import render

    odd = 'a"b\\c\nd'
    text = render(
        [
            Family("zephon_x_total", "counter", 'counts "x"\nand more', [({"rank": "0"}, 3.0)]),
            Family("zephon_y", "gauge", "y", [({"rank": "0", "component": odd}, float("inf"))]),
        ]
    ).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }
    assert got == {
        ("zephon_x_total", (("rank", "0"),)): 3.0,
        ("zephon_y", (("component", odd), ("rank", "0"))): float("inf"),
    }


def test_the_endpoint_serves_metrics_only_and_its_thread_ends_at_close():
    with pipeline().iter() as loader:
        server = serve_metrics(loader)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url.removesuffix("metrics") + "other", timeout=30)
        assert missing.value.code == 404
        missing.value.close()
        head = urllib.request.Request(server.url, method="HEAD")
        with urllib.request.urlopen(head, timeout=30) as reply:
            assert reply.status == 200 and reply.read() == b""
        server.close()
        server.close()  # twice is once
        assert not any(t.name == "zephon-metrics" for t in threading.enumerate())
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(server.url, timeout=30)


def test_the_endpoint_listens_on_ipv6_addresses_and_its_url_brackets_them():
    with pipeline().iter() as loader:
        with serve_metrics(loader, addr="::1") as server:
            assert server.url == f"http://[::1]:{server.port}/metrics"
            with urllib.request.urlopen(server.url, timeout=30) as reply:
                assert b"zephon_records_delivered_total" in reply.read()
        with serve_metrics(loader, addr="::") as every:  # every address, IPv4 ones too
            for host in ("[::1]", "127.0.0.1"):
                url = f"http://{host}:{every.port}/metrics"
                with urllib.request.urlopen(url, timeout=30) as reply:
                    assert b"zephon_records_delivered_total" in reply.read()
    assert not any(t.name == "zephon-metrics" for t in threading.enumerate())


def test_a_scrape_whose_stats_fail_is_a_500_naming_the_error_and_the_endpoint_stays_up(capsys):
    from zephon.integrations.torch import as_torch_dataset

    # Before its first item, the torch dataset's stats() are those of the state it will start
    # from; a state of another pipeline fails there (as the training loop's iter() will).
    with pipeline().iter() as other:
        run(other, 3)
        state = other.state_dict()
    dataset = as_torch_dataset(pipeline(epoch_chunks=2))
    dataset.load_state_dict(state)
    with serve_metrics(dataset) as server:
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(server.url, timeout=30)
        assert failed.value.code == 500
        assert b"CheckpointMismatchError" in failed.value.read()
        failed.value.close()
        assert main(["explain", f"127.0.0.1:{server.port}"]) == 1  # says why, too
        assert "500" in (said := capsys.readouterr().err) and "CheckpointMismatchError" in said
        with dataset.pipeline.iter() as fresh:
            dataset.load_state_dict(fresh.state_dict())
        with urllib.request.urlopen(server.url, timeout=30) as reply:
            assert b"zephon_records_delivered_total" in reply.read()
    assert not any(t.name == "zephon-metrics" for t in threading.enumerate())


def test_a_client_that_sends_nothing_holds_the_endpoint_only_until_its_deadline(monkeypatch):
    from zephon.observability import server as metrics_server

    monkeypatch.setattr(metrics_server, "_CLIENT_DEADLINE", 0.5)
    with pipeline().iter() as loader, serve_metrics(loader) as server:
        stalled = socket.create_connection((server.addr, server.port))  # and never asks
        began = time.monotonic()
        with urllib.request.urlopen(server.url, timeout=30) as reply:
            assert reply.status == 200 and b"zephon_" in reply.read()
        assert 0.4 < time.monotonic() - began < 10, "served once the stalled client's time was up"
        stalled.close()
    assert not any(t.name == "zephon-metrics" for t in threading.enumerate())


def test_the_docs_list_every_metric_family():
    from zephon.observability.families import catalogue

    page = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    listed = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `zephon_")}
    assert listed == {name for name, _, _ in catalogue()}


def test_a_training_and_an_evaluation_loader_share_one_registry_under_their_labels():
    from prometheus_client import CollectorRegistry, generate_latest

    from zephon.observability.prometheus import ZephonCollector

    with pipeline().iter() as train, pipeline().iter() as evaluation, pipeline().iter() as older:
        for _ in zip(range(10), train):
            pass
        for _ in zip(range(3), evaluation):
            pass
        registry = CollectorRegistry(auto_describe=True)  # as prometheus_client's own REGISTRY
        collector = ZephonCollector(older, labels={"loader": "eval"})
        collector.add(train, labels={"loader": "train"})
        collector.add(evaluation, labels={"loader": "eval"})  # in place of the older one
        registry.register(collector)
        text = generate_latest(registry).decode()
        # A scraper refuses an exposition that declares a metric twice.
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
        assert len(types) == len(set(types))
        delivered = {
            s.labels["loader"]: s.value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "zephon_records_delivered_total"
        }
        assert delivered == {
            "train": train.stats()["delivered"],
            "eval": evaluation.stats()["delivered"],
        }
        assert delivered["train"] != delivered["eval"]
        with pytest.raises(ValueError, match=r"labels may not name .*'rank'"):
            ZephonCollector(train, labels={"rank": "1"})


@pytest.mark.parametrize("where", ["s3://bucket/run.jsonl", Path("gs://bucket/run.jsonl")])
def test_a_metrics_log_in_object_storage_is_refused_not_written_beside_the_job(
    tmp_path: Path, monkeypatch, where
):
    # A log appended line by line cannot be an object; taken for a local path, "s3://..."
    # became a directory "s3:" under the working directory.
    monkeypatch.chdir(tmp_path)
    refused = r"MetricsLog: the log, a file appended line by line, is on this machine"
    with pipeline().iter() as loader, pytest.raises(ValueError, match=refused):
        MetricsLog(loader, where)
    assert list(tmp_path.iterdir()) == []
