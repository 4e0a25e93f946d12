"""Thresholds for a compute target or a perplexity budget, and policies compared at matched compute.

Calibration uses held-out text the models never saw (`calibration_ids`), never the evaluation set (WikiText-2
test). It reads the models only through `moelab.evaluate`: a `RouterSample` for estimates, `evaluate` for
measurements and `reference_ppl` for the perplexity they are measured against.

Threshold family: for k_values of length m, one knob u in [0, 1] puts the m-1 thresholds at the entropy quantiles
u^((m-1-j)/(m-1)), j = 0..m-2 (ascending). u = 0: every token keeps k_max; u = 1: every token keeps k_min; mean k
falls monotonically in between, so bisection on u reaches a target reduction. Shared thresholds use the quantiles
of all layers pooled; per-layer thresholds each layer's own (every layer then keeps the same k fractions).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from moelab.evaluate import RouterSample, evaluate, reference_ppl
from moelab.params import check_int, is_int, is_real
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP, quantile

log = logging.getLogger(__name__)


def calibration_ids(tokenizer, max_tokens: int, names=None) -> torch.Tensor:
    """Token ids of held-out text for calibration: an equal share of each held-out slice, concatenated (the five
    OLMoE domain files are left out: their last 5% repeats their training part)."""
    from moelab.data import TRAIN_TEXTS, heldout_texts

    check_int("max_tokens", max_tokens, 2)
    texts = heldout_texts()
    names = [names] if isinstance(names, str) else list(names or texts)
    seen = [n for n in names if n in TRAIN_TEXTS and n not in texts]
    if seen:
        raise ValueError(f"calibration texts {seen}: left out, their held-out part repeats their training text; "
                         f"choose from {sorted(texts)}")
    bad = [n for n in names if n not in texts]
    if bad:
        raise ValueError(f"calibration texts {bad}: unknown; choose from {sorted(texts)}")
    share = max(2, max_tokens // len(names))
    parts = []
    for n in names:
        ids = tokenizer(texts[n], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        if len(ids) < share:
            log.info("calibration text %s: its held-out part has %d tokens, short of its share of %d",
                     n, len(ids), share)
        parts.append(torch.tensor(ids[:share], dtype=torch.long))
    return torch.cat(parts)[:max_tokens]


def _strict(ths: list[float]) -> tuple[float, ...]:
    """Make quantile thresholds strictly ascending (ties from repeated entropies) by the smallest nudge."""
    out = []
    for t in ths:
        t = float(t)
        if out and t <= out[-1]:
            t = math.nextafter(out[-1], math.inf)
        out.append(t)
    return tuple(out)


def _check_target(target, k_min: int, k_max: int, native_k: int, what: str) -> None:
    """A target reduction that k in [k_min, k_max] can reach on native k."""
    if not is_real(target):
        raise ValueError(f"target_reduction={target!r}: must be a number")
    lo, hi = 1 - k_max / native_k, 1 - k_min / native_k
    if not lo <= target <= hi:
        raise ValueError(f"target_reduction={target}: {what} on native k={native_k} reach only [{lo:.3f}, {hi:.3f}]")


def _tol(sample: RouterSample, k_min: int, k_max: int) -> float:
    """The bisection's tolerance on a reduction: one token of each layer changing k from k_max to k_min."""
    return (k_max - k_min) / (sample.native_k * sample.num_tokens) + 1e-9


def _warn_missed(sample: RouterSample, pol, target: float, k_min: int, k_max: int, what: str):
    """pol, with a warning where its estimated reduction misses the target by more than the bisection's
    tolerance: many tokens change k at the same point, i.e. ties in the signal."""
    got = sample.estimate(pol)["expert_reduction"]
    if abs(got - target) > _tol(sample, k_min, k_max):
        warnings.warn(f"target_reduction={target}: {what} reaches {got:.3f} at the closest, not the target "
                      f"(ties in the routing signal on the sample: many tokens change k at once)", stacklevel=3)
    return pol


def check_budget(budget: float, steps: int) -> None:
    """A budget > 0 and bisection steps >= 0 (shared with `paper.paper_rows`, which checks before any forward)."""
    if not is_real(budget) or not budget > 0:
        raise ValueError(f"budget={budget}: must be > 0 (relative perplexity increase, e.g. 0.005)")
    check_int("steps", steps, 0, " (bisection steps of the budget search)")


def check_fixed_ks(fixed_ks, k_cap: int, what: str = "the router sample's k_cap") -> list[int]:
    """Lower fixed k's as ints in [1, k_cap]; `what` names where k_cap comes from."""
    fixed_ks = list(fixed_ks)
    bad = [k for k in fixed_ks if not is_int(k) or not 1 <= k <= k_cap]
    if bad:
        raise ValueError(f"fixed_ks={fixed_ks}: {bad} not ints in [1, {k_cap}] ({what})")
    return [int(k) for k in fixed_ks]


