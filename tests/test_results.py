"""Results files: newest by date, and the fallback to the committed results for topics a run did not write."""

import json
import lzma
import os
import re
import stat
from pathlib import Path

import pytest

from moelab import results


def test_load_results_newest_and_fallback(tmp_path, capsys):
    for day, value in (("20261128", 1), ("20261130", 2)):
        (tmp_path / f"routing-kernel-{day}.json").write_text(json.dumps({"rows": [{"v": value}]}))
    assert results.load_results("routing-kernel", tmp_path)["rows"] == [{"v": 2}]  # the newest date
    with pytest.raises(FileNotFoundError, match="'moe-layer'"):
        results.load_results("moe-layer", tmp_path)  # no silent substitution unless asked
    doc = results.load_results("moe-layer", tmp_path, fallback=True)
    assert doc == results.load_results("moe-layer")  # the committed file
    assert "using the committed ones" in capsys.readouterr().out
    assert results.load_results("routing-kernel", tmp_path, fallback=True)["rows"] == [{"v": 2}]


def test_current_file_is_plain_or_compressed_never_both(tmp_path):
    """A topic's current file is the newest `<topic>-<yyyymmdd>.json` or `.json.xz` (the large committed ones are
    compressed); one day in both forms is refused, naming both, rather than one picked silently."""
    (tmp_path / "moe-layer-20261130.json").write_text(json.dumps({"rows": [{"v": 1}]}))
    (tmp_path / "moe-layer-20261201.json.xz").write_bytes(lzma.compress(json.dumps({"rows": [{"v": 2}]}).encode()))
    (tmp_path / "moe-layer-extra-20261202.json").write_text("{}")  # another topic
    assert results.current_file("moe-layer", tmp_path).name == "moe-layer-20261201.json.xz"
    assert results.load_results("moe-layer", tmp_path)["rows"] == [{"v": 2}]
    assert results.current_file("routing-kernel", tmp_path) is None
    (tmp_path / "moe-layer-20261201.json").write_text(json.dumps({"rows": [{"v": 3}]}))
    with pytest.raises(ValueError, match=r"moe-layer-20261201\.json', 'moe-layer-20261201\.json\.xz'.*keep one"):
        results.load_results("moe-layer", tmp_path)
    assert results.current_file("moe-layer") is not None  # the committed files: one form a day


def test_load_results_takes_only_its_own_topic(tmp_path):
    """A topic that starts another's name ('pair-layout', 'pair-layout-sweep') gets its own file only."""
    (tmp_path / "pair-layout-20261129.json").write_text(json.dumps({"rows": [{"v": "layout"}]}))
    (tmp_path / "pair-layout-sweep-20261130.json").write_text(json.dumps({"rows": [{"v": "sweep"}]}))
    assert results.load_results("pair-layout", tmp_path)["rows"] == [{"v": "layout"}]
    assert results.load_results("pair-layout-sweep", tmp_path)["rows"] == [{"v": "sweep"}]


def test_load_optional_says_why_there_is_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(results, "REPO", tmp_path)  # no committed results either
    assert results.load_optional("routing-ablation", tmp_path / "run") is None
    assert "no results for topic 'routing-ablation'" in capsys.readouterr().out


