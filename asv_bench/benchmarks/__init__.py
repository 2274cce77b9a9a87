import os as _os
import sys as _sys

# The workloads live in ``asv_bench/zephon_bench`` (shared with ``zephon bench``), outside the
# installed package.
_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
