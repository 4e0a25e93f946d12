"""Data: hash checks, the held-out split, and the restricted unpickler for routing counts."""

import pickle

import numpy as np
import pytest

from moelab import data


def test_texts_load_and_eval_set_is_never_trained_on():
    assert set(data.TRAIN_TEXTS) <= set(data.text_names())
    assert data.EVAL_TEXT not in data.TRAIN_TEXTS
    train = data.training_texts()
    assert all("wikitext2_test" not in n for n in train)
    wt2 = data.load_text(data.EVAL_TEXT)
    probe = wt2[10000:10200]
    assert all(probe not in t for t in train.values())


def test_eval_text_is_the_test_file_with_lf_line_ends():
    raw, text = data.load_text(data.EVAL_TEXT), data.eval_text()
    assert raw.count("\r\n") == 2891 and "\r" not in text  # every line of the shipped copy ends in CRLF
    assert text == raw.replace("\r\n", "\n") and text.count("\n") == 2891


def test_heldout_split_is_disjoint_and_complete():
    text = data.load_text("tinyshakespeare")
    tr, ho = data.split_heldout(text)
    assert tr + ho == text and 0.04 < len(ho) / len(text) < 0.06 and tr.endswith("\n")
    with pytest.raises(ValueError, match="fraction=1.5"):
        data.split_heldout(text, 1.5)


def test_heldout_texts_share_no_text_with_training():
    """What calibration and validation use was never trained on: no 200-character block of a held-out slice
    occurs in any training text. The five OLMoE domain files repeat their text, so their last 5% is
    training text: heldout_repeats finds it, and heldout_texts() leaves them out."""
    held = data.heldout_texts()
    assert sorted(held) == ["tinyshakespeare", "wikitext2_valid.tokens"]
    train = "\n".join(data.training_texts().values())
    for name, text in held.items():
        blocks = [text[i : i + 200] for i in range(0, len(text) - 200, 1000)]
        assert blocks and not any(b in train for b in blocks), name
    for name in data.DOMAINS.values():
        assert data.heldout_repeats(name) == 1.0
    assert len(data.heldout_texts(unseen_only=False)) == len(data.TRAIN_TEXTS)


def test_altered_file_is_refused(tmp_path, monkeypatch):
    """An altered corpus is refused, also after the good one was read (the caches follow MOELAB_DATA)."""
    good_text = data.load_text("tinyshakespeare")  # cached from the project's data/
    (tmp_path / "text").mkdir()
    good = data.data_dir() / "SHA256SUMS"
    (tmp_path / "SHA256SUMS").write_text(good.read_text())
    (tmp_path / "text" / "tinyshakespeare.txt").write_text("not the original")
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    with pytest.raises(ValueError, match="does not match"):
        data.load_text("tinyshakespeare")
    with pytest.raises(ValueError, match="unknown"):
        data.load_text("nope")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "SHA256SUMS").write_text("")  # another folder's list: nothing known there
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "other"))
    with pytest.raises(ValueError, match="unknown; choose one of \\[\\]"):
        data.load_text("tinyshakespeare")
    monkeypatch.delenv("MOELAB_DATA")
    assert data.load_text("tinyshakespeare") == good_text


def test_routing_counts_are_real_and_balanced():
    for model, E in data.COUNT_MODELS.items():
        for domain in data.DOMAINS:
            c = data.load_routing_counts(model, domain)
            assert c.shape == (3, E) and c.sum() > 0
            # the real checkpoints' load entropies (0.83 to 1.0), the bar our routers must meet
            assert all(0.8 <= data.normalised_entropy(row) <= 1.0 for row in c)
    top = data.load_routing_counts("olmoe", "c4")
    top1 = data.load_routing_counts("olmoe", "c4", top1=True)
    assert abs(top.sum() / top1.sum() - 8) < 1e-6  # top-8 choices vs first choices


def test_unpickler_refuses_anything_else():
    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    import io

    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        data._CountsUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    with pytest.raises(ValueError, match="domain='tulu'"):
        data.load_routing_counts("mistral", "tulu")


def test_split_heldout_holds_out_about_its_fraction_whatever_the_line_breaks():
    """The cut moves back to a line break only within another fraction of the text: a text whose one line break
    is near its start does not hold out almost all of itself."""
    from moelab.data import split_heldout

    train, held = split_heldout("Title\n" + "x" * 10_000)
    assert train + held == "Title\n" + "x" * 10_000 and 0.05 <= len(held) / 10_006 < 0.051
    lines = "".join(f"line {i}\n" for i in range(1000))
    train, held = split_heldout(lines)
    assert train.endswith("\n") and held.startswith("line ") and 0.05 <= len(held) / len(lines) < 0.1
    train, held = split_heldout("\n" + "y" * 99 + "\n" + "z" * 9)  # a break at 100 of 110: within the window
    assert held == "z" * 9


