"""moelab.sweep: grid expansion and validation, run hashes, one real sweep of a toy notebook
(parallel-safe layout, failures recorded without stopping the others, combined tables, resume)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
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


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"parameters": {"x": 3}}, "parameters.x=3"),
        ({"parameters": {"x": []}}, "non-empty list"),
        ({"parameters": {"x": [1]}, "fixed": {"x": 2}}, "both as swept and as fixed"),
        ({"name": "a/b"}, "name='a/b'"),
        ({"figures": "elsewhere"}, "figures='elsewhere'"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"timeout_s": "15m"}, "timeout_s='15m'"),
        ({"timeout_s": True}, "timeout_s=True"),
        ({"workers": 0}, "workers=0"),
        ({"parameters": {"x": [1, 2, 1]}}, "x: the value 1 is listed twice"),
        ({"fixed": {"log_path": datetime.date(2024, 5, 1)}}, r"log_path=datetime.date\(2024, 5, 1\) \(date\): must"),
        ({"parameters": {"sleep_s": [0.5, float("nan")]}}, "sleep_s=nan"),
    ],
)
def test_bad_grids_raise_naming_the_value(toy, kw, match):
    args = {"notebook": toy, "name": "g", **kw}
    with pytest.raises(ValueError, match=match):
        sweep.Grid(**args)


def test_missing_notebook_and_unknown_parameter(toy, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        sweep.Grid(notebook=tmp_path / "nope.ipynb", name="g")
    with pytest.raises(ValueError, match=r"\['y'\]: not in the parameters cell of toy.ipynb"):
        sweep.Grid(notebook=toy, name="g", parameters={"y": [1]}).check_parameters()


def test_load_grid_resolves_the_notebook_beside_the_grid(toy, tmp_path):
    p = tmp_path / "grid.yaml"
    p.write_text(yaml.safe_dump({"notebook": str(toy), "name": "g", "parameters": {"x": [1, 2]}}))
    g = sweep.load_grid(p)
    assert g.notebook == toy and len(g.points()) == 2
    p.write_text(yaml.safe_dump({"notebook": str(toy), "parameter": {"x": [1]}}))
    with pytest.raises(ValueError, match=r"unknown keys \['parameter'\]"):
        sweep.load_grid(p)


def test_shards_split_the_grid_disjointly(toy, tmp_path):
    assert sweep.parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "x/2", "1"):
        with pytest.raises(ValueError, match="shard="):
            sweep.parse_shard(bad)
    # run_sweep with each shard I/N (collect_only: nothing executes) covers every point exactly once
    g = sweep.Grid(notebook=toy, name="g", parameters={"x": [1, 2, 3, 4, 5]})
    everything = [h for h, _ in sweep.param_hash_points(g)]
    assert len(set(everything)) == 5
    for n in (1, 2, 3):
        shards = [[r.hash for r in sweep.run_sweep(g, root=tmp_path / "runs", shard=f"{i}/{n}", collect_only=True,
                                                   progress=False).runs] for i in range(n)]
        assert sorted(h for s in shards for h in s) == sorted(everything), n
        assert [len(s) for s in shards] == [len(range(i, 5, n)) for i in range(n)], n


def test_repo_grids_are_valid():
    for path in sorted((sweep.REPO / "notebooks" / "grids").glob("*.yaml")):
        if path.name == "ci.yaml":
            continue  # per-notebook overrides, not a grid (tests/test_notebooks.py reads it)
        g = sweep.load_grid(path)
        g.check_parameters()
        assert g.points()


@pytest.mark.slow
def test_sweep_runs_records_failures_combines_and_resumes(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figs"))
    log = tmp_path / "log.txt"
    g = sweep.Grid(notebook=toy, name="toy", parameters={"x": [1, 2, 3]},
                   fixed={"fail_at": 2, "log_path": str(log)})
    rep = sweep.run_sweep(g, root=tmp_path / "runs", progress=False)
    assert sorted(r.status for r in rep.runs) == ["failed", "ok", "ok"]

    # the failure names its cell and the exception, and did not stop the other runs
    (bad,) = rep.failed
    assert bad.params["x"] == 2
    assert bad.error["cell_index"] == 2 and bad.error["ename"] == "ValueError"
    assert "x=2 is the configured failure" in bad.error["evalue"]
    assert bad.error["source_excerpt"].startswith("line 13: raise ValueError")
    failed_dir = rep.directory / bad.hash
    assert (failed_dir / "error.json").exists() and not (failed_dir / "done").exists()
    assert (failed_dir / "notebook.ipynb").exists()  # the executed notebook shows the traceback

    # every finished run is complete in its own folder; no temporary folders remain
    for r in rep.runs:
        d = rep.directory / r.hash
        assert json.loads((d / "params.json").read_text())["parameters"]["x"] == r.params["x"]
        if r.status == "ok":
            assert (d / "done").exists() and (d / "results" / "metrics.json").exists()
    assert not list(rep.directory.glob(".tmp-*"))

    # the combined tables carry the parameters as columns
    summary = pd.read_parquet(rep.tables["summary.parquet"])
    assert sorted(summary.x) == [1, 2, 3]
    ok = summary[summary.status == "ok"].sort_values("x")
    assert ok["metrics.y"].tolist() == [1, 9]
    assert "cell 2" in summary.loc[summary.x == 2, "error"].item()
    rows = pd.read_parquet(rep.tables["rows.parquet"])
    assert sorted(rows.x.unique()) == [1, 3] and len(rows) == 4
    assert (rows.v - rows.x).tolist() == [0.0, 0.5, 0.0, 0.5]
    assert pd.read_csv(rep.tables["rows.csv"]).shape == rows.shape

    # a rerun skips the finished runs and retries only the failed one (which now succeeds)
    before = log_lines(log)
    g2 = sweep.Grid(notebook=toy, name="toy", parameters={"x": [1, 2, 3]},
                    fixed={"fail_at": 2, "log_path": str(log)})
    g2.fixed["fail_at"] = 2  # same grid: same hashes
    rep2 = sweep.run_sweep(g2, root=tmp_path / "runs", progress=False)
    assert sorted(r.status for r in rep2.runs) == ["done", "done", "failed"]
    assert log_lines(log)[len(before):] == ["start 2"]

    # a rerun whose notebook now fails on a point that finished before reports the failure and keeps it
    g3 = sweep.Grid(notebook=toy, name="toy", parameters={"x": [1]}, fixed={"fail_at": 2, "log_path": str(log)})
    (h1,) = [h for h, p in sweep.param_hash_points(g3)]
    (rep.directory / h1 / "done").write_text("{}")  # as if finished by an earlier version
    params = json.loads((rep.directory / h1 / "params.json").read_text())
    params["parameters"]["fail_at"] = 1  # this attempt fails at x = 1 ...
    orig = sweep._launch
    monkeypatch.setattr(sweep, "_launch", lambda nb, p, *a: orig(nb, {**p, "fail_at": 1}, *a))
    rep3 = sweep.run_sweep(g3, root=tmp_path / "runs", progress=False, rerun=True)
    assert [r.status for r in rep3.runs] == ["failed"]  # ... and is not hidden by the earlier 'done'
    assert (rep.directory / h1 / "error.json").exists() and not (rep.directory / h1 / "done").exists()

    # a failure of the runner itself is recorded against its point; the other points still run
    def broken(nb, p, *a):
        if p["x"] == 3:
            raise OSError("disk full")
        return orig(nb, p, *a)

    monkeypatch.setattr(sweep, "_launch", broken)
    rep4 = sweep.run_sweep(g, root=tmp_path / "runs", progress=False, rerun=True)
    by_x = {r.params["x"]: r for r in rep4.runs}
    assert by_x[3].status == "failed" and by_x[3].error["ename"] == "RunnerOSError"
    assert by_x[1].status == "ok" and by_x[2].status == "failed"


@pytest.mark.slow
def test_main_runs_every_notebook_reports_failures_and_lists_outputs(tmp_path, monkeypatch, capsys):
    nbs = tmp_path / "notebooks"
    write_toy_notebook(nbs / "01_first.ipynb")
    write_toy_notebook(nbs / "02_second.ipynb")
    write_toy_notebook(nbs / "notes.ipynb")  # not NN_*: not part of the main job
    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figures"))
    assert [g.notebook.name for g in sweep.main_grids(nbs)] == ["01_first.ipynb", "02_second.ipynb"]
    rc = sweep.run_main(nbs, root=tmp_path / "runs",
                        overrides={"01_first": {"fail_at": 0}, "02_second": {"table": "02_table"}})
    out = capsys.readouterr().out
    assert rc == 1  # 01 failed, and 02 still ran
    assert "01_first.ipynb: cell 2" in out and "FAILED: 01_first.ipynb" in out
    assert "1/2 notebooks ran" in out
    assert f"Figures and tables (2 files) are in {tmp_path / 'figures'}/" in out
    assert "02_table.csv" in out and "02_table.tex" in out
    assert (tmp_path / "runs" / "main" / "02_second" / "summary.csv").exists()
    rc = sweep.run_main(nbs, root=tmp_path / "runs", resume=True,  # 02 finished: not run again, and said so
                        overrides={"01_first": {"fail_at": 0}, "02_second": {"table": "02_table"}})
    out = capsys.readouterr().out
    assert rc == 1 and "done earlier (--resume: not run again)" in out and "0/2 notebooks ran, 1 done earlier" in out


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_imports_this_checkouts_lib_before_any_other_moelab(tmp_path):
    """`make run` / `make test` import the moelab beside the Makefile even when another one comes first on the
    path (an editable install of another clone): else they would run, test and record that clone's code."""
    decoy = tmp_path / "other" / "moelab"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(decoy.parent)}
    out = subprocess.run(
        ["make", "-s", "-C", str(REPO), "--eval",
         'where:\n\t@$(PY) -c "import moelab; print(moelab.__file__)"', "where"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.splitlines()
    assert Path(out[0]) == REPO / "lib" / "moelab" / "__init__.py"


def test_list_gives_an_outside_engine_what_keeps_its_runs_current(toy, tmp_path):
    """A run made by another engine from a --list line (params.json = the line, a `done` marker) counts as
    finished for a later ordinary sweep (not stale, not rerun) and is collected into the summary."""
    g = sweep.Grid(notebook=toy, name="ext", parameters={"x": [1, 2]}, fixed={"sleep_s": 0.0})
    lines = sweep.list_points(g, root=tmp_path)
    assert [ln["hash"] for ln in lines] == [h for h, _ in sweep.param_hash_points(g)]
    for ln in lines:
        d = Path(ln["run_dir"])
        d.mkdir(parents=True)
        (d / "params.json").write_text(json.dumps(ln))
        (d / "done").write_text("{}")
        assert sweep.run_state(d, sweep.notebook_digest(toy)) == "done"
    rep = sweep.run_sweep(g, root=tmp_path, collect_only=True)
    assert rep.counts().get("done") == 2 and not rep.failed
    summary = pd.read_csv(tmp_path / "ext" / "summary.csv")
    assert sorted(summary["x"]) == [1, 2] and set(summary["status"]) == {"ok"}


@pytest.mark.parametrize("argv, match", [
    (["--main", "--list"], "--main runs every notebook with its defaults; it takes only --resume and --root, "
                           "not --list"),
    (["--main", "--collect", "--shard", "0/2"], "not --collect, --shard"),
    (["missing-grid.yaml"], "grid 'missing-grid.yaml': no such file"),
    (["notebooks/grids/ci.yaml", "--workers", "0"], "--workers 0: must be at least 1"),
    (["notebooks/grids/ci.yaml", "--resume"], "--resume is for --main"),
    (["notebooks/grids/ci.yaml", "--list", "--shard", "0/2", "--rerun"], "it takes only --root, not --shard, --rerun"),
])
def test_cli_refuses_flags_it_would_ignore(argv, match, capsys, monkeypatch):
    """A flag the command would not honour (--main --list used to run every notebook) stops it at once."""
    monkeypatch.setattr(sweep, "run_main", lambda **kw: pytest.fail("ran notebooks"))
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: pytest.fail("ran a sweep"))
    with pytest.raises(SystemExit) as e:
        sweep.main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_bad_parameter_or_shard_is_a_usage_error_and_list_checks_names(toy, tmp_path, capsys, monkeypatch):
    """A misspelt parameter or a bad --shard stops the command with a one-line usage error (exit 2), not a
    traceback; --list refuses the misspelt parameter too, instead of listing points an engine would run."""
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: pytest.fail("ran a sweep"))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"notebook": str(toy), "parameters": {"x": [1, 2]}}))
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"notebook": str(toy), "parameters": {"xx": [1, 2]}}))
    for argv, match in (([str(typo)], "parameters ['xx']: not in the parameters cell"),
                        ([str(typo), "--list"], "parameters ['xx']: not in the parameters cell"),
                        ([str(good), "--shard", "3/2"], "shard='3/2': need N >= 1 and 0 <= I < N"),
                        ([str(good), "--shard", "abc"], "shard='abc': must read I/N")):
        with pytest.raises(SystemExit) as e:
            sweep.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and match in err and "Traceback" not in err, (argv, err)


