"""Calibration: thresholds reach compute targets, the budget search stays within its budget."""

import numpy as np
import pandas as pd
import pytest
import torch

from moelab.calibrate import (
    MATCHED_KINDS,
    budget_search,
    calibrate_thresholds,
    calibration_ids,
    compare_at_matched_compute,
    compare_rules,
    layer_budget,
    layer_sensitivity,
    lu_median,
    match_policy,
    matched_policies,
    pareto_mask,
    ser,
    ser_label,
    thresholds_at,
    verdict,
)
from moelab.evaluate import evaluate, policy_label, reference_ppl, router_sample
from moelab.hf import moe_layers
from moelab.models import tiny_random
from moelab.routing import RatioSkip, TopK, TopP

CTX = 64


@pytest.fixture(scope="module")
def model(spread_mixtral):
    return spread_mixtral


@pytest.fixture(scope="module")
def sample(model):
    ids = torch.randint(0, 256, (1024,), generator=torch.Generator().manual_seed(0))
    return router_sample(model, ids, context=CTX, progress=False)


def test_threshold_family_ends(sample):
    assert sample.estimate(thresholds_at(sample, (1, 2, 4), 0.0))["mean_k"] == 4.0
    assert sample.estimate(thresholds_at(sample, (1, 2, 4), 1.0))["mean_k"] == 1.0


@pytest.mark.parametrize("target", [0.0, 0.2, 0.35])
def test_calibrated_thresholds_hit_target(sample, target):
    pol = calibrate_thresholds(sample, (1, 2, 4), target)
    assert sample.estimate(pol)["expert_reduction"] == pytest.approx(target, abs=0.01)
    per = calibrate_thresholds(sample, (1, 2, 4), target, per_layer=True)
    assert len(per) == 2
    for mk in sample.estimate(per)["mean_k_layers"]:
        assert 1 - mk / 2 == pytest.approx(target, abs=0.01)


@pytest.mark.parametrize("kind", ["TopP", "RatioSkip", "EntropyAdaptiveK"])
def test_matched_policies_hit_target(sample, kind):
    pol = match_policy(sample, kind, 0.25, k_min=1, k_max=4)
    assert type(pol).__name__ == kind
    assert sample.estimate(pol)["expert_reduction"] == pytest.approx(0.25, abs=0.01)
    if kind == "EntropyAdaptiveK":
        assert pol.k_values == (1, 2, 4)  # k_min, the native k, k_max
        default = match_policy(sample, kind, 0.25)  # k in [1, native k]: k values (1, 2)
        assert default.k_values == (1, 2)
        assert sample.estimate(default)["expert_reduction"] == pytest.approx(0.25, abs=0.01)


def test_unreachable_target_raises(sample):
    with pytest.raises(ValueError, match="target_reduction=0.6"):
        calibrate_thresholds(sample, (1, 2, 4), 0.6)  # k >= 1 on native 2: at most 50%
    with pytest.raises(ValueError, match="at least two"):
        calibrate_thresholds(sample, (2,), 0.1)
    with pytest.raises(ValueError, match=r"k_values=\[4, 2, 1\]: must be strictly ascending"):
        calibrate_thresholds(sample, (4, 2, 1), 0.1)
    with pytest.raises(ValueError, match="k_min=2, k_max=2"):
        match_policy(sample, "EntropyAdaptiveK", 0.0, k_min=2, k_max=2)


@pytest.mark.parametrize("kw, match", [({"context": 0}, "context=0"), ({"context": -4}, "context=-4"),
                                       ({"max_tokens": -100}, "max_tokens=-100"), ({"k_cap": 0}, "k_cap=0"),
                                       ({"batch_size": 0}, "batch_size=0")])
def test_router_sample_rejects_bad_arguments(model, kw, match):
    with pytest.raises(ValueError, match=match):
        router_sample(model, torch.arange(200) % 256, progress=False, **kw)


