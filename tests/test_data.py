"""Data: hash checks, the held-out split, and the restricted unpickler for routing counts."""

import pickle

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
