"""The claims under test (`PUBLISHED`, `CLAIMS`, `PR_PPL_CLAIM`: copied, not measured) and the paper table's
protocol: `paper_rows` measures one model's rows with routing really changed, `paper_table` lays them out.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pandas as pd
import torch

from moelab.calibrate import (
    MATCHED_KINDS,
    budget_search,
    calibrate_thresholds,
    check_budget,
    check_fixed_ks,
    check_k_values,
    compare_rules,
    layer_sensitivity,
    lu_median,
    matched_policies,
    ser_label,
    verdict,
)
from moelab.evaluate import (
    SIXTEEN_BIT,
    bootstrap_ppl,
    evaluate_many,
    interval,
    model_dtype,
    reference_ppl,
    router_sample,
    token_ids,
)
from moelab.hf import moe_layers, native_policy
from moelab.models import check_ids, moe_info
from moelab.params import is_int, is_real
from moelab.routing import EntropyAdaptiveK, TopK

log = logging.getLogger(__name__)

# name -> (k_values, thresholds in nats)
PUBLISHED = {
    "trtllm-default": ((2, 5, 8), (1.3, 1.7)),
    "sdk-mixtral": ((1, 2, 4), (0.6, 1.2)),
    "sdk-qwen-moe": ((1, 2, 4), (0.5, 1.0)),
    "sdk-olmoe": ((1, 2, 4), (0.7, 1.3)),
    "qwen1.5-measured": ((2, 3, 4), (3.55, 3.79)),
}
# the PR's stated bound on the perplexity change of its configurations (its text; the paper's table is below)
PR_PPL_CLAIM = 0.005
# family -> what was claimed for the real model of that family
CLAIMS = {
    "mixtral": {"claimed_model": "Mixtral 8x7B", "pr_reduction": 0.525, "paper_native_k": 2, "paper_mean_k": 0.95,
                "paper_compute": 0.475, "paper_ppl_base": 3.84, "paper_ppl_adaptive": 3.87},
    "qwen2_moe": {"claimed_model": "Qwen-MoE", "pr_reduction": 0.324, "paper_native_k": 4, "paper_mean_k": 2.71,
                  "paper_compute": 0.676, "paper_ppl_base": 8.12, "paper_ppl_adaptive": 8.19},
    "olmoe": {"claimed_model": "OLMoE-1B-7B", "pr_reduction": 0.247, "paper_native_k": 8, "paper_mean_k": 6.02,
              "paper_compute": 0.753, "paper_ppl_base": 10.45, "paper_ppl_adaptive": 10.51},
}
_FAMILY_PRESETS = {"mixtral": ("sdk-mixtral",), "qwen2_moe": ("sdk-qwen-moe", "qwen1.5-measured"),
                   "olmoe": ("sdk-olmoe",)}


def sdk_preset(family: str) -> str:
    """The name in PUBLISHED of the SDK preset for a family; the TensorRT-LLM default for other families."""
    return _FAMILY_PRESETS.get(family, ("trtllm-default",))[0]


def published_configs(family: str, num_experts: int) -> dict[str, EntropyAdaptiveK]:
    """The published configurations that apply to a family: the TensorRT-LLM default and its presets."""
    out = {}
    for name in ("trtllm-default", *_FAMILY_PRESETS.get(family, ())):
        kv, th = PUBLISHED[name]
        if kv[-1] <= num_experts:
            out[name] = EntropyAdaptiveK(kv, th)
    return out


def calibration_k_values(family: str, native_k: int) -> tuple[int, ...]:
    """k values to calibrate with, ending at the native k (u = 0 is the unchanged model): the family's preset if it
    ends there, else {native/4, native/2, native}."""
    if not is_int(native_k) or native_k < 1:
        raise ValueError(f"native_k={native_k!r}: must be an int >= 1 (the model's top-k)")
    preset = _FAMILY_PRESETS.get(family, (None,))[0]
    if preset and PUBLISHED[preset][0][-1] == native_k:
        return PUBLISHED[preset][0]
    ladder = sorted({max(1, native_k // 4), max(1, native_k // 2), native_k})
    if len(ladder) < 2:
        raise ValueError(f"native_k={native_k}: no lower k to adapt to; pass k_values explicitly")
    return tuple(ladder)


def lower_fixed_ks(native_k: int) -> list[int]:
    """The lower fixed k the paper tables compare against: 1, native/2 and 3*native/4 where below native."""
    return sorted({k for k in (1, native_k // 2, (3 * native_k) // 4) if 1 <= k < native_k})


def _stream(model, name: str, ids) -> torch.Tensor:
    """ids as one stream of >= 2 token ids inside the model's vocabulary; errors name the argument."""
    try:
        ids = check_ids(model, token_ids(None, ids))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    if ids.numel() < 2:
        raise ValueError(f"{name} of {ids.numel()} tokens: need at least 2 to score one")
    return ids