def test_reference_ppl_is_the_unchanged_model_in_fp32_and_the_patched_native_in_bf16(model):
    import copy

    from moelab.hf import native_policy

    ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(5))
    kw = dict(context=CTX, stride=CTX, progress=False)
    for m, want in ((model, "unchanged"), (copy.deepcopy(model).to(torch.bfloat16), "patched-native")):
        ref = reference_ppl(m, ids, **kw)
        pol = [native_policy(layer) for layer in moe_layers(m)] if want == "patched-native" else None
        assert ref["reference"] == want and ref["ppl"] == evaluate(m, pol, ids, **kw).summary["ppl"]
        assert ref["dtype"] == ("float32" if want == "unchanged" else "bfloat16")


def test_budget_search_stays_within_budget():
    """On a trained model the bisection really runs; it ends on the largest in-budget reduction it measured."""
    from moelab.models import load

    net, tok = load("tiny-mixtral")
    ids = calibration_ids(tok, 1536)
    smp = router_sample(net, ids[:1024], context=128, progress=False)  # thresholds from one part
    cal = ids[1024:]  # perplexity on another
    budget, steps, kv = 0.02, 2, (1, 2)
    res = budget_search(net, smp, cal, kv, budget=budget, steps=steps, context=128, stride=128, progress=False)
    tr = res["trace"]
    lo, hi = max(0.0, 1 - kv[-1] / smp.native_k), 1 - kv[0] / smp.native_k
    # the premise: the highest reduction breaks the budget and the lowest keeps it, so the bisection runs
    assert tr["target_reduction"].iloc[0] == hi and not tr["within"].iloc[0]
    assert tr["target_reduction"].iloc[1] == lo and tr["within"].iloc[1]
    assert len(tr) == steps + 2
    assert (tr["within"] == (tr["ppl_change"] <= budget)).all()
    # every later step measures the middle of the bracket left by the steps before it
    a, b = lo, hi
    for r, within in zip(tr["target_reduction"].iloc[2:], tr["within"].iloc[2:]):
        assert r == pytest.approx((a + b) / 2, abs=1e-12)
        a, b = (r, b) if within else (a, r)
    # the result keeps the budget and is the largest reduction measured within it
    assert res["within_budget"] and res["ppl_change"] <= budget
    chosen = res["target_reduction"]
    assert chosen == tr[tr["within"]]["target_reduction"].max()
    assert not tr[tr["target_reduction"] > chosen]["within"].any()
    # the bracket around the budget's edge has shrunk to (hi - lo) / 2**steps
    first_out = tr[~tr["within"]]["target_reduction"].min()
    assert chosen < first_out <= chosen + (hi - lo) / 2**steps + 1e-12
    # its numbers are a real measurement on the calibration text
    assert res["ppl"] == tr[tr["target_reduction"] == chosen]["ppl"].iloc[0]
    again = evaluate(net, res["policy"], cal, context=128, stride=128, progress=False).summary
    assert again["ppl"] == pytest.approx(res["ppl"], rel=1e-9)
    assert again["expert_reduction"] == pytest.approx(res["expert_reduction"], rel=1e-9)


def test_compare_at_matched_compute_rows_are_their_policies(model, sample):
    ev_ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(2))
    kw = dict(context=CTX, stride=CTX, progress=False)
    base = evaluate(model, None, ev_ids, **kw).summary["ppl"]
    kv = (1, 2, 4)
    f = compare_at_matched_compute(model, sample, ev_ids, [0.2, 0.4], kv, base, context=CTX, stride=CTX,
                                   progress=False)
    assert len(f) == 7 and f["estimated"].eq(False).all()
    assert sorted(f["kind"]) == sorted(["EntropyAdaptiveK", "TopP", "RatioSkip"] * 2 + ["TopK"])
    for _, row in f.iterrows():
        # each row measures a policy of its own kind, matched on the sample to its target
        assert row["policy"] == row["kind"] and row["label"].startswith(row["kind"] + " ")
        assert row["est_expert_reduction"] == pytest.approx(row["target_reduction"], abs=0.01)
        if row["kind"] == "TopK":
            pol = TopK(int(row["k_max"]))
            assert row["target_reduction"] == 1 - pol.k / sample.native_k
        elif row["kind"] == "TopP":
            pol = TopP(row["p"], int(row["k_max"]), int(row["k_min"]))
        elif row["kind"] == "RatioSkip":
            pol = RatioSkip(row["beta"], int(row["k_max"]), int(row["k_min"]))
        else:
            pol = match_policy(sample, "EntropyAdaptiveK", row["target_reduction"], k_values=kv)
        if row["kind"] != "TopK":  # the same k range as the entropy policy's k values
            assert (row["k_min"], row["k_max"]) == (kv[0], kv[-1])
        assert policy_label(pol) == row["label"]
        # its perplexity is that policy's, measured on the same text and context
        s = evaluate(model, pol, ev_ids, baseline_ppl=base, **kw).summary
        assert s["ppl"] == pytest.approx(row["ppl"], rel=1e-9)
        assert s["expert_reduction"] == pytest.approx(row["expert_reduction"], rel=1e-9)
    assert verdict(f).startswith("Entropy is")