def test_load_runs_current_and_archived_oldest_first(tmp_path):
    """Every run of a topic: the current file and its archived predecessors, ordered by when they ran; other
    topics (a longer name that starts the same) and other file names stay out."""
    (tmp_path / "archive").mkdir()
    docs = {"moe-layer-20261130.json": "2026-11-30T23:00",
            "archive/moe-layer-20261130-abc1234.json": "2026-11-30T20:00",
            "archive/moe-layer-20261129-def5678.json": "2026-11-29T10:00",
            "archive/moe-layer-extra-20261130-abc1234.json": "2026-11-30T21:00",
            "archive/moe-layer-20261130-notes.json": "2026-11-30T22:00"}
    for name, created in docs.items():
        (tmp_path / name).write_text(json.dumps({"created": created, "rows": []}))
    # the archive's compressed form, and a current file committed compressed (the newest here)
    for name, created in {"archive/moe-layer-20261128-0123abc.json.xz": "2026-11-28T09:00",
                          "moe-layer-20261201.json.xz": "2026-12-01T09:00"}.items():
        (tmp_path / name).write_bytes(lzma.compress(json.dumps({"created": created, "rows": []}).encode()))
    got = [d["created"] for d in results.load_runs("moe-layer", tmp_path)]
    assert got == ["2026-11-28T09:00", "2026-11-29T10:00", "2026-11-30T20:00", "2026-11-30T23:00", "2026-12-01T09:00"]
    assert results.load_results("moe-layer", tmp_path)["created"] == "2026-12-01T09:00"
    assert results.read_file(tmp_path / "archive/moe-layer-20261128-0123abc.json.xz")["created"] == "2026-11-28T09:00"
    with pytest.raises(FileNotFoundError, match="'routing-kernel'"):
        results.load_runs("routing-kernel", tmp_path)
    committed = results.load_runs("moe-layer")  # the committed runs: the newest is the current file
    assert len(committed) >= 2 and committed[-1] == results.load_results("moe-layer")


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


def test_write_results_keeps_an_earlier_run_of_the_same_day(tmp_path, monkeypatch, capsys):
    """A second run of a topic on the same day moves the first run's file to archive/ (named by its commit)
    instead of overwriting it; a run's own later writes (saving as it goes) replace its file."""
    from moelab import results

    monkeypatch.setattr(results, "_WRITTEN", set())
    monkeypatch.setenv("MOELAB_COMMIT", "aaaaaaa111")
    first = results.write_results("topic-x", [{"v": 1}], out_dir=tmp_path)
    results.write_results("topic-x", [{"v": 2}], out_dir=tmp_path)  # the same run, a later save
    assert not (tmp_path / "archive").exists()
    monkeypatch.setattr(results, "_WRITTEN", set())  # as if a new process
    monkeypatch.setenv("MOELAB_COMMIT", "bbbbbbb222")
    results.write_results("topic-x", [{"v": 3}], out_dir=tmp_path)
    kept = tmp_path / "archive" / f"{first.stem}-aaaaaaa.json"
    assert json.loads(kept.read_text())["rows"] == [{"v": 2}]
    assert json.loads(first.read_text())["rows"] == [{"v": 3}]
    assert "moved to" in capsys.readouterr().out
    monkeypatch.setattr(results, "_WRITTEN", set())
    results.write_results("topic-x", [{"v": 4}], out_dir=tmp_path)  # same commit again: a numbered name
    assert json.loads((tmp_path / "archive" / f"{first.stem}-bbbbbbb.json").read_text())["rows"] == [{"v": 3}]
    monkeypatch.setattr(results, "_WRITTEN", set())
    monkeypatch.setenv("MOELAB_COMMIT", "bbbbbbb222")
    results.write_results("topic-x", [{"v": 5}], out_dir=tmp_path)
    assert json.loads((tmp_path / "archive" / f"{first.stem}-bbbbbbb-2.json").read_text())["rows"] == [{"v": 4}]
    assert sorted(d["rows"][0]["v"] for d in results.load_runs("topic-x", tmp_path)) == [2, 3, 4, 5]  # all kept
    # a current file committed compressed is kept the same way, compressed, named by its own commit
    first.with_name(first.name + ".xz").write_bytes(lzma.compress(first.read_bytes()))
    first.unlink()
    monkeypatch.setattr(results, "_WRITTEN", set())
    results.write_results("topic-x", [{"v": 6}], out_dir=tmp_path)
    kept = tmp_path / "archive" / f"{first.stem}-bbbbbbb-3.json.xz"
    assert results.read_file(kept)["rows"] == [{"v": 5}] and not first.with_name(first.name + ".xz").exists()
    assert results.load_results("topic-x", tmp_path)["rows"] == [{"v": 6}]


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


def test_a_row_that_cannot_be_written_leaves_the_days_earlier_file(tmp_path, monkeypatch):
    """The new document is made into JSON before the earlier run's file moves to archive/: a row JSON cannot hold
    raises and the earlier file stays where it was."""
    monkeypatch.setattr(results, "_WRITTEN", set())
    first = results.write_results("topic-x", [{"v": 1}], out_dir=tmp_path)
    monkeypatch.setattr(results, "_WRITTEN", set())  # a new process
    with pytest.raises(TypeError, match="set"):
        results.write_results("topic-x", [{"v": {1, 2}}], out_dir=tmp_path)
    assert json.loads(first.read_text())["rows"] == [{"v": 1}] and not (tmp_path / "archive").exists()


