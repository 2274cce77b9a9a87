"""give_back: free memory between live allocations goes back to the operating system."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap"
)

# In a fresh interpreter, so that nothing else this test process did shapes its heap.
SCRIPT = textwrap.dedent(
    """
    import pyarrow as pa

    from zephon.runtime.memory import give_back


    def resident_anon_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])


    pa.array(range(100_000))  # Arrow's pool in use: give_back releases it as well
    blocks = [bytearray(4000) for _ in range(20_000)]  # about 80 MB of malloc'd blocks
    kept = blocks[::32]  # one live block every 128 KB: free() cannot shrink the heap
    del blocks
    before = resident_anon_kib()
    give_back()
    after = resident_anon_kib()
    print(before, after, len(kept))
    """
)


def test_give_back_returns_the_free_pages_between_live_allocations() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    before, after, _ = map(int, done.stdout.split())
    assert before - after > 40 * 1024, (before, after)