def _frame(ppl_by_kind, reductions=(0.1, 0.2, 0.3, 0.4), topk=()):
    """A compare_at_matched_compute-like frame: each kind measured exactly at the target reductions."""
    rows = [{"kind": kind, "target_reduction": t, "expert_reduction": t, "ppl": p}
            for kind, ppls in ppl_by_kind.items() for t, p in zip(reductions, ppls)]
    rows += [{"kind": "TopK", "target_reduction": r, "expert_reduction": r, "ppl": p, "k_max": k} for k, r, p in topk]
    return pd.DataFrame(rows)


def _wins(frame):
    """Lowest-perplexity kind at each reduction (each kind measured at the same reductions), counted."""
    f = frame[frame["kind"] != "TopK"]
    return f.loc[f.groupby("expert_reduction")["ppl"].idxmin(), "kind"].value_counts().to_dict()


def test_verdict_counts_the_lowest_perplexity():
    # entropy lowest at 10% and 40%, TopP at 20%, RatioSkip at 30%; TopP and RatioSkip tie at 10%
    ent_wins = _frame({"EntropyAdaptiveK": [10.0, 11.0, 12.5, 12.0], "TopP": [10.5, 10.8, 12.0, 13.0],
                       "RatioSkip": [10.5, 12.0, 11.5, 14.0]}, topk=[(3, 0.25, 11.6)])
    assert _wins(ent_wins) == {"EntropyAdaptiveK": 2, "TopP": 1, "RatioSkip": 1}
    text = verdict(ent_wins)
    assert text.startswith("Entropy is the better signal here: EntropyAdaptiveK has the lowest perplexity at 2 of 4 "
                           "matched compute levels")
    # each level lists the kinds from lowest to highest perplexity
    assert "at 20% reduction TopP 10.8, EntropyAdaptiveK 11, RatioSkip 12;" in text
    assert "at 30% reduction RatioSkip 11.5, TopP 12, EntropyAdaptiveK 12.5;" in text
    # TopK k=3 at 25% lies between the 20% and 30% points: interpolated, only TopP (11.4) is below its 11.6
    assert "TopK k=3 (25%, ppl 11.6) is beaten by TopP." in text

    # TopP lowest at three of four levels
    topp_wins = _frame({"EntropyAdaptiveK": [10.0, 11.0, 12.5, 13.0], "TopP": [10.5, 10.8, 12.0, 12.9],
                        "RatioSkip": [11.0, 12.0, 12.2, 14.0]})
    assert _wins(topp_wins) == {"TopP": 3, "EntropyAdaptiveK": 1}
    assert verdict(topp_wins).startswith("Entropy is not the better signal here: TopP has the lowest perplexity at 3 "
                                         "of 4 matched compute levels, EntropyAdaptiveK at 1")

    # a tie in the count of levels won: two each for entropy and RatioSkip
    tie = _frame({"EntropyAdaptiveK": [10.0, 11.0, 12.5, 12.0], "TopP": [10.5, 11.5, 12.6, 13.0],
                  "RatioSkip": [11.0, 10.9, 11.5, 14.0]})
    assert _wins(tie) == {"EntropyAdaptiveK": 2, "RatioSkip": 2}
    assert verdict(tie).startswith("Entropy is not clearly the better signal here: EntropyAdaptiveK ties with "
                                   "RatioSkip")


