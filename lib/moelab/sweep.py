"""Parameter sweeps over notebooks with papermill: a grid -> one executed notebook per point, resumable.

    python -m moelab.sweep notebooks/grids/quickstart_logit_scale.yaml     # a grid -> runs/<name>/
    python -m moelab.sweep --main     # every notebooks/NN_*.ipynb with its defaults, figures to figures/

A grid (YAML) has notebook (repo- or grid-relative), name, parameters (lists: their cartesian product is swept),
fixed (the same in every run) and an optional timeout_s; names and types are checked against the notebook's
`parameters` cell (a line per parameter `name: type = value  # help`). Each point runs in a temporary folder
renamed to runs/<name>/<hash>/ (params.json, notebook.ipynb, results/, figures/, papermill.log, and `done` or
error.json). Running again skips points done with the same notebook source and retries failed ones. An exclusive
<hash>.claim file lets sweeps share a folder (a dead or stale claimant's claim is released); grid.json refuses
another grid under the same name. summary.{csv,parquet} has a row per run, <result>.{csv,parquet} each saved
frame's rows with the run's parameters.

Points run one after another, one per GPU with `--gpus 0,1`, or on any `concurrent.futures.Executor` passed to
`run_sweep` (e.g. Dask's, with pure=False). `--shard I/N` splits a grid over job-array tasks sharing runs/, then
`--collect` builds the tables; `--list` prints each point as a JSON line for an engine that runs papermill itself
(write the line as <run_dir>/params.json, set MOELAB_RUN_DIR, touch `done`, then `--collect`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from moelab.results import REPO

log = logging.getLogger("moelab.sweep")
PARAMS, OUT, DONE, ERROR, GRID = "params.json", "notebook.ipynb", "done", "error.json", "grid.json"
CLAIM_STALE_S = 24 * 3600
TYPES = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "str": lambda v: isinstance(v, str),
         "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "bool": lambda v: isinstance(v, bool), "list": lambda v: isinstance(v, list)}
_LIVE: dict[int, subprocess.Popen] = {}  # this process's papermill runs, killed on Ctrl-C
_STOP = threading.Event()


def runs_root() -> Path:
    return Path(os.environ.get("MOELAB_RUNS", REPO / "runs"))


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({type(e).__name__}: {e})") from None


def _create(path: Path, text: str) -> bool:
    """Create `path` holding `text` unless it exists: a hard link of a complete file (atomic, NFS too)."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


@dataclasses.dataclass
class Grid:
    notebook: Path
    name: str
    parameters: dict = dataclasses.field(default_factory=dict)
    fixed: dict = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None

    def __post_init__(self):
        self.notebook = Path(self.notebook).with_suffix(".ipynb")
        if not self.notebook.is_file():
            raise ValueError(f"notebook={str(self.notebook)!r}: no such .ipynb file")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name={self.name!r}: must be a plain folder name (no '/', not hidden)")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout_s={t!r}: must be a number of seconds > 0")
        if not isinstance(self.parameters, dict) or not isinstance(self.fixed, dict):
            raise ValueError(f"parameters={self.parameters!r}, fixed={self.fixed!r}: must be mappings")
        for k, vs in [*self.parameters.items(), *((k, [v]) for k, v in self.fixed.items())]:
            if not isinstance(vs, list) or not vs:
                raise ValueError(f"parameters.{k}={vs!r}: swept values must be a non-empty list (one value: fixed)")
            seen = set()
            for v in vs:
                try:  # stored in params.json, injected by papermill
                    seen.add(json.dumps(v, allow_nan=False, sort_keys=True))
                except (TypeError, ValueError):
                    raise ValueError(f"parameter {k}={v!r} ({type(v).__name__}): must be a JSON value (number, "
                                     "string, bool, null, list or mapping of those); quote dates") from None
            if len(seen) < len(vs):
                raise ValueError(f"parameters.{k}={vs!r}: a value is listed twice; each point must be distinct")
        if set(self.parameters) & set(self.fixed):
            raise ValueError(f"parameters {sorted(set(self.parameters) & set(self.fixed))}: both swept and fixed")

    def points(self) -> list[dict]:
        """The cartesian product of the swept lists, each with the fixed values."""
        return [{**self.fixed, **dict(zip(self.parameters, vs))} for vs in itertools.product(*self.parameters.values())]

    def check_parameters(self) -> None:
        """Every name must be in the notebook's parameters cell, every value of the type it declares."""
        known = notebook_parameters(self.notebook)
        unknown = sorted((set(self.parameters) | set(self.fixed)) - set(known))
        if unknown:
            raise ValueError(f"parameters {unknown}: not in the parameters cell of {self.notebook.name}; it has "
                             f"{sorted(known)}")
        for k, v in [(k, v) for k, vs in self.parameters.items() for v in vs] + list(self.fixed.items()):
            if not TYPES.get(known[k]["type"], lambda v: True)(v):
                raise ValueError(f"parameter {k}={v!r}: {self.notebook.name} declares it {known[k]['type']}")


