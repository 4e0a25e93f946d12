"""Parameter sweeps over notebooks with papermill: a grid -> one executed notebook per point, resumable.

    python -m moelab.sweep notebooks/grids/quickstart.yaml     # a grid
    python -m moelab.sweep --main                              # every notebook with its defaults

A grid file (YAML)::

    notebook: notebooks/01_routing_quickstart.ipynb   # repo-relative, or relative to the grid file
    name: quickstart-native-k                         # runs go to runs/<name>/
    parameters:                                       # lists: the cartesian product is swept
      native_k: [2, 4, 8]
      seed: [0, 1]
    fixed:                                            # the same in every run
      tokens: 2048
    # optional: timeout_s (per run), workers (CPU only), figures: run | repo

Each run lives in runs/<name>/<hash>/ where <hash> identifies (notebook name, parameters). A run
executes in a temporary sibling folder and is renamed into place when it ends, holding params.json,
source.ipynb (the notebook as the run started, the copy it ran: an edit during a sweep reaches only later
runs, and params.json holds the copy's digest), notebook.ipynb (executed), results/ (what
`moelab.results.save` wrote; MOELAB_RUN_DIR points there), figures/ (for grids; `--main` writes the
repo's figures/) and either `done` or `error.json` (cell index, execution count, source excerpt,
exception). A rerun skips every run with a
`done` marker whose notebook is unchanged, so a sweep killed at any moment loses no finished run;
failed runs are retried. Runs are spread over the visible GPUs, one worker process per GPU with
CUDA_VISIBLE_DEVICES set to it, or run one after another on a CPU. At the end the runs combine into
runs/<name>/summary.{parquet,csv} (one row per run: parameters as columns, status, scalar results)
and runs/<name>/<result>.{parquet,csv} for each saved frame (its rows, with the parameters as
columns).

Scaling out without writing a scheduler: every run is an independent `papermill` process, so an
existing engine can run the same grid. `--shard I/N` runs only the points whose index modulo N is
I (a disjoint split), on a shared file system all shards write into the same runs/<name>/, and a
final `--collect` (no runs) builds the tables. With Slurm, for example::

    #SBATCH --array=0-31 --gpus=1
    python -m moelab.sweep grid.yaml --shard $SLURM_ARRAY_TASK_ID/32
    # afterwards, once:  python -m moelab.sweep grid.yaml --collect

The same works with any job array (Kubernetes indexed Jobs, SGE, ...); `--list` prints every point
(hash, run folder, notebook, its digest, parameters: one JSON line each) for engines that prefer to
start `papermill` themselves (set MOELAB_RUN_DIR to the run folder, write the line as its params.json and
keep the layout above, and `--collect` still combines them). See docs/sweeps.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moelab.results import REPO, atomic_write_bytes, write_json

log = logging.getLogger("moelab.sweep")

DONE = "done"
ERROR = "error.json"
PARAMS = "params.json"
NOTEBOOK_OUT = "notebook.ipynb"
SOURCE = "source.ipynb"  # the notebook as it was when the run started (its digest is in params.json)
WORKER_LOG = "worker.log"
TABLES = "tables.json"  # in a sweep's folder: the table files its last collect wrote
HEARTBEAT = "heartbeat"  # an attempt's runner touches it every HEARTBEAT_S while its worker runs
HEARTBEAT_S = 30.0
HEARTBEAT_STALE_S = 600.0  # another host's attempt whose heartbeat is older than this is over (clock skew allowed)
FIGURES_MODES = ("run", "repo")
MAIN_TIME_BUDGET_S = 15 * 60


def runs_root() -> Path:
    """Where sweeps keep their runs: runs/ of the repository (MOELAB_RUNS overrides)."""
    return Path(os.environ.get("MOELAB_RUNS", REPO / "runs"))


def notebooks_dir() -> Path:
    return REPO / "notebooks"


# ----------------------------------------------------------------------------------------------- grid


@dataclasses.dataclass
class Grid:
    """A notebook, a sweep name, swept parameters (lists) and fixed ones."""

    notebook: Path
    name: str
    parameters: dict[str, list] = dataclasses.field(default_factory=dict)
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None
    workers: int | None = None
    figures: str = "run"

    def __post_init__(self):
        self.notebook = Path(self.notebook)
        if self.notebook.suffix == ".py" and self.notebook.with_suffix(".ipynb").exists():
            self.notebook = self.notebook.with_suffix(".ipynb")
        if self.notebook.suffix != ".ipynb":
            raise ValueError(f"notebook={str(self.notebook)!r}: must be an .ipynb file (papermill executes those)")
        if not self.notebook.exists():
            raise ValueError(f"notebook={str(self.notebook)!r}: no such file")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name={self.name!r}: must be a plain folder name (no '/', not hidden)")
        if not isinstance(self.parameters, dict) or not isinstance(self.fixed, dict):
            raise ValueError(f"parameters={self.parameters!r}, fixed={self.fixed!r}: must be mappings")
        for k, v in self.parameters.items():
            if not isinstance(v, list) or not v:
                raise ValueError(
                    f"parameters.{k}={v!r}: swept values must be a non-empty list; put single values under fixed"
                )
        both = sorted(set(self.parameters) & set(self.fixed))
        if both:
            raise ValueError(f"parameters {both}: given both as swept and as fixed; keep one")
        if self.figures not in FIGURES_MODES:
            raise ValueError(f"figures={self.figures!r}: must be one of {FIGURES_MODES}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be a number of seconds > 0")
        for k, v in [*self.fixed.items(), *((k, x) for k, vs in self.parameters.items() for x in vs)]:
            try:  # a run's parameters are stored as JSON (params.json) and injected by papermill
                json.dumps(v, allow_nan=False)
            except (TypeError, ValueError):
                raise ValueError(f"parameter {k}={v!r} ({type(v).__name__}): must be a JSON value (number, string, "
                                 f"bool, null, list or mapping of those); quote dates and other YAML types") from None
        for k, vs in self.parameters.items():
            seen: set[str] = set()
            for v in vs:
                key = json.dumps(v, sort_keys=True)
                if key in seen:
                    raise ValueError(f"parameters.{k}: the value {v!r} is listed twice; each point must be distinct")
                seen.add(key)
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers={self.workers!r}: must be an int >= 1")

    def points(self) -> list[dict]:
        """Every run's full parameters: the cartesian product of the swept lists, plus the fixed ones."""
        keys = list(self.parameters)
        out = []
        for values in itertools.product(*(self.parameters[k] for k in keys)):
            out.append({**self.fixed, **dict(zip(keys, values))})
        return out

    def check_parameters(self) -> None:
        """Every parameter must exist in the notebook's parameters cell (typos fail before hours of runs)."""
        known = notebook_parameters(self.notebook)
        unknown = sorted((set(self.parameters) | set(self.fixed)) - set(known))
        if unknown:
            raise ValueError(
                f"parameters {unknown}: not in the parameters cell of {self.notebook.name}; it has {sorted(known)}"
            )
        values = [(k, v) for k, vs in self.parameters.items() for v in vs] + list(self.fixed.items())
        for k, v in values:  # a value of another type than the cell declares fails every run it is in
            want = _DECLARED.get(known[k]["type"])
            if want is not None and not want(v):
                raise ValueError(f"parameter {k}={v!r}: {self.notebook.name} declares it {known[k]['type']}")