def test_verdict_counts_an_exact_tie_as_nobodys_win():
    """Kinds with the same perplexity at a level (e.g. the same pairs kept) share it: no win goes to the first
    kind in the frame's order."""
    one = pd.DataFrame({"kind": ["EntropyAdaptiveK", "TopP", "RatioSkip"], "target_reduction": [0.5] * 3,
                        "expert_reduction": [0.5] * 3, "ppl": [225.0] * 3})
    text = verdict(one)
    assert text.startswith("No policy has the lowest perplexity alone at any of the 1 matched compute levels")
    assert "(tied: EntropyAdaptiveK = RatioSkip = TopP)" in text
    # TopP and RatioSkip tie lowest at 30% (the level that is counted for neither); RatioSkip wins 10% and 20%
    f = _frame({"EntropyAdaptiveK": [11.0, 12.0, 13.0], "TopP": [10.5, 11.5, 12.0], "RatioSkip": [10.0, 11.0, 12.0]})
    text = verdict(f)
    assert text.startswith("Entropy is not the better signal here: RatioSkip has the lowest perplexity at 2 of 3 "
                           "matched compute levels, EntropyAdaptiveK at 0 (RatioSkip 2, EntropyAdaptiveK 0, TopP 0, "
                           "1 tied)"), text
    assert "at 30% reduction RatioSkip 12, TopP 12, EntropyAdaptiveK 13 (tied: RatioSkip = TopP)" in text


def test_verdict_without_a_shared_range_names_the_measured_reductions():
    f = pd.DataFrame({"kind": ["EntropyAdaptiveK", "TopP", "RatioSkip"], "target_reduction": [0.2] * 3,
                      "expert_reduction": [0.16, 0.15, 0.14], "ppl": [200.0, 201.0, 199.0]})
    assert verdict(f) == ("No target reduction was reached by two or more policies, so there is no matched comparison "
                          "(measured expert reductions: EntropyAdaptiveK 16.0%-16.0%, RatioSkip 14.0%-14.0%, "
                          "TopP 15.0%-15.0%; curves compare where they overlap, or within tol=0.03 of a curve's end).")


def test_pareto_mask():
    m = pareto_mask([0.1, 0.2, 0.2, 0.3], [1.0, 1.1, 1.05, 1.0])
    assert m.tolist() == [False, False, False, True]
    assert pareto_mask([0.1, 0.3], [1.0, 2.0]).tolist() == [True, True]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from moelab.models import tokenizer_dir

    return AutoTokenizer.from_pretrained(tokenizer_dir())


def test_calibration_ids_from_heldout_only(tok):
    from moelab.data import heldout_texts, load_text

    held = heldout_texts()
    ids = calibration_ids(tok, 700)
    assert ids.numel() == 700
    share = 700 // len(held)
    first = tok(held["tinyshakespeare"], add_special_tokens=False)["input_ids"][:share]
    start = list(held).index("tinyshakespeare") * share
    assert ids[start : start + share].tolist() == first
    # the evaluation text's opening does not appear
    ev = tok(load_text("wikitext2_test.raw")[:2000], add_special_tokens=False)["input_ids"][:50]
    s = " ".join(map(str, ids.tolist()))
    assert " ".join(map(str, ev)) not in s
    with pytest.raises(ValueError, match="unknown"):
        calibration_ids(tok, 100, names=["wikitext2_test.raw"])
    with pytest.raises(ValueError, match=r"\['olmoe_c4'\]: left out, their held-out part repeats their training"):
        calibration_ids(tok, 100, names=["olmoe_c4"])  # its last 5% repeats its training part
    # ids a model can embed: the tokenizer's own vocabulary
    assert ids.dtype == torch.long and 0 <= int(ids.min()) and int(ids.max()) < len(tok)


