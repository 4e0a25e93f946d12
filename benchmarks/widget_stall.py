"""How often a headless executor stalls on a widget explorer: widgets.interactive against moelab.plots.explorer.

Runs a one-cell notebook N times through nbclient (what papermill drives), each with a cell timeout: the
explorer over a small frame, written either as widgets.interactive (display() captured in its Output, which
nbclient mimics by sending the kernel comm messages on the shell socket it is waiting on) or as
moelab.plots.explorer (the Output filled kernel-side). A run whose cell takes most of the timeout stalled: without
a timeout (papermill's default) it would have waited for good, as one CI run did, on a 2-core machine busy
with the test suite: --load N keeps N other processes spinning meanwhile, as such a machine is. Writes
data/results/widget-stall-<date>.json; CPU only, about 2 s a run.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import multiprocessing as mp
import time

import nbformat
from tqdm.auto import tqdm

from moelab.results import write_results

SETUP = """import ipywidgets as widgets, pandas as pd
from IPython.display import display
df = pd.DataFrame({"s": list("aabb"), "T": [1, 2, 1, 2], "v": [1.0, 2.0, 3.0, 4.0]})
"""
CELLS = {
    "interactive": SETUP + """def show(s):
    display(df[df.s == s].pivot_table(index="T", values="v"))
display(widgets.interactive(show, s=widgets.Dropdown(options=["a", "b"])))""",
    "explorer": SETUP + """from moelab.plots import explorer
def show(s):
    return df[df.s == s].pivot_table(index="T", values="v")
display(explorer(show, s=widgets.Dropdown(options=["a", "b"])))""",
}
STALL_SHARE = 0.9  # a cell that took this share of its timeout or more stalled (a normal one: about a second at most)


def run_once(source: str, timeout_s: float) -> tuple[float, bool]:
    """Execute the one-cell notebook once; (cell seconds, timed out)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=True)
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellTimeoutError:
        return time.perf_counter() - t0, True
    timing = nb.cells[0].metadata["execution"]
    start, end = (md_time(timing[k]) for k in ("iopub.execute_input", "shell.execute_reply"))
    return end - start, False


def spin() -> None:
    """A process that keeps one core busy until it is terminated (--load)."""
    while True:
        pass


def md_time(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=150, help="runs per variant (>= 1)")
    ap.add_argument("--variants", default="interactive,explorer", help=f"comma list of {sorted(CELLS)}")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="cell timeout in seconds (> 1)")
    ap.add_argument("--load", type=int, default=0, help="processes kept spinning during the runs (>= 0)")
    args = ap.parse_args(argv)
    runs = args.runs if args.runs >= 1 else ap.error(f"--runs {args.runs}: must be >= 1")
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in CELLS]
    if bad:
        ap.error(f"--variants {bad}: each must be one of {sorted(CELLS)}")
    if not args.timeout_s > 1:
        ap.error(f"--timeout-s {args.timeout_s}: must be > 1")
    if args.load < 0:
        ap.error(f"--load {args.load}: must be >= 0")
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.load)]
    for sp in spinners:
        sp.start()
    rows = []
    try:
        for variant in variants:
            for i in tqdm(range(runs), desc=variant):
                cell_s, timed_out = run_once(CELLS[variant], args.timeout_s)
                rows.append({"variant": variant, "run": i, "cell_s": round(cell_s, 3), "timed_out": timed_out,
                             "stalled": timed_out or cell_s >= STALL_SHARE * args.timeout_s})
    finally:
        for sp in spinners:
            sp.terminate()
    summary = {v: sum(r["stalled"] for r in rows if r["variant"] == v) for v in variants}
    packages = ("nbclient", "papermill", "jupyter_client", "ipykernel", "ipywidgets", "pyzmq")
    versions = {p: md.version(p) for p in packages}
    path = write_results("widget-stall", rows, notes=(
        f"stalled runs of {runs} per variant, {args.load} spinning processes beside: {summary}; a stalled cell ran "
        f"until the {args.timeout_s} s timeout, where pyzmq's timed poll found the waiting reply (it finished, late)"),
        extra={"timeout_s": args.timeout_s, "load": args.load, "stalled": summary, "versions": versions,
               "source": CELLS})
    print(f"stalled of {runs}: {summary} -> {path}")


if __name__ == "__main__":
    main()
