"""Thresholds for a compute target or a perplexity budget, and policies compared at matched compute.

Calibration always uses held-out text (`calibration_ids`: equal shares of every corpus's held-out
slice from moelab.data.heldout_texts()), never the evaluation set (WikiText-2 test).

Threshold family: for k_values of length m, one knob u in [0, 1] puts the m-1 thresholds at the
entropy quantiles u^((m-1-j)/(m-1)), j = 0..m-2 (ascending). u = 0: every token keeps k_max;
u = 1: every token keeps k_min; mean k falls monotonically in between, so bisection on u reaches a
target compute reduction. Shared thresholds use the quantiles of all layers pooled; per-layer
thresholds use each layer's own quantiles (every layer then keeps the same k fractions).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from moelab.evaluate import RouterSample, estimate, evaluate, policy_label
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP

__all__ = [
    "calibration_ids",
    "thresholds_at",
    "calibrate_thresholds",
    "match_policy",
    "budget_search",
    "compare_at_matched_compute",
    "pareto_mask",
    "verdict",
    "PUBLISHED",
    "CLAIMS",
    "published_configs",
]

log = logging.getLogger(__name__)


def calibration_ids(tokenizer, max_tokens: int, names=None) -> torch.Tensor:
    """Token ids of held-out text for calibration: an equal share of each held-out slice, concatenated."""
    from moelab.data import heldout_texts

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens!r}: must be an int >= 2")
    texts = heldout_texts()
    names = list(names or texts)
    bad = [n for n in names if n not in texts]
    if bad:
        raise ValueError(f"calibration texts {bad}: unknown; choose from {sorted(texts)}")
    share = max(2, max_tokens // len(names))
    parts = []
    for n in names:
        ids = tokenizer(texts[n], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        parts.append(torch.tensor(ids[:share], dtype=torch.long))
    return torch.cat(parts)[:max_tokens]


def _levels(u: float, m: int) -> list[float]:
    return [u ** ((m - 1 - j) / (m - 1)) for j in range(m - 1)]


def _strict(ths: list[float]) -> tuple[float, ...]:
    """Make quantile thresholds strictly ascending (ties from repeated entropies) by the smallest nudge."""
    out = []
    for t in ths:
        t = float(t)
        if out and t <= out[-1]:
            t = math.nextafter(out[-1], math.inf)
        out.append(t)
    return tuple(out)


def _check_k_values(k_values, sample: RouterSample) -> tuple[int, ...]:
    kv = tuple(int(k) for k in k_values)
    if len(kv) < 2:
        raise ValueError(f"k_values={list(kv)}: need at least two k values to calibrate thresholds")
    if kv[-1] > sample.k_cap:
        raise ValueError(f"k_values={list(kv)}: k_max exceeds the sample's k_cap={sample.k_cap}")
    return kv


def thresholds_at(sample: RouterSample, k_values, u: float, per_layer: bool = False):
    """EntropyAdaptiveK (shared) or a per-layer list of them with thresholds at the family's quantiles."""
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"u={u}: must be in [0, 1]")
    kv = _check_k_values(k_values, sample)
    q = torch.tensor(_levels(u, len(kv)), dtype=torch.float64)

    def make(ent_T):
        ths = torch.quantile(ent_T.double(), q).tolist()
        # u = 0 / 1: move the thresholds past every token so that all keep k_max / k_min
        ths = [t - 1e-6 if lv == 0 else (t + 1e-6 if lv == 1 else t) for t, lv in zip(ths, q.tolist())]
        return EntropyAdaptiveK(kv, _strict(ths), renormalize=None)

    if per_layer:
        return [make(e) for e in sample.entropy]
    return make(sample.entropy_all())


