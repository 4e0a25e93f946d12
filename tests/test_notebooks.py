"""Notebooks: conventions (jupytext pairs in sync, no committed outputs, a documented parameters cell), bad
parameters refused by name, and one papermill run of every notebook with its CI parameters (notebooks/grids/
ci.yaml) per test session, which the per-notebook tests inspect (marked slow: CI runs them once)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import nbformat
import pytest
import yaml

from moelab import sweep

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
SCRIPTS = sorted(NB_DIR.glob("[0-9][0-9]_*.py"))  # numbered notebooks only: notebooks/ also holds modules
CI_OVERRIDES = yaml.safe_load((NB_DIR / "grids" / "ci.yaml").read_text()) or {}
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
    assert re.search(r"^\*\.ipynb .*filter=nbstripout", (REPO / ".gitattributes").read_text(), re.M)
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
    inspected = sweep.notebook_parameters(nb)  # what `papermill --help-notebook` lists
    assert sorted(inspected) == sorted(PARAM_LINE.match(ln)["name"] for ln in lines)
    assert all(v["help"] and v["type"] != "None" for v in inspected.values())
    unknown = set(CI_OVERRIDES.get(nb.stem) or {}) - set(inspected)
    assert not unknown, f"notebooks/grids/ci.yaml sets {sorted(unknown)}, not parameters of {nb.name}"


def test_quickstart_lists_its_parameters_with_types():
    params = sweep.notebook_parameters(NB_DIR / "01_routing_quickstart.ipynb")
    got = {k: params[k]["type"] for k in ("tokens", "native_k", "adaptive_quantiles", "interactive")}
    assert got == {"tokens": "int", "native_k": "int", "adaptive_quantiles": "list[float]", "interactive": "bool"}


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


@pytest.mark.parametrize("stem, params, message", BAD_PARAMETERS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_parameters_are_named(stem, params, message, tmp_path, monkeypatch):
    """The notebook's own code, in this process (as papermill would run it: the parameters cell, then the values
    given), refuses the values in one of the first two code cells after its parameters, naming them."""
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.chdir(NB_DIR)  # papermill's working directory: notebooks/ (its modules import from there)
    monkeypatch.syspath_prepend(str(NB_DIR))
    code = [c for c in nbformat.read(str(NB_DIR / f"{stem}.ipynb"), as_version=4).cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    ns: dict = {}
    exec(code[first].source, ns)
    ns.update(params)
    with pytest.raises(ValueError, match=re.escape(message)):
        for cell in code[first + 1:first + 3]:
            exec(compile(cell.source, f"{stem}.ipynb", "exec"), ns)


# ------------------------------------------------------------------------- one papermill run per notebook


@pytest.fixture(scope="session")
def ci_runs(tmp_path_factory) -> dict[str, Path]:
    """Every notebook once under papermill with its ci.yaml parameters, two at a time (on 2 CPU cores that
    halves the wall time): {stem: run folder}."""
    import concurrent.futures
    import time

    root = tmp_path_factory.mktemp("ci-runs")
    grids = [sweep.Grid(nb, nb.stem, fixed=dict(CI_OVERRIDES.get(nb.stem) or {}), timeout_s=1200)  # a hang fails
             for nb in NOTEBOOKS]
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reps = list(pool.map(lambda g: sweep.run_sweep(g, root=root), grids))
    out = {}
    for rep in reps:
        (point,) = rep.points
        out[rep.name] = rep.directory / point.hash
        print(f"{rep.name}: {point.status} in {point.elapsed_s} s")
    print(f"wall {time.time() - t0:.0f} s, sum {sum(r.points[0].elapsed_s or 0 for r in reps):.0f} s")
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("ci_runs")  # one worker runs the notebooks, once
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_headless(nb, ci_runs):
    """Each notebook runs under papermill with its CI parameters, saving its own figures and results."""
    run = ci_runs[nb.stem]
    assert (run / "done").exists(), sweep.describe_error(nb.name, sweep._read_json(run / "error.json"))
    executed = nbformat.read(str(run / "notebook.ipynb"), as_version=4)
    assert all(c.metadata.get("papermill", {}).get("status") == "completed" for c in executed.cells
               if c.cell_type == "code")
    figures = sorted(p.name for p in (run / "figures").glob("*.png"))
    assert figures, f"{nb.name} saved no figure through moelab.plots.savefig"
    assert all(f.startswith(nb.stem[:2]) for f in figures), figures
    saved = sorted(p.name for p in (run / "results").glob("*"))
    assert saved and all(n.startswith(nb.stem[:3]) for n in saved), saved  # one folder can hold every notebook's


@pytest.mark.slow
@pytest.mark.xdist_group("ci_runs")
def test_quickstart_results_hold_what_its_figure_shows(ci_runs):
    """The quickstart's named results, counted against the native k."""
    from moelab.results import load_saved

    saved = load_saved(ci_runs["01_routing_quickstart"])
    stats = saved["01_policy_stats_random"].set_index("policy")
    native = stats.loc[stats.index.str.contains("native")].iloc[0]
    assert native.mean_k == 2.0 and native.expert_reduction == 0.0 and native.kept_pairs == native.native_pairs
    # EntropyAdaptiveK (k 1 or 2) with its threshold at the median entropy: mean k 1.5, 25% saved
    ea = stats.loc["EntropyAdaptiveK"]
    assert abs(ea.mean_k - 1.5) < 0.01 and abs(ea.expert_reduction - 0.25) < 0.01
    assert (stats.kept_pairs <= stats.native_pairs).all()
    assert "01_expert_load" in saved and (saved["01_expert_load"].normalised_entropy <= 1).all()


@pytest.mark.slow
@pytest.mark.xdist_group("ci_runs")
def test_kernel_bench_explorer_runs(ci_runs):
    """04's explorer (ipywidgets, interactive=True in ci.yaml) builds from the committed results."""
    assert CI_OVERRIDES["04_kernel_bench"]["interactive"] is True
    out = nbformat.read(str(ci_runs["04_kernel_bench"] / "notebook.ipynb"), as_version=4)
    # one widget stored with the notebook: a shape dropdown and, in its output, the first shape's table of graph
    # and eager times per T
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