def test_load_runs_reads_a_run_archived_without_a_commit(tmp_path, monkeypatch):
    """Where git is missing the commit reads 'unknown', and the archived file is named so: still a run."""
    monkeypatch.setattr(results, "commit", lambda: "unknown")
    for v in (1, 2):
        monkeypatch.setattr(results, "_WRITTEN", set())
        results.write_results("topic-x", [{"v": v}], out_dir=tmp_path)
    assert [p.name.rsplit("-", 1)[1] for p in (tmp_path / "archive").iterdir()] == ["unknown.json"]
    assert sorted(d["rows"][0]["v"] for d in results.load_runs("topic-x", tmp_path)) == [1, 2]


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
    monkeypatch.setattr(results, "_WRITTEN", set())
    path = results.write_results("topic-x", [{"v": 1}], out_dir=tmp_path, extra={"x": 1, "tuned": {"a": [2]}})
    doc = json.loads(path.read_text())
    assert doc["x"] == 1 and doc["tuned"] == {"a": [2]} and doc["rows"] == [{"v": 1}] and doc["schema"] == 1


def test_archiving_skips_a_name_taken_by_a_compressed_run(tmp_path, monkeypatch):
    """An archived run compressed to .json.xz still holds its name: the next run of that day and commit is
    archived under the next number, and the compressed file stays as it was."""
    monkeypatch.setenv("MOELAB_COMMIT", "ccccccc333")
    monkeypatch.setattr(results, "_WRITTEN", set())
    first = results.write_results("topic-x", [{"v": 1}], out_dir=tmp_path)
    xz = tmp_path / "archive" / f"{first.stem}-ccccccc.json.xz"
    xz.parent.mkdir()
    old = lzma.compress(json.dumps({"created": "2026-01-01T00:00", "rows": [{"v": 0}]}).encode())
    xz.write_bytes(old)
    monkeypatch.setattr(results, "_WRITTEN", set())  # a new process
    results.write_results("topic-x", [{"v": 2}], out_dir=tmp_path)
    assert sorted(p.name for p in xz.parent.iterdir()) == sorted([xz.name, f"{first.stem}-ccccccc-2.json"])
    assert json.loads((xz.parent / f"{first.stem}-ccccccc-2.json").read_text())["rows"] == [{"v": 1}]
    assert xz.read_bytes() == old


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
    monkeypatch.setattr(results, "_WRITTEN", set())
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


