"""Notebooks: conventions (jupytext pairs in sync, no committed outputs, a documented parameters cell),
every notebook executes headless under papermill with CPU-small parameters, a killed sweep resumes
without redoing finished runs, and a failing cell is reported by its index and source."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml
from toy_notebooks import log_lines, write_toy_notebook

from moelab import sweep

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
SCRIPTS = sorted(NB_DIR.glob("[0-9][0-9]_*.py"))
CI_OVERRIDES = yaml.safe_load((NB_DIR / "grids" / "ci.yaml").read_text()) or {}
# Each cell of a test's notebook run is bounded, so a hung kernel or executor fails its test instead of running
# the suite past CI's limit (no CPU cell takes near this long).
CELL_TIMEOUT_S = 1200
PARAM_LINE = re.compile(r"^(?P<name>[A-Za-z_]\w*): (?P<type>[\w\[\], ]+) = (?P<value>.+?)  # (?P<help>\S.*)$")


def _sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_is_a_quickstart_notebook():
    assert NB_DIR / "01_routing_quickstart.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_jupytext_pair_in_sync(script):
    import jupytext

    ipynb = script.with_suffix(".ipynb")
    assert ipynb.exists(), f"{script.name} has no paired notebook: run `jupytext --to ipynb {script}`"
    a, b = jupytext.read(script), nbformat.read(str(ipynb), as_version=4)
    assert _sources(a) == _sources(b), f"{ipynb.name} is out of sync with {script.name}: `jupytext --sync {script}`"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_output_free(nb):
    assert nb.with_suffix(".py").exists(), f"{nb.name}: author it as {nb.stem}.py (jupytext percent format)"
    doc = nbformat.read(str(nb), as_version=4)
    dirty = [i for i, c in enumerate(doc.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{nb.name}: cells {dirty} carry outputs; strip them (`nbstripout {nb}`)"


def test_committed_notebooks_are_output_free_and_the_filter_is_configured():
    attrs = (REPO / ".gitattributes").read_text()
    assert re.search(r"^\*\.ipynb .*filter=nbstripout", attrs, re.M)
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.ipynb"], capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for rel in listed:
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"HEAD:{rel}"], capture_output=True, text=True)
        if blob.returncode:  # added but not committed yet
            continue
        doc = nbformat.reads(blob.stdout, as_version=4)
        assert not any(c.get("outputs") or c.get("execution_count") for c in doc.cells if c.cell_type == "code"), \
            f"committed {rel} carries outputs"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_is_documented(nb):
    doc = nbformat.read(str(nb), as_version=4)
    tagged = [c for c in doc.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{nb.name}: {len(tagged)} cells tagged parameters, need exactly one"
    lines = [ln for ln in tagged[0].source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    bad = [ln for ln in lines if not PARAM_LINE.match(ln)]
    assert not bad, f"{nb.name}: parameter lines must read `name: type = value  # help`: {bad}"
    eq = [ln for ln in lines if ln.count("=") != 1]
    assert not eq, f"{nb.name}: papermill drops parameter lines with a second '=' (reword the help): {eq}"
    inspected = sweep.notebook_parameters(nb)
    assert sorted(inspected) == sorted(PARAM_LINE.match(ln)["name"] for ln in lines)
    assert all(v["help"] and v["type"] != "None" for v in inspected.values())
    unknown = set(CI_OVERRIDES.get(nb.stem) or {}) - set(inspected)
    assert not unknown, f"notebooks/grids/ci.yaml sets {sorted(unknown)}, not parameters of {nb.name}"


def test_quickstart_help_lists_every_parameter():
    out = subprocess.run([sys.executable, "-m", "papermill", "--help-notebook",
                          str(NB_DIR / "01_routing_quickstart.ipynb")], capture_output=True, text=True, check=True)
    for name in ("tokens: int", "native_k: int", "adaptive_quantiles: list[float]", "interactive: bool"):
        assert name in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_headless(nb, tmp_path, monkeypatch):
    """Each notebook runs under papermill with its CI parameters and writes its figures and results."""
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path / "run"))
    params = dict(CI_OVERRIDES.get(nb.stem) or {})
    t0 = time.time()
    sweep.execute(nb, tmp_path / "out.ipynb", params, cell_timeout_s=CELL_TIMEOUT_S)
    elapsed = time.time() - t0
    figures = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    assert figures, f"{nb.name} saved no figure through moelab.plots.savefig"
    assert all(p.name.startswith(nb.stem[:2]) for p in (tmp_path / "figures").glob("*.png")), figures
    saved = sorted(p.name for p in (tmp_path / "run" / "results").glob("*"))
    assert saved and all(n.startswith(nb.stem[:3]) for n in saved), saved  # one folder can hold all notebooks' results
    executed = nbformat.read(str(tmp_path / "out.ipynb"), as_version=4)
    assert all(c.metadata.get("papermill", {}).get("status") == "completed" for c in executed.cells
               if c.cell_type == "code")
    print(f"{nb.name}: {elapsed:.0f} s, figures {figures}")
    if nb.stem == "01_routing_quickstart":
        _check_quickstart_results(tmp_path, params)


def _check_quickstart_results(tmp_path: Path, params: dict) -> None:
    """The quickstart's named results hold what its figure shows, counted against the native k."""
    from moelab.results import load_saved

    saved = load_saved(tmp_path / "run")
    stats = saved["01_policy_stats_random"].set_index("policy")
    native = stats.loc[stats.index.str.contains("native")].iloc[0]
    assert native.mean_k == 2.0 and native.expert_reduction == 0.0 and native.kept_pairs == native.native_pairs
    # EntropyAdaptiveK (k 1 or 2) with its threshold at the median entropy: mean k 1.5, 25% saved
    ea = stats.loc["EntropyAdaptiveK"]
    assert abs(ea.mean_k - 1.5) < 0.01 and abs(ea.expert_reduction - 0.25) < 0.01
    assert (stats.kept_pairs <= stats.native_pairs).all()
    assert "01_expert_load" in saved and (saved["01_expert_load"].normalised_entropy <= 1).all()


