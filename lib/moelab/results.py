"""Results with provenance: a results file carries the machine, library versions, commit and command.

Two writers:
- `write_results(topic, rows, ...)`: a benchmark or GPU run's file `data/results/<topic>-<yyyymmdd>.json`
  (schema 1: topic, created, commit, command, machine, rows, notes); an earlier run's file of the same name
  is moved to `archive/<topic>-<yyyymmdd>-<commit>.json` first, never overwritten. A committed current file may
  be xz-compressed (`<topic>-<yyyymmdd>.json.xz`, the large ones: the tree travels to the GPU machine under a
  size limit); the readers take either form;
- `save(name, obj)`: a notebook's named result (JSON for scalars/dicts, parquet for frames) in the
  current run directory (`MOELAB_RUN_DIR`, set by the sweep runner; `runs/interactive` otherwise), as it
  is: its provenance is the run folder's params.json and executed notebook.
Files are written atomically (temp file + rename): a killed process leaves the old file or the new one.
`diff(old, new)` (or `python -m moelab.results diff OLD NEW`) says where a rerun's file differs from another's.
`read_log(name)` (or `python -m moelab.results log NAME`) reads a GPU call's log by the name the docs give it
(`logs/<step>-<sha>.txt.xz`), whether it lies in data/results/logs as a file or packed in a bundle there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import lzma
import math
import numbers
import os
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCHEMA = 1
FIELDS = ("schema", "topic", "created", "commit", "command", "machine", "rows", "notes")  # a document's own
log = logging.getLogger("moelab.results")


def _check_stem(what: str, name) -> None:
    """A topic or result name becomes a file name: a plain stem in its folder."""
    if not isinstance(name, str):
        raise TypeError(f"{what} {name!r}: must be a str, not {type(name).__name__}")
    if not name or "/" in name or name.startswith(".") or name.endswith((".json", ".xz", ".parquet", ".csv")):
        raise ValueError(f"{what} {name!r}: must be a plain file stem (no '/', not hidden, no file extension)")


def commit() -> str:
    """The git commit of the code that ran (MOELAB_COMMIT wins: the GPU machine's copy has no .git)."""
    env = os.environ.get("MOELAB_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:  # the first status of a fresh checkout or worktree hashes every file: allow it time
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return out + "-unverified"  # the commit, but whether the tree was clean could not be checked
    return out + ("-dirty" if dirty else "")


def cpu_model() -> str:
    """The host CPU's model name (Linux /proc/cpuinfo), else the architecture: eager timings depend on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Device name and library versions of this process."""
    import torch

    info: dict[str, Any] = {
        "host_cpu": platform.processor() or platform.machine(),  # the architecture (kept: older files have it)
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    for mod in ("transformers", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def command_line() -> str:
    """This process's command as typed: `python -m pkg.mod ...` for a module run with -m (whose argv[0] is its file)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv = list(sys.argv)
    if spec is not None and spec.name and argv:
        argv[0:1] = ["-m", spec.name.removesuffix(".__main__")]
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *argv])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: os.umask can only be read by setting it


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file. The file gets the mode
    an ordinary open would give it (mkstemp's are owner-only: colleagues on a shared box could not read them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(x):
    import numpy as np

    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, np.ndarray) or (hasattr(x, "tolist") and hasattr(x, "dtype")):  # and torch tensors
        return _jsonable(x.tolist())  # NaN inside becomes null too
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None  # strict JSON has no NaN or Infinity
    if isinstance(x, Path):
        return str(x)
    return x


def _json_bytes(obj) -> bytes:
    """Strict JSON (NaN and +-inf as null): a value that cannot be written raises here, before any file moves."""
    return (json.dumps(_jsonable(obj), indent=1, allow_nan=False) + "\n").encode()


def write_json(path: Path, obj) -> Path:
    atomic_write_bytes(Path(path), _json_bytes(obj))
    return Path(path)


def results_dir() -> Path:
    return Path(os.environ.get("MOELAB_RESULTS_DIR", REPO / "data" / "results"))


LOG_BUNDLES = "packed-*.tar.xz"  # logs/packed-<yyyymmdd>.tar.xz: the logs packed that day (.ci/gpu pack-logs)


def _log_member(name: str) -> str:
    """'logs/<name>.txt.xz', '<name>.txt.xz', '<name>.txt' or '<name>' -> '<name>.txt', a bundle's member name
    (.csv stays .csv)."""
    member = Path(str(name)).name.removesuffix(".xz")
    return member if member.endswith((".txt", ".csv")) else member + ".txt"


def read_log(name: str, directory: Path | None = None) -> str:
    """A GPU call's log as text, by the name the docs give it (`logs/<step>-<sha>.txt.xz`): the file in
    data/results/logs, or the member of a bundle there (`packed-<date>.tar.xz`: one solid xz of many small logs
    takes an eighth of the disk blocks they take as files, and the tree travels to the GPU machine under a limit)."""
    d = Path(directory) if directory is not None else results_dir() / "logs"
    member = _log_member(name)
    loose = d / (member + ".xz")
    if loose.is_file():
        return lzma.decompress(loose.read_bytes()).decode()
    bundles = sorted(d.glob(LOG_BUNDLES))
    for bundle in bundles:
        with tarfile.open(bundle, "r:xz") as tar:
            try:
                f = tar.extractfile(member)
            except KeyError:
                continue
            if f is not None:
                return f.read().decode()
    raise FileNotFoundError(f"log {name!r}: no {loose.name} in {d}, and no member {member} in its {len(bundles)} "
                            f"bundle(s) ({LOG_BUNDLES}); `python -m moelab.results log --list` lists them")


def log_names(directory: Path | None = None) -> list[str]:
    """Every log's member name (`<step>-<sha>.txt`), loose or bundled, sorted."""
    d = Path(directory) if directory is not None else results_dir() / "logs"
    names = {p.name.removesuffix(".xz") for p in d.glob("*.xz") if not p.name.endswith(".tar.xz")}
    for bundle in d.glob(LOG_BUNDLES):
        with tarfile.open(bundle, "r:xz") as tar:
            names.update(m.name for m in tar.getmembers() if m.isfile())
    return sorted(names)


def write_results(topic: str, rows: list[dict], notes: str = "", command: str | None = None,
                  out_dir: Path | None = None, extra: dict | None = None) -> Path:
    """Write `<out_dir>/<topic>-<yyyymmdd>.json` (schema 1) and return its path. `extra`: the topic's own
    fields, none of them one of the document's (FIELDS)."""
    _check_stem("topic", topic)
    taken = sorted(set(extra or ()) & set(FIELDS))
    if taken:
        raise ValueError(f"extra keys {taken}: taken by the document's own fields {FIELDS}")
    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {
        "schema": SCHEMA,
        "topic": topic,
        "created": now.isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command or command_line(),
        "machine": machine(),
        "rows": rows,
        "notes": notes,
    }
    if extra:
        doc.update(extra)
    path = Path(out_dir or results_dir()) / f"{topic}-{now:%Y%m%d}.json"
    data = _json_bytes(doc)  # first: a row that cannot be written must not cost the day's earlier file
    for old in (path, path.with_name(path.name + ".xz")):  # an earlier run's file of the same day: keep it
        if old.exists() and old.resolve() not in _WRITTEN:
            kept = _archive_name(old)
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.replace(old, kept)
            print(f"{old.name}: the earlier run of this day moved to {kept}")
    _WRITTEN.add(path.resolve())
    atomic_write_bytes(path, data)
    return path


_WRITTEN: set[Path] = set()  # results files this process wrote: its own later writes (a run saving as it goes)
# replace them; a file from another run is moved to archive/ first


def _archive_name(path: Path) -> Path:
    """archive/<topic>-<yyyymmdd>-<commit>.json (.json.xz for a compressed file) for an earlier results file (its
    commit's first 7 characters; -2, -3, ... where that name is taken in either form)."""
    try:
        sha = str(read_file(path).get("commit", "unknown"))[:7]
    except (OSError, ValueError):
        sha = "unknown"
    stem, xz = path.name.removesuffix(".xz").removesuffix(".json"), ".xz" if path.name.endswith(".xz") else ""
    archive = path.parent / "archive"
    name, n = f"{stem}-{sha}", 2
    while (archive / f"{name}.json").exists() or (archive / f"{name}.json.xz").exists():
        name, n = f"{stem}-{sha}-{n}", n + 1
    return archive / f"{name}.json{xz}"


def current_file(topic: str, directory: Path | None = None) -> Path | None:
    """A topic's current file in `directory` (default: the committed data/results): the newest by the date in
    its name of `<topic>-<yyyymmdd>.json` and its xz-compressed form `.json.xz`; None when there is none. Both
    forms for that day raise ValueError: which one is the run is not for the reader to guess."""
    d = Path(directory or REPO / "data" / "results")
    # exactly <topic>-<yyyymmdd>.json(.xz): 'pair-layout' must not pick up 'pair-layout-sweep-...'
    name = re.compile(rf"{re.escape(topic)}-(\d{{8}})\.json(\.xz)?")
    days: dict[str, list[Path]] = {}
    for f in d.glob(f"{topic}-*.json*"):
        m = name.fullmatch(f.name)
        if m:
            days.setdefault(m[1], []).append(f)
    if not days:
        return None
    newest = days[max(days)]
    if len(newest) > 1:
        raise ValueError(f"{sorted(f.name for f in newest)} in {d}: one day's results of topic {topic!r} both plain "
                         "and xz-compressed; keep one")
    return newest[0]


def load_results(topic: str, directory: Path | None = None, fallback: bool = False) -> dict:
    """The newest results file of a topic (by the date in its name) in `directory` (default: the committed
    data/results). fallback: if `directory` has none, the committed one, and a line says so (a GPU run of
    some benchmark parts still plots the others; every figure names the commit its numbers came from)."""
    committed = REPO / "data" / "results"
    d = Path(directory or committed)
    found = current_file(topic, d)
    if found is None and fallback and d != committed:
        print(f"{topic}: no results in {d}, using the committed ones in {committed}")
        return load_results(topic)
    if found is None:
        raise FileNotFoundError(f"no results for topic {topic!r} in {d}; run its benchmark on a GPU first")
    return read_file(found)


def load_runs(topic: str, directory: Path | None = None) -> list[dict]:
    """Every committed run of a topic, oldest first (by `created`): the current `<topic>-<yyyymmdd>.json` (or
    `.json.xz`) and the runs it replaced, `archive/<topic>-<yyyymmdd>-<commit>.json.xz` (xz-compressed, since
    2026-12-01: the repository travels to the GPU machine whole, under a size limit; plain `.json` there is read
    too): how far a number moves between runs. Side runs of another configuration, archived under a descriptive
    suffix (`graph-pool-20261129-primed-default.json.xz`), are not replaced runs: `read_file` opens them. A file
    that cannot be read (or has no `created`) is left out with a warning naming it, so one damaged archive does
    not hide the history; ValueError when no file of the topic can be read."""
    d = Path(directory or REPO / "data" / "results")
    name = re.compile(rf"{re.escape(topic)}-\d{{8}}(-([0-9a-f]{{7,40}}|unknown)(-\d+)?)?\.json(\.xz)?")
    candidates = (*d.glob(f"{topic}-*.json*"), *(d / "archive").glob(f"{topic}-*.json*"))
    files = [f for f in candidates if name.fullmatch(f.name)]
    if not files:
        raise FileNotFoundError(f"no results for topic {topic!r} in {d} or {d / 'archive'}")
    docs = []
    for f in files:
        try:
            doc = read_file(f)
            if not isinstance(doc.get("created"), str):
                raise ValueError(f"{f}: no 'created' time in it")
            docs.append(doc)
        except ValueError as e:
            log.warning("%s: left out of the runs of %r", e, topic)
    if not docs:
        raise ValueError(f"no readable results for topic {topic!r} in {d} or {d / 'archive'} (see the warnings)")
    return sorted(docs, key=lambda doc: doc["created"])


def read_json(path: Path):
    """A JSON file's value (xz-compressed for `.xz`); a damaged file raises ValueError naming it."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(lzma.decompress(data) if path.suffix == ".xz" else data)
    except (ValueError, lzma.LZMAError) as e:
        raise ValueError(f"{path}: not readable as JSON{' (xz)' if path.suffix == '.xz' else ''}: {e}") from e


def read_file(path: Path) -> dict:
    """One results file: JSON, or xz-compressed JSON (`.json.xz`, the archive's form). A damaged file, or one
    that holds no JSON object, raises ValueError naming it."""
    path = Path(path)
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}, not a results document (an object)")
    return doc


def load_optional(topic: str, directory: Path | None = None) -> dict | None:
    """load_results(topic, directory, fallback=True), or None with the reason printed: for a notebook
    section that plots a topic only where it has been measured. A file there that cannot be read is no
    missing measurement: its ValueError (naming it) goes through."""
    try:
        return load_results(topic, directory, fallback=True)
    except FileNotFoundError as e:
        print(e)
        return None


def rows_frame(doc: dict):
    """A results document's rows as a pandas frame."""
    import pandas as pd

    if not isinstance(doc, dict):
        raise TypeError(f"doc: a {type(doc).__name__}, not a results document (a dict)")
    if not isinstance(doc.get("rows"), list):
        raise ValueError(f"doc (keys {list(doc)}): not a results document, which has a 'rows' list")
    return pd.DataFrame(doc["rows"])


def run_dir() -> Path:
    """Where a notebook's named results go: MOELAB_RUN_DIR (set per sweep run) or runs/interactive."""
    return Path(os.environ.get("MOELAB_RUN_DIR", REPO / "runs" / "interactive"))


def save(name: str, obj) -> Path:
    """Save a named result of a notebook: a DataFrame as parquet, anything else as JSON. Saving a name again
    replaces its earlier result, also one saved in the other format."""
    import pandas as pd

    _check_stem("result name", name)
    if name == "summary":
        raise ValueError("result name 'summary': taken by a sweep's table of its runs (summary.csv); choose another")
    d = run_dir() / "results"
    if isinstance(obj, pd.DataFrame):
        path, other = d / f"{name}.parquet", d / f"{name}.json"
        tmp = d / f".{name}.parquet.tmp"
        d.mkdir(parents=True, exist_ok=True)
        try:
            obj.to_parquet(tmp, index=False)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    else:
        path, other = write_json(d / f"{name}.json", obj), d / f"{name}.parquet"
    other.unlink(missing_ok=True)
    return path


def load_saved(directory: Path) -> dict:
    """All named results in a run directory: {name: dict or DataFrame}. A damaged file raises ValueError
    naming it."""
    import pandas as pd

    out = {}
    for p in sorted((Path(directory) / "results").glob("*")):
        if p.suffix == ".json":
            out[p.stem] = read_json(p)
        elif p.suffix == ".parquet":
            try:
                out[p.stem] = pd.read_parquet(p)
            except ValueError as e:  # pyarrow's ArrowInvalid is one
                raise ValueError(f"{p}: not readable as parquet: {e}") from e
    return out


DIFF_SKIP = frozenset({"created", "commit", "command", "machine", "wall_s"})  # what differs between any two runs


def diff(old: dict, new: dict, rtol: float = 0.0, skip=()) -> list[dict]:
    """Where two results documents differ, leaf by leaf: [{path, field, old, new, rel}], `rel` the relative
    change |new - old| / max(|old|, |new|) of two numbers (None for anything else). Numbers whose rel is at
    most rtol count as equal, NaN equals NaN; keys in DIFF_SKIP (the provenance that differs between any two
    runs) or `skip`, at any depth, are not compared; a key or list item on one side only is a difference."""
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not 0 <= rtol < math.inf:
        raise ValueError(f"rtol={rtol!r}: must be a finite number >= 0")
    if isinstance(skip, str):
        skip = [skip]
    skip = DIFF_SKIP | set(skip)
    out: list[dict] = []
    missing = "<missing>"

    def add(path, field, a, b, rel=None):
        out.append({"path": path, "field": field, "old": a, "new": b, "rel": rel})

    def walk(a, b, path, field):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in [*a, *(k for k in b if k not in a)]:
                if k in skip:
                    continue
                sub = f"{path}.{k}" if path else str(k)
                if k not in a or k not in b:
                    add(sub, k, a.get(k, missing), b.get(k, missing))
                else:
                    walk(a[k], b[k], sub, k)
        elif isinstance(a, list) and isinstance(b, list):
            for i in range(max(len(a), len(b))):
                if i >= len(a) or i >= len(b):
                    add(f"{path}[{i}]", field, a[i] if i < len(a) else missing, b[i] if i < len(b) else missing)
                else:
                    walk(a[i], b[i], f"{path}[{i}]", field)
        elif _is_num(a) and _is_num(b):
            if a == b or (math.isnan(a) and math.isnan(b)):
                return
            big = max(abs(a), abs(b))
            rel = abs(b - a) / big if math.isfinite(big) else math.inf
            if not rel <= rtol:
                add(path, field, a, b, rel)
        elif a != b or type(a) is not type(b):
            add(path, field, a, b)

    walk(old, new, "", "")
    return out


def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _main(argv: list[str] | None = None) -> int:
    """`python -m moelab.results diff OLD NEW [--rtol R] [--skip KEY ...]`: the differing fields, largest
    change first; exit status 1 where the files differ, 0 where they agree. `python -m moelab.results log NAME`:
    a GPU call's log (loose or bundled) on standard output; `log --list`: every log's name."""
    ap = argparse.ArgumentParser(prog="python -m moelab.results", description=_main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("diff", help="where two results files (.json or .json.xz) differ")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--rtol", type=float, default=0.0, help="numbers this close (relative) count as equal")
    d.add_argument("--skip", nargs="*", default=[],
                   help="more keys not to compare, besides " + ", ".join(sorted(DIFF_SKIP)))
    d.add_argument("--most", type=int, default=20, help="how many differences to list (all are counted)")
    lg = sub.add_parser("log", help="a GPU call's log by its name (logs/<step>-<sha>.txt.xz), loose or bundled")
    lg.add_argument("name", nargs="?")
    lg.add_argument("--list", action="store_true", help="every log's name instead")
    a = ap.parse_args(argv)
    if a.cmd == "log":
        if a.list == (a.name is not None):
            ap.error("log: give a NAME or --list (one of them)")
        try:
            print("\n".join(log_names()) if a.list else read_log(a.name), end="\n" if a.list else "")
        except (OSError, tarfile.TarError, lzma.LZMAError) as e:
            ap.error(str(e))
        return 0
    try:
        old, new = read_file(a.old), read_file(a.new)
        rows = diff(old, new, a.rtol, a.skip)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    n_old, n_new = (sum(1 for _ in _numbers(doc)) for doc in (old, new))
    print(f"{a.old.name} ({old.get('commit')}) -> {a.new.name} ({new.get('commit')}): {len(rows)} differences "
          f"(rtol {a.rtol:g}) among {n_old} / {n_new} numbers")
    by_field: dict[str, list] = {}
    for r in rows:
        by_field.setdefault(r["field"], []).append(r["rel"])
    for field, rels in sorted(by_field.items(), key=lambda kv: -max((x or math.inf) for x in kv[1])):
        nums = [x for x in rels if x is not None]
        print(f"  {field}: {len(rels)} differ" + (f", largest relative change {max(nums):.3g}" if nums else ""))
    for r in sorted(rows, key=lambda r: -(math.inf if r["rel"] is None else r["rel"]))[:max(a.most, 0)]:
        rel = "" if r["rel"] is None else f"  (rel {r['rel']:.3g})"
        print(f"    {r['path']}: {r['old']!r} -> {r['new']!r}{rel}")
    return 1 if rows else 0


def _numbers(x):
    if isinstance(x, dict):
        for k, v in x.items():
            if k not in DIFF_SKIP:
                yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif _is_num(x):
        yield x


if __name__ == "__main__":
    sys.exit(_main())