def load_grid(path: str | Path) -> Grid:
    """A grid YAML file (notebook, name, parameters, fixed, timeout_s); errors name the file."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"grid {str(path)!r}: cannot be read as YAML ({type(e).__name__}: {e})") from None
    keys = {"notebook", "name", "parameters", "fixed", "timeout_s"}
    if not isinstance(doc, dict) or "notebook" not in doc or set(doc) - keys:
        raise ValueError(f"grid {str(path)!r}: must be a mapping with a notebook and only the keys {sorted(keys)}; "
                         f"it has {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    nb = Path(str(doc["notebook"]))
    nb = next((r / nb for r in (path.parent, REPO, Path.cwd()) if (r / nb).exists()), REPO / nb).resolve()
    try:
        return Grid(nb, str(doc.get("name") or path.stem), doc.get("parameters") or {}, doc.get("fixed") or {},
                    doc.get("timeout_s"))
    except ValueError as e:
        raise ValueError(f"grid {str(path)!r}: {e}") from None


def notebook_parameters(notebook: Path) -> dict[str, dict]:
    """The parameters cell: {name: {type, default, help}} (papermill's own parser)."""
    import papermill

    try:
        found = papermill.inspect_notebook(str(notebook))
    except Exception as e:  # noqa: BLE001  nbformat's and papermill's own errors do not name the file
        raise ValueError(f"{notebook}: papermill cannot read it ({type(e).__name__}: {e})") from None
    return {k: {"type": v["inferred_type_name"], "default": v["default"], "help": v["help"]} for k, v in found.items()}


def param_hash(notebook: Path | str, params: dict) -> str:
    """12 hex digits naming a run: the notebook's file name and its parameters (order-free)."""
    key = json.dumps({"notebook": Path(notebook).name, "parameters": params}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def notebook_digest(notebook: Path) -> str:
    """sha256 of the notebook's cell types and sources (not outputs or metadata)."""
    body = [(c["cell_type"], "".join(c["source"])) for c in _read_json(notebook)["cells"]]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


def run_state(run_dir: Path, digest: str | None = None) -> str:
    """'done' (with this notebook digest, when given), 'stale' (done with another), 'failed' or 'pending'."""
    if (run_dir / DONE).exists():
        return "done" if digest in (None, _read_json(run_dir / PARAMS).get("notebook_digest")) else "stale"
    return "failed" if (run_dir / ERROR).exists() else "pending"


def _claim(path: Path, stale_s: float) -> str | None:
    """Claim a point for this thread: the claim's text, or None while a live claimant holds it."""
    mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "thread": threading.get_ident(),
                       "started": time.time()})
    for _ in range(3):
        if _create(path, mine):
            return mine
        try:
            seen, age = path.read_text(), time.time() - _mtime(path)
        except FileNotFoundError:  # released meanwhile
            continue
        try:
            holder = dict(json.loads(seen))
        except (ValueError, TypeError):
            holder = {}
        pid, here = holder.get("pid"), holder.get("host") == socket.gethostname()
        if not (here and isinstance(pid, int) and not _alive(pid)) and age <= stale_s:
            return None
        brk = path.with_name(path.name + ".break")  # one breaker at a time, removing only the claim it judged
        if _create(brk, ""):
            log.info("%s: releasing a stale claim %s", path, seen)
            _release(path, seen)
            brk.unlink()
        elif time.time() - _mtime(brk) > 60:  # its breaker died
            brk.unlink(missing_ok=True)
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def _release(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            path.unlink()
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


@dataclasses.dataclass
class Point:
    hash: str
    params: dict
    status: str  # ok, failed, done (earlier), busy (another sweep's), pending, stale, interrupted
    error: dict | None = None
    elapsed_s: float | None = None


def run_point(notebook: Path, params: dict, run_dir: Path, *, digest: str | None = None, rerun: bool = False,
              figures: Path | None = None, timeout_s: float | None = None, gpu: str | None = None) -> Point:
    """Claim the point, run papermill in a temporary sibling folder, rename it into place, release the claim;
    a point done (unless rerun) or another sweep's is left as it is."""
    notebook, run_dir = Path(notebook), Path(run_dir)
    h, sweep_dir = run_dir.name, run_dir.parent
    sweep_dir.mkdir(parents=True, exist_ok=True)
    claim = sweep_dir / f"{h}.claim"
    mine = _claim(claim, CLAIM_STALE_S if timeout_s is None else timeout_s + 60)
    if mine is None:
        return Point(h, params, "busy")
    tmp, old = sweep_dir / f".tmp-{h}-{os.getpid()}-{secrets.token_hex(4)}", sweep_dir / f".old-{h}"
    try:
        for left in sweep_dir.glob(f".tmp-{h}-*"):  # a dead claimant's attempt
            shutil.rmtree(left, ignore_errors=True)
        if old.exists() and not run_dir.exists():  # a dead claimant's replacement, stopped between its renames
            os.rename(old, run_dir)
        shutil.rmtree(old, ignore_errors=True)
        if run_state(run_dir, digest) == "done" and not rerun:
            return Point(h, params, "done")
        tmp.mkdir()
        where = {"host": socket.gethostname(), "gpu": gpu}
        (tmp / PARAMS).write_text(json.dumps({"notebook": str(notebook), "notebook_digest": notebook_digest(notebook),
                                              "parameters": params, "started": time.strftime("%FT%T%z"), **where}))
        error, elapsed = _papermill(notebook, tmp, params, Path(figures or tmp / "figures"), timeout_s, gpu)
        if _STOP.is_set():
            return Point(h, params, "interrupted")
        (tmp / (ERROR if error else DONE)).write_text(json.dumps({**(error or {}), "elapsed_s": elapsed, **where}))
        if run_dir.exists():  # a failed or stale run: set aside, move the new one in, then delete
            os.rename(run_dir, old)
        os.rename(tmp, run_dir)
        shutil.rmtree(old, ignore_errors=True)
        return Point(h, params, "failed" if error else "ok", error, elapsed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _release(claim, mine)


def _papermill(notebook: Path, out: Path, params: dict, figures: Path, timeout_s, gpu) -> tuple[dict | None, float]:
    env = {**os.environ, "MOELAB_RUN_DIR": str(out), "MOELAB_FIGURES": str(figures), "HF_HUB_DISABLE_PROGRESS_BARS":
           "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "lib"), os.environ.get("PYTHONPATH")]))}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(out / OUT), "-y", json.dumps(params),
           "--cwd", str(notebook.parent), "--no-progress-bar"]
    t0, error = time.monotonic(), None
    with open(out / "papermill.log", "wb") as f:  # its own session; the kernel exits with papermill
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE[proc.pid] = proc
    try:
        if _STOP.is_set():  # Ctrl-C came while it started
            _kill(proc)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        error = {"cell_index": None, "ename": "Timeout", "evalue": f"the run passed timeout_s={timeout_s}"}
    finally:  # also on Ctrl-C in a sweep that runs points in this thread
        if proc.returncode is None:
            _kill(proc)
            proc.wait()
        _LIVE.pop(proc.pid, None)
    if proc.returncode and not error:
        tail = (out / "papermill.log").read_text(errors="replace")[-2000:]
        raised = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception)): ?(.*)$", tail, re.M)
        error = _cell_error(out / OUT) or {"cell_index": None, "evalue": tail,
                                           "ename": raised[-1][0] if raised else f"PapermillExit{proc.returncode}"}
    return error, round(time.monotonic() - t0, 2)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _cell_error(executed: Path) -> dict | None:
    """The failing cell of an executed notebook: its index in the source notebook, line, source, exception."""
    try:
        cells = json.loads(executed.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return None
    added = {"injected-parameters", "papermill-error-cell-tag"}
    cells = [c for c in cells if not added & set(c.get("metadata", {}).get("tags", []))]
    for i, c in enumerate(cells):
        for o in [o for o in c.get("outputs", []) if o.get("output_type") == "error"]:
            tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.get("traceback", [])))
            hits = re.findall(rf"Cell In\[{c.get('execution_count')}\], line (\d+)", tb)
            line, src = (int(hits[-1]) if hits else None), "".join(c["source"]).splitlines()
            return {"cell_index": i, "exec_count": c.get("execution_count"), "line": line, "ename": o.get("ename"),
                    "evalue": o.get("evalue"), "source_excerpt": f"line {line}: {src[line - 1].strip()}"
                    if line and line <= len(src) else "\n".join(src[:3])}
    return None