EVAL_NAME = "wikitext2"  # the `text` of rows measured on the evaluation text (WikiText-2 test)


def paper_rows(model, name: str, eval_ids: torch.Tensor, cal_ids: torch.Tensor, context: int = 2048,
               stride: int = 512, batch_size: int = 8, budget: float = 0.005, budget_steps: int = 6,
               targets=(0.1, 0.2, 0.3, 0.4), k_values=None, per_layer: bool = True, fixed_ks=None,
               progress: bool = True, domains: dict | None = None, margins=(0.5,), kinds=MATCHED_KINDS,
               resamples: int = 2000, bootstrap_seed: int = 0, train_seed: int | None = None) -> dict:
    """Everything the paper table needs for one model, measured with patched forwards.

    Sections: baseline, patched-native (the model's own TopK through moelab: the patching noise floor), published,
    claimed-target (calibrated to the claimed reduction), calibrated (largest reduction within `budget` and within
    budget * each margin, shared and per-layer), matched (`kinds` at matched compute, lower fixed k, Lu et al.'s
    median). Thresholds see only cal_ids (refused where equal to eval_ids). Every policy runs on eval_ids in one
    pass, all but the published and claimed ones also on each of `domains`; rows carry window_nll and the
    `vs_patched` intervals. Returns dict(rows, traces, verdict, comparisons, sample).
    """
    info = moe_info(model)
    family, native_k, E = info["family"], info["native_k"], info["num_experts"]
    # every argument checked before the first evaluation
    eval_ids, cal_ids = _stream(model, "eval_ids", eval_ids), _stream(model, "cal_ids", cal_ids)
    if eval_ids.shape == cal_ids.shape and torch.equal(eval_ids.cpu(), cal_ids.cpu()):
        raise ValueError(f"cal_ids: the same {cal_ids.numel()} tokens as eval_ids; calibrate on held-out text "
                         "(calibration_ids), never on the evaluation text")
    texts = {EVAL_NAME: eval_ids, **{d: _stream(model, f"domains[{d!r}]", ids) for d, ids in (domains or {}).items()}}
    check_budget(budget, budget_steps)
    bad = [t for t in targets if not is_real(t) or not 0 < t < 1]
    if bad:
        raise ValueError(f"targets={list(targets)}: {bad} not in (0, 1) (routed-expert reductions against native k)")
    bad = [m for m in margins if not is_real(m) or not 0 < m < 1]
    if bad:
        raise ValueError(f"margins={list(margins)}: {bad} not in (0, 1) (fractions of the budget to calibrate to)")
    if fixed_ks is not None:
        fixed_ks = check_fixed_ks(fixed_ks, E, f"num_experts={E}")
    if k_values:
        k_values = check_k_values(k_values, E, "num_experts")
    kw = dict(context=context, stride=stride, batch_size=batch_size)
    claims = CLAIMS.get(family, {})
    jobs, traces, t_all = [], [], time.perf_counter()  # jobs: (policy, on every text?, row fields)

    jobs.append((None, True, dict(section="baseline", config="native (unpatched)")))
    jobs.append(([native_policy(layer) for layer in moe_layers(model)], True,
                 dict(section="patched-native", config=f"TopK k={native_k} via moelab")))
    jobs += [(pol, False, dict(section="published", config=c)) for c, pol in published_configs(family, E).items()]
    kv = tuple(k_values) if k_values else calibration_k_values(family, native_k)
    k_cap = min(E, max(kv[-1], 16, *(fixed_ks or ())))  # every k asked for fits the sample
    sample = router_sample(model, cal_ids, context=context, batch_size=batch_size, k_cap=k_cap, progress=False)
    log.info("%s: router sample of %d held-out tokens (%d in no whole chunk of %d left out)", name,
             sample.num_tokens, sample.unused_tokens, sample.context)
    lo_r, hi_r = 1 - kv[-1] / native_k, 1 - kv[0] / native_k
    unreachable = None
    if claims:
        r = claims["pr_reduction"]
        if lo_r <= r <= hi_r:
            jobs.append((calibrate_thresholds(sample, kv, r), False,
                         dict(section="claimed-target", config=f"calibrated to claimed {r:.1%}", target_reduction=r)))
        else:
            unreachable = {"model": name, "family": family, "text": EVAL_NAME, "section": "claimed-target",
                           "native_k": native_k, "dtype": model_dtype(model), "train_seed": train_seed,
                           "config": f"claimed {r:.1%} unreachable: k >= {kv[0]} gives at most {hi_r:.1%}",
                           "target_reduction": r, **claims}
    cal_red = []
    ref = reference_ppl(model, cal_ids, **kw)  # once for every search
    cal_base, cal_ref = ref["ppl"], ref["reference"]
    for b in [budget, *(budget * m for m in margins)]:
        for pl in (False, True) if per_layer else (False,):
            res = budget_search(model, sample, cal_ids, kv, budget=b, per_layer=pl, steps=budget_steps,
                                baseline_ppl=cal_base, progress=False, **kw)
            traces.append(res["trace"].assign(model=name, per_layer=pl, budget=b))
            jobs.append((res["policy"], True, dict(
                section="calibrated", config=f"{'per-layer' if pl else 'shared'} thresholds, budget {100 * b:+.2g}%",
                budget=b, margin=b / budget,
                cal_ppl_change=res["ppl_change"], cal_within_budget=res["within_budget"], cal_reference=cal_ref,
                target_reduction=res["target_reduction"])))
            if b == budget:
                cal_red.append(res["target_reduction"])
    if targets or fixed_ks:  # matched compute: the targets plus the calibrated reductions
        tg = sorted({round(float(t), 4) for t in [*targets, *(cal_red if targets else [])]
                     if lo_r <= t <= hi_r and t > 0})
        out = [t for t in targets if not lo_r <= t <= hi_r]
        if out:
            log.warning("%s: targets %s left out: k_values %s reach only [%.3f, %.3f]", name, out, list(kv),
                        lo_r, hi_r)
        sens = (layer_sensitivity(model, sample, cal_ids, kv[0], kv[-1], baseline_ppl=cal_base, **kw)
                if "AllocBudget" in kinds and tg else None)
        on_all = {round(float(t), 4) for t in targets}
        for t, kind, pol in matched_policies(sample, tg, kv, kinds, sensitivity=sens):
            jobs.append((pol, t in on_all, dict(section="matched", config=ser_label(pol) if kind == "SER" else None,
                                                kind=kind, target_reduction=t)))
        points = [(TopK(k), "TopK", 1 - k / native_k) for k in (lower_fixed_ks(native_k) if fixed_ks is None
                                                                  else fixed_ks)]
        if targets:
            lu = lu_median(sample, kv[0], kv[-1])
            points.append((lu, "LuMedian", sample.estimate(lu)["expert_reduction"]))
        jobs += [(pol, True, dict(section="matched", config=None if kind == "TopK" else "Lu et al. median ratio",
                                  kind=kind, target_reduction=t)) for pol, kind, t in points]
        if sens is not None:
            log.info("%s: layer sensitivity (ppl change per unit reduction) %s", name, [f"{x:.3g}" for x in sens])
    t_cal = time.perf_counter() - t_all

    rows = []
    for text, ids in texts.items():
        t0 = time.perf_counter()
        run = [(pol, fields) for pol, everywhere, fields in jobs if text == EVAL_NAME or everywhere]
        evs = evaluate_many(model, [pol for pol, _ in run], ids, kl=True, progress=progress, **kw)
        text_rows = []
        for (pol, fields), ev in zip(run, evs):
            est = {"est_expert_reduction": sample.estimate(pol)["expert_reduction"]} if pol is not None else {}
            text_rows.append({"model": name, "family": family, "text": text, "text_tokens": int(ids.numel()),
                         **ev.summary, **est, **{k: v for k, v in fields.items() if v is not None},
                         "config": fields.get("config") or ev.summary["label"], "train_seed": train_seed,
                         "window_nll": [round(x, 2) for x in ev.window_nll], "window_tokens": ev.window_tokens,
                         **claims})
        text_rows[0]["wall_s"] = time.perf_counter() - t0  # the text's whole pass, on its baseline row
        if text == EVAL_NAME and unreachable:  # where a reachable claim's row would stand
            at = next((i for i, r in enumerate(text_rows) if r["section"] == "calibrated"), len(text_rows))
            text_rows.insert(at, unreachable)
        rows += text_rows
    rows[0]["cal_wall_s"] = t_cal
    rows = vs_patched(rows, resamples, bootstrap_seed)
    nat = next(r for r in rows if r["section"] == "patched-native")
    if nat["dtype"] in SIXTEEN_BIT:
        log.warning("%s in %s: the patch alone moves perplexity by %+.2e (the model's own TopK through moelab "
                    "against the unchanged model); ppl_change carries that bias, ppl_change_vs_patched does not "
                    "(or run in float32)", name, nat["dtype"], nat["ppl_change"])
    matched = pd.DataFrame([r for r in rows if r["section"] == "matched"])
    parts = [compare_rules(g, resamples, bootstrap_seed).assign(model=name, text=text, train_seed=train_seed)
             for text, g in matched.groupby("text", sort=False) if len(g["window_tokens"].iloc[0]) > 1] \
        if len(matched) else []
    comparisons = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    main = matched[matched["text"] == EVAL_NAME] if len(matched) else matched
    return {"rows": rows, "traces": pd.concat(traces, ignore_index=True) if traces else pd.DataFrame(),
            "verdict": verdict(main) if len(main) else "", "comparisons": comparisons, "sample": sample}


