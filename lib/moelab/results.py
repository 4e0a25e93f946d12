"""Results files with provenance (`write_results` / `load_results`: data/results/<topic>.json, one per topic),
a notebook's named results (`save`, into MOELAB_RUN_DIR or runs/interactive), and `diff` of two results files
(also `python -m moelab.results diff OLD NEW`). Files are written atomically, as strict JSON (NaN as null); bulky
per-row number lists can be kept apart, in a sidecar `<topic>.npz` beside the JSON (`write_results(..., apart=keys)`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import io
import json
import math
import numbers
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCHEMA = 1
FIELDS = ("schema", "topic", "created", "commit", "command", "machine", "rows", "notes")  # a document's own
APART = "apart"  # a document's record of the row keys kept in its sidecar: {"keys", "file", "sha256"}


def _check_stem(what: str, name) -> None:
    """A topic or result name becomes a file name: a plain stem in its folder."""
    if not isinstance(name, str):
        raise TypeError(f"{what} {name!r}: must be a str, not {type(name).__name__}")
    if not name or "/" in name or name.startswith(".") or name.endswith((".json", ".xz", ".parquet", ".csv")):
        raise ValueError(f"{what} {name!r}: must be a plain file stem (no '/', not hidden, no file extension)")


def commit() -> str:
    """The git commit of the code that ran, '-dirty' when a tracked file differs from it (MOELAB_COMMIT wins: the
    GPU machine's copy has no .git)."""
    env = os.environ.get("MOELAB_COMMIT")
    if env:
        return env
    git = ["git", "-C", str(REPO)]
    try:
        out = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:  # the first status of a fresh checkout hashes every file: allow it time
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=300, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return out + "-unverified"
    return out + ("-dirty" if dirty else "")


def machine() -> dict:
    """Device, host CPU and library versions of this process."""
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cpu = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    info: dict[str, Any] = {
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu[0] if cpu else platform.processor() or platform.machine(),  # eager timings depend on it
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


_UMASK = os.umask(0o022)  # os.umask can only be read by setting it: read once, and set back
os.umask(_UMASK)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file; the mode is an ordinary
    open's (mkstemp's are owner-only)."""
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
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # strict JSON has no NaN or Infinity
    if isinstance(x, Path):
        return str(x)
    return x


def _json_bytes(obj) -> bytes:
    """Strict JSON (NaN and +-inf as null), one top-level key per line and a list of records (rows) one record per
    line: small in the tree, and a diff names the rows that changed. A value that cannot be written raises before
    any file is touched."""
    obj = _jsonable(obj)
    dump = lambda v: json.dumps(v, allow_nan=False, separators=(", ", ": "))  # noqa: E731
    if not isinstance(obj, dict):
        return (dump(obj) + "\n").encode()
    parts = []
    for k, v in obj.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            parts.append(f" {dump(k)}: [\n" + ",\n".join("  " + dump(x) for x in v) + "\n ]")
        else:
            parts.append(f" {dump(k)}: {dump(v)}")
    return ("{\n" + ",\n".join(parts) + "\n}\n").encode()


def write_json(path: Path, obj) -> Path:
    atomic_write_bytes(Path(path), _json_bytes(obj))
    return Path(path)


def machine_line(doc: dict) -> str:
    """'NVIDIA H200 · torch 2.11 · triton 3.6 · transformers 5.17 · commit (short hash) · 2026-11-29', plus
    ' · routing launches tuned on X' (or 'untuned') for each part whose `tuned_on` is not this device."""
    missing = [k for k in ("machine", "commit", "created") if k not in doc]
    if missing:
        raise ValueError(f"doc (keys {list(doc)}): lacks {missing}, not a results document")
    m = doc["machine"]
    line = (f"{m['device']} · torch {m['torch']} · triton {m['triton']} · transformers {m['transformers']} · "
            f"commit {str(doc['commit'])[:7]} · {doc['created'][:10]}")
    borrowed = {part: n for part, n in (doc.get("tuned_on") or {}).items() if n != m["device"]}
    for part, n in borrowed.items():
        line += f" · {part} launches " + ("untuned" if n is None else f"tuned on {n}")
    return line


def read_json(path: Path):
    """A JSON file's value; a damaged file raises ValueError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{path}: not readable as JSON: {e}") from e


def results_dir() -> Path:
    """Where results files are written and read: MOELAB_RESULTS_DIR, else the committed data/results."""
    return Path(os.environ.get("MOELAB_RESULTS_DIR", REPO / "data" / "results"))


def _pack(rows: list[dict], keys) -> tuple[list[dict], bytes]:
    """Copies of the rows without `keys` (where a row holds a list) and the sidecar's bytes: per key its values
    (ints as int64; floats as int32 hundredths, `<key>.x100`, where that is exact; else float64, None as NaN) and
    each row's count (`<key>.len`, -1 where the row keeps its value). The zip entries have fixed dates, so the same
    rows make the same bytes."""
    import numpy as np

    rows, arrays = [dict(r) for r in rows], {}
    for key in keys:
        lens, flat = [], []
        for i, r in enumerate(rows):
            v = _jsonable(r.get(key))
            if not isinstance(v, list):
                lens.append(-1)
                continue
            if not all(x is None or _is_num(x) for x in v):
                raise ValueError(f"rows[{i}][{key!r}] = {str(v)[:80]}: kept apart only as a flat list of numbers")
            del r[key]
            lens.append(len(v))
            flat += v
        arrays[f"{key}.len"] = np.asarray(lens, dtype=np.int64)
        if all(isinstance(x, int) for x in flat):
            arrays[key] = np.asarray(flat, dtype=np.int64)
            continue
        x = np.asarray(flat, dtype=np.float64)
        x100 = np.rint(x * 100)
        if np.all(np.abs(x100) < 2**31) and np.array_equal(x100 / 100, x):  # NaN never equal: stays float64
            arrays[f"{key}.x100"] = x100.astype(np.int32)
        else:
            arrays[key] = x
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, a in arrays.items():
            npy = io.BytesIO()
            np.lib.format.write_array(npy, a, allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{name}.npy", (1980, 1, 1, 0, 0, 0)), npy.getvalue(), zipfile.ZIP_DEFLATED, 9)
    return rows, buf.getvalue()


def _attach(path: Path, doc: dict) -> dict:
    """The document with its sidecar's lists back in its rows (the sidecar: `<path stem>.npz`, else the file the
    record names, whichever has the recorded sha256); without the sidecar, the rows without them and a line."""
    import numpy as np

    rec = doc[APART]
    if not isinstance(rec, dict) or not {"keys", "file", "sha256"} <= set(rec):
        raise ValueError(f"{path}: its {APART!r} record {rec!r} lacks keys, file or sha256")
    found = [p for p in dict.fromkeys((path.with_suffix(".npz"), path.parent / Path(rec["file"]).name)) if p.exists()]
    if not found:
        print(f"{path.name}: no sidecar {rec['file']} beside it: its rows come without {', '.join(rec['keys'])}")
        return doc
    data = next((d for d in map(Path.read_bytes, found) if hashlib.sha256(d).hexdigest() == rec["sha256"]), None)
    if data is None:
        raise ValueError(f"{found[0]}: not the sidecar {path.name} records (sha256 {rec['sha256']}): another "
                         "run's, or damaged")
    with np.load(io.BytesIO(data)) as z:
        for key in rec["keys"]:
            vals = (z[f"{key}.x100"] / 100).tolist() if f"{key}.x100" in z else z[key].tolist()
            vals = [None if x != x else x for x in vals]  # NaN: null, as in the JSON
            at = 0
            for r, n in zip(doc["rows"], z[f"{key}.len"].tolist()):
                if n >= 0:
                    r[key], at = vals[at:at + n], at + n
    return doc


def write_doc(path: Path, doc: dict, apart=()) -> Path:
    """Write a results document to `path`; the rows' `apart` keys go to the sidecar `<path stem>.npz` (its name and
    sha256 recorded under the document's key APART), written first; without `apart`, an earlier sidecar goes."""
    path, keys = Path(path), [apart] if isinstance(apart, str) else list(apart)
    sidecar, data = path.with_suffix(".npz"), None
    if keys:
        rows, data = _pack(doc["rows"], keys)
        doc = {**doc, "rows": rows, APART: {"keys": keys, "file": sidecar.name,
                                            "sha256": hashlib.sha256(data).hexdigest()}}
    body = _json_bytes(doc)  # a value that cannot be written raises before any file is touched
    if data is None:
        sidecar.unlink(missing_ok=True)
    else:
        atomic_write_bytes(sidecar, data)
    atomic_write_bytes(path, body)
    return path


def write_results(topic: str, rows: list[dict], notes: str = "", command: str | None = None,
                  out_dir: Path | None = None, extra: dict | None = None, apart=()) -> Path:
    """Write `<out_dir>/<topic>.json` (schema 1), replacing the topic's earlier file, and return its path.
    `extra`: the topic's own fields, none of them one of the document's (FIELDS). `apart`: row keys whose lists go
    to the sidecar `<topic>.npz` (write_doc)."""
    _check_stem("topic", topic)
    taken = sorted(set(extra or ()) & {*FIELDS, APART})
    if taken:
        raise ValueError(f"extra keys {taken}: taken by the document's own fields {(*FIELDS, APART)}")
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    doc = {"schema": SCHEMA, "topic": topic, "created": created, "commit": commit(),
           "command": command or command_line(), "machine": machine(), "rows": rows, "notes": notes, **(extra or {})}
    return write_doc(Path(out_dir or results_dir()) / f"{topic}.json", doc, apart)


def read_file(path: Path) -> dict:
    """One results file, with the lists its sidecar keeps back in its rows. A damaged file, one that holds no JSON
    object, or a sidecar that is not the one it records raises ValueError naming it."""
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}, not a results document (an object)")
    return _attach(Path(path), doc) if APART in doc else doc


def load_results(topic: str, directory: Path | None = None, fallback: bool = False) -> dict:
    """`<directory>/<topic>.json` (default: the committed data/results). fallback: where `directory` has none, the
    committed file, and a line says so (a GPU run of some benchmark parts still plots the others)."""
    _check_stem("topic", topic)
    committed = REPO / "data" / "results"
    d = Path(directory or committed)
    path = d / f"{topic}.json"
    if not path.exists() and fallback and d != committed:
        print(f"{topic}: no results in {d}, using the committed ones in {committed}")
        path = committed / f"{topic}.json"
    if not path.exists():
        raise FileNotFoundError(f"no results for topic {topic!r} in {path.parent}; run its benchmark first")
    return read_file(path)


def load_optional(topic: str, directory: Path | None = None) -> dict | None:
    """load_results(topic, directory, fallback=True), or None with the reason printed (a damaged file still raises):
    for a notebook section that plots a topic only where it has been measured."""
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
    """Save a notebook's named result: a DataFrame as parquet, anything else as JSON, replacing any earlier one."""
    import pandas as pd

    _check_stem("result name", name)
    if name == "summary":
        raise ValueError("result name 'summary': taken by a sweep's table of its runs (summary.csv); choose another")
    d = run_dir() / "results"
    if isinstance(obj, pd.DataFrame):
        path, other, tmp = d / f"{name}.parquet", d / f"{name}.json", d / f".{name}.parquet.tmp"
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
    """All named results in a run directory: {name: dict or DataFrame}. A damaged file raises ValueError naming it."""
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


DIFF_SKIP = frozenset({"created", "commit", "command", "machine", "wall_s", APART})  # what differs between any two runs
_MISSING = "<missing>"  # a key or list item on one side only


def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def diff(old: dict, new: dict, rtol: float = 0.0, skip=()) -> list[dict]:
    """Where two results documents differ, leaf by leaf: [{path, field, old, new, rel}], rel = |new - old| /
    max(|old|, |new|) for numbers (None otherwise). Numbers within rtol are equal, NaN equals NaN; keys in DIFF_SKIP
    or `skip` are not compared at any depth."""
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not 0 <= rtol < math.inf:
        raise ValueError(f"rtol={rtol!r}: must be a finite number >= 0")
    skip = DIFF_SKIP | ({skip} if isinstance(skip, str) else set(skip))
    out: list[dict] = []

    def walk(a, b, path, field):
        if isinstance(a, dict) and isinstance(b, dict):
            keys = [k for k in [*a, *(k for k in b if k not in a)] if k not in skip]
            subs = [(f"{path}.{k}" if path else str(k), k, a.get(k, _MISSING), b.get(k, _MISSING)) for k in keys]
        elif isinstance(a, list) and isinstance(b, list):
            subs = [(f"{path}[{i}]", field, a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING)
                    for i in range(max(len(a), len(b)))]
        else:
            rel = None
            if _is_num(a) and _is_num(b):
                if a == b or (math.isnan(a) and math.isnan(b)):
                    return
                big = max(abs(a), abs(b))
                rel = abs(b - a) / big if math.isfinite(big) else math.inf
                if rel <= rtol:
                    return
            elif a == b and type(a) is type(b):
                return
            out.append({"path": path, "field": field, "old": a, "new": b, "rel": rel})
            return
        for sub in subs:
            walk(sub[2], sub[3], sub[0], sub[1])

    walk(old, new, "", "")
    return out


def _main(argv: list[str] | None = None) -> int:
    """`python -m moelab.results diff OLD NEW [--rtol R] [--skip KEY ...]`: the differing leaves, largest change
    first; exit status 1 where the files differ, 0 where they agree."""
    ap = argparse.ArgumentParser(prog="python -m moelab.results", description=_main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("diff", help="where two results files differ")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--rtol", type=float, default=0.0, help="numbers this close (relative) count as equal")
    d.add_argument("--skip", nargs="*", default=[], help="more keys not to compare, besides " + ", ".join(DIFF_SKIP))
    d.add_argument("--most", type=int, default=20, help="how many differences to list (all are counted)")
    a = ap.parse_args(argv)
    try:
        old, new = read_file(a.old), read_file(a.new)
        rows = diff(old, new, a.rtol, a.skip)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"{a.old.name} ({old.get('commit')}) -> {a.new.name} ({new.get('commit')}): {len(rows)} differences "
          f"(rtol {a.rtol:g})")
    for r in sorted(rows, key=lambda r: -(math.inf if r["rel"] is None else r["rel"]))[:max(a.most, 0)]:
        print(f"  {r['path']}: {r['old']!r} -> {r['new']!r}" + ("" if r["rel"] is None else f"  (rel {r['rel']:.3g})"))
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(_main())