def check_k_values(k_values, k_cap: int, what: str = "the sample's k_cap") -> tuple[int, ...]:
    """At least two strictly ascending ints in [1, k_cap]."""
    seq = isinstance(k_values, Iterable) and not isinstance(k_values, (str, bytes))
    k_values = list(k_values) if seq else k_values
    if not seq or not all(is_int(k) for k in k_values):
        raise ValueError(f"k_values={k_values!r}: must be a sequence of ints")
    kv = tuple(int(k) for k in k_values)
    if len(kv) < 2:
        raise ValueError(f"k_values={list(kv)}: need at least two k values to calibrate thresholds")
    if any(b <= a for a, b in zip(kv, kv[1:])) or kv[0] < 1:
        raise ValueError(f"k_values={list(kv)}: must be strictly ascending ints >= 1")
    if kv[-1] > k_cap:
        raise ValueError(f"k_values={list(kv)}: k_max exceeds {what}={k_cap}")
    return kv


def thresholds_at(sample: RouterSample, k_values, u: float, per_layer: bool = False):
    """EntropyAdaptiveK (shared) or a per-layer list of them with thresholds at the family's quantiles."""
    if not is_real(u) or not 0.0 <= u <= 1.0:
        raise ValueError(f"u={u!r}: must be a number in [0, 1]")
    kv = check_k_values(k_values, sample.k_cap)
    m = len(kv)
    q = torch.tensor([u ** ((m - 1 - j) / (m - 1)) for j in range(m - 1)], dtype=torch.float64)

    def make(ent_T):
        ths = quantile(ent_T.double(), q).tolist()
        # u = 0 / 1: move the thresholds past every token so that all keep k_max / k_min
        ths = [t - 1e-6 if lv == 0 else (t + 1e-6 if lv == 1 else t) for t, lv in zip(ths, q.tolist())]
        return EntropyAdaptiveK(kv, _strict(ths), renormalize=None)

    if per_layer:
        return [make(e) for e in sample.entropy]
    return make(sample.entropy_all())