def test_normalised_entropy_divides_by_the_log_of_all_experts():
    """Entropy / log(E) counts idle experts in E: two of four equally used -> log 2 / log 4 = 0.5."""
    import math

    assert data.normalised_entropy([1, 1, 0, 0]) == pytest.approx(math.log(2) / math.log(4))
    assert data.normalised_entropy([3, 3, 3]) == pytest.approx(1.0) and data.normalised_entropy([5, 0]) == 0.0
    for bad in ([2, -1], [1], [0, 0], [1, float("nan")], [[1, 1]]):
        with pytest.raises(ValueError, match="non-negative count per expert"):
            data.normalised_entropy(bad)


def test_split_heldout_ignores_a_line_break_beyond_one_more_fraction():
    """A break between one and two fractions before the cut is not used: the cut stays mid-line at 95%."""
    text = "a" * 880 + "\n" + "b" * 119  # 1000 characters; the 5% cut is at 950, the window [900, 950)
    train, held = data.split_heldout(text)
    cut = int(len(text) * (1 - data.HELDOUT_FRACTION))
    assert train == text[:cut] and held == text[cut:]
    text = "a" * 920 + "\n" + "b" * 79  # a break inside the window: cut after it
    assert data.split_heldout(text) == (text[:921], text[921:])


def _data_folder(path, files: dict):
    """A data folder holding `files` {path under data/: bytes} and their SHA256SUMS."""
    import hashlib

    lines = []
    for rel, raw in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(raw)
        lines.append(f"{hashlib.sha256(raw).hexdigest()}  {rel}")
    (path / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return path


def test_heldout_repeats_is_the_share_of_repeated_blocks(tmp_path, monkeypatch):
    """One of the held-out slice's four 200-character blocks occurs in the training part: 1/4, not all or none."""
    import random

    rng = random.Random(0)

    def noise(n):
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))

    n = 16_000
    held_len = n - int(n * (1 - data.HELDOUT_FRACTION))
    blocks = [noise(data.REPEAT_BLOCK) for _ in range(held_len // data.REPEAT_BLOCK)]
    train = blocks[0] + noise(n - held_len - data.REPEAT_BLOCK - 1) + "\n"
    text = train + "".join(blocks)
    assert len(text) == n and len(blocks) == 4
    monkeypatch.setenv("MOELAB_DATA", str(_data_folder(tmp_path, {"text/toy.txt": text.encode()})))
    assert data.split_heldout(data.load_text("toy")) == (train, "".join(blocks))
    assert data.heldout_repeats("toy") == 1 / len(blocks)


def test_a_plain_file_is_read_before_its_xz_copy(tmp_path, monkeypatch):
    """Where both `rel` and `rel.xz` exist, the plain file is the one read (and hash-checked)."""
    import lzma

    d = _data_folder(tmp_path, {"text/toy.txt": b"the listed text\n", "text/old.txt": b"the listed text\n"})
    for name in ("toy", "old"):
        (d / "text" / f"{name}.txt.xz").write_bytes(lzma.compress(b"a stale copy\n"))
    (d / "text" / "old.txt").unlink()  # the .xz alone is read, and its content must match the hash
    monkeypatch.setenv("MOELAB_DATA", str(d))
    assert data.load_text("toy") == "the listed text\n"
    with pytest.raises(ValueError, match="old.txt.xz: sha256 .* does not match"):
        data.load_text("old")


def test_routing_counts_rows_follow_the_layer_order(tmp_path, monkeypatch):
    """Row i of load_routing_counts is the i-th layer's Counter in the file (layers COUNT_LAYERS[i])."""
    import collections

    layers = [collections.Counter({0: 5}), collections.Counter({3: 2, 7: 4}), collections.Counter({1: 9})]
    rel = "routing_counts/mistral/expert_counts/toy.pkl"
    monkeypatch.setenv("MOELAB_DATA", str(_data_folder(tmp_path, {rel: pickle.dumps(layers)})))
    c = data.load_routing_counts("mistral", "toy")
    assert c.shape == (len(data.COUNT_LAYERS), data.COUNT_MODELS["mistral"])
    for i, counter in enumerate(layers):
        assert {e: int(n) for e, n in enumerate(c[i]) if n} == dict(counter)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "not xz"])
