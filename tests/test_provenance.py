"""Every committed results file names where it came from, and the docs' tables and links follow from the files."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "data" / "results"
FILES = sorted(RESULTS.glob("*.json"))


def test_results_are_one_json_file_per_topic():
    """One JSON file per topic; beside one, only the sidecar it records (moelab.results keeps its lists there)."""
    assert FILES and all(p.is_file() for p in FILES) and len(FILES) <= 40
    for p in RESULTS.iterdir():
        if p.suffix != ".json":
            doc = p.with_suffix(".json")
            assert p.suffix == ".npz" and doc.is_file() and "apart" in json.loads(doc.read_text()), p.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_results_file_names_machine_versions_commit_and_command(path):
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    doc = json.loads(path.read_bytes(), parse_constant=refuse)
    assert doc["schema"] == 1 and isinstance(doc["rows"], list) and doc["rows"], path
    assert path.stem.startswith(doc["topic"]), f"{path}: topic {doc['topic']!r} is not the file's"
    assert doc["machine"].get("device") and doc["machine"].get("torch"), f"{path}: no device or torch version"
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", str(doc["commit"])), f"{path}: commit {doc['commit']!r}"
    assert str(doc["command"]).strip() and doc["created"], path
    if "apart" in doc:  # its sidecar is the one it records
        from moelab import results

        assert results.read_file(path)["rows"] != doc["rows"], path


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """tools/report.py run into a fresh folder: the documents with their tables made again, and the figures."""
    out = tmp_path_factory.mktemp("report")
    subprocess.run([sys.executable, "tools/report.py", "--out", str(out)], cwd=REPO, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO / "lib")})
    return out


def test_docs_tables_are_made_from_the_current_results(regenerated):
    """Every table in README.md and docs/*.md is what tools/report.py makes from data/results, byte for byte (make
    report writes them again), and it draws exactly the committed figures."""
    for doc in DOCS:
        rel = doc.relative_to(REPO)
        assert (regenerated / rel).read_text() == doc.read_text(), f"{rel}: its tables differ; run make report"
    drawn = sorted(p.name for p in (regenerated / "docs" / "figures").iterdir())
    assert drawn == sorted(p.name for p in (REPO / "docs" / "figures").iterdir())


def test_every_link_to_results_and_figures_exists():
    for doc in DOCS:
        for link in re.findall(r"\]\(([^)\s#]+)", doc.read_text()):
            if "data/results/" in link or "figures/" in link or link.endswith(".md"):
                assert (doc.parent / link).resolve().is_file(), f"{doc.name}: link {link} leads nowhere"


def test_docs_name_no_commit_hashes_outside_results_links():
    """Provenance lives in the results files: the README and the reports cite files, not commits."""
    sha = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    for doc in DOCS:
        text = re.sub(r"\]\([^)]*data/results/[^)]*\)", "]()", doc.read_text())
        assert not sha.findall(text), f"{doc.name}: {sha.findall(text)[:5]}"
    assert len((REPO / "README.md").read_text().splitlines()) < 250
