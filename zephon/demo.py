"""``zephon demo``: the whole story on a small generated corpus, in well under a minute.

It writes a two-component Parquet corpus, runs fetch -> tokenize (split) -> pack -> mixture ->
batch on two process lanes with live throughput, lets a training process save checkpoints and
then SIGKILLs it mid-run, restores from the last checkpoint file, and proves that the resumed
stream is identical to an uninterrupted run, batch for batch and byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import zephon
from zephon.ops import batch, ensure_mixture, fetch, pack_sequences, tokenize
from zephon.progress import bar as progress_bar
from zephon.sources import ArrowSource, MixtureSource

SEQ_LEN = 1024
WEIGHTS = {"prose": 0.5, "code": 0.5}
WORDS = ("data", "loader", "resume", "exact", "chunk", "lane", "cursor", "epoch", "token", "pack")


def write_corpus(root: Path, docs_per_component: int = 3000, seed: int = 0) -> dict[str, Path]:
    """Two Parquet files of generated text; "code" documents are about 3x longer than "prose"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paths = {}
    for name, mean_words in (("prose", 60), ("code", 180)):
        lengths = rng.integers(mean_words // 4, mean_words * 7 // 4, docs_per_component)
        texts = [" ".join(rng.choice(WORDS, int(n))) for n in lengths]
        path = root / f"{name}.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=512)
        paths[name] = path
    return paths


def demo_pipeline(paths: dict[str, Path], workers: str = "process") -> zephon.Pipeline:
    """The demo's pipeline over the generated corpus."""
    source = MixtureSource(
        {name: ArrowSource([path], dataset_id=i) for i, (name, path) in enumerate(paths.items())},
        WEIGHTS,
        by="tokens",  # the byte tokenizer makes one token per byte of text
        tokens_per_byte=1.0,
        seed=1,
        chunk_size=256,
    )
    ops = [
        fetch(),
        tokenize(max_len=SEQ_LEN, split_long_samples=True),
        pack_sequences(SEQ_LEN, open_bins=64),
        ensure_mixture(WEIGHTS, by="tokens", buffer_size=64),
        batch(8),
    ]
    return zephon.Pipeline(source, ops, lanes=2, workers=workers, epoch_chunks=4)


def batch_digest(item: Any) -> str:
    """A digest of what the training loop saw: every cursor and every payload byte."""
    h = hashlib.sha256()
    for rec in item:
        h.update(repr(rec.meta.cursor).encode())
    for key in sorted(item.payload):
        h.update(key.encode())
        h.update(np.ascontiguousarray(item.payload[key]).tobytes())
    return h.hexdigest()


def _train(corpus: Path, out: Path) -> None:
    """The training process of the demo: checkpoints every 10 batches until it is killed."""
    paths = {name: corpus / f"{name}.parquet" for name in WEIGHTS}
    with demo_pipeline(paths).iter() as loader, open(out / "seen.txt", "w") as log:
        for step, item in enumerate(loader, 1):
            log.write(batch_digest(item) + "\n")
            log.flush()
            if step % 10 == 0:  # the step and the loader state in one atomic write
                zephon.save_checkpoint(
                    out / "train.json", {"step": step, "loader": loader.state_dict()}
                )
            time.sleep(0.01)  # a training step


def _saved_step(checkpoint: Path) -> int:
    """The step of the training process's last checkpoint, 0 before the first one."""
    return zephon.load_checkpoint(checkpoint)["step"] if checkpoint.exists() else 0


class _Progress:
    """Batches and tokens/s: a tqdm bar when progress is shown (``zephon.show_progress``, on in
    the CLI) and tqdm is installed, else a line of text."""

    def __init__(self, out: TextIO, label: str, total: int | None):
        self.out, self.label, self.total = out, label, total
        self.start = time.perf_counter()
        self.tty = out.isatty()
        self.shown = progress_bar(total, f"zephon demo: {label.strip()}", unit="batch")

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        if not (force or done % 25 == 0):
            return
        rate = tokens / max(time.perf_counter() - self.start, 1e-9)
        if self.shown is not None:
            self.shown.n = done
            self.shown.set_postfix_str(f"{rate / 1e6:.2f} M tokens/s")
            if force:
                self.shown.close()
                print(f"  {self.label} {done} batches, {rate / 1e6:.2f} M tokens/s", file=self.out)
            return
        bar = ""
        if self.total:
            filled = int(30 * done / self.total)
            bar = "[" + "#" * filled + "." * (30 - filled) + "] "
        line = f"  {self.label} {bar}{done} batches, {rate / 1e6:.2f} M tokens/s"
        if self.tty:
            print("\r" + line, end="\n" if force else "", file=self.out, flush=True)
        elif force:
            print(line, file=self.out, flush=True)


def run_demo(out: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code (0 when the resumed stream is identical)."""
    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
        root = Path(tmp)
        paths = write_corpus(root)
        pipeline = demo_pipeline(paths)
        say(
            "Zephon demo: a two-component Parquet corpus ('code' documents ~3x longer than 'prose')"
        )
        say(pipeline.compile().describe())

        say("\n1. An uninterrupted run on two process lanes")
        reference: list[str] = []
        real = total = 0
        with pipeline.iter() as loader:
            progress = _Progress(out, "reference", None)
            for item in loader:
                reference.append(batch_digest(item))
                segments = item.payload["segment_ids"]
                real += int(np.count_nonzero(segments))
                total += segments.size
                progress.update(len(reference), real)
            progress.update(len(reference), real, force=True)
            stats = loader.stats()
        say(f"   packing fill: {real / total:.4f} of {total:,} token slots hold real tokens")
        shares = ", ".join(f"{k}: {v:.3f}" for k, v in sorted(stats["mixture"].items()))
        say(
            f"   realized token mixture: {shares} (target 0.5 / 0.5); "
            f"{stats['mixture_dropped']} records dropped to hold it"
        )

        say("\n2. A training process that checkpoints every 10 batches, killed with SIGKILL")
        work = root / "run"
        work.mkdir()
        cmd = [sys.executable, "-m", "zephon.demo", "--train", str(root), str(work)]
        proc = subprocess.Popen(cmd)
        stop_after = len(reference) // 2
        checkpoint = work / "train.json"
        deadline = time.monotonic() + 60
        while True:
            done = _saved_step(checkpoint)
            if done >= stop_after or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        seen = (work / "seen.txt").read_text().split()
        saved_run = zephon.load_checkpoint(checkpoint)
        saved, state = saved_run["step"], saved_run["loader"]
        size = checkpoint.stat().st_size
        say(f"   killed after {len(seen)} batches; last checkpoint at batch {saved} ({size} bytes)")

        say("\n3. Restore from the checkpoint file and finish the run")
        tail: list[str] = []
        with pipeline.iter(state=state) as loader:
            progress = _Progress(out, "resumed  ", len(reference) - saved)
            tokens = 0
            for item in loader:
                tail.append(batch_digest(item))
                tokens += int(np.count_nonzero(item.payload["segment_ids"]))
                progress.update(len(tail), tokens)
            progress.update(len(tail), tokens, force=True)
            replayed = loader.stats()["replayed"]
        say(f"   {replayed} records replayed to reach the checkpoint (at most one epoch per lane)")
        same = seen[:saved] + tail == reference
        say(
            f"\nResumed stream identical to the uninterrupted run: {'YES' if same else 'NO'} "
            f"({saved} + {len(tail)} = {len(reference)} batches compared by cursor and bytes)"
        )
        return 0 if same else 1


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--train":
    _train(Path(sys.argv[2]), Path(sys.argv[3]))
