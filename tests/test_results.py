"""Results files (one per topic, with provenance), a notebook's named results, and the figure helpers."""

import json
import os
import re
import stat
from pathlib import Path

import pytest

from moelab import results


def test_write_results_replaces_the_topics_file_and_names_where_it_came_from(tmp_path, monkeypatch):
    """data/results/<topic>.json: a second write replaces the first (git keeps the old one), atomically, and the
    document names the machine, the library versions, the commit and the command."""
    monkeypatch.setenv("MOELAB_COMMIT", "feedbee")
    first = results.write_results("topic-x", [{"v": 1}], notes="n", out_dir=tmp_path)
    assert first == tmp_path / "topic-x.json"
    path = results.write_results("topic-x", [{"v": 2}], command="python bench.py --fast", out_dir=tmp_path)
    assert path == first and [p.name for p in tmp_path.iterdir()] == ["topic-x.json"]
    doc = results.load_results("topic-x", tmp_path)
    assert doc["rows"] == [{"v": 2}] and doc["topic"] == "topic-x" and doc["schema"] == 1
    assert doc["commit"] == "feedbee" and doc["command"] == "python bench.py --fast"
    assert doc["machine"]["device"] and doc["machine"]["torch"] and "transformers" in doc["machine"]
    with pytest.raises(TypeError, match="set"):  # a row JSON cannot hold: the earlier file stays as it was
        results.write_results("topic-x", [{"v": {1, 2}}], out_dir=tmp_path)
    assert results.load_results("topic-x", tmp_path)["rows"] == [{"v": 2}]
    assert [p.name for p in tmp_path.iterdir()] == ["topic-x.json"]


def test_load_results_reads_its_topic_and_falls_back_to_the_committed_file(tmp_path, capsys):
    (tmp_path / "routing-kernel.json").write_text(json.dumps({"rows": [{"v": 2}]}))
    assert results.load_results("routing-kernel", tmp_path)["rows"] == [{"v": 2}]
    with pytest.raises(FileNotFoundError, match="'moe-layer'"):
        results.load_results("moe-layer", tmp_path)  # no silent substitution unless asked
    assert results.load_results("moe-layer", tmp_path, fallback=True) == results.load_results("moe-layer")
    assert "using the committed ones" in capsys.readouterr().out
    with pytest.raises(ValueError, match="plain file stem"):
        results.load_results("../moe-layer")


def test_damaged_results_files_raise_naming_the_file(tmp_path):
    """A results file that is no JSON object (bad JSON, binary, empty, a list) raises ValueError naming it;
    load_optional lets that through (None only where there is no file); rows_frame names what it got."""
    for name, data in {"bad": b"{not json", "bin": b"\xff\xfe\x00junk", "empty": b"", "list": b"[1, 2]"}.items():
        (tmp_path / f"{name}.json").write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / f"{name}.json"))):
            results.load_results(name, tmp_path)
    with pytest.raises(ValueError, match="list.json: holds a JSON list"):
        results.read_file(tmp_path / "list.json")
    with pytest.raises(ValueError, match="bad.json: not readable as JSON"):
        results.load_optional("bad", tmp_path)
    with pytest.raises(ValueError, match=r"doc \(keys \['schema'\]\): not a results document, which has a 'rows'"):
        results.rows_frame({"schema": 1})
    with pytest.raises(TypeError, match="doc: a list, not a results document"):
        results.rows_frame([1, 2])



def test_lists_kept_apart_come_back_exactly_from_the_sidecar(tmp_path, monkeypatch, capsys):
    """write_results(apart=keys) keeps those rows' lists in <topic>.npz (the same rows make the same bytes);
    read_file puts back the very values written: floats at 0.01, other floats, ints, NaN as null (as in the JSON)."""
    np = pytest.importorskip("numpy")
    monkeypatch.setenv("MOELAB_COMMIT", "feedbee")
    rng = np.random.default_rng(0)
    nll = [round(float(x), 2) for x in rng.uniform(-5, 30000, 500)] + [0.07, 2729.13, -0.01]
    rows = [{"m": "a", "nll": nll, "tok": [511] * 502 + [7], "x": [1 / 3, float("nan"), 2.0]},
            {"m": "b", "nll": np.array(nll[:3]), "tok": [], "x": None},  # an array goes too; None stays in the JSON
            {"m": "c"}]
    path = results.write_results("t", rows, out_dir=tmp_path, apart=("nll", "tok", "x"))
    sidecar = (tmp_path / "t.npz").read_bytes()
    assert json.loads(path.read_text())["rows"] == [{"m": "a"}, {"m": "b", "x": None}, {"m": "c"}]
    back = results.load_results("t", tmp_path)["rows"]
    assert back == [{**rows[0], "x": [1 / 3, None, 2.0]}, {**rows[1], "nll": nll[:3]}, rows[2]]
    assert all(type(v) is float for v in back[0]["nll"]) and all(type(v) is int for v in back[0]["tok"])
    results.write_results("t", rows, out_dir=tmp_path, apart=("nll", "tok", "x"))
    assert (tmp_path / "t.npz").read_bytes() == sidecar
    path.rename(tmp_path / "renamed.json")  # a file renamed alone still finds the sidecar it records
    assert results.read_file(tmp_path / "renamed.json")["rows"] == back
    assert not capsys.readouterr().out