BAD_PARAMETERS = [  # (notebook, parameters, what the error must name): refused before any long work
    ("02_entropy_sweep", {"grid_points": 1}, "grid_points=1: must be an int >= 3"),
    ("02_entropy_sweep", {"grid_points": 5, "confirm_points": 4}, "confirm_points=4: at most grid_points - 2 = 3"),
    ("05_paper_tables", {"models": []}, "models=[]: must be a non-empty list"),
    ("06_graph_pool_memory", {"arms": ["shared-reuse"]}, "arms=['shared-reuse']: must be a non-empty list"),
    ("06_graph_pool_memory", {"live": "no"}, "live='no': must be True or False"),
    ("03_k_distributions", {"calibrated_target": 0.8}, "calibrated_target=0.8: at most 1 - 2/8 = 0.750"),
    ("06_graph_pool_memory", {"buckets": [4, 0]}, "bucket 0 in [4, 0]: batch sizes must be ints >= 1"),
    ("06_graph_pool_memory", {"live_model": "/ckpt/OLMoE-1B-7B"},
     "live_model='/ckpt/OLMoE-1B-7B': must be an embedded name ['tiny-mixtral'"),
    ("01_routing_quickstart", {"model": "", "adaptive_quantiles": [1.5]}, "adaptive_quantiles=[1.5]: each must be"),
    ("01_routing_quickstart", {"model": "", "adaptive_k_values": [1, 2, 4]},
     "adaptive_quantiles=[0.5]: need one per threshold, len(adaptive_k_values) - 1 = 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stem, params, message", BAD_PARAMETERS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_parameters_are_named(stem, params, message, tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path / "run"))
    with pytest.raises(sweep.NotebookRunError) as info:
        sweep.execute(NB_DIR / f"{stem}.ipynb", tmp_path / "out.ipynb", params, cell_timeout_s=CELL_TIMEOUT_S)
    assert "ValueError" in str(info.value) and message in str(info.value)


@pytest.mark.slow
def test_kernel_bench_explorer_runs(tmp_path, monkeypatch):
    """04's interactive explorer (ipywidgets) builds from the committed results."""
    pytest.importorskip("ipywidgets")
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path / "run"))
    sweep.execute(NB_DIR / "04_kernel_bench.ipynb", tmp_path / "out.ipynb", {"interactive": True},
                  cell_timeout_s=CELL_TIMEOUT_S)
    # the explorer cell shows one widget, stored with the notebook: a shape dropdown and, in its output, the
    # first shape's table of graph and eager times per T
    out = nbformat.read(str(tmp_path / "out.ipynb"), as_version=4)
    (cell,) = [c for c in out.cells if c.cell_type == "code" and c.source.startswith("if interactive:")]
    (view,) = [o["data"]["application/vnd.jupyter.widget-view+json"] for o in cell.outputs
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    state = out.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    kids = [state[c.removeprefix("IPY_MODEL_")] for c in state[view["model_id"]]["state"]["children"]]
    (dropdown,) = [k["state"] for k in kids if k["model_name"] == "DropdownModel"]
    (output,) = [k["state"] for k in kids if k["model_name"] == "OutputModel"]
    shapes = dropdown["_options_labels"]
    assert dropdown["description"] == "shape" and shapes and len(set(shapes)) == len(shapes)
    (table,) = [o["data"]["text/html"] for o in output["outputs"] if "text/html" in o.get("data", {})]
    assert "graph_us" in table and "eager_us" in table and "<table" in table
    # filled kernel-side: the Output never captured display() (msg_id stays empty), so the executor never sent the
    # kernel a message mid-cell, the path that can hang a headless run for good (nbclient issue 312)
    assert not output.get("msg_id")


def test_a_cell_past_its_timeout_fails_named(tmp_path):
    toy = write_toy_notebook(tmp_path / "toy.ipynb")
    with pytest.raises(sweep.NotebookRunError) as info:
        sweep.execute(toy, tmp_path / "out.ipynb", {"x": 1, "sleep_s": 60}, cell_timeout_s=2)
    assert info.value.error["ename"] == "CellTimeoutError" and "toy.ipynb" in str(info.value)
    with pytest.raises(ValueError, match=r"cell_timeout_s=0: must be a number of seconds > 0, or None"):
        sweep.execute(toy, tmp_path / "out.ipynb", {}, cell_timeout_s=0)


def test_failing_cell_is_named(tmp_path):
    toy = write_toy_notebook(tmp_path / "toy.ipynb")
    with pytest.raises(sweep.NotebookRunError) as info:
        sweep.execute(toy, tmp_path / "out.ipynb", {"x": 5, "fail_at": 5}, cell_timeout_s=CELL_TIMEOUT_S)
    msg = str(info.value)
    assert "toy.ipynb: cell 2" in msg and "ValueError: x=5 is the configured failure" in msg
    assert "line 13: raise ValueError" in msg  # the failing line of the cell, from the traceback
    assert info.value.error["cell_index"] == 2 and info.value.error["line"] == 13


def _wait_for(pred, timeout_s: float, what: str):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_runs(tmp_path):
    toy = write_toy_notebook(tmp_path / "toy.ipynb")
    log = tmp_path / "log.txt"
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"notebook": str(toy), "name": "killme", "parameters": {"x": [1, 2, 3]},
                                    "fixed": {"sleep_s": 2.0, "log_path": str(log)}}))
    root = tmp_path / "runs"
    env = {**os.environ, "MOELAB_FIGURES": str(tmp_path / "figs")}
    cmd = [sys.executable, "-m", "moelab.sweep", str(grid), "--root", str(root)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sweep_dir = root / "killme"
    done = lambda: sorted(p.parent.name for p in sweep_dir.glob("*/done"))  # noqa: E731
    try:
        _wait_for(lambda: done(), 240, "the first finished run")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(2.0)  # a worker that outlived the sweep would show up now
    finished = done()
    assert 1 <= len(finished) < 3, f"killed too late to test resuming: {finished}"
    ended_before = [ln for ln in log_lines(log) if ln.startswith("end")]
    assert len(ended_before) == len(finished)

    # the killed sweep's worker died with it: nothing else finishes on its own
    time.sleep(3.0)
    assert done() == finished and [ln for ln in log_lines(log) if ln.startswith("end")] == ended_before

    n_before = len(log_lines(log))
    rc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert len(done()) == 3 and not list(sweep_dir.glob(".tmp-*"))
    finished_x = {json.loads((sweep_dir / h / "params.json").read_text())["parameters"]["x"] for h in finished}
    rerun_started = {int(ln.split()[1]) for ln in log_lines(log)[n_before:] if ln.startswith("start")}
    assert rerun_started == {1, 2, 3} - finished_x, "the rerun redid a finished run"
    ends = [ln for ln in log_lines(log) if ln.startswith("end")]
    assert sorted(ends) == ["end 1", "end 2", "end 3"]
    summary = (sweep_dir / "summary.csv").read_text()
    assert summary.count("\n") == 4  # header + three runs