def _bisect(f, lo: float, hi: float, target: float, increasing: bool, iters: int = 40) -> float:
    """x in [lo, hi] with f(x) ~ target for a monotone f."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate_thresholds(sample: RouterSample, k_values, target_reduction: float, per_layer: bool = False):
    """Thresholds whose estimated routed-expert reduction on the sample reaches target_reduction."""
    kv = _check_k_values(k_values, sample)
    native = sample.native_k
    lo_r, hi_r = 1 - kv[-1] / native, 1 - kv[0] / native
    if not lo_r <= target_reduction <= hi_r:
        raise ValueError(
            f"target_reduction={target_reduction}: k_values={list(kv)} on native k={native} reach only "
            f"[{lo_r:.3f}, {hi_r:.3f}]"
        )
    red = lambda u: estimate(sample, thresholds_at(sample, kv, u, per_layer))["expert_reduction"]  # noqa: E731
    u = _bisect(red, 0.0, 1.0, target_reduction, increasing=True, iters=30)
    return thresholds_at(sample, kv, u, per_layer)


def match_policy(sample: RouterSample, kind: str, target_reduction: float, k_min: int = 1, k_max: int | None = None,
                 k_values=None, per_layer: bool = False) -> Policy:
    """A policy of a kind ('EntropyAdaptiveK', 'TopP', 'RatioSkip') whose estimated reduction hits the target."""
    k_max = k_max or sample.native_k
    if kind == "EntropyAdaptiveK":
        return calibrate_thresholds(sample, k_values or (k_min, sample.native_k, k_max), target_reduction, per_layer)
    lo_r, hi_r = 1 - k_max / sample.native_k, 1 - k_min / sample.native_k
    if not lo_r <= target_reduction <= hi_r:
        raise ValueError(f"target_reduction={target_reduction}: k in [{k_min}, {k_max}] reaches only "
                         f"[{lo_r:.3f}, {hi_r:.3f}] on native k={sample.native_k}")
    if kind == "TopP":  # larger p keeps more experts: reduction falls
        red = lambda p: estimate(sample, TopP(max(p, 1e-9), k_max, k_min))["expert_reduction"]  # noqa: E731
        p = _bisect(red, 0.0, 1.0, target_reduction, increasing=False)
        return TopP(float(min(max(p, 1e-9), 1.0)), k_max, k_min)
    if kind == "RatioSkip":  # larger beta drops more experts: reduction rises
        red = lambda b: estimate(sample, RatioSkip(b, k_max, k_min))["expert_reduction"]  # noqa: E731
        b = _bisect(red, 0.0, 1.0, target_reduction, increasing=True)
        return RatioSkip(float(b), k_max, k_min)
    raise ValueError(f"kind={kind!r}: must be 'EntropyAdaptiveK', 'TopP' or 'RatioSkip'")


def budget_search(
    model,
    sample: RouterSample,
    cal_ids: torch.Tensor,
    k_values,
    budget: float = 0.005,
    per_layer: bool = False,
    baseline_ppl: float | None = None,
    steps: int = 6,
    progress: bool = True,
    **eval_kw,
) -> dict:
    """Largest routed-expert reduction whose measured perplexity on calibration text stays within budget.

    Bisection over the target reduction in [max(0, lowest reachable), highest reachable], each step a
    patched perplexity on cal_ids (held-out text). Returns dict(policy, target_reduction, ppl,
    ppl_change, within_budget, trace: DataFrame of every step).
    """
    if not budget > 0:
        raise ValueError(f"budget={budget}: must be > 0 (relative perplexity increase, e.g. 0.005)")
    kv = _check_k_values(k_values, sample)
    if baseline_ppl is None:
        baseline_ppl = evaluate(model, None, cal_ids, progress=False, **eval_kw).summary["ppl"]
    lo, hi = max(0.0, 1 - kv[-1] / sample.native_k), 1 - kv[0] / sample.native_k
    trace = []

    def measure(r):
        pol = calibrate_thresholds(sample, kv, r, per_layer)
        s = evaluate(model, pol, cal_ids, baseline_ppl=baseline_ppl, progress=False, **eval_kw).summary
        trace.append({"target_reduction": r, "label": policy_label(pol), "expert_reduction": s["expert_reduction"],
                      "ppl": s["ppl"], "ppl_change": s["ppl_change"], "within": s["ppl_change"] <= budget})
        return pol, s

    best = None
    bar = tqdm(total=steps + 2, desc="budget search", disable=not progress)
    pol, s = measure(hi)
    bar.update()
    if s["ppl_change"] <= budget:
        best = (hi, pol, s)
    else:
        pol, s = measure(lo)
        bar.update()
        if s["ppl_change"] <= budget:
            best = (lo, pol, s)
            for _ in range(steps):
                mid = (lo + hi) / 2
                pol, s = measure(mid)
                bar.update()
                if s["ppl_change"] <= budget:
                    lo, best = mid, (mid, pol, s)
                else:
                    hi = mid
    bar.close()
    if best is None:  # even the least reduction breaks the budget: report it, flagged
        log.warning("budget %.4f: no reduction >= %.3f stays within it on the calibration text", budget, lo)
        best = (lo, pol, s)
    r, pol, s = best
    return {"policy": pol, "target_reduction": r, "expert_reduction": s["expert_reduction"], "ppl": s["ppl"],
            "ppl_base": baseline_ppl, "ppl_change": s["ppl_change"], "within_budget": s["ppl_change"] <= budget,
            "trace": pd.DataFrame(trace)}


def compare_at_matched_compute(
    model,
    sample: RouterSample,
    eval_ids: torch.Tensor,
    targets,
    k_values,
    baseline_ppl: float,
    kinds=("EntropyAdaptiveK", "TopP", "RatioSkip"),
    fixed_ks=None,
    per_layer: bool = False,
    progress: bool = True,
    **eval_kw,
) -> pd.DataFrame:
    """Measured perplexity vs compute for each policy kind matched (on the sample) to each target reduction.

    TopP and RatioSkip get the same k range as the entropy policy's k_values; lower fixed k (TopK with k
    below native) gives points of its own. Rows: measured evaluations plus target and matched-on columns.
    """
    kv = tuple(int(k) for k in k_values)
    k_min, k_max = kv[0], kv[-1]
    fixed_ks = list(range(max(1, k_min), sample.native_k)) if fixed_ks is None else list(fixed_ks)
    jobs = []
    for t in targets:
        for kind in kinds:
            pol = match_policy(sample, kind, float(t), k_min=k_min, k_max=k_max, k_values=kv, per_layer=per_layer)
            jobs.append((float(t), kind, pol))
    for k in fixed_ks:
        jobs.append((1 - k / sample.native_k, "TopK", TopK(int(k))))
    rows = []
    for t, kind, pol in tqdm(jobs, desc="matched compute", disable=not progress):
        est = estimate(sample, pol)
        s = evaluate(model, pol, eval_ids, baseline_ppl=baseline_ppl, progress=False, **eval_kw).summary
        rows.append({**s, "kind": kind, "target_reduction": t, "est_expert_reduction": est["expert_reduction"]})
    return pd.DataFrame(rows)


def pareto_mask(reduction, ppl) -> np.ndarray:
    """True where no other point has at least the reduction and at most the perplexity (one strictly)."""
    r, p = np.asarray(reduction, float), np.asarray(ppl, float)
    out = np.ones(len(r), dtype=bool)
    for i in range(len(r)):
        dominated = (r >= r[i]) & (p <= p[i]) & ((r > r[i]) | (p < p[i]))
        out[i] = not dominated.any()
    return out


def verdict(frame: pd.DataFrame, kinds=("EntropyAdaptiveK", "TopP", "RatioSkip"), tol: float = 0.02) -> str:
    """Plain statement of which signal had the lowest perplexity at matched compute, target by target.

    Each kind's perplexity is interpolated at each target reduction along its own measured curve
    (measured reductions differ slightly from the targets they were matched to; up to `tol` beyond a
    curve's ends its end point stands in). Lower fixed k points are compared the same way.
    """
    f = frame[frame["kind"].isin(kinds)]
    curves = {}
    for kind, g in f.groupby("kind"):
        g = g.sort_values("expert_reduction")
        curves[kind] = (g["expert_reduction"].to_numpy(float), g["ppl"].to_numpy(float))

    def at(t):
        return {kind: float(np.interp(t, x, y)) for kind, (x, y) in curves.items()
                if len(x) and x.min() - tol <= t <= x.max() + tol}

    wins = {k: 0 for k in curves}
    lines = []
    for t in sorted(f["target_reduction"].unique()):
        vals = at(t)
        if len(vals) < 2:
            continue
        best = min(vals, key=vals.get)
        wins[best] += 1
        ranked = sorted(vals.items(), key=lambda kv: kv[1])
        lines.append(f"at {t:.0%} reduction " + ", ".join(f"{k} {v:.4g}" for k, v in ranked))
    if not lines:
        return "No target reduction was reached by two or more policies, so there is no matched comparison."
    total = sum(wins.values())
    leader = max(wins, key=wins.get)
    ent = wins.get("EntropyAdaptiveK", 0)
    if leader == "EntropyAdaptiveK" and ent > total / 2:
        head = (f"Entropy is the better signal here: EntropyAdaptiveK has the lowest perplexity at {ent} of "
                f"{total} matched compute levels.")
    else:
        head = (f"Entropy is not the better signal here: {leader} has the lowest perplexity at {wins[leader]} "
                f"of {total} matched compute levels, EntropyAdaptiveK at {ent}.")
    fixed = []
    for _, r in frame[frame["kind"] == "TopK"].iterrows():
        vals = at(float(r["expert_reduction"]))
        if vals:
            better = [k for k, v in vals.items() if v < r["ppl"]]
            fixed.append(f"TopK k={int(r['k_max'])} ({r['expert_reduction']:.0%}, ppl {r['ppl']:.4g}) is beaten by "
                         f"{', '.join(sorted(better)) or 'none'}")
    tail = (" Lower fixed k: " + "; ".join(fixed) + ".") if fixed else ""
    return head + " Perplexity interpolated at each target: " + "; ".join(lines) + "." + tail


# --- the published configurations and the claims under test (issue 4) ---

# name -> (k_values, thresholds in nats)
PUBLISHED = {
    "trtllm-default": ((2, 5, 8), (1.3, 1.7)),
    "sdk-mixtral": ((1, 2, 4), (0.6, 1.2)),
    "sdk-qwen-moe": ((1, 2, 4), (0.5, 1.0)),
    "sdk-olmoe": ((1, 2, 4), (0.7, 1.3)),
    "qwen1.5-measured": ((2, 3, 4), (3.55, 3.79)),
}
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


def published_configs(family: str, num_experts: int) -> dict[str, EntropyAdaptiveK]:
    """The published configurations that apply to a family: the TensorRT-LLM default and its presets."""
    out = {}
    for name in ("trtllm-default", *_FAMILY_PRESETS.get(family, ())):
        kv, th = PUBLISHED[name]
        if kv[-1] <= num_experts:
            out[name] = EntropyAdaptiveK(kv, th)
    return out
