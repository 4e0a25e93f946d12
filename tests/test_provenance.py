"""Every committed result names where it came from: machine, versions, commit (in this repository) and command."""
import json
import lzma
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "data" / "results"
MODELS = REPO / "data" / "models"
# Commits named by committed files but not kept in this repository (data/results/trials/README.md says so).
LOST = {"321924d541cbda9ddc8b85067058966d4bbaaf8f": "the per-layer cards' branch perlayer-adopt"}
COMMIT = re.compile(r"(?P<sha>[0-9a-f]{7,40})(-dirty)?")


def _results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.name.endswith((".json", ".json.xz")))


def _strict(path: Path):
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")
    raw = lzma.open(path).read() if path.name.endswith(".xz") else path.read_bytes()
    return json.loads(raw, parse_constant=refuse)


def _machine(doc: dict) -> dict:
    return doc.get("machine") or {k: doc.get(k) for k in ("device", "torch", "triton")}  # the one older trial layout


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def history():
    """A function telling whether a commit is in this clone's history (skips where that cannot be known)."""
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("shallow clone: older commits are not here")
    return lambda sha: _git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0


def test_there_are_committed_results():
    files = _results_files()
    assert len(files) > 100 and any(p.parent == RESULTS for p in files)


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_file_names_machine_versions_commit_and_command(path, history):
    doc = _strict(path)
    assert isinstance(doc, dict), path
    machine = _machine(doc)
    assert machine.get("device") and machine.get("torch"), f"{path}: no device name or torch version"
    m = COMMIT.fullmatch(str(doc.get("commit")))
    assert m, f"{path}: commit {doc.get('commit')!r} is no commit id"
    sha = m["sha"]
    if sha not in LOST:
        assert history(sha), f"{path}: commit {sha} is not in this repository"
    if "schema" in doc:  # written by moelab.results.write_results
        assert str(doc.get("command", "")).strip(), f"{path}: no command"
        assert path.name.startswith(doc["topic"]), f"{path}: topic {doc['topic']!r} is not the file's"
        assert doc["created"][:10].replace("-", "") in path.name, f"{path}: created {doc['created']} not in its name"
    elif not path.name.startswith("card-eval-"):  # the cards' command is in the card (see the model READMEs)
        assert str(doc.get("command", "")).strip(), f"{path}: no command"


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.iterdir() if (p / "train_log.json").exists()))
def test_embedded_models_name_their_training_and_card_commits(name, history):
    folder = MODELS / name
    tlog, ev = _strict(folder / "train_log.json"), _strict(folder / "eval.json")
    assert tlog["command"].strip() and tlog["machine"]["torch"]
    for doc in (tlog, ev):
        sha = COMMIT.fullmatch(doc["commit"])["sha"]
        assert history(sha), f"{name}: commit {sha} is not in this repository"
    card = (folder / "README.md").read_text()
    assert f"commit {ev['commit'][:12]}" in card and f"commit {tlog['commit'][:12]}" in card


def test_lost_commits_are_said_to_be_lost(history):
    notes = (RESULTS / "trials" / "README.md").read_text()
    for sha in LOST:
        assert not history(sha), f"{sha} is in the repository after all: take it out of LOST"
        assert f"neither it nor {sha[:7]} is in this repository" in notes