def test_a_missing_sidecar_leaves_its_keys_out_and_a_wrong_one_raises(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOELAB_COMMIT", "feedbee")
    path = results.write_results("t", [{"m": "a", "nll": [1.5, 2.25]}], out_dir=tmp_path, apart=["nll"])
    other = results.write_results("u", [{"m": "a", "nll": [1.5, 2.5]}], out_dir=tmp_path, apart=["nll"])
    (tmp_path / "t.npz").unlink()
    assert results.read_file(path)["rows"] == [{"m": "a"}]
    assert "t.json: no sidecar t.npz beside it: its rows come without nll" in capsys.readouterr().out
    (tmp_path / "t.npz").write_bytes(other.with_suffix(".npz").read_bytes())  # another run's
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 't.npz'}: not the sidecar t.json records")):
        results.read_file(path)
    results.write_results("t", [{"m": "a"}], out_dir=tmp_path)  # written again without lists apart: no sidecar
    assert not (tmp_path / "t.npz").exists()
    with pytest.raises(ValueError, match=r"rows\[0\]\['nll'\] = \[\[1\]\]: kept apart only as a flat list"):
        results.write_results("t", [{"nll": [[1]]}], out_dir=tmp_path, apart=["nll"])


def test_load_optional_says_why_there_is_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(results, "REPO", tmp_path)  # no committed results either
    assert results.load_optional("routing-ablation", tmp_path / "run") is None
    assert "no results for topic 'routing-ablation'" in capsys.readouterr().out