def test_a_run_set_aside_by_a_killed_finish_comes_back(tmp_path):
    """`_finish` sets the old run folder aside (named after its attempt) before moving the new one in. Killed
    between the two renames, the next look at the run finishes the move once that attempt's process is gone:
    the attempt's folder moves in when it finished, else the old run moves back; nothing finished is lost. A
    live attempt's folders are left alone, and one set aside beside a run folder that exists is deleted."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()

    def folders(prefix, pid, token="0badf00d", done=True):
        d = tmp_path / f"{prefix}abc123-{host}-{pid}-{token}"
        (d / "results").mkdir(parents=True)
        (d / ("done" if done else "error.json")).write_text("{}")
        (d / "results" / "metrics.json").write_text(json.dumps({"y": prefix}))
        return d

    final = tmp_path / "abc123"
    old = folders(".old-", dead.pid)  # killed before the new run moved in, which had not finished
    assert sweep.run_state(final) == "done" and not old.exists()
    assert json.loads((final / "results" / "metrics.json").read_text()) == {"y": ".old-"}
    sweep.shutil.rmtree(final)
    old, new = folders(".old-", dead.pid), folders(".tmp-", dead.pid, done=False)  # the new one had finished
    assert sweep.run_state(final) == "failed" and not old.exists() and not new.exists()
    assert json.loads((final / "results" / "metrics.json").read_text()) == {"y": ".tmp-"}
    old = folders(".old-", dead.pid)  # left beside a run folder that exists
    assert sweep.run_state(final) == "failed" and not old.exists()
    sweep.shutil.rmtree(final)
    live = folders(".old-", os.getpid())  # a live attempt between its renames: not this look's to finish
    assert sweep.run_state(final) == "pending" and live.exists()
    sweep.shutil.rmtree(live)
    # an ordinary replacement leaves no folder aside
    final.mkdir()
    (final / "done").write_text("{}")
    tmp = tmp_path / f".tmp-abc123-{host}-{os.getpid()}-12345678"
    tmp.mkdir()
    (tmp / "error.json").write_text("{}")
    sweep._finish(tmp, final)
    assert sweep.run_state(final) == "failed" and sorted(p.name for p in tmp_path.iterdir()) == ["abc123"]


def test_a_timeout_is_a_failure_unless_the_run_had_already_written_done(tmp_path):
    """A run past timeout_s is killed and recorded as a Timeout failure. One killed after its `done` was written
    (here the notebook writes it itself and then hangs, standing in for a worker stopped while it moves its
    finished run into place) is finished: `done` and no error, reported ok, nothing left beside it."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("x: int = 0  # 1: write done first")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import json, os, pathlib, time\n"
        "if x == 1:\n"
        "    pathlib.Path(os.environ['MOELAB_RUN_DIR'], 'done').write_text(json.dumps({'status': 'ok'}))\n"
        "time.sleep(300)")]
    path = tmp_path / "hang.ipynb"
    nbformat.write(nb, str(path))
    # 45 s: room for a kernel start on a busy 2-core machine (20 s was once too little there)
    g = sweep.Grid(notebook=path, name="hang", parameters={"x": [1, 2]}, timeout_s=45, workers=2)
    rep = sweep.run_sweep(g, root=tmp_path / "runs", progress=False)
    by_x = {r.params["x"]: r for r in rep.runs}
    assert by_x[2].status == "failed" and by_x[2].error["ename"] == "Timeout"
    assert by_x[2].error["elapsed_s"] >= 45 and by_x[2].error["host"]  # the fields of a worker's own errors
    assert (rep.directory / by_x[2].hash / "error.json").exists()
    assert not (rep.directory / by_x[2].hash / "done").exists()
    assert by_x[1].status == "ok", by_x[1].error
    assert (rep.directory / by_x[1].hash / "done").exists()
    assert not (rep.directory / by_x[1].hash / "error.json").exists()
    assert sweep.run_state(rep.directory / by_x[1].hash) == "done"
    assert not [p for p in rep.directory.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_a_papermill_failure_on_a_rerun_replaces_the_old_result(tmp_path):
    """A worker whose papermill call fails outside any cell (here: a notebook nbformat cannot read) records a
    failure; it does not leave the earlier run's `done` in place, nor its own temporary folder behind."""
    bad = tmp_path / "bad.ipynb"  # valid JSON with cells (it has a digest) but no nbformat version
    bad.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "1", "metadata": {}, "outputs": [],
                                          "execution_count": None}], "metadata": {}}))
    final = tmp_path / "runs" / "abc123"
    final.mkdir(parents=True)
    (final / "params.json").write_text(json.dumps({"notebook_digest": "OLD", "parameters": {}}))
    (final / "done").write_text("{}")
    st = sweep._launch(bad, {}, final, "run", None, 120, sweep.notebook_digest(bad))
    # the worker named papermill's own exception (not just "the worker exited") and finished the run itself
    assert st.status == "failed" and st.error["ename"] and not st.error["ename"].startswith("WorkerExit")
    assert st.error["evalue"]
    assert (final / "error.json").exists() and not (final / "done").exists()
    assert json.loads((final / "params.json").read_text())["notebook_digest"] == sweep.notebook_digest(bad)
    assert "Traceback" in (final / "worker.log").read_text()
    assert not list(final.parent.glob(".tmp-*"))