def test_damaged_results_files_raise_naming_the_file(tmp_path, capsys):
    """A results file that is no JSON object (bad JSON, binary, empty, a list, a bad .xz) raises ValueError naming
    it; load_optional lets that through (None only where there is no file); rows_frame names what it got."""
    files = {"bad-20260101.json": b"{not json", "bin-20260101.json": b"\xff\xfe\x00junk", "empty-20260101.json": b"",
             "list-20260101.json": b"[1, 2]"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            results.load_results(name.split("-")[0], tmp_path)
    with pytest.raises(ValueError, match="list-20260101.json: holds a JSON list"):
        results.read_file(tmp_path / "list-20260101.json")
    (tmp_path / "x.json.xz").write_bytes(b"not xz")
    with pytest.raises(ValueError, match=r"x\.json\.xz: not readable as JSON \(xz\)"):
        results.read_file(tmp_path / "x.json.xz")
    with pytest.raises(ValueError, match="bad-20260101.json: not readable as JSON"):
        results.load_optional("bad", tmp_path)
    with pytest.raises(ValueError, match=r"doc \(keys \['schema'\]\): not a results document, which has a 'rows'"):
        results.rows_frame({"schema": 1})
    with pytest.raises(TypeError, match="doc: a list, not a results document"):
        results.rows_frame([1, 2])


def test_load_runs_leaves_out_a_damaged_run_with_a_warning(tmp_path, caplog):
    """One damaged archive (or one without `created`) does not hide a topic's history: it is left out and a
    warning names it; a topic with no readable run raises ValueError."""
    (tmp_path / "archive").mkdir()
    (tmp_path / "moe-layer-20261130.json").write_text(json.dumps({"created": "2026-11-30T23:00", "rows": []}))
    (tmp_path / "archive/moe-layer-20261129-abc1234.json.xz").write_bytes(b"not xz")
    (tmp_path / "archive/moe-layer-20261128-def5678.json").write_text(json.dumps({"rows": []}))
    with caplog.at_level("WARNING", logger="moelab.results"):
        got = results.load_runs("moe-layer", tmp_path)
    assert [d["created"] for d in got] == ["2026-11-30T23:00"]
    assert "moe-layer-20261129-abc1234.json.xz: not readable" in caplog.text
    assert "moe-layer-20261128-def5678.json: no 'created'" in caplog.text
    (tmp_path / "moe-layer-20261130.json").write_text("{")
    with pytest.raises(ValueError, match="no readable results for topic 'moe-layer'"):
        results.load_runs("moe-layer", tmp_path)


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

    a, b = tmp_path / "a.json", tmp_path / "b.json.xz"
    a.write_text(json.dumps({"commit": "a", "rows": [{"ppl": 1.0}, {"ppl": 2.0}]}))
    b.write_bytes(lzma.compress(json.dumps({"commit": "b", "rows": [{"ppl": 1.0}, {"ppl": 2.5}]}).encode()))
    env = {**os.environ, "PYTHONPATH": str(Path(results.__file__).parents[1])}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "moelab.results", "diff", *map(str, args)], env=env,
                              capture_output=True, text=True)

    r = run(a, b)
    assert r.returncode == 1 and "1 differences (rtol 0) among 2 / 2 numbers" in r.stdout
    assert "rows[1].ppl: 2.0 -> 2.5  (rel 0.2)" in r.stdout
    assert run(a, b, "--rtol", "0.25").returncode == 0
    r = run(a, tmp_path / "none.json")
    assert r.returncode == 2 and "none.json" in r.stderr


def test_read_log_loose_first_then_bundles_and_a_missing_one_named(tmp_path, monkeypatch, capsys):
    """read_log takes the docs' name in any form; a loose file wins over a bundled one of the same name; a log found
    nowhere raises FileNotFoundError naming it and the bundles looked in; the CLI prints it or lists the names."""
    import tarfile
    from io import BytesIO

    with tarfile.open(tmp_path / "packed-20261206.tar.xz", "w:xz") as tar:
        for name, text in (("a-1234567.txt", "packed a\n"), ("b-1234567.txt", "packed b\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, BytesIO(text.encode()))
    (tmp_path / "b-1234567.txt.xz").write_bytes(lzma.compress(b"loose b\n"))
    for form in ("logs/a-1234567.txt.xz", "a-1234567.txt", "a-1234567"):
        assert results.read_log(form, tmp_path) == "packed a\n"
    assert results.read_log("b-1234567.txt.xz", tmp_path) == "loose b\n"
    with pytest.raises(FileNotFoundError, match=r"'logs/c-1234567.txt.xz'.*1 bundle"):
        results.read_log("logs/c-1234567.txt.xz", tmp_path)
    assert results.log_names(tmp_path) == ["a-1234567.txt", "b-1234567.txt"]
    monkeypatch.setenv("MOELAB_RESULTS_DIR", str(tmp_path.parent))
    (tmp_path.parent / "logs").mkdir(exist_ok=True)
    (tmp_path.parent / "logs" / "d-1234567.txt.xz").write_bytes(lzma.compress(b"# rc=0\n"))
    assert results._main(["log", "logs/d-1234567.txt.xz"]) == 0 and capsys.readouterr().out == "# rc=0\n"
    assert results._main(["log", "--list"]) == 0 and capsys.readouterr().out == "d-1234567.txt\n"
    for argv in (["log"], ["log", "d", "--list"], ["log", "nosuch"]):
        with pytest.raises(SystemExit) as e:
            results._main(argv)
        assert e.value.code == 2
    assert "no nosuch.txt.xz" in capsys.readouterr().err