def test_write_json_is_strict_json_with_nan_as_null(tmp_path):
    """NaN and +-inf from Python, numpy and torch values alike are written as null: the file stays valid JSON."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    obj = {"a": float("nan"), "b": np.float64("nan"), "c": np.array([1.0, np.nan]), "d": torch.tensor([float("nan")]),
           "e": np.int64(3), "f": float("inf"), "g": [float("-inf")], "h": np.array([np.inf])}
    path = results.write_json(tmp_path / "x.json", obj)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}")) == {
        "a": None, "b": None, "c": [1.0, None], "d": [None], "e": 3, "f": None, "g": [None], "h": [None]}


def test_machine_names_the_cpu_model():
    """Eager timings depend on the host CPU: the results files name its model, not only the architecture."""
    from moelab.results import machine

    m = machine()
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if ln.startswith("model name")]
    if names:
        assert m["cpu_model"] == names[0]


def test_figures_and_tables_are_written_into_figures_only(tmp_path, monkeypatch):
    """savefig / save_table take a plain stem: a folder part or an extension of its own is an error naming
    the name, and the files land in figures/ (MOELAB_FIGURES here), byte for byte the same on a second save."""
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from moelab import plots

    monkeypatch.setenv("MOELAB_FIGURES", str(tmp_path / "figs"))
    for bad in ("wide", 0, -3.0, True, None):
        with pytest.raises(ValueError, match=rf"width={bad!r}: must be 'column', 'full' or a width in inches"):
            plots.figure(bad)
    fig, axes = plots.figure("full", aspect=0.3, ncols=3)  # constrained layout: the suptitle clears the titles
    for ax in axes:
        ax.set_title("layer 15")
    sup = fig.suptitle("a figure-wide title as long as the row of panels beneath it, or nearly so")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert not any(sup.get_window_extent(r).overlaps(ax.title.get_window_extent(r)) for ax in axes)
    fig, ax = plots.figure()
    ax.plot([0, 1], [1, 0])
    for bad in ("../escaped", "sub/t", "a\\b", "..", "x.png"):
        with pytest.raises(ValueError, match="give a plain stem"):
            plots.savefig(fig, bad)
    for bad in ("../escaped", "sub/t", "t.csv"):
        with pytest.raises(ValueError, match=r"table name .*give a plain stem"):
            plots.save_table(pd.DataFrame({"a": [1]}), bad)
    assert not (tmp_path / "escaped.csv").exists() and not (tmp_path / "figs" / "sub").exists()
    first = {k: p.read_bytes() for k, p in plots.savefig(fig, "t").items()}
    again = {k: p.read_bytes() for k, p in plots.savefig(fig, "t").items()}
    assert first == again and sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["t.pdf", "t.png"]


def test_policy_figure_draws_each_policy_share_and_saving():
    """plot_policy_stats: per policy one bar per k with that k's share of tokens, and one bar of the routed
    FLOPs saved (percent) in the policy's colour, the native top-k in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    from moelab.compute import policy_stats
    from moelab.plots import POLICY_COLORS, plot_policy_stats
    from moelab.routing import EntropyAdaptiveK, TopK

    pols = {"TopK k=2 (native)": TopK(2), "ada": EntropyAdaptiveK((1, 2), (1.2,))}
    stats = policy_stats(torch.randn(50, 8) * 2, pols, native_k=2, renormalize=True)
    fig = plot_policy_stats(stats, "t", 2)
    ax_h, ax_r = fig.axes
    heights = np.array([p.get_height() for p in ax_h.patches]).reshape(2, 2)  # [policy, k = 1..2]
    want = np.array([np.asarray(h[1:]) / 50 for h in stats.k_hist])
    assert np.allclose(heights, want) and np.allclose(heights.sum(1), 1)
    assert [p.get_width() for p in ax_r.patches] == pytest.approx(list(100 * stats.expert_reduction))
    colours = [matplotlib.colors.to_hex(p.get_facecolor()).lower() for p in ax_r.patches]
    assert colours == [POLICY_COLORS["native"].lower(), POLICY_COLORS["EntropyAdaptiveK"].lower()]
    from moelab.plots import policy_color  # "native" as a word, not inside another one
    assert policy_color("native-k TopK", "TopK") == POLICY_COLORS["native"]
    assert policy_color("alternative thresholds", "TopP") == POLICY_COLORS["TopP"]
    fig2 = plot_policy_stats(stats.assign(forward_reduction=[0.0, 0.1]), "t", 2)
    labels = [t.get_text() for t in fig2.axes[1].get_yticklabels()]
    assert labels[0].endswith("forward saved 0.0%") and labels[1].endswith("forward saved 10.0%")
    plt.close(fig2)
    plt.close(fig)


def test_explorer_redraws_kernel_side_and_closes_its_figures():
    """plots.explorer shows render(**control values) in its Output and again when a control changes, without
    capturing display() in the Output (msg_id stays empty: the path that hangs headless runs), and closes the
    figures render returns."""
    widgets = pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt
    import pandas as pd

    from moelab import plots

    calls = []

    def render(n, label):
        calls.append((n, label))
        return pd.DataFrame({"n": [n], "label": [label]})

    n, label = widgets.IntSlider(value=3, min=1, max=9), widgets.Dropdown(options=["a", "b"])
    box = plots.explorer(render, n=n, label=label)
    slider, dropdown, out = box.children
    assert (slider, dropdown) == (n, label) and isinstance(out, widgets.Output)
    assert calls == [(3, "a")] and len(out.outputs) == 1 and "3" in out.outputs[0]["data"]["text/plain"]
    label.value = "b"
    n.value = 5
    assert calls == [(3, "a"), (3, "b"), (5, "b")] and len(out.outputs) == 1
    assert "5" in out.outputs[0]["data"]["text/plain"] and "b" in out.outputs[0]["data"]["text/plain"]
    assert not out.msg_id
    before = set(plt.get_fignums())
    plots.explorer(lambda n: plt.figure(), n=widgets.IntSlider(value=1))
    assert set(plt.get_fignums()) == before