def test_a_slice_short_of_its_share_is_logged(tok, caplog):
    """paper_tables' 32,768 asked-for tokens: WikiText-2 valid's held-out part has 16,322, short of its share of
    16,384 (logged), so the calibration text has 32,706."""
    with caplog.at_level("INFO", logger="moelab.calibrate"):
        ids = calibration_ids(tok, 32768)
    assert ids.numel() == 32706
    short = [r.getMessage() for r in caplog.records if "wikitext2_valid.tokens" in r.getMessage()]
    assert len(short) == 1 and "16322" in short[0] and "16384" in short[0], short  # the text, what it has, its share


def test_matched_compute_and_thresholds_reject_bad_ks(model, sample):
    with pytest.raises(ValueError, match=r"fixed_ks=\[1, 9\]"):
        compare_at_matched_compute(model, sample, torch.arange(64), [0.25], (1, 2), 10.0, fixed_ks=[1, 9])
    for kv in ("12", (1.7, 2)):
        with pytest.raises(ValueError, match="must be a sequence of ints"):
            thresholds_at(sample, kv, 0.5)
        with pytest.raises(ValueError, match="must be a sequence of ints"):  # before any evaluation runs
            compare_at_matched_compute(model, sample, torch.arange(64), [0.25], kv, 10.0)


@pytest.fixture(scope="module")
def tied_sample():
    """Every router uniform (zero gate weights): all tokens share one entropy and tied probabilities."""
    m = tiny_random("olmoe", num_hidden_layers=1)
    for layer in moe_layers(m):
        torch.nn.init.zeros_(layer.block.gate.weight)
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0))
    return router_sample(m, ids, context=32, progress=False)


@pytest.mark.parametrize("kind, reachable", [("EntropyAdaptiveK", 0.0), ("TopP", 0.25), ("RatioSkip", 0.0)])
def test_target_out_of_reach_through_ties_warns_with_the_closest(tied_sample, kind, reachable):
    """Tied signals reach only a few reductions: the closest comes back, with a warning naming both numbers."""
    S = tied_sample
    assert S.native_k == 8 and (S.entropy[0] == S.entropy[0][0]).all()
    with pytest.warns(UserWarning, match=rf"target_reduction=0.3: {kind} .*reaches {reachable:.3f} .*ties"):
        pol = match_policy(S, kind, 0.3, k_min=2, k_max=8, k_values=(2, 8))
    assert S.estimate(pol)["expert_reduction"] == pytest.approx(reachable)
    with pytest.warns(UserWarning, match=r"target_reduction=0.3: EntropyAdaptiveK k_values=\[2, 8\] reaches 0.000"):
        calibrate_thresholds(S, (2, 8), 0.3)
    # a reduction the tied signal does reach comes back without a warning, also at the range's ends
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S.estimate(match_policy(S, "TopP", 0.25, k_min=2))["expert_reduction"] == pytest.approx(0.25)
        for t in (0.0, 0.75):
            assert S.estimate(calibrate_thresholds(S, (2, 8), t))["expert_reduction"] == pytest.approx(t)


def test_match_policy_checks_its_k_range(sample):
    for kw, match in [(dict(k_max=0), r"k_max=0: must be an int >= 1 or None"),
                      (dict(k_min=0), r"k_min=0: must be an int >= 1"),
                      (dict(k_max=2.5), r"k_max=2.5: must be an int"),
                      (dict(k_min=6, k_max=4), r"k_min=6 > k_max=4")]:
        for kind in ("TopP", "RatioSkip", "EntropyAdaptiveK"):
            with pytest.raises(ValueError, match=match):
                match_policy(sample, kind, 0.2, **kw)
    assert match_policy(sample, "TopP", 0.2, k_max=None) == match_policy(sample, "TopP", 0.2, k_max=2)