def test_collect_lists_runs_of_another_notebook_version_as_stale(tmp_path):
    """--collect with the notebook changed since a run finished: that run is 'stale' in the summary and its
    results are in no table; a current run's are."""
    for h, dig, y in (("aaa", "OLD", 1.0), ("bbb", "NEW", 2.0)):
        d = tmp_path / h
        (d / "results").mkdir(parents=True)
        (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "notebook_digest": dig,
                                                   "parameters": {"x": h}}))
        (d / "done").write_text(json.dumps({"elapsed_s": 1}))
        (d / "results" / "metrics.json").write_text(json.dumps({"y": y}))
    tables = sweep.collect(tmp_path, ["aaa", "bbb"], "t", digest="NEW")
    summary = pd.read_csv(tables["summary.csv"]).set_index("run")
    assert summary.loc["aaa", "status"] == "stale" and pd.isna(summary.loc["aaa", "metrics.y"])
    assert summary.loc["bbb", "status"] == "ok" and summary.loc["bbb", "metrics.y"] == 2.0
    assert set(pd.read_csv(sweep.collect(tmp_path, ["aaa", "bbb"])["summary.csv"]).status) == {"ok"}  # no digest


def test_collect_keeps_its_own_columns_when_names_collide(tmp_path):
    """A parameter or scalar named like a summary column, a frame with a `run` column, or a frame named
    `summary` (written by hand: `results.save` refuses the name) leave the summary's run ids and statuses
    intact and every value in some column."""
    def run(h, params, frames=(), scalars=()):
        d = tmp_path / h
        (d / "results").mkdir(parents=True)
        (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "notebook_digest": "D",
                                                   "parameters": params}))
        (d / "done").write_text(json.dumps({"elapsed_s": 1}))
        for n, df in dict(frames).items():
            df.to_parquet(d / "results" / f"{n}.parquet", index=False)
        for n, v in dict(scalars).items():
            (d / "results" / f"{n}.json").write_text(json.dumps(v))

    run("aaa", {"run": 7, "x": 1}, frames={"curve": pd.DataFrame({"run": ["r1"], "loss": [0.5]}),
                                           "summary": pd.DataFrame({"metric": [10]})},
        scalars={"status": "converged", "x": 3})
    tables = sweep.collect(tmp_path, ["aaa"], "t", digest="D")
    (row,) = pd.read_csv(tables["summary.csv"]).to_dict("records")
    assert row == {"run": "aaa", "param.run": 7, "x": 1, "status": "ok", "elapsed_s": 1, "result.status": "converged",
                   "result.x": 3}
    assert pd.read_csv(tables["curve.csv"]).to_dict("records") == [
        {"sweep.run": "aaa", "param.run": 7, "x": 1, "run": "r1", "loss": 0.5}]
    assert pd.read_csv(tables["result.summary.csv"])["metric"].tolist() == [10]
    with pytest.raises(ValueError, match="'summary'"):
        from moelab import results
        results.save("summary", {"y": 1})


