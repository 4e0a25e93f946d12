"""moelab.sweep: grids, run folders, claims, tables and the command line; real sweeps of a toy notebook (resume,
executors, two sweeps on one folder, Ctrl-C, timeouts, the main job)."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from toy_notebooks import log_lines, write_toy_notebook

from moelab import sweep
from moelab.results import REPO


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return write_toy_notebook(tmp_path_factory.mktemp("nb") / "toy.ipynb")


def _starts(log: Path) -> list[tuple[int, str]]:
    """(x, CUDA_VISIBLE_DEVICES) of every run the toy notebook started."""
    return [(int(ln.split()[1]), ln.split()[2]) for ln in log_lines(log) if ln.startswith("start")]


def _run(d: Path, params: dict, end: str = "done", record=None, digest: str = "D", results: dict | None = None):
    """A finished run folder written by hand (what a sweep or an outside engine leaves)."""
    (d / "results").mkdir(parents=True)
    (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "notebook_digest": digest,
                                               "parameters": params}))
    (d / end).write_text(json.dumps(record if record is not None else {"elapsed_s": 1}))
    for name, obj in (results or {}).items():
        if isinstance(obj, pd.DataFrame):
            obj.to_parquet(d / "results" / f"{name}.parquet", index=False)
        else:
            (d / "results" / f"{name}.json").write_text(json.dumps(obj))
    return d


# ------------------------------------------------------------------------------------------------ grids


def test_grid_points_are_the_cartesian_product_plus_fixed(toy):
    g = sweep.Grid(notebook=toy, name="g", parameters={"x": [1, 2, 3], "fail_at": [0, 9]}, fixed={"sleep_s": 0.1})
    pts = g.points()
    assert len(pts) == 6
    assert {(p["x"], p["fail_at"]) for p in pts} == {(x, f) for x in (1, 2, 3) for f in (0, 9)}
    assert all(p["sleep_s"] == 0.1 for p in pts)
    g.check_parameters()


def test_param_hash_is_stable_order_free_and_distinct(toy):
    a = sweep.param_hash(toy, {"x": 1, "sleep_s": 0.0})
    assert a == sweep.param_hash(toy, {"sleep_s": 0.0, "x": 1})
    assert a != sweep.param_hash(toy, {"x": 2, "sleep_s": 0.0})
    assert a != sweep.param_hash(toy.with_name("other.ipynb"), {"x": 1, "sleep_s": 0.0})
    assert len(a) == 12 and int(a, 16) >= 0


@pytest.mark.parametrize("kw, match", [
    ({"parameters": {"x": 3}}, "parameters.x=3"),
    ({"parameters": {"x": []}}, "non-empty list"),
    ({"parameters": {"x": [1]}, "fixed": {"x": 2}}, r"\['x'\]: both swept and fixed"),
    ({"name": "a/b"}, "name='a/b'"),
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": "15m"}, "timeout_s='15m'"),
    ({"timeout_s": True}, "timeout_s=True"),
    ({"parameters": {"x": [1, 2, 1]}}, r"parameters.x=\[1, 2, 1\]: a value is listed twice"),
    ({"fixed": {"log_path": datetime.date(2024, 5, 1)}}, r"log_path=datetime.date\(2024, 5, 1\) \(date\): must"),
    ({"parameters": {"sleep_s": [0.5, float("nan")]}}, "sleep_s=nan"),
])
def test_bad_grids_raise_naming_the_value(toy, kw, match):
    with pytest.raises(ValueError, match=match):
        sweep.Grid(**{"notebook": toy, "name": "g", **kw})


def test_missing_notebook_unknown_parameter_and_wrong_type(toy, tmp_path):
    with pytest.raises(ValueError, match="nope.ipynb'?: no such"):
        sweep.Grid(notebook=tmp_path / "nope.ipynb", name="g")
    with pytest.raises(ValueError, match=r"\['y'\]: not in the parameters cell of toy.ipynb"):
        sweep.Grid(notebook=toy, name="g", parameters={"y": [1]}).check_parameters()
    with pytest.raises(ValueError, match=r"parameter x='1024': toy.ipynb declares it int"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": ["1024", 2048]}).check_parameters()
    with pytest.raises(ValueError, match=r"parameter x=True: toy.ipynb declares it int"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": [True]}).check_parameters()
    with pytest.raises(ValueError, match=r"parameter sleep_s='1': toy.ipynb declares it float"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": [1]}, fixed={"sleep_s": "1"}).check_parameters()
    sweep.Grid(notebook=toy, name="t", parameters={"x": [1]}, fixed={"sleep_s": 1}).check_parameters()  # int: float


def test_load_grid_finds_the_notebook_and_names_the_file_it_cannot_read(toy, tmp_path):
    p = tmp_path / "grid.yaml"
    p.write_text(yaml.safe_dump({"notebook": "toy.ipynb", "name": "g", "parameters": {"x": [1, 2]}}))
    shutil.copy(toy, tmp_path / "toy.ipynb")
    g = sweep.load_grid(p)  # the notebook beside the grid file
    assert g.notebook == tmp_path / "toy.ipynb" and len(g.points()) == 2
    for text, match in (("parameter: {x: [1]}\nnotebook: toy.ipynb", r"only the keys .* it has \['notebook', 'par"),
                        ("[1, 2]", "must be a mapping"), ("notebook: [unclosed", "cannot be read as YAML"),
                        ("notebook: toy.ipynb\nparameters: {x: 3}", "parameters.x=3: swept values"),
                        ("notebook: nope.ipynb", "nope.ipynb'?: no such")):
        p.write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            sweep.load_grid(p)
        assert str(p) in str(e.value)
    p.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match=f"grid '{p}': cannot be read"):
        sweep.load_grid(p)
    with pytest.raises(ValueError, match="grid 'missing.yaml': cannot be read"):
        sweep.load_grid("missing.yaml")


def test_a_damaged_notebook_is_named(tmp_path):
    nb = tmp_path / "broken.ipynb"
    nb.write_text('{"cells": [')
    with pytest.raises(ValueError, match=re.escape(f"{nb}: papermill cannot read it")):
        sweep.Grid(nb, "g", {"x": [1]}).check_parameters()
    with pytest.raises(ValueError, match=re.escape(f"{nb}: cannot be read as JSON")):
        sweep.notebook_digest(nb)


def test_repo_grids_are_valid():
    for path in sorted((REPO / "notebooks" / "grids").glob("*.yaml")):
        if path.name == "ci.yaml":
            continue  # per-notebook overrides for the tests, not a grid
        g = sweep.load_grid(path)
        g.check_parameters()
        assert g.points()


# ------------------------------------------------------------------------------------ folders and claims


def test_shards_split_the_grid_disjointly(toy, tmp_path):
    g = sweep.Grid(notebook=toy, name="g", parameters={"x": [1, 2, 3, 4, 5]})
    everything = [sweep.param_hash(toy, p) for p in g.points()]
    for n in (1, 2, 3):
        shards = [[p.hash for p in sweep.run_sweep(g, root=tmp_path, shard=(i, n), collect_only=True).points]
                  for i in range(n)]
        assert sorted(h for s in shards for h in s) == sorted(everything), n
        assert [len(s) for s in shards] == [len(range(i, 5, n)) for i in range(n)], n


def test_a_grid_unlike_the_folders_is_refused_and_more_values_extend_it(toy, tmp_path):
    sweep.run_sweep(sweep.Grid(toy, "same", {"x": [1, 2]}, {"sleep_s": 0.0}), root=tmp_path, collect_only=True)
    sweep.run_sweep(sweep.Grid(toy, "same", {"x": [1, 2, 3]}, {"sleep_s": 0.0}), root=tmp_path, collect_only=True)
    for params, fixed, match in (({"x": [1]}, {"sleep_s": 1.0}, "sleep_s: fixed 0.0 there, fixed 1.0 here"),
                                 ({"x": [1], "fail_at": [0]}, {"sleep_s": 0.0}, "fail_at: absent there, swept here"),
                                 ({"x": [1]}, {}, "sleep_s: fixed 0.0 there, absent here")):
        with pytest.raises(ValueError, match=match) as e:
            sweep.run_sweep(sweep.Grid(toy, "same", params, fixed), root=tmp_path, collect_only=True)
        assert f"{tmp_path / 'same'} holds runs of another grid named 'same'" in str(e.value)
    other = toy.with_name("other.ipynb")
    shutil.copy(toy, other)
    with pytest.raises(ValueError, match="notebook toy.ipynb there, other.ipynb here"):
        sweep.run_sweep(sweep.Grid(other, "same", {"x": [1]}, {"sleep_s": 0.0}), root=tmp_path, collect_only=True)


def test_claims_are_exclusive_and_a_dead_claimants_is_released(tmp_path):
    claim = tmp_path / "abc.claim"
    mine = sweep._claim(claim, 3600)
    assert mine and json.loads(mine)["pid"] == os.getpid()
    assert sweep._claim(claim, 3600) is None  # held by a live process
    sweep._release(claim, mine)
    assert not claim.exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    here, now = socket.gethostname(), time.time()
    for holder, age, free in (({"host": here, "pid": gone.pid}, 0, True),  # this host, process gone
                              ({"host": here, "pid": os.getppid()}, 0, False),  # this host, alive
                              ({"host": "elsewhere", "pid": gone.pid}, 0, False),  # another host's, fresh
                              ({"host": "elsewhere", "pid": 1}, 7200, True),  # another host's, past the timeout
                              (None, 7200, True)):  # unreadable and old
        claim.write_text(json.dumps(holder) if holder else "{")
        os.utime(claim, (now - age, now - age))
        got = sweep._claim(claim, 3600)
        assert (got is not None) == free, (holder, age)
        if got:
            assert json.loads(claim.read_text())["pid"] == os.getpid()
            sweep._release(claim, got)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "abc.claim"]  # no break lock or temporary left


def test_a_point_another_sweep_holds_is_left_to_it(toy, tmp_path):
    """A point claimed by a live process is reported busy and not run (no papermill starts here)."""
    run_dir = tmp_path / "s" / sweep.param_hash(toy, {"x": 1})
    run_dir.parent.mkdir()
    (tmp_path / "s" / f"{run_dir.name}.claim").write_text(json.dumps({"host": socket.gethostname(),
                                                                      "pid": os.getppid(), "started": time.time()}))
    assert sweep.run_point(toy, {"x": 1}, run_dir).status == "busy" and not run_dir.exists()


# -------------------------------------------------------------------------------------------------- tables


def test_collect_tabulates_parameters_status_and_results(tmp_path):
    _run(tmp_path / "aaa", {"x": 1, "run": 7}, results={"metrics": {"y": 1, "nested": {"z": [1, 2]}},
                                                          "status": "converged",
                                                          "rows": pd.DataFrame({"run": ["r1"], "x": [0.5]})})
    _run(tmp_path / "bbb", {"x": 2, "run": 8}, end="error.json",
         record={"cell_index": 3, "exec_count": 4, "ename": "E", "evalue": "bad", "source_excerpt": "line 1: f()"})
    _run(tmp_path / "ccc", {"x": 3, "run": 9}, digest="OLD", results={"metrics": {"y": 9}})
    tables = sweep.collect(tmp_path, "D")
    summary = pd.read_csv(tables["summary.csv"]).set_index("x")
    assert summary.loc[1, "status"] == "ok" and summary.loc[1, "metrics.y"] == 1
    assert summary.loc[1, "metrics.nested.z"] == "[1, 2]" and summary.loc[1, "result.status"] == "converged"
    assert summary.loc[1, "run"] == "aaa" and summary.loc[1, "param.run"] == 7  # a parameter named like a column
    assert summary.loc[2, "status"] == "failed" and "cell 3 failed: E: bad" in summary.loc[2, "error"]
    assert summary.loc[3, "status"] == "stale" and pd.isna(summary.loc[3, "metrics.y"])  # another notebook version
    assert pd.read_csv(tables["rows.csv"]).to_dict("records") == [
        {"sweep.run": "aaa", "param.x": 1, "param.run": 7, "run": "r1", "x": 0.5}]
    assert pd.read_parquet(tables["summary.parquet"]).shape == pd.read_csv(tables["summary.csv"]).shape
    # every run stale now: the frame tables of the earlier collect go, the summary stays
    assert set(sweep.collect(tmp_path, "NEW")) == {"summary.csv", "summary.parquet"}
    assert not (tmp_path / "rows.csv").exists() and not (tmp_path / "rows.parquet").exists()


def test_mixed_value_types_in_a_column_still_tabulate(tmp_path):
    _run(tmp_path / "aaa", {"x": "1024"})
    _run(tmp_path / "bbb", {"x": 2048})
    assert sorted(pd.read_parquet(sweep.collect(tmp_path)["summary.parquet"])["x"]) == ["1024", "2048"]


@pytest.mark.parametrize("damage, file", [({"params": "{"}, "params.json"), ({"done": "{"}, "done"),
                                           ({"metrics": '{"y": '}, "metrics.json")])
def test_a_run_file_that_cannot_be_read_is_named(tmp_path, damage, file):
    d = _run(tmp_path / "aaa", {"x": 1}, results={"metrics": {"y": 1}})
    target = {"params": d / "params.json", "done": d / "done", "metrics": d / "results" / "metrics.json"}
    for k, text in damage.items():
        target[k].write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(d)) + ".*" + file):
        sweep.collect(tmp_path)


def test_a_damaged_params_json_stops_a_sweep_naming_it(toy, tmp_path):
    g = sweep.Grid(toy, "dmg", {"x": [1]})
    d = tmp_path / "dmg" / sweep.param_hash(toy, {"x": 1})
    _run(d, {"x": 1})
    (d / "params.json").write_text("not json")
    with pytest.raises(ValueError, match=re.escape(f"{d / 'params.json'}: cannot be read as JSON")):
        sweep.run_sweep(g, root=tmp_path)


def test_list_lines_let_an_outside_engine_keep_its_runs_current(toy, tmp_path, capsys):
    """A run made by another engine from a --list line (params.json = the line, a `done` marker) counts as
    done for a later sweep (not stale, not rerun) and is in the summary."""
    grid = tmp_path / "ext.yaml"
    grid.write_text(yaml.safe_dump({"notebook": str(toy), "name": "ext", "parameters": {"x": [1, 2]}}))
    assert sweep.main([str(grid), "--list", "--root", str(tmp_path)]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [ln["parameters"] for ln in lines] == [{"x": 1}, {"x": 2}]
    for ln in lines:
        d = Path(ln["run_dir"])
        d.mkdir(parents=True)
        (d / "params.json").write_text(json.dumps(ln))
        (d / "done").write_text("{}")
    rep = sweep.run_sweep(grid, root=tmp_path)  # nothing left to run
    assert rep.counts() == {"done": 2}
    summary = pd.read_csv(tmp_path / "ext" / "summary.csv")
    assert sorted(summary["x"]) == [1, 2] and set(summary["status"]) == {"ok"}


def test_a_failure_of_the_runner_is_recorded_against_its_point(toy, tmp_path, monkeypatch):
    """An exception outside the notebook (a full disk, say) fails its point; the other points still run."""
    def run_point(notebook, params, run_dir, **kw):
        if params["x"] == 2:
            raise OSError("disk full")
        return sweep.Point(run_dir.name, params, "ok")

    monkeypatch.setattr(sweep, "run_point", run_point)
    rep = sweep.run_sweep(sweep.Grid(toy, "runner", {"x": [1, 2, 3]}), root=tmp_path)
    assert [(p.params["x"], p.status) for p in rep.points] == [(1, "ok"), (2, "failed"), (3, "ok")]
    assert rep.failed[0].error == {"ename": "OSError", "evalue": "disk full"}


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("argv, match", [
    (["--main", "--list"], "--main takes only --resume and --root, not --list"),
    (["--main", "--collect", "--shard", "0/2"], "not --collect --shard"),
    (["notebooks/grids/ci.yaml", "--resume"], "--resume is for --main"),
    (["notebooks/grids/ci.yaml", "--list", "--shard", "0/2", "--rerun"], "it takes only --root, not --rerun --shard"),
    (["missing-grid.yaml"], "grid 'missing-grid.yaml': cannot be read"),
    (["g.yaml", "--shard", "3/2"], "shard='3/2': must read I/N with integers 0 <= I < N"),
    (["g.yaml", "--shard", "abc"], "shard='abc'"),
])
def test_cli_refuses_what_it_would_not_honour(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "run_main", lambda **kw: pytest.fail("ran notebooks"))
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: pytest.fail("ran a sweep"))
    with pytest.raises(SystemExit) as e:
        sweep.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and "Traceback" not in err


def test_cli_bad_parameter_is_a_usage_error(toy, tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"notebook": str(toy), "parameters": {"xx": [1, 2]}}))
    for argv in ([str(typo)], [str(typo), "--list"]):
        with pytest.raises(SystemExit) as e:
            sweep.main([*argv, "--root", str(tmp_path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "parameters ['xx']: not in the parameters cell" in err and "Traceback" not in err


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_imports_this_checkouts_lib_before_any_other_moelab(tmp_path):
    """`make run` / `make test` import the moelab beside the Makefile even when another one comes first on the
    path (an editable install of another clone)."""
    decoy = tmp_path / "other" / "moelab"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    out = subprocess.run(["make", "-s", "-C", str(REPO), "--eval",
                          'where:\n\t@$(PY) -c "import moelab; print(moelab.__file__)"', "where"],
                         env={**os.environ, "PYTHONPATH": str(decoy.parent)}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert Path(out[0]) == REPO / "lib" / "moelab" / "__init__.py"


# ------------------------------------------------------------------------------ real runs of the toy notebook


def test_sweep_records_failures_tabulates_and_resumes(toy, tmp_path):
    log = tmp_path / "log.txt"
    g = sweep.Grid(toy, "toy", {"x": [2, 3]}, {"fail_at": 2, "log_path": str(log)})
    rep = sweep.run_sweep(g, root=tmp_path / "runs")
    assert [(p.params["x"], p.status) for p in rep.points] == [(2, "failed"), (3, "ok")]
    # the failure names its cell, line and exception, and did not stop the next run
    (bad,) = rep.failed
    assert bad.error["cell_index"] == 2 and bad.error["ename"] == "ValueError" and bad.error["line"] == 14
    assert "x=2 is the configured failure" in bad.error["evalue"]
    assert bad.error["source_excerpt"].startswith("line 14: raise ValueError")
    failed = rep.directory / bad.hash
    assert (failed / "error.json").exists() and not (failed / "done").exists()
    assert (failed / "notebook.ipynb").exists()  # the executed notebook shows the traceback
    for p in rep.points:  # each run complete in its own folder; nothing temporary or claimed is left
        d = rep.directory / p.hash
        assert json.loads((d / "params.json").read_text())["parameters"]["x"] == p.params["x"]
        assert p.status == "failed" or ((d / "done").exists() and (d / "results" / "metrics.json").exists())
    assert sorted(f.name for f in rep.directory.iterdir() if f.is_file()) == [
        "grid.json", "rows.csv", "rows.parquet", "summary.csv", "summary.parquet"]
    summary = pd.read_parquet(rep.tables["summary.parquet"]).set_index("x")
    assert summary["metrics.y"].dropna().to_dict() == {3: 9} and "cell 2 failed" in summary.loc[2, "error"]
    rows = pd.read_parquet(rep.tables["rows.parquet"]).sort_values(["x", "i"])
    assert rows.x.tolist() == [3, 3] and (rows.v - rows.x).tolist() == [0.0, 0.5]
    # the same sweep again skips the finished runs and retries only the failed one, which fails again in place
    n = len(log_lines(log))
    rep2 = sweep.run_sweep(g, root=tmp_path / "runs")
    assert [p.status for p in rep2.points] == ["failed", "done"]
    assert log_lines(log)[n:] == ["start 2 -"] and (failed / "error.json").exists()
    assert not [f for f in rep.directory.iterdir() if f.name.startswith(".")]


def test_points_spread_over_gpus_through_an_executor_run_once_each(toy, tmp_path):
    """--gpus: a thread pool whose threads each take a free GPU id from a queue and set CUDA_VISIBLE_DEVICES
    (fake ids here: the toy only records them)."""
    log = tmp_path / "log.txt"
    g = sweep.Grid(toy, "gpus", {"x": [1, 2, 3]}, {"log_path": str(log), "sleep_s": 1.0})
    rep = sweep.run_sweep(g, root=tmp_path, gpus=["7", "8"])
    assert [p.status for p in rep.points] == ["ok"] * 3
    starts = _starts(log)
    assert sorted(x for x, _ in starts) == [1, 2, 3]  # each point once
    assert {gpu for _, gpu in starts} == {"7", "8"}  # two at a time, one per GPU
    for p in rep.points:
        assert json.loads((rep.directory / p.hash / "done").read_text())["gpu"] in ("7", "8")


@pytest.mark.slow
def test_a_dask_executor_runs_the_grid(toy, tmp_path):
    distributed = pytest.importorskip("distributed")
    log = tmp_path / "log.txt"
    g = sweep.Grid(toy, "dask", {"x": [1, 2]}, {"log_path": str(log)})
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as client:
        rep = sweep.run_sweep(g, root=tmp_path, executor=client.get_executor(pure=False))
    assert [p.status for p in rep.points] == ["ok", "ok"] and sorted(x for x, _ in _starts(log)) == [1, 2]
    assert len(pd.read_csv(rep.tables["summary.csv"])) == 2


def _sweep_cmd(grid: Path, root: Path) -> list[str]:
    return [sys.executable, "-m", "moelab.sweep", str(grid), "--root", str(root)]


def test_two_sweeps_started_at_once_on_one_folder_run_each_point_once(toy, tmp_path):
    log = tmp_path / "log.txt"
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"notebook": str(toy), "name": "both", "parameters": {"x": [1, 2, 3, 4]},
                                    "fixed": {"log_path": str(log), "sleep_s": 0.5}}))
    procs = [subprocess.Popen(_sweep_cmd(grid, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(x for x, _ in _starts(log)) == [1, 2, 3, 4], outs  # every point run exactly once
    assert len(list((tmp_path / "both").glob("*/done"))) == 4
    assert not list((tmp_path / "both").glob("*.claim")) and not list((tmp_path / "both").glob(".tmp-*"))


def _wait_for(pred, timeout_s: float, what: str):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def test_ctrl_c_says_what_finished_keeps_it_and_the_command_resumes(toy, tmp_path):
    log = tmp_path / "log.txt"
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"notebook": str(toy), "name": "stop", "parameters": {"x": [1, 2]},
                                    "fixed": {"log_path": str(log), "sleep_s": 3.0}}))
    d = tmp_path / "stop"
    proc = subprocess.Popen(_sweep_cmd(grid, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_starts(log)) >= 2, 300, "the second run to start")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in out + err, out + err
    (line,) = out.splitlines()
    finished = [p.parent for p in d.glob("*/done")]
    assert line.startswith(f"interrupted: {len(finished)} of 2 points done in {d} (kept); to resume: "
                           f"python -m moelab.sweep {grid} --root {tmp_path}"), line
    assert len(finished) in (1, 2)  # x = 1 (x = 2 too only if its sleep outlasted the signal on a busy machine)
    assert not list(d.glob("*.claim")) and not list(d.glob(".tmp-*"))
    # the line's command resumes: only the points not finished run
    n = len(_starts(log))
    subprocess.run(_sweep_cmd(grid, tmp_path), check=True, capture_output=True)
    assert len(list(d.glob("*/done"))) == 2 and len(_starts(log)) - n == 2 - len(finished)


def test_a_run_past_its_timeout_fails_as_timeout(toy, tmp_path):
    g = sweep.Grid(toy, "slow", {"x": [1]}, {"sleep_s": 120.0}, timeout_s=1)
    (p,) = sweep.run_sweep(g, root=tmp_path).points
    assert p.status == "failed" and p.error["ename"] == "Timeout" and "timeout_s=1" in p.error["evalue"]
    assert (tmp_path / "slow" / p.hash / "error.json").exists() and not (tmp_path / "slow" / p.hash / "done").exists()


def test_a_papermill_failure_outside_any_cell_is_named(tmp_path):
    bad = tmp_path / "bad.ipynb"  # cells (so it has a digest) but no nbformat version: papermill refuses it
    bad.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "1", "metadata": {}, "outputs": [],
                                          "execution_count": None}], "metadata": {}}))
    p = sweep.run_point(bad, {}, tmp_path / "runs" / "abc123")
    assert p.status == "failed" and p.error["cell_index"] is None and p.error["ename"] != "PapermillExit1"
    assert "Traceback" in (tmp_path / "runs" / "abc123" / "papermill.log").read_text()


def test_main_runs_every_notebook_reports_failures_and_resumes(tmp_path, capsys):
    nbs = tmp_path / "notebooks"
    write_toy_notebook(nbs / "01_first.ipynb")
    write_toy_notebook(nbs / "02_second.ipynb")
    write_toy_notebook(nbs / "notes.ipynb")  # not NN_*: not part of the main job
    overrides = {"01_first": {"fail_at": 0}, "02_second": {"table": "02_table"}}
    rc = sweep.run_main(nbs, root=tmp_path / "runs", overrides=overrides, figures=tmp_path / "figures")
    out = capsys.readouterr().out
    assert rc == 1 and "01_first.ipynb: cell 2 failed" in out and "FAILED: 01_first.ipynb" in out  # 02 still ran
    assert "1 of 2 notebooks ran" in out and f"figures in {tmp_path / 'figures'}/" in out
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["02_table.csv", "02_table.tex"]
    assert not (tmp_path / "runs" / "main" / "notes").exists()
    rc = sweep.run_main(nbs, root=tmp_path / "runs", resume=True, overrides=overrides, figures=tmp_path / "figures")
    out = capsys.readouterr().out
    assert rc == 1 and "02_second.ipynb: done earlier" in out and "01_first.ipynb: FAILED" in out