def test_calibration_arguments_of_the_wrong_type_are_named(sample):
    for target in ("0.2", None, True):
        with pytest.raises(ValueError, match=rf"target_reduction={target!r}: must be a number"):
            calibrate_thresholds(sample, (1, 2), target)
        with pytest.raises(ValueError, match=rf"target_reduction={target!r}: must be a number"):
            match_policy(sample, "TopP", target)
    with pytest.raises(ValueError, match=r"u='0.5': must be a number in \[0, 1\]"):
        thresholds_at(sample, (1, 2), "0.5")
    with pytest.raises(ValueError, match=r"k_values=8: must be a sequence of ints"):
        calibrate_thresholds(sample, 8, 0.2)
    with pytest.raises(ValueError, match=r"reduction of shape \(2,\), ppl of shape \(1,\)"):
        pareto_mask([0.1, 0.2], [1.0])
    with pytest.raises(ValueError, match=r"frame without columns \['kind', 'target_reduction'"):
        verdict(pd.DataFrame())
    with pytest.raises(ValueError, match=r"frame without columns \['k_max'\]"):
        verdict(_frame({"TopP": [1.0]}, topk=[(1, 0.5, 2.0)]).drop(columns="k_max"))
    # numpy scalars are numbers
    assert calibrate_thresholds(sample, np.array([1, 2]), np.float64(0.2)) == calibrate_thresholds(sample, (1, 2), 0.2)


def test_compare_at_matched_compute_takes_one_kind_as_a_string(model, sample):
    ev_ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(2))
    f = compare_at_matched_compute(model, sample, ev_ids, [0.25], (1, 2), 10.0, kinds="TopP", fixed_ks=[],
                                   context=CTX, stride=CTX, progress=False)
    assert f["kind"].tolist() == ["TopP"]




def test_ser_and_lu_median_are_ratio_skip_with_a_floor_and_median_betas(sample):
    pol = ser(2, 0.3, 4)
    assert pol == RatioSkip(0.3, 4, 2) and ser_label(pol) == "SER(2, 0.3)"
    lu = lu_median(sample)
    assert len(lu) == sample.num_layers and all(p.k_min == 1 and p.k_max == sample.native_k for p in lu)
    for p, probs in zip(lu, sample.top_probs):
        ratio = (probs[:, 1] / probs[:, 0]).double()
        assert p.beta == pytest.approx(float(ratio.median()), abs=2e-3)
    # on a top-2 model the median ratio drops the second expert of about half the tokens: a quarter saved
    assert sample.estimate(lu)["expert_reduction"] == pytest.approx(0.25, abs=0.01)


def test_layer_budgets_keep_one_total_spread_evenly_or_by_sensitivity(sample):
    even = layer_budget(sample, 0.3, 1, 2)
    reds = [1 - float(sample.k(p, i).float().mean()) / 2 for i, p in enumerate(even)]
    assert reds == pytest.approx([0.3, 0.3], abs=2e-3)
    spread = layer_budget(sample, 0.3, 1, 2, sensitivity=[1.0, 3.0])  # layer 1 three times as sensitive
    reds = [1 - float(sample.k(p, i).float().mean()) / 2 for i, p in enumerate(spread)]
    assert np.mean(reds) == pytest.approx(0.3, abs=2e-3) and reds[0] == pytest.approx(3 * reds[1], rel=0.02)
    clipped = layer_budget(sample, 0.3, 1, 2, sensitivity=[1.0, 100.0])  # layer 0 takes all it can: 50%
    reds = [1 - float(sample.k(p, i).float().mean()) / 2 for i, p in enumerate(clipped)]
    assert reds == pytest.approx([0.5, 0.1], abs=3e-3)
    with pytest.raises(ValueError, match=r"sensitivity of shape \(3,\): need one value per MoE layer \(2\)"):
        layer_budget(sample, 0.3, 1, 2, sensitivity=[1, 2, 3])


def test_layer_sensitivity_is_the_change_per_reduction_of_one_layer_alone(model, sample):
    ids = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(5))
    kw = dict(context=CTX, stride=CTX)
    sens = layer_sensitivity(model, sample, ids, 1, 2, probe=0.25, **kw)
    base = evaluate(model, None, ids, progress=False, **kw).summary["ppl"]
    for layer, s in enumerate(sens):
        pol = {layer: layer_budget(sample, 0.25, 1, 2)[layer]}
        ev = evaluate(model, pol, ids, baseline_ppl=base, progress=False, **kw)
        assert s == pytest.approx(ev.summary["ppl_change"] / ev.layers["expert_reduction"].iloc[0], rel=1e-9)


