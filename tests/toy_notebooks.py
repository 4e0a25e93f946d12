"""A tiny real notebook for the sweep tests: sleeps, optionally fails, saves a scalar and a frame."""

from __future__ import annotations

from pathlib import Path

import nbformat

PARAMETERS = """\
x: int = 0  # the swept value
fail_at: int = -1  # raise in the work cell when x equals this
sleep_s: float = 0.0  # seconds of work per run
log_path: str = ""  # append 'start <x> <CUDA_VISIBLE_DEVICES>' and 'end <x> ...' lines here (counts executions)
table: str = ""  # if set, save a table of the metrics under this name through moelab.plots.save_table
"""

WORK = """\
import os
import time
import pandas as pd
from moelab import results

def mark(what):
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"{what} {x} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}\\n")

mark("start")
time.sleep(sleep_s)
if x == fail_at:
    raise ValueError(f"x={x} is the configured failure")
"""

SAVE = """\
results.save("metrics", {"y": x * x, "label": f"x{x}"})
results.save("rows", pd.DataFrame({"i": [0, 1], "v": [x, x + 0.5]}))
if table:
    from moelab.plots import save_table
    save_table(pd.DataFrame({"x": [x], "y": [x * x]}), table)
mark("end")
"""


def write_toy_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(PARAMETERS)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# toy"), params, nbformat.v4.new_code_cell(WORK),
                nbformat.v4.new_code_cell(SAVE)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