def vs_patched(rows, resamples: int = 2000, seed: int = 0) -> list[dict]:
    """The rows with ppl_change_vs_patched (against the same model's patched-native row on the same text, so the
    patch's own bias cancels) and, where rows carry window_nll, paired bootstrap intervals of ppl_change and
    ppl_change_vs_patched (ci_lo, ci_hi, ci_lo_vs_patched, ci_hi_vs_patched). Rows without `text` are on EVAL_NAME."""
    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else [dict(r) for r in rows]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.get("model"), r.get("text") or EVAL_NAME), []).append(r)
    ok = lambda r: is_real(r.get("ppl")) and math.isfinite(r["ppl"])  # noqa: E731
    for group in groups.values():
        refs = {sec: next((r for r in group if r.get("section") == sec and ok(r)), None)
                for sec in ("baseline", "patched-native")}
        base, nat = refs["baseline"], refs["patched-native"]
        for r in group:
            r["ppl_change_vs_patched"] = r["ppl"] / nat["ppl"] - 1.0 if ok(r) and nat else None
            if ok(r) and base:
                r.update(ppl_base=base["ppl"], ppl_change=r["ppl"] / base["ppl"] - 1.0)
        have = [r for r in group if ok(r) and isinstance(r.get("window_nll"), list)]
        if len(have and have[0]["window_tokens"]) < 2:  # no interval from fewer than two windows
            continue
        ppl_BR = bootstrap_ppl([r["window_nll"] for r in have], have[0]["window_tokens"], resamples, seed)
        at = {id(r): j for j, r in enumerate(have)}
        for r in have:
            for ref, suffix in ((base, ""), (nat, "_vs_patched")):
                if ref is not None and id(ref) in at:
                    change, lo, hi = interval(ppl_BR[:, at[id(r)]], ppl_BR[:, at[id(ref)]], r["ppl"], ref["ppl"])
                    r.update({f"ppl_change{suffix}": change, f"ci_lo{suffix}": lo, f"ci_hi{suffix}": hi})
            r.update(windows=len(r["window_tokens"]), resamples=resamples, bootstrap_seed=seed)
    return rows


