"""The paper table's protocol: every section measured with routing changed, arguments checked before any
evaluation, the claims' configurations, and the committed run's verdicts following from its rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import moelab.paper as paper
from moelab import results
from moelab.calibrate import verdict
from moelab.models import tiny_random
from moelab.paper import calibration_k_values, lower_fixed_ks, paper_rows, paper_table, published_configs

CTX = 64
REPO = Path(__file__).resolve().parents[1]


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
    ev = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(3))
    cal = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(4))
    other = torch.randint(0, 256, (192,), generator=torch.Generator().manual_seed(5))
    out = paper_rows(model, "rand-mixtral", ev, cal, context=CTX, stride=CTX, budget_steps=1, targets=(0.25,),
                     per_layer=True, fixed_ks=[1], progress=False, domains={"other": other}, resamples=200,
                     train_seed=7)
    rows = out["rows"]
    by = {}
    for r in rows:
        by.setdefault((r["text"], r["section"]), []).append(r)
    assert {s for t, s in by if t == "wikitext2"} == {"baseline", "patched-native", "published", "claimed-target",
                                                      "calibrated", "matched"}
    assert {s for t, s in by if t == "other"} == {"baseline", "patched-native", "calibrated", "matched"}
    main = {s: v for (t, s), v in by.items() if t == "wikitext2"}
    assert main["patched-native"][0]["ppl_change"] == pytest.approx(0.0, abs=1e-5)
    assert "unreachable" in main["claimed-target"][0]["config"]  # 52.5% > the 50% a top-2 model can save
    cal_rows = main["calibrated"]  # shared and per layer, within the budget and within half of it
    assert [(r["budget"], r["margin"]) for r in cal_rows] == [(0.005, 1.0)] * 2 + [(0.0025, 0.5)] * 2
    assert [r["config"] for r in cal_rows][::2] == ["shared thresholds, budget +0.5%",
                                                    "shared thresholds, budget +0.25%"]
    # SER keeps at least native k / 2 = 1 expert, the range's own floor: RatioSkip again, left out
    assert {r["kind"] for r in main["matched"]} == {"EntropyAdaptiveK", "TopP", "RatioSkip", "EvenBudget",
                                                    "AllocBudget", "TopK", "LuMedian"}
    assert {r["kind"] for r in by[("other", "matched")]} == {"EntropyAdaptiveK", "TopP", "RatioSkip", "EvenBudget",
                                                             "AllocBudget", "TopK", "LuMedian"}
    assert len(main["matched"]) > len(by[("other", "matched")])  # the budget points: on the evaluation text only
    measured = [r for r in rows if "ppl" in r]
    assert all(r.get("estimated") is False and r["train_seed"] == 7 for r in measured)
    for r in measured:  # intervals from the windows, which the rows carry (rounded to 0.01 nats: 1e-6 of a change)
        assert r["windows"] == len(r["window_tokens"]) == len(r["window_nll"]) == (4 if r["text"] == "wikitext2"
                                                                                   else 3)
        assert r["ci_lo"] <= r["ppl_change"] + 1e-6 and r["ppl_change"] <= r["ci_hi"] + 1e-6
        assert r["resamples"] == 200 and r["bootstrap_seed"] == 0 and r["kl"] > -1e-8 and 0 <= r["top1_agree"] <= 1
    base = main["baseline"][0]
    assert base["kl"] == 0 and base["top1_agree"] == 1 and base["ci_lo"] == base["ci_hi"] == 0
    assert base["text_tokens"] == 256 and by[("other", "baseline")][0]["text_tokens"] == 192
    comp = out["comparisons"]
    assert set(comp["text"]) == {"wikitext2", "other"} and set(comp["model"]) == {"rand-mixtral"}
    assert comp["verdict"].str.match(r"(no difference between )?\S.* (lower than .* )?at [\d.]+%: [+-]").all()
    assert (comp["win"] == ((comp["ci_hi"] < 0) | (comp["ci_lo"] > 0))).all()
    table = paper_table(rows, resamples=200)  # the README's and notebook 05's columns, from the rows
    f = pd.DataFrame([r for r in rows if r["text"] == "wikitext2" and r["section"] in (
        "baseline", "patched-native", "published", "claimed-target", "calibrated")])
    np.testing.assert_allclose(table["compute %"], 100 * f["mean_k"] / f["native_k"], rtol=1e-12)
    np.testing.assert_allclose(table["change %"], 100 * (f["ppl"] / f["ppl_base"] - 1), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(table["ci lo %"], 100 * f["ci_lo"].astype(float), rtol=1e-12)
    nat = main["patched-native"][0]["ppl"]
    np.testing.assert_allclose(table["vs patched %"], 100 * (f["ppl"] / nat - 1), rtol=1e-9, atol=1e-12)
    assert main["patched-native"][0]["ppl_change_vs_patched"] == 0.0
    assert all(r["ppl_change_vs_patched"] == pytest.approx(r["ppl"] / nat - 1) for r in main["matched"])
    assert main["claimed-target"][0]["ppl_change_vs_patched"] is None  # no perplexity: nothing was run
    assert main["claimed-target"][0]["dtype"] == "float32"
    assert {r["cal_reference"] for r in cal_rows} == {"unchanged"}
    assert list(table["model"].unique()) == ["rand-mixtral"] and (table["claimed"] == "Mixtral 8x7B").all()
    old = [{k: v for k, v in r.items() if k != "ppl_change_vs_patched"} for r in rows]  # a file from before it
    pd.testing.assert_frame_equal(paper_table(old, resamples=200), table)
    legacy = [{k: v for k, v in r.items() if not k.startswith(("window", "ci_", "text", "kl", "top1"))}
              for r in rows if r["text"] == "wikitext2"]  # a file from before windows and texts
    pd.testing.assert_frame_equal(paper_table(legacy).drop(columns=["ci lo %", "ci hi %", "KL", "top-1 %"]),
                                  table.drop(columns=["ci lo %", "ci hi %", "KL", "top-1 %"]))


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

    monkeypatch.setattr(paper, "evaluate_many", no_forward)
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

    monkeypatch.setattr(paper, "evaluate_many", no_forward)
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
    doc = results.load_results("paper-tables")
    rows = pd.DataFrame(doc["rows"])
    rows = rows[rows["text"] == "wikitext2"] if "text" in rows else rows  # the verdicts are the evaluation text's
    assert set(doc["verdicts"]) == set(rows["model"])
    for model, text in doc["verdicts"].items():
        assert verdict(rows[(rows["model"] == model) & (rows["section"] == "matched")]) == text, model


def test_lower_fixed_ks_are_one_half_and_three_quarters_of_native():
    """The lower fixed k the paper tables compare against: 1, native / 2 and 3 native / 4 (OLMoE's 6 among them)."""
    assert lower_fixed_ks(8) == [1, 4, 6] and lower_fixed_ks(4) == [1, 2, 3] and lower_fixed_ks(2) == [1]


def _script(name: str, args: list[str], results: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib"), "MOELAB_RESULTS_DIR": str(results)}
    return subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900, check=True)


@pytest.mark.slow
def test_paper_tables_on_the_cpu_writes_every_new_column(tmp_path):
    """The whole pipeline on tiny sizes: every row with its text, KL, top-1 agreement, windows, intervals and
    training seed; the other domain's rows; the comparisons between rules."""
    _script("paper_tables", ["--models", "tiny-mixtral", "--max-tokens", "512", "--cal-tokens", "256", "--context",
                             "128", "--stride", "128", "--budget-steps", "1", "--targets", "0.25", "--domains",
                             "requests_src.py", "--domain-tokens", "384", "--resamples", "50"], tmp_path)
    doc = results.read_file(tmp_path / "paper-tables-smoke.json")  # the window lists from its sidecar
    rows = [r for r in doc["rows"] if "ppl" in r]
    new = {"text", "text_tokens", "kl", "top1_agree", "window_nll", "window_tokens", "ppl_change", "ci_lo", "ci_hi",
           "ppl_change_vs_patched", "ci_lo_vs_patched", "ci_hi_vs_patched", "windows", "resamples", "bootstrap_seed",
           "train_seed"}
    assert all(new <= set(r) for r in rows), [sorted(new - set(r)) for r in rows if not new <= set(r)][:1]
    assert {r["text"] for r in rows} == {"wikitext2", "requests_src.py"} and {r["train_seed"] for r in rows} == {1}
    assert {r["windows"] for r in rows if r["text"] == "requests_src.py"} == {3}  # 384 tokens in windows of 128
    assert {r["resamples"] for r in rows} == {50} and doc["protocol"]["domains"] == ["requests_src.py"]
    assert {r["kind"] for r in rows if r["section"] == "matched"} == {"EntropyAdaptiveK", "TopP", "RatioSkip",
                                                                      "EvenBudget", "AllocBudget", "TopK", "LuMedian"}
    assert {r["margin"] for r in rows if r["section"] == "calibrated"} == {1.0, 0.5}
    comp = pd.DataFrame(doc["comparisons"])
    assert set(comp["text"]) == {"wikitext2", "requests_src.py"} and comp["verdict"].str.contains(" at ").all()


@pytest.mark.slow
def test_seeds_trains_evaluates_and_resumes_per_model_and_seed(tmp_path):
    """A micro run: a new seed trained a few steps, it and the shipped checkpoint evaluated (matched rules, budget,
    comparisons with intervals); --resume finishes what a file lacks and reuses a checkpoint trained before."""
    args = ["--models", "tiny-mixtral", "--seeds", "1", "--workers", "1", "--eval-tokens", "512", "--cal-tokens",
            "256", "--context", "128", "--budget-steps", "1", "--targets", "0.25", "--resamples", "50", "--out",
            str(tmp_path / "ck"), "--train", json.dumps({"max_steps": 2, "batch_size": 2, "seq_len": 128,
                                                          "eval_every": 2, "eval_tokens": 512, "train_tokens": 8192,
                                                          "warmup_steps": 1})]
    _script("seeds", args, tmp_path)
    path = tmp_path / "seeds.json"
    doc = json.loads(path.read_text())
    assert doc["done"] == [["tiny-mixtral", 0], ["tiny-mixtral", 1]] and doc["complete"]  # seed 1 is the shipped one
    rows = pd.DataFrame(doc["rows"])
    assert set(rows["seed"]) == {0, 1} and rows.groupby("seed")["shipped"].first().to_dict() == {0: False, 1: True}
    assert set(rows["section"]) == {"baseline", "calibrated", "matched", "comparison"}
    m = rows[rows["section"] == "matched"]
    assert {"RatioSkip", "EntropyAdaptiveK", "TopK", "LuMedian"} <= set(m["kind"]) and m["ci_lo"].notna().all()
    assert (rows.loc[rows["seed"] == 0, "train_steps"] == 2).all() and (rows["eval_tokens"] == 512).all()
    c = rows[rows["section"] == "comparison"]
    assert c["verdict"].notna().all() and set(c["seed"]) == {0, 1}
    assert (tmp_path / "ck" / "tiny-mixtral-s0" / "train_log.json").exists()
    doc["done"], doc["rows"] = doc["done"][1:], [r for r in doc["rows"] if r["seed"] == 1]  # as if cut short
    path.write_text(json.dumps(doc))
    _script("seeds", [*args, "--resume"], tmp_path)
    again = json.loads(path.read_text())
    assert again["done"] == [["tiny-mixtral", 1], ["tiny-mixtral", 0]] and again["complete"]
    assert again["timings"][-1]["seed"] == 0 and again["timings"][-1]["train_s"] < 1  # trained before: not again
    assert len(again["rows"]) == len(rows)
