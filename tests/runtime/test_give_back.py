"""give_back: free memory between live allocations goes back to the operating system."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap"
)

# In a fresh interpreter, so that nothing else this test process did shapes its heap. Each step
# leaves about 80 MB of malloc'd blocks free, with a live block every 128 KB so that free()
# cannot shrink the heap, and prints the resident anonymous memory before and after a call.
SCRIPT = textwrap.dedent(
    """
    import pyarrow as pa

    from zephon.runtime.memory import give_back, give_back_at_most_every


    def resident_anon_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])


    kept = []


    def step(call):
        blocks = [bytearray(4000) for _ in range(20_000)]
        kept.extend(blocks[::32])
        del blocks
        before = resident_anon_kib()
        call()
        print(before - resident_anon_kib())


    pa.array(range(100_000))  # Arrow's pool in use: give_back releases it as well
    step(give_back)
    step(lambda: give_back_at_most_every(3600.0))  # the first call in this process gives back
    step(lambda: give_back_at_most_every(3600.0))  # within the hour: it does not
    """
)


def test_give_back_returns_the_free_pages_between_live_allocations() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    now, first, again = map(int, done.stdout.split())
    assert now > 40 * 1024 and first > 40 * 1024, (now, first)
    assert again < 8 * 1024, again