def test_collect_leaves_out_a_run_whose_files_cannot_be_read(tmp_path, caplog):
    """A damaged params.json, done marker or saved result leaves that run out of the summary with a warning
    naming the run and the file; the other runs' rows and tables are written."""
    def run(h, params=None, done='{"elapsed_s": 1}', metrics='{"y": 1}'):
        d = tmp_path / h
        (d / "results").mkdir(parents=True)
        (d / "params.json").write_text(params or json.dumps({"notebook": "toy.ipynb", "parameters": {"x": h}}))
        (d / "done").write_text(done)
        (d / "results" / "metrics.json").write_text(metrics)

    run("good")
    run("badparams", params="{")
    run("noparams", params="[1]")
    run("noparamsobj", params='{"notebook": "toy.ipynb"}')
    run("baddone", done="{")
    run("badresult", metrics='{"y": ')
    with caplog.at_level("WARNING", logger="moelab.sweep"):
        tables = sweep.collect(tmp_path, ["good", "badparams", "noparams", "noparamsobj", "baddone", "badresult"],
                               "t")
    assert pd.read_csv(tables["summary.csv"])["run"].tolist() == ["good"]
    for h, file in (("badparams", "params.json"), ("noparams", "params.json"), ("noparamsobj", "params.json"),
                    ("baddone", "done"), ("badresult", "metrics.json")):
        assert f"run {h}: left out of the summary" in caplog.text and str(tmp_path / h) in caplog.text
        assert any(h in r.getMessage() and file in r.getMessage() for r in caplog.records)


