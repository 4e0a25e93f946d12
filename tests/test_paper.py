"""The paper table's protocol: every section measured with routing changed, arguments checked before any
evaluation, the claims' configurations, and the committed run's verdicts following from its rows."""

import numpy as np
import pandas as pd
import pytest
import torch

import moelab.paper as paper
from moelab.calibrate import verdict
from moelab.models import tiny_random
from moelab.paper import calibration_k_values, lower_fixed_ks, paper_rows, paper_table, published_configs

CTX = 64


@pytest.fixture(scope="module")
def model(spread_mixtral):
    return spread_mixtral


def test_published_configs():
    assert set(published_configs("qwen2_moe", 60)) == {"trtllm-default", "sdk-qwen-moe", "qwen1.5-measured"}
    assert set(published_configs("mixtral", 8)) == {"trtllm-default", "sdk-mixtral"}
    assert set(published_configs("mixtral", 4)) == {"sdk-mixtral"}  # k 8 does not fit 4 experts


def test_calibration_k_values_end_at_native():
    assert calibration_k_values("mixtral", 2) == (1, 2)
    assert calibration_k_values("qwen2_moe", 4) == (1, 2, 4)
    assert calibration_k_values("olmoe", 8) == (2, 4, 8)
    with pytest.raises(ValueError, match="native_k=1"):
        calibration_k_values("qwen3_moe", 1)


def test_paper_rows_sections(model):
    ev = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3))
    cal = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(4))
    out = paper_rows(model, "rand-mixtral", ev, cal, context=CTX, stride=CTX, budget_steps=1, targets=(0.25,),
                     per_layer=True, fixed_ks=[1], progress=False)
    rows = out["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)
    assert set(by) == {"baseline", "patched-native", "published", "claimed-target", "calibrated", "matched"}
    assert by["patched-native"][0]["ppl_change"] == pytest.approx(0.0, abs=1e-5)
    assert "unreachable" in by["claimed-target"][0]["config"]  # 52.5% > the 50% a top-2 model can save
    assert len(by["calibrated"]) == 2 and all(r["native_k"] == 2 for r in by["calibrated"])
    assert {r["kind"] for r in by["matched"]} == {"EntropyAdaptiveK", "TopP", "RatioSkip", "TopK"}
    assert all(r.get("estimated") is False for r in rows if "ppl" in r)
    table = paper_table(rows)  # the README's and notebook 05's columns, from the rows
    f = pd.DataFrame([r for r in rows if r["section"] in ("baseline", "patched-native", "published", "claimed-target",
                                                           "calibrated")])
    np.testing.assert_allclose(table["compute %"], 100 * f["mean_k"] / f["native_k"], rtol=1e-12)
    np.testing.assert_allclose(table["change %"], 100 * (f["ppl"] / f["ppl_base"] - 1), rtol=1e-9, atol=1e-12)
    nat = by["patched-native"][0]["ppl"]
    np.testing.assert_allclose(table["vs patched %"], 100 * (f["ppl"] / nat - 1), rtol=1e-9, atol=1e-12)
    assert by["patched-native"][0]["ppl_change_vs_patched"] == 0.0
    assert all(r["ppl_change_vs_patched"] == pytest.approx(r["ppl"] / nat - 1) for r in by["matched"])
    assert by["claimed-target"][0]["ppl_change_vs_patched"] is None  # no perplexity: nothing was run
    assert by["claimed-target"][0]["dtype"] == "float32"
    assert {r["cal_reference"] for r in by["calibrated"]} == {"unchanged"}
    assert list(table["model"].unique()) == ["rand-mixtral"] and (table["claimed"] == "Mixtral 8x7B").all()
    old = [{k: v for k, v in r.items() if k != "ppl_change_vs_patched"} for r in rows]  # a file from before it
    pd.testing.assert_frame_equal(paper_table(old), table)


def test_paper_rows_in_bf16_warn_of_the_patch_bias(model, caplog):
    """In 16-bit the patch alone moves perplexity: paper_rows says so and gives the change against it."""
    import copy

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    ev = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(3))
    cal = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(4))
    with caplog.at_level("WARNING", logger="moelab.paper"):
        rows = paper_rows(m16, "rand-mixtral", ev, cal, context=CTX, stride=CTX, budget_steps=0, targets=(),
                          per_layer=False, progress=False)["rows"]
    nat = next(r for r in rows if r["section"] == "patched-native")
    assert nat["dtype"] == "bfloat16"
    said = [r.getMessage() for r in caplog.records if "the patch alone moves perplexity" in r.getMessage()]
    assert len(said) == 1 and "bfloat16" in said[0] and f"{nat['ppl_change']:+.2e}" in said[0]
    base = next(r for r in rows if r["section"] == "baseline")
    assert base["ppl_change_vs_patched"] == pytest.approx(base["ppl"] / nat["ppl"] - 1)
    cal_row = next(r for r in rows if r["section"] == "calibrated")
    assert cal_row["cal_reference"] == "patched-native"  # the budget is not charged the patch's own change


