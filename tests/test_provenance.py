"""Every committed results file is strict JSON and names its machine, versions, commit and command."""
import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
FILES = sorted(RESULTS.iterdir())


def test_results_are_one_json_file_per_topic():
    assert FILES and all(p.is_file() and p.suffix == ".json" for p in FILES), [p.name for p in FILES]
    assert len(FILES) <= 40


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