def test_a_sweep_leaves_other_attempts_folders_alone(toy, tmp_path):
    """Only attempt folders whose attempt is over are cleaned up: this host's whose process is gone, another
    host's once it started longer ago than the grid's timeout. Another sweep on the same file system may be
    running the others (a host `vm` does not claim host `vm-2`'s). The run executes a copy of the notebook,
    kept in its folder, whose digest params.json records."""
    import socket
    import time

    g = sweep.Grid(notebook=toy, name="attempts", parameters={"x": [1]}, fixed={"sleep_s": 0.0}, timeout_s=600)
    ((h, _),) = sweep.param_hash_points(g)
    d = tmp_path / "attempts"
    d.mkdir()
    host = socket.gethostname()
    keep = [d / f".tmp-{h}-{host}-1-0badc0de",  # pid 1 lives
            d / f".tmp-{h}-{host}-2-{2**22 + 12345}-0badc0de",  # host '<host>-2', a dead pid here
            d / f".tmp-{h}-elsewhere-77-0badc0de"]  # another host's, started now
    gone = [d / f".tmp-{h}-{host}-{2**22 + 12345}-0badc0de",  # above the default pid_max: no such process
            d / f".tmp-{h}-elsewhere-78-0badc0de"]  # another host's, started past the timeout
    for f, started in zip(keep + gone, [0, time.time(), time.time(), 0, time.time() - 3600]):
        f.mkdir()
        (f / "params.json").write_text(json.dumps({"started_epoch": started}))
    rep = sweep.run_sweep(g, root=tmp_path, progress=False)
    assert [r.status for r in rep.runs] == ["ok"]
    assert all(f.exists() for f in keep) and not any(f.exists() for f in gone)
    run = d / h
    assert sweep.notebook_digest(run / "source.ipynb") == sweep.notebook_digest(toy)
    assert json.loads((run / "params.json").read_text())["notebook_digest"] == sweep.notebook_digest(toy)