def describe_error(notebook: str, e: dict) -> str:
    if e.get("cell_index") is None:
        return f"{notebook}: {e.get('ename', 'error')}: {str(e.get('evalue', ''))[-500:]}"
    return f"{notebook}: cell {e['cell_index']} failed: {e['ename']}: {e['evalue']}\n    {e.get('source_excerpt')}"


class GPUExecutor(cf.ThreadPoolExecutor):
    """A thread per GPU; each task runs with gpu= an id taken from a queue of free GPUs."""

    def __init__(self, gpus: list[str]):
        super().__init__(max_workers=len(gpus))
        self.free: queue.Queue = queue.Queue()
        for g in gpus:
            self.free.put(str(g))

    def submit(self, fn, /, *args, **kwargs):
        def on_gpu():
            gpu = self.free.get()
            try:
                return fn(*args, gpu=gpu, **kwargs)
            finally:
                self.free.put(gpu)
        return super().submit(on_gpu)


class Serial(cf.Executor):
    """Runs each task when it is submitted, in this thread."""

    def submit(self, fn, /, *args, **kwargs):
        f = cf.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001  into the future, as a pool does (Ctrl-C goes through)
            f.set_exception(e)
        return f


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep; the message says what finished."""


@dataclasses.dataclass
class Report:
    name: str
    directory: Path
    points: list[Point]
    tables: dict[str, Path]

    @property
    def failed(self) -> list[Point]:
        return [p for p in self.points if p.status == "failed"]

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(p.status for p in self.points))


def _check_folder(sweep_dir: Path, grid: Grid) -> None:
    """Record the grid in runs/<name>/grid.json, or refuse one that differs from the grid recorded there."""
    here = json.loads(json.dumps({"notebook": grid.notebook.name, "swept": sorted(grid.parameters),
                                  "fixed": grid.fixed}))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if _create(sweep_dir / GRID, json.dumps(here, indent=1)):
        return
    there = _read_json(sweep_dir / GRID)

    def role(g, k):
        return "swept" if k in g["swept"] else f"fixed {g['fixed'][k]!r}" if k in g["fixed"] else "absent"
    names = sorted({*here["swept"], *here["fixed"], *there["swept"], *there["fixed"]})
    diffs = [f"{k}: {role(there, k)} there, {role(here, k)} here" for k in names if role(there, k) != role(here, k)]
    diffs += [f"notebook {there['notebook']} there, {here['notebook']} here"] * (there["notebook"] != here["notebook"])
    if diffs:
        raise ValueError(f"{sweep_dir} holds runs of another grid named {grid.name!r} ({'; '.join(diffs)}): give this "
                         "grid another name, or remove that folder")


def run_sweep(grid: Grid | str | Path, *, root: Path | None = None, executor: cf.Executor | None = None,
              gpus: list[str] | None = None, shard: tuple[int, int] = (0, 1), rerun: bool = False,
              collect_only: bool = False, figures: Path | None = None) -> Report:
    """Run the grid's points (of one shard) that are not done, on `executor` (any with `submit`), else one per
    GPU of `gpus`, else one after another; then build the tables."""
    grid = grid if isinstance(grid, Grid) else load_grid(grid)
    grid.check_parameters()
    sweep_dir = Path(root or runs_root()) / grid.name
    _check_folder(sweep_dir, grid)
    digest = notebook_digest(grid.notebook)
    points = [(param_hash(grid.notebook, p), p) for j, p in enumerate(grid.points()) if j % shard[1] == shard[0]]
    states = {h: Point(h, p, run_state(sweep_dir / h, digest)) for h, p in points}
    for h in states if collect_only else ():
        states[h].error = _read_json(sweep_dir / h / ERROR) if states[h].status == "failed" else None
    todo = [] if collect_only else [(h, p) for h, p in points if rerun or states[h].status != "done"]
    _STOP.clear()
    ex = executor or (GPUExecutor(gpus) if gpus else Serial())
    futures: dict[cf.Future, tuple[str, dict]] = {}
    try:
        for h, p in todo:
            futures[ex.submit(run_point, grid.notebook, p, sweep_dir / h, digest=digest, rerun=rerun,
                              figures=figures, timeout_s=grid.timeout_s)] = (h, p)
        for f in cf.as_completed(futures):
            (h, p), e = futures[f], f.exception()
            states[h] = Point(h, p, "failed", {"ename": type(e).__name__, "evalue": str(e)}) if e else f.result()
            log.info("%s %s %s", states[h].status, h, json.dumps(p, default=str))
    except KeyboardInterrupt:
        _STOP.set()
        for proc in list(_LIVE.values()):
            _kill(proc)
        for f in futures:
            f.cancel()
        if executor is None:
            ex.shutdown(wait=True)
        done = sum((sweep_dir / h / DONE).exists() for h, _ in points)
        raise Interrupted(f"interrupted: {done} of {len(points)} points done in {sweep_dir} (kept)") from None
    finally:
        if executor is None:
            ex.shutdown(wait=False)
    return Report(grid.name, sweep_dir, [states[h] for h, _ in points], collect(sweep_dir, digest))


def collect(sweep_dir: Path, digest: str | None = None) -> dict[str, Path]:
    """Build summary.{csv,parquet} and a table per saved frame from every run in the folder (module docstring),
    replacing the folder's earlier tables. A run's file that cannot be read raises ValueError naming it."""
    import pandas as pd

    from moelab.results import load_saved

    def cell(v):
        return v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)

    def put(row, key, value, prefix):
        row[prefix + key if key in row else key] = value

    def flat(d, pre=""):  # {'a': {'b': 1}} -> {'a.b': 1}
        return {k2: v2 for k, v in d.items() for k2, v2 in
                (flat(v, f"{pre}{k}.").items() if isinstance(v, dict) and v else [(pre + k, v)])}
    rows, frames = [], {}
    for d in sorted(p for p in sweep_dir.iterdir() if (p / PARAMS).exists() and not p.name.startswith(".")):
        state, spec = run_state(d, digest), _read_json(d / PARAMS)
        row, params = {"run": d.name, "status": state.replace("done", "ok")}, spec.get("parameters", {})
        for k, v in params.items():
            put(row, k, cell(v), "param.")
        if state == "failed":
            row["error"] = describe_error(Path(spec.get("notebook", "?")).name, _read_json(d / ERROR))
        if state == "done":
            row["elapsed_s"] = _read_json(d / DONE).get("elapsed_s")
            for name, obj in load_saved(d).items():
                if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
                    obj = pd.DataFrame(obj)
                if isinstance(obj, pd.DataFrame):
                    cols = {"sweep.run" if "run" in obj else "run": d.name}
                    cols.update({f"param.{k}" if k in obj or k in cols else k: cell(v) for k, v in params.items()})
                    frames.setdefault(("result." if name == "summary" else "") + name, []).append(
                        obj.assign(**cols)[[*cols, *obj.columns]])
                elif isinstance(obj, dict):
                    for k, v in flat(obj).items():
                        put(row, f"{name}.{k}", cell(v), "result.")
                else:
                    put(row, name, cell(obj), "result.")
        rows.append(row)
    tables = {"summary": pd.DataFrame(rows), **{k: pd.concat(v, ignore_index=True) for k, v in frames.items()}}
    out = {}
    for name, df in tables.items() if rows else ():
        for c in df.columns:  # parquet takes one type per column: mixed ones as text
            if df[c].dtype == object and len({type(v) for v in df[c].dropna()}) > 1:
                df[c] = df[c].map(lambda v: v if v is None or v != v else str(v))
        for ext in ("csv", "parquet"):
            out[f"{name}.{ext}"] = path = sweep_dir / f"{name}.{ext}"
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            df.to_csv(tmp, index=False) if ext == "csv" else df.to_parquet(tmp, index=False)
            os.replace(tmp, path)
    for old in {*sweep_dir.glob("*.csv"), *sweep_dir.glob("*.parquet")} - set(out.values()):  # of runs now stale
        old.unlink()
    return out


def run_main(directory: Path | None = None, root: Path | None = None, overrides: dict | None = None,
             resume: bool = False, figures: Path | None = None) -> int:
    """Every notebook NN_*.ipynb with its defaults (and overrides[stem]) into runs/main/<stem>/, figures into
    figures/ (MOELAB_FIGURES); with resume, notebooks done with this source are skipped. 1 if one failed."""
    nbs = sorted(Path(directory or REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    root, t0, failed = Path(root or runs_root()) / "main", time.time(), []
    figures = Path(figures or os.environ.get("MOELAB_FIGURES", REPO / "figures"))
    for k, nb in enumerate(nbs):
        t1 = time.time()
        try:
            rep = run_sweep(Grid(nb, nb.stem, fixed=dict((overrides or {}).get(nb.stem) or {})), root=root,
                            rerun=not resume, figures=figures)
        except Interrupted:
            raise Interrupted(f"interrupted: {k} of {len(nbs)} notebooks done (runs in {root})") from None
        status = "FAILED" if rep.failed else "done earlier" if rep.counts().get("done") else "ok"
        print(f"{nb.name}: {status} in {time.time() - t1:.0f} s", flush=True)
        for p in rep.failed:
            print("   " + describe_error(nb.name, p.error).replace("\n", "\n   "), flush=True)
            failed.append(nb.name)
    print(f"{len(nbs) - len(failed)} of {len(nbs)} notebooks ran in {time.time() - t0:.0f} s; figures in {figures}/, "
          f"executed notebooks and results in {root}/<notebook>/<run>/")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed or not nbs else 0


def _shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"shard={text!r}: must read I/N with integers 0 <= I < N, e.g. 3/32")
    return int(i), int(n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m moelab.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("grid", nargs="?", help="grid YAML file")
    ap.add_argument("--main", action="store_true", help="run every notebook in notebooks/ with its defaults")
    ap.add_argument("--resume", action="store_true", help="with --main: skip notebooks done with this source")
    ap.add_argument("--gpus", help="GPU ids, e.g. 0,1,2,3: one point per GPU at a time")
    ap.add_argument("--shard", type=_shard, help="I/N: only the points whose index %% N is I")
    ap.add_argument("--rerun", action="store_true", help="run done points again")
    ap.add_argument("--collect", action="store_true", help="run nothing; build the tables")
    ap.add_argument("--list", action="store_true", help="print each point as a JSON line; run nothing")
    ap.add_argument("--root", type=Path, help="runs folder (default runs/, or MOELAB_RUNS)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.main else logging.INFO, format="%(message)s")  # a line a point
    logging.getLogger("papermill").setLevel(logging.WARNING)
    extra = [f"--{k}" for k in ("list", "collect", "rerun", "gpus", "shard") if getattr(a, k)]
    if a.main and (a.grid or extra):
        ap.error(f"--main takes only --resume and --root, not {' '.join(extra + [a.grid or ''])}")
    if not a.main and (not a.grid or a.resume):
        ap.error("give a grid file or --main (--resume is for --main: a grid sweep always resumes)")
    if a.list and extra != ["--list"]:
        ap.error(f"--list runs nothing; it takes only --root, not {' '.join(extra[1:])}")
    try:
        if a.main:
            return run_main(root=a.root, resume=a.resume)
        grid = load_grid(a.grid)
        if a.list:
            grid.check_parameters()
            digest, hashes = notebook_digest(grid.notebook), [param_hash(grid.notebook, p) for p in grid.points()]
            for h, p in zip(hashes, grid.points()):
                print(json.dumps({"hash": h, "run_dir": str(Path(a.root or runs_root()) / grid.name / h),
                                  "notebook": str(grid.notebook), "notebook_digest": digest, "parameters": p}))
            return 0
        rep = run_sweep(grid, root=a.root, gpus=a.gpus and a.gpus.split(","), shard=a.shard or (0, 1),
                        rerun=a.rerun, collect_only=a.collect)
    except ValueError as e:
        ap.error(str(e))
    except KeyboardInterrupt as e:
        resume = [x for x in argv if x != "--rerun"] + ["--resume"] * (a.main and not a.resume)
        print(f"{e if isinstance(e, Interrupted) else 'interrupted'}; to resume: python -m moelab.sweep "
              f"{shlex.join(resume)}", flush=True)
        return 130
    busy = sum(p.status == "busy" for p in rep.points)
    print(f"{rep.name}: {rep.counts()} in {rep.directory}" + f" ({busy} run by another sweep now)" * bool(busy))
    for p in rep.failed:
        print(f"FAILED {p.hash} {json.dumps(p.params, default=str)}\n  {describe_error(grid.notebook.name, p.error)}")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