# a parameters cell's declared type -> which grid values it takes (other declarations are not checked)
_DECLARED = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
}


def _resolve_notebook(value: str, base: Path) -> Path:
    p = Path(value)
    if p.is_absolute():
        return p
    for root in (base, REPO, Path.cwd()):
        if (root / p).exists():
            return (root / p).resolve()
    return (REPO / p).resolve()


def load_grid(path: str | Path) -> Grid:
    """Read a grid YAML file (see the module docstring for its keys)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"grid {str(path)!r}: no such file (a grid YAML file; notebooks/grids/ has examples)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a grid file must be a YAML mapping with notebook, name, parameters, fixed")
    allowed = {"notebook", "name", "parameters", "fixed", "timeout_s", "workers", "figures"}
    extra = sorted(set(doc) - allowed)
    if extra:
        raise ValueError(f"{path}: unknown keys {extra}; allowed are {sorted(allowed)}")
    if "notebook" not in doc:
        raise ValueError(f"{path}: missing 'notebook'")
    return Grid(
        notebook=_resolve_notebook(str(doc["notebook"]), path.parent),
        name=str(doc.get("name") or path.stem),
        parameters=doc.get("parameters") or {},
        fixed=doc.get("fixed") or {},
        timeout_s=doc.get("timeout_s"),
        workers=doc.get("workers"),
        figures=doc.get("figures", "run"),
    )


def notebook_parameters(notebook: Path) -> dict[str, dict]:
    """The parameters cell's parameters: {name: {type, default, help}} (papermill's own parser)."""
    import papermill

    return {
        k: {"type": v["inferred_type_name"], "default": v["default"], "help": v["help"]}
        for k, v in papermill.inspect_notebook(str(notebook)).items()
    }


def param_hash(notebook: Path | str, params: dict) -> str:
    """12 hex digits identifying a run: the notebook's name and its parameters (order-free)."""
    key = json.dumps({"notebook": Path(notebook).name, "parameters": params}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def notebook_digest(notebook: Path) -> str:
    """sha256 of the notebook's cell types and sources (outputs and metadata ignored)."""
    nb = json.loads(Path(notebook).read_text())
    body = [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- one run


class NotebookRunError(RuntimeError):
    """A notebook failed: names the cell (index, execution count, first source lines) and the exception."""

    def __init__(self, notebook: str, error: dict):
        self.notebook = notebook
        self.error = error
        super().__init__(describe_error(notebook, error))


def describe_error(notebook: str, error: dict) -> str:
    if error.get("cell_index") is None:
        return f"{notebook}: {error.get('ename', 'error')}: {error.get('evalue', '')}"
    return (
        f"{notebook}: cell {error['cell_index']} (In [{error.get('exec_count')}]) failed: "
        f"{error['ename']}: {error['evalue']}\n    cell source: "
        + str(error.get("source_excerpt", "")).replace("\n", "\n                 ")
    )


def _excerpt(source: str, lines: int = 3, width: int = 200) -> str:
    text = "\n".join(source.strip().splitlines()[:lines])
    return text if len(text) <= width else text[: width - 3] + "..."


def execute(notebook: Path, output: Path, parameters: dict, cwd: Path | None = None,
            kernel: str = "python3", name: str | None = None, cell_timeout_s: float | None = None) -> None:
    """Run one notebook with papermill; a failing cell raises NotebookRunError naming the cell (and the
    notebook as `name`, default its file name). cell_timeout_s bounds each cell (None: no bound; a sweep bounds
    whole runs with its grid's timeout_s instead): a cell past it fails as CellTimeoutError."""
    number = isinstance(cell_timeout_s, (int, float)) and not isinstance(cell_timeout_s, bool)
    if cell_timeout_s is not None and not (number and cell_timeout_s > 0):
        raise ValueError(f"cell_timeout_s={cell_timeout_s!r}: must be a number of seconds > 0, or None")
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    try:
        papermill.execute_notebook(
            str(notebook), str(output), parameters=parameters, kernel_name=kernel,
            cwd=str(cwd or Path(notebook).parent), progress_bar=False, log_output=False,
            execution_timeout=cell_timeout_s,
        )
    except PapermillExecutionError as e:
        line = _failing_line(e.traceback, e.exec_count)
        lines = e.source.splitlines()
        raise NotebookRunError(name or Path(notebook).name, {
            "cell_index": _source_index(Path(output), e.cell_index),
            "exec_count": e.exec_count,
            "line": line,
            "source_excerpt": (f"line {line}: {lines[line - 1].strip()}" if line and line <= len(lines)
                               else _excerpt(e.source)),
            "ename": e.ename,
            "evalue": e.evalue,
        }) from e
    except (CellTimeoutError, DeadKernelError) as e:  # no cell index from nbclient: the message names it
        raise NotebookRunError(name or Path(notebook).name, {"cell_index": None, "ename": type(e).__name__,
                                                     "evalue": str(e)[:2000]}) from e


def _die_with_parent() -> None:
    """Linux: let the kernel SIGKILL this worker when the sweep process dies (its kernel then exits too,
    ipykernel polls its parent), so a killed sweep leaves no orphan runs behind."""
    parent = os.environ.get("MOELAB_SWEEP_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError) as e:
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable (%s): a killed sweep may leave this run going", e)
        return
    if os.getppid() != int(parent):  # the sweep died before prctl took effect
        os._exit(1)


def _failing_line(traceback: list[str], exec_count) -> int | None:
    """The line of the failing cell in IPython's traceback ('Cell In[3], line 14'), if it names one."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(traceback or []))
    hits = re.findall(rf"Cell In\[{exec_count}\], line (\d+)", text)
    return int(hits[-1]) if hits else None


def _source_index(executed: Path, index: int) -> int:
    """The failing cell's index in the source notebook (papermill adds injected-parameters and error cells)."""
    import nbformat

    try:
        cells = nbformat.read(str(executed), as_version=4).cells
    except (OSError, ValueError):
        return index
    added = ("injected-parameters", "papermill-error-cell-tag")
    source = [c for c in cells if not set(c.get("metadata", {}).get("tags", [])) & set(added)]
    for i, c in enumerate(source):
        if c.get("metadata", {}).get("papermill", {}).get("status") == "failed":
            return i
    return index


def _worker(tmp: Path) -> int:
    """Child process: execute the run described by tmp/params.json, then finish it (atomic rename)."""
    _die_with_parent()
    spec = json.loads((tmp / PARAMS).read_text())
    os.environ["MOELAB_RUN_DIR"] = str(tmp)
    if spec["figures"] == "run":
        os.environ["MOELAB_FIGURES"] = str(tmp / "figures")
    t0 = time.time()
    status = {"host": socket.gethostname(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    source = tmp / SOURCE if (tmp / SOURCE).exists() else Path(spec["notebook"])  # the copy the digest names
    try:
        execute(source, tmp / NOTEBOOK_OUT, spec["parameters"], cwd=Path(spec["notebook"]).parent,
                name=Path(spec["notebook"]).name)
        status.update(status="ok", elapsed_s=round(time.time() - t0, 2))
        write_json(tmp / DONE, status)
        rc = 0
    except NotebookRunError as e:
        write_json(tmp / ERROR, {**e.error, **status, "elapsed_s": round(time.time() - t0, 2)})
        rc = 1
    except Exception as e:  # noqa: BLE001  papermill itself failed (no kernel, unreadable notebook, ...): a failed run
        import traceback

        traceback.print_exc()  # into worker.log, which travels with the run folder
        write_json(tmp / ERROR, {"cell_index": None, "ename": type(e).__name__, "evalue": str(e)[:2000], **status,
                                 "elapsed_s": round(time.time() - t0, 2)})
        rc = 1
    _finish(tmp, Path(spec["final"]))
    return rc


def _finish(tmp: Path, final: Path) -> None:
    """Move a finished (or failed) run into place, replacing what was there: an earlier attempt, failed, stale
    or rerun. Only a concurrent attempt (another shard or host) that finished this version of the notebook
    while this one ran is kept over this one's failure."""
    if final.exists():
        if (final / DONE).exists() and not (tmp / DONE).exists() and _finished_during(final, tmp):
            shutil.rmtree(tmp)  # someone else finished it meanwhile; keep theirs
            return
        # set the old run aside, move the new one in, then delete the old: a sweep killed between the two
        # renames leaves both, named after this attempt, and `run_state` finishes the move once this attempt's
        # process is gone (a kill during a delete in place could leave a folder with `done` but part of its results)
        old = final.parent / (".old-" + tmp.name[len(".tmp-"):])
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            if old.exists() and not final.exists():
                os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, final)


def _restore_set_aside(final: Path) -> None:
    """Finish the move of a `_finish` that was killed between its two renames (its attempt's process gone):
    the attempt's own folder moves in if it finished (done or error), else the run set aside moves back.
    A set-aside folder beside a run folder that exists is deleted; a live attempt's is left alone."""
    for old in sorted(final.parent.glob(f".old-{final.name}-*")):
        if not _dead_attempt(old, None):
            continue
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            continue
        attempt = final.parent / (".tmp-" + old.name[len(".old-"):])
        try:
            if (attempt / DONE).exists() or (attempt / ERROR).exists():
                os.rename(attempt, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, final)
        except OSError:  # another sweep finished the move first
            pass


def _finished_during(final: Path, tmp: Path) -> bool:
    """Whether final's run finished after tmp's attempt started, with the same notebook version."""
    try:
        ours, theirs = json.loads((tmp / PARAMS).read_text()), json.loads((final / PARAMS).read_text())
        return (theirs.get("notebook_digest") == ours.get("notebook_digest")
                and (final / DONE).stat().st_mtime >= ours.get("started_epoch", float("inf")))
    except (OSError, json.JSONDecodeError):
        return False


@dataclasses.dataclass
class RunState:
    hash: str
    params: dict
    status: str  # "done" (finished earlier), "ok", "failed", "pending"; with --collect also "stale"
    error: dict | None = None
    elapsed_s: float | None = None


def run_state(run_dir: Path, digest: str | None = None) -> str:
    """'done' if the run finished (with this notebook version when digest is given; 'stale' if with another),
    'failed', or 'pending'."""
    _restore_set_aside(run_dir)
    if (run_dir / DONE).exists():
        if digest is not None:
            try:
                seen = json.loads((run_dir / PARAMS).read_text()).get("notebook_digest")
            except (OSError, json.JSONDecodeError):
                seen = None
            if seen != digest:
                return "stale"
        return "done"
    if (run_dir / ERROR).exists():
        return "failed"
    return "pending"


def _dead_attempt(folder: Path, timeout_s: float | None) -> bool:
    """Whether an attempt folder `.tmp-<hash>-<host>-<pid>-<token>` (or the run it set aside, `.old-...`) was
    left by an attempt that is over.

    This host's: its process is gone (Linux / macOS; on Windows, where probing a process can end it, never).
    Another host's (a shared file system): when its runner's heartbeat is older than HEARTBEAT_STALE_S (it
    touches the file every HEARTBEAT_S while its worker runs); an attempt without one (an older moelab's)
    only when it started longer ago than the grid's timeout_s, past which its own runner would have killed
    it, and without a timeout never: it may still run."""
    host = socket.gethostname()
    prefix = folder.name[:5]  # ".tmp-" or ".old-"
    h = folder.name[len(prefix):].split("-", 1)[0]
    mine = folder.name[len(f"{prefix}{h}-{host}-"):] if folder.name.startswith(f"{prefix}{h}-{host}-") else ""
    pid, _, token = mine.partition("-")
    if pid.isdigit() and len(token) == 8 and all(c in "0123456789abcdef" for c in token):
        # this host's (the token's shape keeps a host `node` from claiming `node-2`'s folders)
        if os.name == "nt":
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: alive, another user's
            return False
        return False
    age = _heartbeat_age(folder, prefix)
    if age is not None:
        return age > HEARTBEAT_STALE_S
    if timeout_s is None:
        return False
    try:
        started = json.loads((folder / PARAMS).read_text())["started_epoch"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            started = folder.stat().st_mtime
        except OSError:  # gone meanwhile (its attempt finished, or another sweep removed it)
            return False
    return time.time() - started > timeout_s + 60


def _heartbeat_age(folder: Path, prefix: str) -> float | None:
    """Seconds since an attempt's runner last touched its heartbeat; None if it has none. A set-aside run
    (`.old-...`) has its attempt's: in the attempt's folder, or in the run folder it was moved to."""
    where = [folder / HEARTBEAT]
    if prefix == ".old-":
        rest = folder.name[len(prefix):]
        where = [folder.parent / (".tmp-" + rest) / HEARTBEAT, folder.parent / rest.split("-", 1)[0] / HEARTBEAT]
    for f in where:
        try:
            return time.time() - f.stat().st_mtime
        except OSError:
            continue
    return None


def _beat(folder: Path) -> None:
    """Touch an attempt's heartbeat (see _dead_attempt); its folder may have moved into place meanwhile."""
    try:
        (folder / HEARTBEAT).touch()
    except OSError:
        pass


def _read_error(run_dir: Path) -> dict:
    """A failed run's error.json ({} with the reason where it cannot be read)."""
    try:
        err = json.loads((run_dir / ERROR).read_text())
        return err if isinstance(err, dict) else {"ename": "UnreadableError", "evalue": f"{run_dir / ERROR}"}
    except (OSError, ValueError) as e:
        return {"ename": "UnreadableError", "evalue": f"{run_dir / ERROR}: {e}"}


def _clear_dead_attempts(final: Path, timeout_s: float | None) -> None:
    """Remove the attempt folders of run `final` left by killed attempts (`_dead_attempt`)."""
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        if _dead_attempt(stale, timeout_s):
            shutil.rmtree(stale, ignore_errors=True)


def _launch(notebook: Path, params: dict, final: Path, figures: str, gpu: str | None,
            timeout_s: float | None, digest: str) -> RunState:
    """Execute one run in a worker process (its own session, so a timeout kills its kernel too)."""
    h = final.name
    _clear_dead_attempts(final, timeout_s)
    tmp = final.parent / f".tmp-{h}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(notebook, tmp / SOURCE)  # the run executes this copy: a later edit cannot reach it
        ran = notebook_digest(tmp / SOURCE)
        write_json(tmp / PARAMS, {
            "notebook": str(notebook), "notebook_digest": ran, "parameters": params, "hash": h,
            "final": str(final), "figures": figures, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "started_epoch": time.time(),
        })
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if ran != digest:
        log.warning("run %s: %s changed since the sweep started; this run uses the new version", h, notebook.name)
    env = dict(os.environ)
    # headless: transformers' weight-loading bar would stay in the saved notebook as a widget frozen at 0%
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env["MOELAB_SWEEP_PARENT"] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "lib"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "moelab.sweep", "--worker", str(tmp)]
    timed_out = None
    with open(tmp / WORKER_LOG, "wb") as logf:  # travels with the folder when it is renamed
        _beat(tmp)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=logf, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = HEARTBEAT_S if deadline is None else min(HEARTBEAT_S, max(0.0, deadline - time.monotonic()))
            try:
                proc.wait(timeout=left)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    os.killpg(proc.pid, 9)  # the worker's session: papermill and its kernel
                    proc.wait()
                    timed_out = {"cell_index": None, "ename": "Timeout",  # fields as the worker's own errors
                                 "evalue": f"run exceeded timeout_s={timeout_s}", "host": socket.gethostname(),
                                 "gpu": gpu, "elapsed_s": round(time.monotonic() - t0, 2)}
                    break
                _beat(tmp)  # still running: other hosts leave this attempt's folder alone
    aside = final.parent / (".old-" + tmp.name[len(".tmp-"):])  # where the worker's `_finish` sets the old run aside
    # the worker has ended: its heartbeat goes (with the folder, if the worker moved its run into place)
    (tmp / HEARTBEAT if tmp.exists() else final / HEARTBEAT).unlink(missing_ok=True)
    if tmp.exists() and (tmp / DONE).exists():
        _finish(tmp, final)  # the notebook finished; the worker was stopped while it moved the run into place
        shutil.rmtree(aside, ignore_errors=True)
    elif tmp.exists() or not final.exists() or (timed_out is None and proc.returncode not in (0, 1)):
        # tmp left: the worker never finished (a timeout, a crash); with tmp gone the worker moved its run in
        where = tmp if tmp.exists() else final
        tail = (where / WORKER_LOG).read_text(errors="replace")[-2000:] if (where / WORKER_LOG).exists() else ""
        err = timed_out or {"cell_index": None, "ename": f"WorkerExit{proc.returncode}", "evalue": tail}
        if tmp.exists():
            write_json(tmp / ERROR, err)
            _finish(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        return RunState(h, params, "failed", err)
    if (final / DONE).exists():
        return RunState(h, params, "ok", elapsed_s=json.loads((final / DONE).read_text()).get("elapsed_s"))
    return RunState(h, params, "failed", _read_error(final))


# -------------------------------------------------------------------------------------------- sweeps


def visible_gpus() -> list[str]:
    """GPU ids to spread runs over: CUDA_VISIBLE_DEVICES if set, else every device torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard={text!r}: must read I/N with integers, e.g. 3/32") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard={text!r}: need N >= 1 and 0 <= I < N")
    return i, n


@dataclasses.dataclass
class SweepReport:
    name: str
    directory: Path
    runs: list[RunState]
    tables: dict[str, Path]

    @property
    def failed(self) -> list[RunState]:
        return [r for r in self.runs if r.status == "failed"]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.runs:
            out[r.status] = out.get(r.status, 0) + 1
        return out


def run_sweep(grid: Grid | str | Path, *, root: Path | None = None, workers: int | None = None,
              shard: str | None = None, rerun: bool = False, collect_only: bool = False,
              progress: bool = True) -> SweepReport:
    """Run every point of a grid that has not finished yet, then combine all finished runs into tables."""
    from tqdm.auto import tqdm

    if not isinstance(grid, Grid):
        grid = load_grid(grid)
    grid.check_parameters()
    sweep_dir = Path(root or runs_root()) / grid.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    digest = notebook_digest(grid.notebook)
    si, sn = parse_shard(shard)
    points = [(param_hash(grid.notebook, p), p) for i, p in enumerate(grid.points()) if i % sn == si]

    states: dict[str, RunState] = {}
    todo = []
    for h, p in points:
        st = run_state(sweep_dir / h, digest)  # first: it finishes an interrupted move, by the attempts' heartbeats
        _clear_dead_attempts(sweep_dir / h, grid.timeout_s)  # also of a point that finished since
        if st == "done" and not rerun:
            states[h] = RunState(h, p, "done")
        elif collect_only and st in ("stale", "failed"):  # listed as they are: --collect runs nothing
            states[h] = RunState(h, p, st, _read_error(sweep_dir / h) if st == "failed" else None)
        else:
            if st == "stale":
                log.warning("run %s finished with another version of %s: running it again", h, grid.notebook.name)
            states[h] = RunState(h, p, "pending")
            todo.append((h, p))

    if todo and not collect_only:
        gpus = visible_gpus()
        slots: list[str | None] = gpus if gpus else [None] * max(1, workers or grid.workers or 1)
        jobs: queue.Queue = queue.Queue()
        for item in todo:
            jobs.put(item)
        bar = tqdm(total=len(points), initial=len(points) - len(todo), desc=f"sweep {grid.name}",
                   unit="run", disable=not progress, file=sys.stderr)
        lock = threading.Lock()

        def work(slot):
            while True:
                try:
                    h, p = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    state = _launch(grid.notebook, p, sweep_dir / h, grid.figures, slot, grid.timeout_s, digest)
                except Exception as e:  # noqa: BLE001  the runner's own failure: recorded, the other points go on
                    log.exception("sweep runner failed on point %s %s", h, json.dumps(p, default=str))
                    state = RunState(h, p, "failed", {"cell_index": None, "ename": f"Runner{type(e).__name__}",
                                                      "evalue": str(e)})
                with lock:
                    states[h] = state
                    bar.update(1)
                    if state.status == "failed":
                        bar.write(f"FAILED {h} {json.dumps(p, default=str)}\n  "
                                  + describe_error(grid.notebook.name, state.error or {}))

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bar.close()
        for h, p in todo:  # nothing may stay pending after a run: a point no worker finished is a failure
            if states[h].status == "pending":
                states[h] = RunState(h, p, "failed", {"cell_index": None, "ename": "NotRun",
                                                      "evalue": "no worker finished this point"})

    # the notebook as it is now: runs that started after an edit during the sweep are current, earlier ones stale
    tables = collect(sweep_dir, [h for h, _ in param_hash_points(grid)], grid.name,
                     digest=notebook_digest(grid.notebook))
    return SweepReport(grid.name, sweep_dir, [states[h] for h, _ in points], tables)


def param_hash_points(grid: Grid) -> list[tuple[str, dict]]:
    """(hash, parameters) of every point of the grid, in grid order."""
    return [(param_hash(grid.notebook, p), p) for p in grid.points()]


# ------------------------------------------------------------------------------------------- tables


def list_points(grid: Grid, root: Path | None = None) -> list[dict]:
    """Per point, what an outside engine needs to run it itself: its run folder and the params.json to
    write there (with the notebook's digest, so that a later ordinary sweep sees the run as current)."""
    grid.check_parameters()
    sweep_dir = Path(root or runs_root()) / grid.name
    digest = notebook_digest(grid.notebook)
    return [{"hash": h, "run_dir": str(sweep_dir / h), "notebook": str(grid.notebook), "notebook_digest": digest,
             "parameters": p} for h, p in param_hash_points(grid)]


def _cell(v):
    """A table cell: scalars as they are, anything else as JSON text (parquet needs one type per column)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v, default=str)


def _flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: nested scalar results become columns."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _one_type_per_column(df):
    """df with every column of mixed value types (e.g. a parameter given as "1024" and as 2048) as text:
    parquet takes one type per column, and the summary must still be written."""
    def missing(v):
        return v is None or (isinstance(v, float) and math.isnan(v))

    out = df.copy()
    for c in out.columns:
        if out[c].dtype == object and len({type(v) for v in out[c] if not missing(v)}) > 1:
            out[c] = out[c].map(lambda v: v if missing(v) else str(v))
    return out


def _write_table(df, path_stem: Path) -> dict[str, Path]:
    import io

    df = _one_type_per_column(df)
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    atomic_write_bytes(path_stem.with_suffix(".parquet"), buf.getvalue())
    atomic_write_bytes(path_stem.with_suffix(".csv"), df.to_csv(index=False).encode())
    return {"parquet": path_stem.with_suffix(".parquet"), "csv": path_stem.with_suffix(".csv")}


_SUMMARY_COLUMNS = ("run", "status", "elapsed_s", "error")


def _read_run(d: Path, state: str) -> tuple[dict, dict, dict]:
    """A finished run's params.json, its `done` or error.json record ({} for a stale run) and saved results;
    a file that cannot be read raises ValueError or OSError naming it."""
    from moelab.results import load_saved, read_json

    def record(path: Path) -> dict:
        value = read_json(path)
        if not isinstance(value, dict):
            raise ValueError(f"{path}: holds a JSON {type(value).__name__}, not an object")
        return value

    spec = record(d / PARAMS)
    if not isinstance(spec.get("parameters"), dict):
        raise ValueError(f"{d / PARAMS}: has no 'parameters' object")
    if state == "stale":
        return spec, {}, {}
    return spec, record(d / (DONE if state == "done" else ERROR)), load_saved(d)


def collect(sweep_dir: Path, hashes: list[str], name: str = "", digest: str | None = None) -> dict[str, Path]:
    """Combine runs into summary.{parquet,csv} (one row per run) and <result>.{parquet,csv} per saved frame.

    Parameters become columns, prefixed `param.` only where a frame already has a column of that name or the
    name is one of the summary's own columns (run, status, elapsed_s, error); a scalar result with such a name
    (or a parameter's) is prefixed `result.`, and a frame with its own `run` column gets the run as `sweep.run`.
    digest: the notebook's current `notebook_digest`; a run finished with another version is listed with
    status 'stale' and none of its results (a sweep without --collect runs it again). A run whose files
    cannot be read (params.json, done, error.json, a saved result) is left out with a warning naming the file.
    """
    import pandas as pd

    summary, frames, stale = [], {}, 0
    for h in hashes:
        d = sweep_dir / h
        state = run_state(d, digest)
        if state == "pending":
            continue
        try:
            spec, end, saved = _read_run(d, state)
        except (OSError, ValueError) as e:
            log.warning("run %s: left out of the summary, a file of it cannot be read: %s", h, e)
            continue
        params = {k: _cell(v) for k, v in spec["parameters"].items()}
        row = {"run": h, **{(f"param.{k}" if k in _SUMMARY_COLUMNS else k): v for k, v in params.items()},
               "status": {"done": "ok", "stale": "stale"}.get(state, "failed")}
        if state == "stale":
            stale += 1
            summary.append(row)
            continue
        if state == "done":
            row["elapsed_s"] = end.get("elapsed_s")
        else:
            row["error"] = describe_error(Path(spec.get("notebook", "notebook")).name, end)
        for rname, obj in saved.items():
            if isinstance(obj, pd.DataFrame) or (isinstance(obj, list) and obj and all(isinstance(x, dict)
                                                                                       for x in obj)):
                df = obj if isinstance(obj, pd.DataFrame) else pd.DataFrame(obj)
                df = df.assign(**{c: df[c].map(_cell) for c in df.columns if df[c].dtype == object})
                run_col = "sweep.run" if "run" in df.columns else "run"
                cols = {(f"param.{k}" if k in df.columns or k == run_col else k): v for k, v in params.items()}
                df = df.assign(**{run_col: h, **cols})[[run_col, *cols, *df.columns]]
                frames.setdefault("result.summary" if rname == "summary" else rname, []).append(df)
            elif isinstance(obj, dict):
                row.update({f"{rname}.{k}": _cell(v) for k, v in _flatten(obj).items()})
            else:
                row[f"result.{rname}" if rname in _SUMMARY_COLUMNS or rname in params else rname] = _cell(obj)
        summary.append(row)
    if stale:
        log.warning("%s: %d runs finished with another version of the notebook: listed as 'stale', without their "
                    "results (run the sweep again to redo them)", name or sweep_dir.name, stale)
    out = {}
    if summary:
        out.update({f"summary.{k}": v for k, v in _write_table(pd.DataFrame(summary), sweep_dir / "summary").items()})
    for rname, dfs in frames.items():
        df = pd.concat(dfs, ignore_index=True)  # columns: run, parameters, then the frame's own
        out.update({f"{rname}.{k}": v for k, v in _write_table(df, sweep_dir / rname).items()})
    _drop_old_tables(sweep_dir, {p.name for p in out.values()})
    return out


def _drop_old_tables(sweep_dir: Path, written: set[str]) -> None:
    """Remove the tables an earlier collect wrote and this one did not (e.g. of runs now stale), then list
    this collect's in TABLES."""
    try:
        old = json.loads((sweep_dir / TABLES).read_text())
    except (OSError, ValueError):
        old = []
    for f in old if isinstance(old, list) else []:
        if isinstance(f, str) and f not in written and f == Path(f).name and f.endswith((".csv", ".parquet")):
            (sweep_dir / f).unlink(missing_ok=True)
    write_json(sweep_dir / TABLES, sorted(written))


# ---------------------------------------------------------------------------------------- main job


def main_grids(directory: Path | None = None, overrides: dict[str, dict] | None = None) -> list[Grid]:
    """One single-run grid per notebook NN_*.ipynb in notebooks/, with its defaults (plus overrides)."""
    d = Path(directory or notebooks_dir())
    out = []
    for nb in sorted(d.glob("[0-9][0-9]_*.ipynb")):
        out.append(Grid(notebook=nb, name=nb.stem, fixed=dict((overrides or {}).get(nb.stem, {})), figures="repo"))
    return out


def run_main(directory: Path | None = None, root: Path | None = None, overrides: dict | None = None,
             budget_s: float = MAIN_TIME_BUDGET_S, resume: bool = False) -> int:
    """Run every notebook through the sweep runner (runs/main/<notebook>/); print where the outputs are.

    Every notebook runs again (fresh figures from the current code) unless resume=True, which skips
    notebooks that finished earlier with the same source.
    """
    from moelab.plots import figures_dir

    grids = main_grids(directory, overrides)
    if not grids:
        print(f"no notebooks NN_*.ipynb in {directory or notebooks_dir()}")
        return 1
    root = Path(root or runs_root()) / "main"
    t0 = time.time()
    failed, skipped = [], 0
    for g in grids:
        t1 = time.time()
        print(f"== {g.notebook.name}", flush=True)
        rep = run_sweep(g, root=root, progress=False, rerun=not resume)
        earlier = not rep.failed and rep.counts().get("done")
        status = "FAILED" if rep.failed else ("done earlier (--resume: not run again)" if earlier else "ok")
        took = "" if earlier else f" in {time.time() - t1:.0f} s"
        print(f"   {status}{took} -> {rep.directory}", flush=True)
        skipped += bool(earlier)
        for r in rep.failed:
            print("   " + describe_error(g.notebook.name, r.error or {}).replace("\n", "\n   "), flush=True)
            failed.append(g.notebook.name)
    total = time.time() - t0
    figs = figures_dir()
    files = sorted(p for p in figs.glob("*") if p.suffix in (".pdf", ".png", ".csv", ".tex")) if figs.exists() else []
    ran = f"{len(grids) - len(failed) - skipped}/{len(grids)} notebooks ran" + (f", {skipped} done earlier" if skipped
                                                                                else "")
    print(f"\n{ran}, in {total:.0f} s "
          f"(budget {budget_s / 60:.0f} min{'' if total <= budget_s else ', EXCEEDED'}).")
    print(f"Figures and tables ({len(files)} files) are in {figs}/:")
    for p in files:
        print(f"  {p.name}")
    print(f"Executed notebooks and named results: {root}/<notebook>/<run>/")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelab.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("grid", nargs="?", help="grid YAML file")
    ap.add_argument("--main", action="store_true", help="run every notebook in notebooks/ with its defaults")
    ap.add_argument("--workers", type=int, help="parallel runs on a CPU (default 1; on GPUs one per GPU)")
    ap.add_argument("--shard", help="I/N: run only the points with index %% N == I (job arrays)")
    ap.add_argument("--rerun", action="store_true", help="run finished points again")
    ap.add_argument("--resume", action="store_true", help="with --main: skip notebooks that finished earlier")
    ap.add_argument("--collect", action="store_true", help="run nothing; combine finished runs into tables")
    ap.add_argument("--list", action="store_true",
                    help="print each point as JSON (hash, run_dir, notebook, notebook_digest, parameters), run nothing")
    ap.add_argument("--root", type=Path, help="runs folder (default runs/ or MOELAB_RUNS)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("papermill").setLevel(logging.WARNING)
    if a.worker:
        return _worker(a.worker)
    if a.workers is not None and a.workers < 1:
        ap.error(f"--workers {a.workers}: must be at least 1")
    if a.main:
        clash = [f"--{k}" for k in ("list", "collect", "shard", "workers", "rerun") if getattr(a, k)]
        if a.grid or clash:
            ap.error(f"--main runs every notebook with its defaults; it takes only --resume and --root, "
                     f"not {', '.join(clash + ([a.grid] if a.grid else []))}")
        return run_main(root=a.root, resume=a.resume)
    if not a.grid:
        ap.error("give a grid file or --main")
    if a.resume:
        ap.error("--resume is for --main; a grid sweep always skips its finished points (--rerun runs them again)")
    if a.list:
        clash = [f"--{k}" for k in ("collect", "shard", "workers", "rerun") if getattr(a, k)]
        if clash:
            ap.error(f"--list prints every point and runs nothing; it takes only --root, not {', '.join(clash)}")
    try:
        grid = load_grid(a.grid)
        if a.list:
            for line in list_points(grid, a.root):
                print(json.dumps(line, default=str))
            return 0
        grid.check_parameters()  # run_sweep checks these too; here a bad value is a usage error, not a traceback
        parse_shard(a.shard)
    except ValueError as e:
        ap.error(str(e))
    rep = run_sweep(grid, root=a.root, workers=a.workers, shard=a.shard, rerun=a.rerun, collect_only=a.collect)
    print(f"{rep.name}: {rep.counts()} in {rep.directory}")
    for k, p in rep.tables.items():
        print(f"  {k}: {p}")
    for r in rep.failed:
        print(f"FAILED {r.hash} {json.dumps(r.params, default=str)}\n  "
              + describe_error(grid.notebook.name, r.error or {}))
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