def test_another_hosts_attempt_is_over_when_its_heartbeat_stops(toy, tmp_path, monkeypatch):
    """A runner touches its attempt's heartbeat while the worker runs and removes it after. Another host's
    attempt folder (or the run it set aside) is cleaned once its heartbeat is older than HEARTBEAT_STALE_S,
    also without a timeout; a fresh heartbeat keeps it even past the timeout; one without a heartbeat
    (an older moelab's) stays without a timeout."""
    import os
    import time

    g = sweep.Grid(notebook=toy, name="beats", parameters={"x": [1]}, fixed={"sleep_s": 1.5})
    ((h, _),) = sweep.param_hash_points(g)
    d = tmp_path / "beats"
    d.mkdir()
    old = time.time() - sweep.HEARTBEAT_STALE_S - 60
    fresh, silent, stale = (d / f".tmp-{h}-elsewhere-{n}-0badc0de" for n in (77, 78, 79))
    aside, aside_attempt = d / f".old-{h}-elsewhere-80-0badc0de", d / f".tmp-{h}-elsewhere-80-0badc0de"
    for f in (fresh, silent, stale, aside, aside_attempt):
        f.mkdir()
        (f / "params.json").write_text(json.dumps({"started_epoch": old}))
    for f in (fresh, stale, aside_attempt):
        (f / sweep.HEARTBEAT).touch()
    for f in (stale, aside_attempt):
        os.utime(f / sweep.HEARTBEAT, (old, old))
    (d / h).mkdir()  # a failed earlier run: the set-aside copy beside it is an interrupted move's leftover
    (d / h / sweep.ERROR).write_text("{}")

    beats = []
    orig = sweep._beat

    def beat(folder):  # the real touch, and when it came
        orig(folder)
        beats.append((time.monotonic(), (folder / sweep.HEARTBEAT).exists()))

    monkeypatch.setattr(sweep, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(sweep, "_beat", beat)
    rep = sweep.run_sweep(g, root=tmp_path, progress=False)
    assert [r.status for r in rep.runs] == ["ok"]
    assert fresh.exists() and silent.exists()
    assert not stale.exists() and not aside.exists() and not aside_attempt.exists()
    touched = [ok for _, ok in beats]  # touched through the run, then gone with the folder the worker moved
    assert sum(touched) >= 4 and touched == sorted(touched, reverse=True)
    assert not (d / h / sweep.HEARTBEAT).exists() and (d / h / sweep.DONE).exists()
    # past a timeout, a fresh heartbeat still keeps another host's attempt; without one it is over
    assert not sweep._dead_attempt(fresh, 1) and sweep._dead_attempt(silent, 1)


def test_an_edit_during_a_sweep_marks_the_runs_before_it_stale(toy, tmp_path, monkeypatch):
    """The tables are collected against the notebook as it is at the end: a run that started before an edit
    made during the sweep is 'stale', one that started after it is current."""
    nb = tmp_path / "toy.ipynb"
    nb.write_bytes(toy.read_bytes())
    g = sweep.Grid(notebook=nb, name="edit", parameters={"x": [1, 2]}, fixed={"sleep_s": 0.0})
    orig = sweep._launch

    def launch_then_edit(notebook, p, *a):
        st = orig(notebook, p, *a)
        if p["x"] == 1:  # the edit lands after the first run
            doc = json.loads(nb.read_text())
            doc["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "edited"})
            nb.write_text(json.dumps(doc))
        return st

    monkeypatch.setattr(sweep, "_launch", launch_then_edit)
    rep = sweep.run_sweep(g, root=tmp_path, progress=False, workers=1)  # one worker (CPU): in grid order
    summary = pd.read_csv(rep.tables["summary.csv"]).set_index("x")
    assert summary.loc[1, "status"] == "stale" and summary.loc[2, "status"] == "ok"


def test_collect_drops_the_tables_of_runs_now_stale(tmp_path):
    """A frame result's table from an earlier collect goes once its runs are stale (the notebook changed): the
    folder then holds only what this collect wrote, as `tables.json` lists it."""
    for h in ("aaa", "bbb"):
        d = tmp_path / h
        (d / "results").mkdir(parents=True)
        (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "notebook_digest": "OLD",
                                                   "parameters": {"x": h}}))
        (d / "done").write_text(json.dumps({"elapsed_s": 1}))
        (d / "results" / "rows.json").write_text(json.dumps([{"y": 1.0}, {"y": 2.0}]))
    first = sweep.collect(tmp_path, ["aaa", "bbb"], "t", digest="OLD")
    assert len(pd.read_csv(first["rows.csv"])) == 4 and (tmp_path / "rows.parquet").exists()
    again = sweep.collect(tmp_path, ["aaa", "bbb"], "t", digest="NEW")
    assert set(pd.read_csv(again["summary.csv"]).status) == {"stale"}
    assert not (tmp_path / "rows.csv").exists() and not (tmp_path / "rows.parquet").exists()
    assert json.loads((tmp_path / "tables.json").read_text()) == ["summary.csv", "summary.parquet"]
    (tmp_path / "mine.csv").write_text("a\n1\n")  # a file no collect wrote stays
    sweep.collect(tmp_path, ["aaa", "bbb"], "t", digest="NEW")
    assert (tmp_path / "mine.csv").exists()