def test_matched_policies_name_their_kinds_and_reach_their_targets():
    net = tiny_random("mixtral", num_experts_per_tok=4, num_hidden_layers=2)
    for layer in moe_layers(net):
        torch.nn.init.normal_(layer.block.gate.weight, std=0.4)
    smp = router_sample(net, torch.randint(0, 256, (1024,), generator=torch.Generator().manual_seed(0)),
                        context=CTX, progress=False)
    jobs = matched_policies(smp, [0.25, 0.6], (1, 2, 4), MATCHED_KINDS, sensitivity=[1.0, 2.0])
    assert [(t, k) for t, k, _ in jobs] == [(0.25, k) for k in MATCHED_KINDS] + [
        (0.6, k) for k in MATCHED_KINDS if k != "SER"]  # SER keeps at least 2 of 4: 50% at most
    for t, kind, pol in jobs:
        assert smp.estimate(pol)["expert_reduction"] == pytest.approx(t, abs=0.01), kind
    assert jobs[3][2].k_min == 2 and jobs[3][2].k_max == 4
    assert not [k for _, k, _ in matched_policies(smp, [0.25], (2, 4), ["SER"])]  # its floor is the range's own
    with pytest.raises(ValueError, match=r"kinds \['Nope'\]: must be among"):
        matched_policies(smp, [0.25], (1, 2, 4), ["Nope"])
    with pytest.raises(ValueError, match=r"kind 'AllocBudget' needs sensitivity"):
        matched_policies(smp, [0.25], (1, 2, 4), ["AllocBudget"])


def _windows_frame(shifts, reductions=(0.1, 0.3), windows=40, seed=0):
    """Matched rows whose window NLLs are a common base plus a per-kind shift (nats per window) and small noise."""
    rng = np.random.default_rng(seed)
    base, tokens, rows = rng.normal(400, 40, windows), [80] * windows, []
    for kind, shift in shifts.items():
        for t in reductions:
            nll = base + shift * (1 + 10 * t) + rng.normal(0, 0.01, windows)
            rows.append({"kind": kind, "label": f"{kind} x", "target_reduction": t, "expert_reduction": t,
                         "ppl": float(np.exp(nll.sum() / sum(tokens))), "window_nll": nll.tolist(),
                         "window_tokens": tokens})
    return rows


def test_compare_rules_counts_a_win_only_where_the_interval_excludes_zero():
    rows = _windows_frame({"RatioSkip": 0.0, "EntropyAdaptiveK": 2.0, "TopP": 0.0})
    topk = _windows_frame({"TopK": 1.0}, reductions=(0.2,))[0]
    f = compare_rules(pd.DataFrame([*rows, {**topk, "label": "TopK k=1"}]), resamples=300, seed=2)
    at = f.set_index(["level", "a", "b"])
    win = at.loc[(0.3, "RatioSkip", "EntropyAdaptiveK")]
    assert win["win"] and win["ci_hi"] < 0 and win["diff"] == pytest.approx(np.exp(-2 * 4 / 80) - 1, rel=1e-3)
    assert win["verdict"].startswith("RatioSkip lower than EntropyAdaptiveK at 30%: -9.5")
    tie = f[(f["level"] == 0.3) & (f[["a", "b"]].apply(set, axis=1) == {"RatioSkip", "TopP"})].iloc[0]
    assert not tie["win"] and tie["ci_lo"] < 0 < tie["ci_hi"] and tie["verdict"].startswith("no difference between")
    # a point meets each curve at its own reduction: EntropyAdaptiveK interpolated halfway, +3 nats a window
    pt = f[(f["level"] == 0.2) & (f["a"] == "TopK k=1") & (f["b"] == "EntropyAdaptiveK")].iloc[0]
    assert pt["win"] and pt["diff"] == pytest.approx(np.exp(-3 / 80) - 1, rel=1e-2)
    assert set(f["level"]) == set(f["target"]) == {0.1, 0.2, 0.3}
    assert (f["resamples"] == 300).all() and (f["windows"] == 40).all()
    with pytest.raises(ValueError, match="frame without window_nll"):
        compare_rules(pd.DataFrame(rows).drop(columns="window_nll"))