def _bisect(f, lo: float, hi: float, target: float, increasing: bool, iters: int = 40, tol: float = 0.0) -> float:
    """x in [lo, hi] with f(x) ~ target for a monotone f: the last bracket's middle, or where f misses the target
    there by more than tol (f jumps over it: ties), whichever of the middle and the bracket's ends is closest."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    mid = (lo + hi) / 2
    return mid if abs(f(mid) - target) <= tol else min((mid, lo, hi), key=lambda x: abs(f(x) - target))


def calibrate_thresholds(sample: RouterSample, k_values, target_reduction: float, per_layer: bool = False):
    """Thresholds whose estimated routed-expert reduction on the sample reaches target_reduction (where tied
    entropies leave it out of reach, the closest, with a warning)."""
    kv = check_k_values(k_values, sample.k_cap)
    _check_target(target_reduction, kv[0], kv[-1], sample.native_k, f"k_values={list(kv)}")
    red = lambda u: sample.estimate(thresholds_at(sample, kv, u, per_layer))["expert_reduction"]  # noqa: E731
    u = _bisect(red, 0.0, 1.0, target_reduction, increasing=True, iters=30, tol=_tol(sample, kv[0], kv[-1]))
    return _warn_missed(sample, thresholds_at(sample, kv, u, per_layer), target_reduction, kv[0], kv[-1],
                        f"EntropyAdaptiveK k_values={list(kv)}")


def match_policy(sample: RouterSample, kind: str, target_reduction: float, k_min: int = 1, k_max: int | None = None,
                 k_values=None, per_layer: bool = False) -> Policy:
    """A policy of a kind ('EntropyAdaptiveK', 'TopP', 'RatioSkip') whose estimated reduction hits the target
    (k_max None: the native k). Where ties in the signal leave it out of reach, the closest, with a warning."""
    check_int("k_min", k_min)
    k_max = sample.native_k if k_max is None else check_int("k_max", k_max, 1, " or None (native k)")
    if k_min > k_max:
        raise ValueError(f"k_min={k_min} > k_max={k_max}: must be k_min <= k_max")
    if kind == "EntropyAdaptiveK":
        if k_values is None:  # k_min, the native k (if inside the range) and k_max
            k_values = sorted({k_min, min(max(sample.native_k, k_min), k_max), k_max})
            if len(k_values) < 2:
                raise ValueError(f"k_min={k_min}, k_max={k_max}: EntropyAdaptiveK needs k_min < k_max "
                                 "(or pass k_values)")
        return calibrate_thresholds(sample, k_values, target_reduction, per_layer)
    if kind not in ("TopP", "RatioSkip"):
        raise ValueError(f"kind={kind!r}: must be 'EntropyAdaptiveK', 'TopP' or 'RatioSkip'")
    _check_target(target_reduction, k_min, k_max, sample.native_k, f"k in [{k_min}, {k_max}]")
    if kind == "TopP":  # larger p keeps more experts: reduction falls
        red = lambda p: sample.estimate(TopP(max(p, 1e-9), k_max, k_min))["expert_reduction"]  # noqa: E731
        p = _bisect(red, 0.0, 1.0, target_reduction, increasing=False, tol=_tol(sample, k_min, k_max))
        pol = TopP(float(min(max(p, 1e-9), 1.0)), k_max, k_min)
    else:  # RatioSkip: larger beta drops more experts: reduction rises
        red = lambda b: sample.estimate(RatioSkip(b, k_max, k_min))["expert_reduction"]  # noqa: E731
        b = _bisect(red, 0.0, 1.0, target_reduction, increasing=True, tol=_tol(sample, k_min, k_max))
        pol = RatioSkip(float(b), k_max, k_min)
    return _warn_missed(sample, pol, target_reduction, k_min, k_max, f"{kind} k in [{k_min}, {k_max}]")


def budget_search(model, sample: RouterSample, cal_ids: torch.Tensor, k_values, budget: float = 0.005,
                  per_layer: bool = False, baseline_ppl: float | None = None, steps: int = 6, progress: bool = True,
                  **eval_kw) -> dict:
    """Largest routed-expert reduction whose measured perplexity on calibration text stays within budget.

    Bisection over the target reduction in [max(0, lowest reachable), highest reachable], each step a
    patched perplexity on cal_ids (held-out text), against baseline_ppl (default: `reference_ppl` on cal_ids).
    Returns dict(policy, target_reduction, ppl, ppl_change, within_budget, trace: DataFrame of every step).
    """
    check_budget(budget, steps)
    kv = check_k_values(k_values, sample.k_cap)
    if baseline_ppl is None:
        baseline_ppl = reference_ppl(model, cal_ids, **eval_kw)["ppl"]
    lo, hi = max(0.0, 1 - kv[-1] / sample.native_k), 1 - kv[0] / sample.native_k
    trace = []

    def measure(r):
        pol = calibrate_thresholds(sample, kv, r, per_layer)
        s = evaluate(model, pol, cal_ids, baseline_ppl=baseline_ppl, progress=False, warn_unchanged=r > 0,
                     **eval_kw).summary  # reduction 0 keeps k_max everywhere on purpose
        trace.append({"target_reduction": r, "label": s["label"], "expert_reduction": s["expert_reduction"],
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


def compare_at_matched_compute(model, sample: RouterSample, eval_ids: torch.Tensor, targets, k_values,
                               baseline_ppl: float, kinds=("EntropyAdaptiveK", "TopP", "RatioSkip"), fixed_ks=None,
                               per_layer: bool = False, progress: bool = True, **eval_kw) -> pd.DataFrame:
    """Measured perplexity vs compute for each policy kind matched (on the sample) to each target reduction.

    TopP and RatioSkip get the same k range as the entropy policy's k_values; lower fixed k (TopK with k
    below native) gives points of its own. Rows: measured evaluations plus target and matched-on columns.
    kinds: kind names, or one name.
    """
    kv = check_k_values(k_values, sample.k_cap)  # checked before any measured evaluation runs
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    k_min, k_max = kv[0], kv[-1]
    if fixed_ks is None:
        fixed_ks = list(range(max(1, k_min), sample.native_k))
    fixed_ks = check_fixed_ks(fixed_ks, sample.k_cap)
    jobs = []
    for t in targets:
        for kind in kinds:
            pol = match_policy(sample, kind, float(t), k_min=k_min, k_max=k_max, k_values=kv, per_layer=per_layer)
            jobs.append((float(t), kind, pol))
    for k in fixed_ks:
        jobs.append((1 - k / sample.native_k, "TopK", TopK(int(k))))
    rows = []
    for t, kind, pol in tqdm(jobs, desc="matched compute", disable=not progress):
        est = sample.estimate(pol)
        s = evaluate(model, pol, eval_ids, baseline_ppl=baseline_ppl, progress=False, **eval_kw).summary
        rows.append({**s, "kind": kind, "target_reduction": t, "est_expert_reduction": est["expert_reduction"]})
    return pd.DataFrame(rows)


def pareto_mask(reduction, ppl) -> np.ndarray:
    """True where no other point has at least the reduction and at most the perplexity (one strictly)."""
    r, p = np.asarray(reduction, float), np.asarray(ppl, float)
    if r.ndim != 1 or r.shape != p.shape:
        raise ValueError(f"reduction of shape {r.shape}, ppl of shape {p.shape}: must be 1-D and of one length")
    out = np.ones(len(r), dtype=bool)
    for i in range(len(r)):
        dominated = (r >= r[i]) & (p <= p[i]) & ((r > r[i]) | (p < p[i]))
        out[i] = not dominated.any()
    return out


def verdict(frame: pd.DataFrame, kinds=("EntropyAdaptiveK", "TopP", "RatioSkip"), tol: float = 0.03) -> str:
    """Plain statement of which signal had the lowest perplexity at matched compute, target by target.

    Each kind's perplexity is interpolated along its own measured curve at the target reductions,
    moved into the range all measured curves cover (measured reductions drift from the targets they
    were matched to on calibration text); without such a range, a curve's end point stands in up to
    `tol` beyond it. Lower fixed k points are compared the same way.
    """
    need = ["kind", "target_reduction", "expert_reduction", "ppl"]
    need += ["k_max"] if "kind" in frame.columns and frame["kind"].eq("TopK").any() else []
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise ValueError(f"frame without columns {missing}: pass compare_at_matched_compute's frame")
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
    points = sorted(t for t in f["target_reduction"].unique() if t == t)
    if len(curves) >= 2:
        # measured reductions drift from the targets (calibration text != evaluation text): compare at
        # the targets moved into the range that every measured curve covers, where there is one
        lo = max(x.min() for x, _ in curves.values())
        hi = min(x.max() for x, _ in curves.values())
        if lo < hi:
            points = sorted({round(float(np.clip(t, lo, hi)), 4) for t in points})
    ties = 0
    for t in points:
        vals = at(t)
        if len(vals) < 2:
            continue
        low = min(vals.values())
        best = sorted(k for k, v in vals.items() if math.isclose(v, low, rel_tol=1e-12))
        if len(best) == 1:
            wins[best[0]] += 1
        else:  # the same perplexity (e.g. policies that kept the same pairs): nobody's win
            ties += 1
        ranked = sorted(vals.items(), key=lambda kv: kv[1])
        lines.append(f"at {t:.0%} reduction " + ", ".join(f"{k} {v:.4g}" for k, v in ranked)
                     + (f" (tied: {' = '.join(best)})" if len(best) > 1 else ""))
    if not lines:
        spans = ", ".join(f"{k} {x.min():.1%}-{x.max():.1%}" for k, (x, _) in curves.items() if len(x))
        return ("No target reduction was reached by two or more policies, so there is no matched comparison "
                f"(measured expert reductions: {spans}; curves compare where they overlap, or within tol={tol} "
                "of a curve's end).")
    total = len(lines)
    ent = wins.get("EntropyAdaptiveK", 0)
    others = {k: v for k, v in wins.items() if k != "EntropyAdaptiveK"}
    best_other = max(others, key=others.get) if others else None
    counts = ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1]))
    counts += f", {ties} tied" if ties else ""
    if not any(wins.values()):
        head = f"No policy has the lowest perplexity alone at any of the {total} matched compute levels ({counts})."
    elif best_other is None or ent > others[best_other]:
        head = (f"Entropy is the better signal here: EntropyAdaptiveK has the lowest perplexity at {ent} of "
                f"{total} matched compute levels ({counts}).")
    elif ent == others[best_other]:
        head = (f"Entropy is not clearly the better signal here: EntropyAdaptiveK ties with {best_other} for the "
                f"most matched compute levels with the lowest perplexity ({counts}; {total} levels).")
    else:
        head = (f"Entropy is not the better signal here: {best_other} has the lowest perplexity at "
                f"{others[best_other]} of {total} matched compute levels, EntropyAdaptiveK at {ent} ({counts}).")
    fixed = []
    for _, r in frame[frame["kind"] == "TopK"].iterrows():
        vals = at(float(r["expert_reduction"]))
        if vals:
            better = [k for k, v in vals.items() if v < r["ppl"]]
            fixed.append(f"TopK k={int(r['k_max'])} ({r['expert_reduction']:.0%}, ppl {r['ppl']:.4g}) is beaten by "
                         f"{', '.join(sorted(better)) or 'none'}")
    tail = (" Lower fixed k: " + "; ".join(fixed) + ".") if fixed else ""
    return head + " Perplexity interpolated at each target: " + "; ".join(lines) + "." + tail