def test_collect_removes_only_plain_table_names_from_an_old_table_list(tmp_path):
    """`tables.json` is read back, so what it lists is removed only where it is a plain .csv/.parquet name in
    the sweep folder: a path out of the folder or another kind of file stays."""
    sweep_dir = tmp_path / "sweep"
    d = sweep_dir / "aaa"
    d.mkdir(parents=True)
    (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "parameters": {"x": 1}}))
    (d / "done").write_text("{}")
    (tmp_path / "x.csv").write_text("a\n1\n")
    (sweep_dir / "keep.txt").write_text("notes")
    (sweep_dir / "tables.json").write_text(json.dumps(["../x.csv", "keep.txt"]))
    sweep.collect(sweep_dir, ["aaa"], "t")
    assert (tmp_path / "x.csv").exists() and (sweep_dir / "keep.txt").exists()
    assert json.loads((sweep_dir / "tables.json").read_text()) == ["summary.csv", "summary.parquet"]


def test_collect_only_lists_stale_and_failed_runs_as_they_are_and_clears_dead_attempts(toy, tmp_path):
    """--collect runs nothing: a run of another notebook version is reported 'stale' and a failed one 'failed'
    with its error (not 'pending'), and a killed attempt's folder beside a finished run is removed."""
    g = sweep.Grid(notebook=toy, name="c", parameters={"x": [1, 2, 3, 4]}, fixed={"sleep_s": 0.0})
    (h1, p1), (h2, p2), (h3, _), (h4, p4) = sweep.param_hash_points(g)
    for h, p, digest, end, record in ((h1, p1, "OLD", "done", {}), (h2, p2, sweep.notebook_digest(toy), "error.json",
                                                                   {"cell_index": 3, "ename": "E", "evalue": "bad"}),
                                      (h4, p4, sweep.notebook_digest(toy), "error.json", [1])):  # not an object
        d = tmp_path / "c" / h
        d.mkdir(parents=True)
        (d / "params.json").write_text(json.dumps({"notebook": str(toy), "notebook_digest": digest, "parameters": p}))
        (d / end).write_text(json.dumps(record))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    dead = tmp_path / "c" / f".tmp-{h1}-{socket.gethostname()}-{gone.pid}-0123abcd"
    dead.mkdir()
    rep = sweep.run_sweep(g, root=tmp_path, collect_only=True, progress=False)
    assert {r.hash: r.status for r in rep.runs} == {h1: "stale", h2: "failed", h3: "pending", h4: "failed"}
    errors = {r.hash: r.error for r in rep.failed}
    assert errors[h2]["evalue"] == "bad" and not dead.exists()
    assert errors[h4] == {"ename": "UnreadableError", "evalue": str(tmp_path / "c" / h4 / "error.json")}