@pytest.mark.parametrize("kw, match", [
    (dict(budget=0), r"budget=0: must be > 0"),
    (dict(budget=True), r"budget=True: must be > 0"),
    (dict(fixed_ks=[1, None]), r"fixed_ks=\[1, None\]: \[None\] not ints"),
    (dict(k_values=(1, "a")), r"k_values=\[1, 'a'\]: must be a sequence of ints"),
    (dict(budget_steps=-3), r"steps=-3: .* int >= 0"),
    (dict(targets=(0.2, 5)), r"targets=\[0.2, 5\]: \[5\] not in \(0, 1\)"),
    (dict(targets=["0.5"]), r"targets=\['0.5'\]: \['0.5'\] not in \(0, 1\)"),
    (dict(fixed_ks=[1, 9]), r"fixed_ks=\[1, 9\]: \[9\] not ints in \[1, 8\]"),
    (dict(k_values=(2, 1)), r"k_values=\[2, 1\]: must be strictly ascending ints >= 1"),
    (dict(k_values=(1, 9)), r"k_values=\[1, 9\]: k_max exceeds num_experts=8"),
])
def test_paper_rows_checks_its_arguments_before_any_evaluation(model, monkeypatch, kw, match):
    """A bad argument fails at once, not after hours of evaluations whose rows would be lost."""
    def no_forward(*a, **k):
        raise AssertionError("evaluated before checking the arguments")

    monkeypatch.setattr(paper, "evaluate", no_forward)
    ids = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=match):
        paper_rows(model, "x", ids, ids.flip(0), context=CTX, **kw)


def test_paper_rows_fixed_k_above_16_experts_is_sampled():
    """A fixed k between 16 and E (OLMoE: 64 experts) is within the router sample's k_cap, not a late error."""
    net = tiny_random("olmoe", num_experts=32, num_hidden_layers=1)
    ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(2))
    out = paper_rows(net, "x", ids, ids.flip(0), context=CTX, stride=CTX, batch_size=2, budget_steps=0, targets=(),
                     fixed_ks=[20], per_layer=False, progress=False)
    assert out["sample"].k_cap >= 20
    assert any(r.get("kind") == "TopK" and r.get("k_max") == 20 for r in out["rows"])
    with pytest.raises(ValueError, match=r"fixed_ks=\[40\]: \[40\] not ints in \[1, 32\] \(num_experts=32\)"):
        paper_rows(net, "x", ids, ids.flip(0), context=CTX, fixed_ks=[40])


@pytest.mark.parametrize("cal_ids, match", [
    (torch.tensor([], dtype=torch.long), r"cal_ids of 0 tokens: need at least 2"),
    (torch.tensor([5]), r"cal_ids of 1 tokens: need at least 2"),
    (torch.tensor([5, 300, 7]), r"cal_ids: token id 300 at position 1: must be in \[0, vocab_size=256\)"),
    (torch.tensor([5.0, 6.0]), r"cal_ids: token ids of dtype torch.float32"),
    ("some text", r"cal_ids: text given as a str but tokenizer=None"),
    (None, r"cal_ids: the same 256 tokens as eval_ids"),  # the evaluation ids themselves, or a copy
])
def test_paper_rows_checks_cal_ids_before_any_evaluation(model, monkeypatch, cal_ids, match):
    """Bad or evaluation-text calibration ids fail before the first evaluation on eval_ids, not after it."""
    def no_forward(*a, **k):
        raise AssertionError("evaluated before checking the arguments")

    monkeypatch.setattr(paper, "evaluate", no_forward)
    ids = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(1))
    for bad in [ids, ids.clone().tolist()] if cal_ids is None else [cal_ids]:
        with pytest.raises(ValueError, match=match):
            paper_rows(model, "x", ids, bad, context=CTX)
    with pytest.raises(ValueError, match=r"eval_ids of 1 tokens"):
        paper_rows(model, "x", ids[:1], ids, context=CTX)


def test_calibration_k_values_refuses_k_below_one():
    for k in (0, -2, 2.0, None):
        with pytest.raises(ValueError, match=rf"native_k={k!r}: must be an int >= 1"):
            calibration_k_values("mixtral", k)


def test_committed_paper_tables_verdicts_follow_from_their_rows():
    """The verdicts the committed paper-tables run states are what `verdict` makes of its matched rows."""
    from moelab import results

    doc = results.load_results("paper-tables")
    rows = pd.DataFrame(doc["rows"])
    assert set(doc["verdicts"]) == set(rows["model"])
    for model, text in doc["verdicts"].items():
        assert verdict(rows[(rows["model"] == model) & (rows["section"] == "matched")]) == text, model


def test_lower_fixed_ks_are_one_half_and_three_quarters_of_native():
    """The lower fixed k the paper tables compare against: 1, native / 2 and 3 native / 4 (OLMoE's 6 among them)."""
    assert lower_fixed_ks(8) == [1, 4, 6] and lower_fixed_ks(4) == [1, 2, 3] and lower_fixed_ks(2) == [1]