def test_a_damaged_xz_corpus_is_named(tmp_path, monkeypatch, damage):
    """A damaged compressed corpus fails with its path, not a bare LZMAError."""
    import shutil

    (tmp_path / "text").mkdir()
    shutil.copy(data.data_dir() / "SHA256SUMS", tmp_path)
    xz = tmp_path / "text" / "tinyshakespeare.txt.xz"
    good = (data.data_dir() / "text" / xz.name).read_bytes()
    xz.write_bytes({"truncated": good[: len(good) // 2], "not xz": b"garbage" * 10,
                    "flipped": good[:4096] + bytes(b ^ 0xFF for b in good[4096:8192]) + good[8192:]}[damage])
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    with pytest.raises(ValueError, match=f"{xz}: damaged xz file"):
        data.load_text("tinyshakespeare")


def test_check_file_hashes_a_listed_file_once_per_version_and_record_hashes_updates_the_list(tmp_path, monkeypatch):
    d = _data_folder(tmp_path, {"models/m/config.json": b"{}"})
    monkeypatch.setenv("MOELAB_DATA", str(d))
    f = data.check_file("models/m/config.json")
    assert f == d / "models/m/config.json"
    f.write_bytes(b'{"a": 1}')
    with pytest.raises(ValueError, match=f"{f}: sha256 .* does not match SHA256SUMS"):
        data.check_file("models/m/config.json")
    with pytest.raises(ValueError, match="models/m/other.json: not listed in"):
        data.check_file("models/m/other.json")
    data.record_hashes(["models/m/config.json"])
    assert data.check_file("models/m/config.json") == f
    assert (d / "SHA256SUMS").read_text().count("models/m/config.json") == 1


def test_check_file_unpacks_a_file_shipped_as_xz_once_and_checks_it(tmp_path, monkeypatch):
    """A listed file present only as `rel.xz` is unpacked beside it (no temporary file left), then reused; a
    damaged .xz is named, and one whose content is not the listed file's is refused."""
    import lzma

    raw = bytes(range(256)) * 64
    d = _data_folder(tmp_path, {"models/m/w.bin": raw})
    f, xz = d / "models/m/w.bin", d / "models/m/w.bin.xz"
    xz.write_bytes(lzma.compress(raw, preset=6))
    f.unlink()
    monkeypatch.setenv("MOELAB_DATA", str(d))
    assert data.check_file("models/m/w.bin") == f and f.read_bytes() == raw
    assert sorted(p.name for p in f.parent.iterdir()) == ["w.bin", "w.bin.xz"]
    xz.write_bytes(b"")  # a second call reads the unpacked file, not the .xz
    assert data.check_file("models/m/w.bin") == f
    f.unlink()
    xz.write_bytes(lzma.compress(raw)[:-100])  # truncated
    with pytest.raises(ValueError, match=f"{xz}: damaged xz file"):
        data.check_file("models/m/w.bin")
    xz.write_bytes(lzma.compress(raw[:-1]))  # another file's content
    with pytest.raises(ValueError, match=f"{xz}: sha256 .* does not match SHA256SUMS"):
        data.check_file("models/m/w.bin")
    assert not f.exists() and sorted(p.name for p in f.parent.iterdir()) == ["w.bin.xz"]


def test_record_hashes_rewrites_the_xz_copy_of_a_retrained_file(tmp_path, monkeypatch):
    """After retraining, record_hashes lists the new file's hash and rewrites its .xz, which then unpacks to it."""
    import lzma

    d = _data_folder(tmp_path, {"models/m/w.bin": b"old weights"})
    f, xz = d / "models/m/w.bin", d / "models/m/w.bin.xz"
    xz.write_bytes(lzma.compress(b"old weights"))
    monkeypatch.setenv("MOELAB_DATA", str(d))
    f.write_bytes(b"new weights")
    with pytest.raises(ValueError, match=f"{f}: sha256 .* delete it to unpack it again"):
        data.check_file("models/m/w.bin")
    data.record_hashes(["models/m/w.bin"])
    assert lzma.decompress(xz.read_bytes()) == b"new weights"
    f.unlink()
    assert data.check_file("models/m/w.bin").read_bytes() == b"new weights"


def test_unseen_texts_share_no_block_with_the_training_texts():
    """The other-domain texts (two books, Python source) were never trained on: none of their 200-character blocks
    occurs in any training text, held-out slices included; the books carry no Project Gutenberg header or footer."""
    unseen = data.unseen_texts()
    assert set(unseen) == set(data.UNSEEN_TEXTS) and not set(unseen) & {*data.TRAIN_TEXTS, data.EVAL_TEXT}
    corpus = "\n".join(data.load_text(n) for n in data.TRAIN_TEXTS)  # whole files: training parts and held-out slices
    for name, text in unseen.items():
        assert len(text) > 200_000 and data.block_repeats(text, corpus) == 0.0, name
        assert "gutenberg" not in text.lower(), name


def test_block_repeats_finds_a_block_at_any_offset():
    rng = np.random.default_rng(0)
    noise = lambda n: "".join(rng.choice(list("abcdefghij"), n))  # noqa: E731
    text = noise(1000)
    for offset in (0, 1, 57, 99, 100, 101, 333):
        corpus = noise(offset) + text[200:400] + noise(50)
        assert data.block_repeats(text, corpus) == 1 / 5, offset
    assert data.block_repeats(text, noise(5000)) == 0.0 and data.block_repeats("short", text) == 0.0