def test_grid_values_of_another_type_than_declared_are_refused_and_mixed_columns_still_tabulate(toy, tmp_path):
    """A grid value of another type than the parameters cell declares (x: int given "1024") is refused before
    any run; runs that did get mixed types into one column (an outside engine's) still give a summary."""
    with pytest.raises(ValueError, match=r"parameter x='1024': toy.ipynb declares it int"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": ["1024", 2048]}).check_parameters()
    with pytest.raises(ValueError, match=r"parameter x=True: toy.ipynb declares it int"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": [True]}).check_parameters()
    with pytest.raises(ValueError, match=r"parameter sleep_s='1': toy.ipynb declares it float"):
        sweep.Grid(notebook=toy, name="t", parameters={"x": [1]}, fixed={"sleep_s": "1"}).check_parameters()
    sweep.Grid(notebook=toy, name="t", parameters={"x": [1]}, fixed={"sleep_s": 1}).check_parameters()  # int as float
    for h, x in (("aaa", "1024"), ("bbb", 2048)):
        d = tmp_path / h
        d.mkdir()
        (d / "params.json").write_text(json.dumps({"notebook": "toy.ipynb", "parameters": {"x": x}}))
        (d / "done").write_text("{}")
    tables = sweep.collect(tmp_path, ["aaa", "bbb"], "t")
    assert sorted(pd.read_parquet(tables["summary.parquet"])["x"]) == ["1024", "2048"]
