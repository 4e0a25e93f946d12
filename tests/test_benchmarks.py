"""The benchmark harness's own helpers (benchmarks/moe_kernels.py), on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_pin_fastest_cpu_pins_to_the_fastest_allowed_cpu():
    """In a child process (the test's own affinity stays as it is): one probe per allowed CPU, and the process
    left on the one with the smallest probe."""
    code = (
        "import json, os, sys; sys.path.insert(0, 'benchmarks'); import moe_kernels as mk; "
        "h = mk.pin_fastest_cpu(); print(json.dumps({'host': h, 'now': sorted(os.sched_getaffinity(0))}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    got = json.loads(out.strip().splitlines()[-1])
    probe = {int(c): us for c, us in got["host"]["probe_us"].items()}
    assert set(probe) == os.sched_getaffinity(0) and all(us > 0 for us in probe.values())
    assert got["now"] == [got["host"]["pinned"]] and probe[got["host"]["pinned"]] == min(probe.values())