def paper_table(rows, resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """The paper's table on the evaluation text: compute, perplexity change with its interval, vs patched % (the
    one to read in 16-bit), KL, top-1 agreement, and the claims beside them."""
    f = pd.DataFrame(vs_patched(rows, resamples, seed))
    f = f[f.get("text", pd.Series(EVAL_NAME, index=f.index)).fillna(EVAL_NAME) == EVAL_NAME]
    f = f[f["section"].isin(["baseline", "patched-native", "published", "claimed-target", "calibrated"])]
    num = lambda c: f[c].astype(float) if c in f else pd.Series(np.nan, index=f.index)  # noqa: E731
    return pd.DataFrame({
        "model": f["model"], "config": f["config"], "native k": f["native_k"], "mean k": f.get("mean_k"),
        "compute %": 100 * (1 - f.get("expert_reduction")), "fwd compute %": 100 * (1 - f.get("forward_reduction")),
        "ppl base": f.get("ppl_base"), "ppl": f.get("ppl"), "change %": 100 * f.get("ppl_change"),
        "ci lo %": 100 * num("ci_lo"), "ci hi %": 100 * num("ci_hi"),
        "vs patched %": 100 * f["ppl_change_vs_patched"].astype(float), "KL": num("kl"),
        "top-1 %": 100 * num("top1_agree"),
        "claimed": f.get("claimed_model"), "claimed compute %": 100 * f.get("paper_compute"),
        "claimed mean k": f.get("paper_mean_k"),
        "claimed change %": 100 * (f.get("paper_ppl_adaptive") / f.get("paper_ppl_base") - 1),
    }).reset_index(drop=True)
