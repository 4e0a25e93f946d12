"""The claims under test and the paper table's protocol: every row measured with routing really changed.

The published configurations and the claimed numbers (`PUBLISHED`, `CLAIMS`, `PR_PPL_CLAIM`) are copied from the
claims, not measured; `paper_rows` measures one model's rows (baseline, patched native, published configurations,
thresholds calibrated to the claim and to a perplexity budget, other policies at matched compute) and
`paper_table` lays them out. Calibration itself is `moelab.calibrate`'s.
"""

from __future__ import annotations

import logging
import math
import time

import pandas as pd
import torch

from moelab.calibrate import (
    budget_search,
    calibrate_thresholds,
    check_budget,
    check_fixed_ks,
    check_k_values,
    compare_at_matched_compute,
    verdict,
)
from moelab.evaluate import SIXTEEN_BIT, evaluate, model_dtype, reference_ppl, router_sample, token_ids
from moelab.hf import moe_layers, native_policy
from moelab.models import check_ids, moe_info
from moelab.params import is_int, is_real
from moelab.routing import EntropyAdaptiveK

__all__ = ["PUBLISHED", "CLAIMS", "PR_PPL_CLAIM", "sdk_preset", "published_configs", "calibration_k_values",
           "lower_fixed_ks", "paper_rows", "paper_table", "vs_patched"]

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
    """k values to calibrate with, ending at the native k (so that u = 0 is the unchanged model).

    The family's published preset if it ends at native k (Qwen-MoE [1, 2, 4]), else the ladder
    {native/4, native/2, native} (Mixtral [1, 2], OLMoE [2, 4, 8]).
    """
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


def paper_rows(model, name: str, eval_ids: torch.Tensor, cal_ids: torch.Tensor, context: int = 2048,
               stride: int = 512, batch_size: int = 8, budget: float = 0.005, budget_steps: int = 6,
               targets=(0.1, 0.2, 0.3, 0.4), k_values=None, per_layer: bool = True, fixed_ks=None,
               progress: bool = True) -> dict:
    """Everything the paper table needs for one model, all measured with patched forwards.

    Sections (column `section`): baseline (unchanged model), patched-native (the model's own TopK through
    moelab: the patching noise floor), published (the configurations of the claims), claimed-target
    (thresholds calibrated on held-out text to the PR's claimed reduction), calibrated (largest reduction
    within `budget` on held-out text, shared and per-layer thresholds; the budget is against the unchanged model,
    in 16-bit against the patched native TopK: column cal_reference), matched (EntropyAdaptiveK, TopP,
    RatioSkip at the same compute, and lower fixed k). Perplexity is always on eval_ids; thresholds only
    ever see cal_ids, which must not be the evaluation text itself (refused where cal_ids equal eval_ids; a
    stream that overlaps it only in part is not detected). targets=() with fixed_ks=None skips the matched section.
    Rows with a perplexity have ppl_change (against the unchanged model) and ppl_change_vs_patched (against the
    patched-native row: the one to read in 16-bit, where the patch alone moves perplexity; `vs_patched`).
    Returns dict(rows: list of dicts, traces: DataFrame, verdict: str, sample: RouterSample).
    """
    info = moe_info(model)
    family, native_k, E = info["family"], info["native_k"], info["num_experts"]
    # every argument checked before the first (long) evaluation
    eval_ids, cal_ids = _stream(model, "eval_ids", eval_ids), _stream(model, "cal_ids", cal_ids)
    if eval_ids.shape == cal_ids.shape and torch.equal(eval_ids.cpu(), cal_ids.cpu()):
        raise ValueError(f"cal_ids: the same {cal_ids.numel()} tokens as eval_ids; calibrate on held-out text "
                         "(calibration_ids), never on the evaluation text")
    check_budget(budget, budget_steps)
    bad = [t for t in targets if not is_real(t) or not 0 < t < 1]
    if bad:
        raise ValueError(f"targets={list(targets)}: {bad} not in (0, 1) (routed-expert reductions against native k)")
    if fixed_ks is not None:
        fixed_ks = check_fixed_ks(fixed_ks, E, f"num_experts={E}")
    if k_values:
        k_values = check_k_values(k_values, E, "num_experts")
    kw = dict(context=context, stride=stride, batch_size=batch_size)
    claims = CLAIMS.get(family, {})
    rows, traces = [], []

    def add(section, ev_summary, t0, **extra):
        rows.append({"model": name, "family": family, "section": section, **ev_summary, **extra,
                     "wall_s": time.perf_counter() - t0, **claims})

    def measure(pol) -> dict:  # on the evaluation text, against the unchanged model
        return evaluate(model, pol, eval_ids, baseline_ppl=base_ppl, progress=False, **kw).summary

    t0 = time.perf_counter()
    base = evaluate(model, None, eval_ids, progress=progress, **kw).summary
    base_ppl = base["ppl"]
    add("baseline", {**base, "ppl_base": base_ppl, "ppl_change": 0.0}, t0, config="native (unpatched)")
    t0 = time.perf_counter()
    s = measure([native_policy(layer) for layer in moe_layers(model)])
    add("patched-native", s, t0, config=f"TopK k={native_k} via moelab")
    if s["dtype"] in SIXTEEN_BIT:
        log.warning("%s in %s: the patch alone moves perplexity by %+.2e (the model's own TopK through moelab "
                    "against the unchanged model); ppl_change carries that bias, ppl_change_vs_patched does not "
                    "(or run in float32)", name, s["dtype"], s["ppl_change"])
    for cname, pol in published_configs(family, E).items():
        t0 = time.perf_counter()
        add("published", measure(pol), t0, config=cname)

    t0 = time.perf_counter()
    kv = tuple(k_values) if k_values else calibration_k_values(family, native_k)
    k_cap = min(E, max(kv[-1], 16, *(fixed_ks or ())))  # every k asked for fits the sample
    sample = router_sample(model, cal_ids, context=context, batch_size=batch_size, k_cap=k_cap, progress=False)
    log.info("%s: router sample of %d held-out tokens (%d in no whole chunk of %d left out) in %.1fs", name,
             sample.num_tokens, sample.unused_tokens, sample.context, time.perf_counter() - t0)
    lo_r, hi_r = 1 - kv[-1] / native_k, 1 - kv[0] / native_k
    if claims:
        r = claims["pr_reduction"]
        if lo_r <= r <= hi_r:
            t0 = time.perf_counter()
            s = measure(calibrate_thresholds(sample, kv, r))
            add("claimed-target", s, t0, config=f"calibrated to claimed {r:.1%}", target_reduction=r)
        else:
            rows.append({"model": name, "family": family, "section": "claimed-target", "native_k": native_k,
                         "dtype": model_dtype(model),
                         "config": f"claimed {r:.1%} unreachable: k >= {kv[0]} gives at most {hi_r:.1%}",
                         "target_reduction": r, **claims})
    cal_red = []
    ref = reference_ppl(model, cal_ids, **kw)  # once for both searches; in 16-bit not charging the patch's own change
    cal_base, cal_ref = ref["ppl"], ref["reference"]
    for pl in (False, True) if per_layer else (False,):
        t0 = time.perf_counter()
        res = budget_search(model, sample, cal_ids, kv, budget=budget, per_layer=pl, steps=budget_steps,
                            baseline_ppl=cal_base, progress=False, **kw)
        traces.append(res["trace"].assign(model=name, per_layer=pl))
        add("calibrated", measure(res["policy"]), t0,
            config=f"{'per-layer' if pl else 'shared'} thresholds, budget {budget:+.1%}",
            cal_ppl_change=res["ppl_change"], cal_within_budget=res["within_budget"], cal_reference=cal_ref,
            target_reduction=res["target_reduction"])
        cal_red.append(res["target_reduction"])
    t0 = time.perf_counter()
    matched = pd.DataFrame()
    if targets or fixed_ks:  # matched compute: the targets plus the calibrated reductions
        wanted = [*targets, *cal_red] if targets else []
        tg = sorted({round(float(t), 4) for t in wanted if lo_r <= t <= hi_r and t > 0})
        out = [t for t in targets if not lo_r <= t <= hi_r]
        if out:
            log.warning("%s: targets %s left out: k_values %s reach only [%.3f, %.3f]", name, out, list(kv),
                        lo_r, hi_r)
        if fixed_ks is None:
            fixed_ks = lower_fixed_ks(native_k)
        matched = compare_at_matched_compute(model, sample, eval_ids, tg, kv, base_ppl, fixed_ks=fixed_ks,
                                             progress=progress, **kw)
        for rec in matched.to_dict("records"):
            rows.append({"model": name, "family": family, "section": "matched", "config": rec["label"], **rec,
                         **claims})
        rows[-1]["wall_s"] = time.perf_counter() - t0  # the whole matched block
    return {"rows": vs_patched(rows), "traces": pd.concat(traces, ignore_index=True) if traces else pd.DataFrame(),
            "verdict": verdict(matched) if len(matched) else "", "sample": sample}