def test_atomic_writes_get_the_mode_an_ordinary_open_gives(tmp_path):
    """Results, figures and tables are written through mkstemp (owner-only, 0600); they must end as readable
    by others as any file the process opens, so colleagues on a shared GPU box can read them."""
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"x")
    path = tmp_path / "sub" / "r.json"
    results.write_json(path, {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert not list(path.parent.glob(".*.tmp"))


def test_saving_a_name_again_replaces_its_result_in_either_format(tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path))
    results.save("m", pd.DataFrame({"loss": [9.9]}))
    results.save("m", {"loss": 0.1})
    assert results.load_saved(tmp_path) == {"m": {"loss": 0.1}}
    results.save("m", pd.DataFrame({"loss": [0.2]}))
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["m.parquet"]

    class Broken(pd.DataFrame):
        def to_parquet(self, *a, **k):
            Path(a[0]).write_bytes(b"half")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        results.save("m", Broken({"loss": [0.3]}))
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["m.parquet"]  # no temporary left
    assert results.load_saved(tmp_path)["m"]["loss"].tolist() == [0.2]


def _git(repo: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_commit_names_the_head_and_whether_the_tree_was_clean(tmp_path, monkeypatch):
    """Without MOELAB_COMMIT: the repository's HEAD (40 hex digits); '-dirty' once a tracked file differs from it;
    '-unverified' where HEAD is readable but `git status` fails (here: a corrupt index), so cleanliness is unknown."""
    import re

    monkeypatch.delenv("MOELAB_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "commit", "-qm", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.setattr(results, "REPO", tmp_path)
    clean = results.commit()
    assert re.fullmatch(r"[0-9a-f]{40}", clean) and clean == head
    (tmp_path / "untracked.txt").write_text("x\n")  # untracked files do not count
    assert results.commit() == head
    (tmp_path / "f.txt").write_text("b\n")
    assert results.commit() == head + "-dirty"
    (tmp_path / ".git" / "index").write_bytes(b"not an index")
    assert results.commit() == head + "-unverified"
    monkeypatch.setenv("MOELAB_COMMIT", "feedbee")  # the GPU machine's copy: the variable wins
    assert results.commit() == "feedbee"


def test_write_results_adds_extra_fields_to_the_document(tmp_path, monkeypatch):
    path = results.write_results("topic-x", [{"v": 1}], out_dir=tmp_path, extra={"x": 1, "tuned": {"a": [2]}})
    doc = json.loads(path.read_text())
    assert doc["x"] == 1 and doc["tuned"] == {"a": [2]} and doc["rows"] == [{"v": 1}] and doc["schema"] == 1


def test_save_refuses_names_that_are_not_a_plain_stem_or_are_taken(tmp_path, monkeypatch):
    """A saved result's name is a file stem in the run's results/: a '/' (another folder) or a leading '.'
    (hidden) is refused naming it, and 'summary' is the sweep's own table; nothing is written for any of them."""
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path))
    for bad in ("sub/m", "../m", ".m", "", "m.json", "m.parquet", "x.csv", "x.json.xz"):
        with pytest.raises(ValueError, match="plain file stem"):
            results.save(bad, {"a": 1})
    with pytest.raises(ValueError, match="'summary'"):
        results.save("summary", {"a": 1})
    assert not tmp_path.exists() or not any(tmp_path.rglob("*"))


def test_paths_are_written_as_their_text(tmp_path, monkeypatch):
    """A pathlib.Path in a saved result or a results row is written as its string (JSON has no path type)."""
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path))
    results.save("where", {"file": tmp_path / "a.bin", "files": [Path("x/y")]})
    assert results.load_saved(tmp_path)["where"] == {"file": str(tmp_path / "a.bin"), "files": ["x/y"]}


def test_write_results_refuses_a_topic_that_is_no_plain_stem_or_extra_that_replaces_its_fields(tmp_path, monkeypatch):
    """The topic names the file: one with a '/' (a file outside out_dir), an empty or hidden one, or no str is
    refused naming it; extra keys that would replace the document's own fields too. Nothing is written."""
    out = tmp_path / "out"
    for bad in ("a/../../escape", "", ".hidden", "x.json", "x.csv", "x.json.xz"):
        with pytest.raises(ValueError, match=f"topic {bad!r}: must be a plain file stem"):
            results.write_results(bad, [], out_dir=out)
    with pytest.raises(TypeError, match="topic 5: must be a str"):
        results.write_results(5, [], out_dir=out)
    with pytest.raises(ValueError, match=r"extra keys \['rows', 'schema'\]: taken by the document's own fields"):
        results.write_results("topic-x", [{"v": 1}], out_dir=out, extra={"rows": "gone", "schema": 99, "x": 1})
    assert not any(tmp_path.rglob("*"))
    # every field a written document has is FIELDS, and each one is refused as an extra key
    written = results.write_results("topic-x", [{"v": 1}], notes="n", out_dir=out)
    own = list(json.loads(written.read_text()))
    assert sorted(own) == sorted(results.FIELDS)
    for key in own:
        with pytest.raises(ValueError, match=rf"extra keys \['{key}'\]: taken by the document's own fields"):
            results.write_results("topic-y", [{"v": 1}], out_dir=out, extra={key: "gone"})
    assert [p.name for p in out.iterdir()] == [written.name]