def vs_patched(rows) -> list[dict]:
    """The rows with ppl_change_vs_patched: perplexity against the same model's patched-native row (its own TopK
    through moelab), so that the patch's own bias (16-bit router ties, fp32 expert sums) cancels; None where a
    row has no perplexity or its model no patched-native row. Also fills the column in results written before it."""
    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else [dict(r) for r in rows]
    nat = {r["model"]: r["ppl"] for r in rows
           if r.get("section") == "patched-native" and is_real(r.get("ppl")) and math.isfinite(r["ppl"])}
    for r in rows:
        ppl, ref = r.get("ppl"), nat.get(r.get("model"))
        ok = is_real(ppl) and math.isfinite(ppl) and ref is not None
        r["ppl_change_vs_patched"] = ppl / ref - 1.0 if ok else None
    return rows


def paper_table(rows) -> pd.DataFrame:
    """The paper's table: model, config, native k, mean k, compute %, ppl base -> policy, change % (against the
    unchanged model), vs patched % (against the patched native TopK: the one to read in 16-bit), claims."""
    f = pd.DataFrame(vs_patched(rows))
    f = f[f["section"].isin(["baseline", "patched-native", "published", "claimed-target", "calibrated"])]
    return pd.DataFrame({
        "model": f["model"], "config": f["config"], "native k": f["native_k"], "mean k": f.get("mean_k"),
        "compute %": 100 * (1 - f.get("expert_reduction")), "fwd compute %": 100 * (1 - f.get("forward_reduction")),
        "ppl base": f.get("ppl_base"), "ppl": f.get("ppl"), "change %": 100 * f.get("ppl_change"),
        "vs patched %": 100 * f["ppl_change_vs_patched"].astype(float),
        "claimed": f.get("claimed_model"), "claimed compute %": 100 * f.get("paper_compute"),
        "claimed mean k": f.get("paper_mean_k"),
        "claimed change %": 100 * (f.get("paper_ppl_adaptive") / f.get("paper_ppl_base") - 1),
    }).reset_index(drop=True)