def test_save_refuses_a_name_that_is_not_a_str(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_RUN_DIR", str(tmp_path))
    with pytest.raises(TypeError, match="result name 5: must be a str, not int"):
        results.save(5, 1)
    assert not any(tmp_path.rglob("*"))


def test_load_saved_names_a_damaged_file(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "good.json").write_text('{"a": 1}')
    (tmp_path / "results" / "broken.json").write_text('{"a": ')
    with pytest.raises(ValueError, match="broken.json: not readable as JSON"):
        results.load_saved(tmp_path)
    (tmp_path / "results" / "broken.json").unlink()
    (tmp_path / "results" / "frame.parquet").write_bytes(b"PAR1junk")
    with pytest.raises(ValueError, match="frame.parquet: not readable as parquet"):
        results.load_saved(tmp_path)


def test_command_line_is_the_command_as_typed(tmp_path):
    """A module run with -m is recorded as `python -m name`, not as the path of its file; a script as its path."""
    import subprocess
    import sys

    (tmp_path / "probe_cmd.py").write_text("from moelab.results import command_line\nprint(command_line())\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "lib")}
    py = Path(sys.executable).name
    for args, want in ((["-m", "probe_cmd", "a", "b c"], f"{py} -m probe_cmd a 'b c'"),
                       (["probe_cmd.py", "x"], f"{py} probe_cmd.py x")):
        out = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_diff_finds_each_changed_leaf_and_nothing_else():
    nan = float("nan")
    old = {"commit": "a", "created": "x", "wall_s": 3.0, "notes": "n",
           "rows": [{"model": "m", "ppl": 190.0, "k": 2, "nan": nan}, {"model": "n", "ppl": 200.0, "ok": True}]}
    new = {"commit": "b", "created": "y", "wall_s": 9.0, "notes": "n", "extra": 1,
           "rows": [{"model": "m", "ppl": 190.0 * (1 + 1e-9), "k": 2, "nan": nan},
                    {"model": "n", "ppl": 210.0, "ok": 1}]}
    assert results.diff(old, old) == []
    got = {r["path"]: r for r in results.diff(old, new)}
    assert set(got) == {"rows[0].ppl", "rows[1].ppl", "rows[1].ok", "extra"}  # provenance and NaN == NaN left out
    assert got["rows[1].ppl"]["rel"] == pytest.approx(10 / 210) and got["rows[1].ppl"]["field"] == "ppl"
    assert got["rows[1].ok"]["rel"] is None  # True is no number: True -> 1 is a change of type
    assert got["extra"]["old"] == "<missing>"
    assert {r["path"] for r in results.diff(old, new, rtol=1e-6)} == {"rows[1].ppl", "rows[1].ok", "extra"}
    assert results.diff(old, new, rtol=0.1, skip={"ok", "extra"}) == []
    assert [r["path"] for r in results.diff({"rows": [1, 2]}, {"rows": [1]})] == ["rows[1]"]
    assert results.diff({"x": float("inf")}, {"x": 1.0})[0]["rel"] == float("inf")
    with pytest.raises(ValueError, match=r"rtol=-1: must be a finite number >= 0"):
        results.diff(old, new, rtol=-1)

def test_diff_command_exits_1_where_files_differ(tmp_path):
    import subprocess
    import sys

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"commit": "a", "rows": [{"ppl": 1.0}, {"ppl": 2.0}]}))
    b.write_text(json.dumps({"commit": "b", "rows": [{"ppl": 1.0}, {"ppl": 2.5}]}))
    env = {**os.environ, "PYTHONPATH": str(Path(results.__file__).parents[1])}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "moelab.results", "diff", *map(str, args)], env=env,
                              capture_output=True, text=True)

    r = run(a, b)
    assert r.returncode == 1 and "1 differences (rtol 0)" in r.stdout
    assert "rows[1].ppl: 2.0 -> 2.5  (rel 0.2)" in r.stdout
    assert run(a, b, "--rtol", "0.25").returncode == 0
    r = run(a, tmp_path / "none.json")
    assert r.returncode == 2 and "none.json" in r.stderr
