"""Thresholds for a compute target or a perplexity budget, and policies compared at matched compute, calibrated
on held-out text (`calibration_ids`), never the evaluation set; models are read only through `moelab.evaluate`.

Threshold family: for m k_values, one knob u in [0, 1] puts the m-1 thresholds at the entropy quantiles
u^((m-1-j)/(m-1)): u = 0 keeps k_max, u = 1 keeps k_min, mean k falls monotonically between, so bisection on u
reaches a target. Shared thresholds use all layers' entropies pooled, per-layer ones each layer's own.
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

from moelab.evaluate import RouterSample, bootstrap_ppl, evaluate, evaluate_many, interval, reference_ppl
from moelab.params import check_int, is_int, is_real
from moelab.routing import EntropyAdaptiveK, Policy, RatioSkip, TopK, TopP, quantile

log = logging.getLogger(__name__)


def calibration_ids(tokenizer, max_tokens: int, names=None) -> torch.Tensor:
    """Held-out token ids: an equal share of each held-out slice, concatenated (the OLMoE domain files are
    refused: their held-out part repeats their training part)."""
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
    """pol, with a warning where its estimated reduction misses the target by more than `_tol` (ties)."""
    got = sample.estimate(pol)["expert_reduction"]
    if abs(got - target) > _tol(sample, k_min, k_max):
        warnings.warn(f"target_reduction={target}: {what} reaches {got:.3f} at the closest, not the target "
                      f"(ties in the routing signal on the sample: many tokens change k at once)", stacklevel=3)
    return pol


def check_budget(budget: float, steps: int) -> None:
    """A budget > 0 and bisection steps >= 0 (also checked by `paper.paper_rows` before any forward)."""
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
    """x in [lo, hi] with f(x) ~ target for a monotone f; where f jumps over the target (ties), the closest of the
    last bracket's middle and ends."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        fm = f(mid)
        if tol and abs(fm - target) <= tol:
            return mid
        if (fm < target) == increasing:
            lo = mid
        else:
            hi = mid
    mid = (lo + hi) / 2
    return mid if abs(f(mid) - target) <= tol else min((mid, lo, hi), key=lambda x: abs(f(x) - target))


def calibrate_thresholds(sample: RouterSample, k_values, target_reduction: float, per_layer: bool = False):
    """Thresholds whose estimated routed-expert reduction on the sample reaches target_reduction (or the closest,
    with a warning)."""
    kv = check_k_values(k_values, sample.k_cap)
    _check_target(target_reduction, kv[0], kv[-1], sample.native_k, f"k_values={list(kv)}")
    red = lambda u: sample.estimate(thresholds_at(sample, kv, u, per_layer))["expert_reduction"]  # noqa: E731
    u = _bisect(red, 0.0, 1.0, target_reduction, increasing=True, iters=30, tol=_tol(sample, kv[0], kv[-1]))
    return _warn_missed(sample, thresholds_at(sample, kv, u, per_layer), target_reduction, kv[0], kv[-1],
                        f"EntropyAdaptiveK k_values={list(kv)}")


def match_policy(sample: RouterSample, kind: str, target_reduction: float, k_min: int = 1, k_max: int | None = None,
                 k_values=None, per_layer: bool = False) -> Policy:
    """A policy of a kind ('EntropyAdaptiveK', 'TopP', 'RatioSkip') whose estimated reduction hits the target
    (or the closest, with a warning); k_max None: the native k."""
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
    """Largest routed-expert reduction whose measured perplexity on cal_ids stays within budget of baseline_ppl
    (default: `reference_ppl`), by bisection over the target: dict(policy, ..., within_budget, trace)."""
    check_budget(budget, steps)
    kv = check_k_values(k_values, sample.k_cap)
    if baseline_ppl is None:
        baseline_ppl = reference_ppl(model, cal_ids, **eval_kw)["ppl"]
    lo, hi = max(0.0, 1 - kv[-1] / sample.native_k), 1 - kv[0] / sample.native_k
    trace, best = [], None
    bar = tqdm(total=steps + 2, desc="budget search", disable=not progress)

    def measure(r):
        pol = calibrate_thresholds(sample, kv, r, per_layer)
        s = evaluate(model, pol, cal_ids, baseline_ppl=baseline_ppl, progress=False, warn_unchanged=r > 0,
                     **eval_kw).summary
        trace.append({"target_reduction": r, "label": s["label"], "expert_reduction": s["expert_reduction"],
                      "ppl": s["ppl"], "ppl_change": s["ppl_change"], "within": s["ppl_change"] <= budget})
        bar.update()
        return pol, s

    pol, s = measure(hi)
    if s["ppl_change"] <= budget:
        best = (hi, pol, s)
    else:
        pol, s = measure(lo)
        if s["ppl_change"] <= budget:
            best = (lo, pol, s)
            for _ in range(steps):
                mid = (lo + hi) / 2
                pol, s = measure(mid)
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


MATCHED_KINDS = ("EntropyAdaptiveK", "TopP", "RatioSkip", "SER", "EvenBudget", "AllocBudget")
POINT_KINDS = ("TopK", "LuMedian")  # rules with one compute level of their own, compared at it


def ser(k_min: int, t: float, k_max: int) -> RatioSkip:
    """ik_llama.cpp's `-ser Kmin,t` (the top Kmin experts, others while p > t p_top): RatioSkip with a k floor."""
    return RatioSkip(float(t), k_max, k_min)


def ser_label(policy: RatioSkip) -> str:
    return f"SER({policy.k_min}, {policy.beta:.4g})"


def lu_median(sample: RouterSample, k_min: int = 1, k_max: int | None = None, q: float = 0.5) -> list[RatioSkip]:
    """Lu et al. (2024): per layer, RatioSkip with beta the quantile q of w1 / w0 (second over first routing
    probability) on the sample."""
    k_max = sample.native_k if k_max is None else k_max
    qs = torch.tensor([float(q)], dtype=torch.float32)
    return [RatioSkip(float(quantile((p[:, 1] / p[:, 0]).float(), qs)[0]), k_max, k_min) for p in sample.top_probs]


def _layer_ratio(sample: RouterSample, layer: int, target: float, k_min: int, k_max: int) -> RatioSkip:
    """RatioSkip whose estimated reduction in one layer hits target."""
    red = lambda b: 1 - float(sample.k(RatioSkip(b, k_max, k_min), layer).float().mean()) / sample.native_k  # noqa
    return RatioSkip(float(_bisect(red, 0.0, 1.0, target, increasing=True, tol=1.5 / sample.num_tokens)), k_max, k_min)


def layer_budget(sample: RouterSample, target: float, k_min: int, k_max: int, sensitivity=None) -> list[RatioSkip]:
    """Per-layer RatioSkip whose reductions average `target`: the same in every layer, or r_l = c / s_l (clipped)
    spread by `sensitivity` (`layer_sensitivity`)."""
    lo, hi = max(0.0, 1 - k_max / sample.native_k), 1 - k_min / sample.native_k
    _check_target(target, k_min, k_max, sample.native_k, f"k in [{k_min}, {k_max}]")
    rs = np.full(sample.num_layers, float(target))
    if sensitivity is not None:
        s = np.maximum(np.asarray(sensitivity, dtype=float), 1e-12)
        if s.shape != (sample.num_layers,):
            raise ValueError(f"sensitivity of shape {s.shape}: need one value per MoE layer ({sample.num_layers})")
        c = _bisect(lambda c: float(np.clip(c / s, lo, hi).mean()), 0.0, hi * s.max(), target, increasing=True)
        rs = np.clip(c / s, lo, hi)
    return [_layer_ratio(sample, i, float(r), k_min, k_max) for i, r in enumerate(rs)]


def layer_sensitivity(model, sample: RouterSample, cal_ids: torch.Tensor, k_min: int, k_max: int, probe: float = 0.25,
                      baseline_ppl: float | None = None, **eval_kw) -> list[float]:
    """Per MoE layer, the measured perplexity change per unit of reduction when that layer alone routes with
    RatioSkip at `probe` reduction (the others native), in one pass over cal_ids."""
    if baseline_ppl is None:
        baseline_ppl = reference_ppl(model, cal_ids, **eval_kw)["ppl"]
    probe = min(max(probe, 1 - k_max / sample.native_k), 1 - k_min / sample.native_k)
    pols = [{i: _layer_ratio(sample, i, probe, k_min, k_max)} for i in range(sample.num_layers)]
    evs = evaluate_many(model, pols, cal_ids, baseline_ppl=baseline_ppl, kl=False, progress=False, **eval_kw)
    return [ev.summary["ppl_change"] / max(float(ev.layers["expert_reduction"].iloc[0]), 1e-9) for ev in evs]


def matched_policies(sample: RouterSample, targets, k_values, kinds=MATCHED_KINDS[:3], per_layer: bool = False,
                     sensitivity=None) -> list[tuple[float, str, object]]:
    """(target, kind, policy) for each target and kind, matched on the sample within k_values' k range; SER keeps
    at least native k / 2 (skipped where that is no higher floor, or out of reach); AllocBudget needs sensitivity."""
    kv = check_k_values(k_values, sample.k_cap)
    kinds, targets = ((kinds,) if isinstance(kinds, str) else tuple(kinds)), [float(t) for t in targets]
    bad = [k for k in kinds if k not in MATCHED_KINDS]
    if bad:
        raise ValueError(f"kinds {bad}: must be among {list(MATCHED_KINDS)}")
    if "AllocBudget" in kinds and sensitivity is None and targets:
        raise ValueError("kind 'AllocBudget' needs sensitivity (layer_sensitivity on calibration text)")
    k_min, k_max, ser_min = kv[0], kv[-1], max(1, sample.native_k // 2)
    jobs = []
    for t in targets:
        for kind in kinds:
            if kind == "SER":
                if ser_min > k_min and t <= 1 - ser_min / sample.native_k:
                    jobs.append((t, kind, match_policy(sample, "RatioSkip", t, k_min=ser_min, k_max=k_max)))
            elif kind in ("EvenBudget", "AllocBudget"):
                jobs.append((t, kind, layer_budget(sample, t, k_min, k_max,
                                                   sensitivity if kind == "AllocBudget" else None)))
            else:
                jobs.append((t, kind, match_policy(sample, kind, t, k_min=k_min, k_max=k_max, k_values=kv,
                                                   per_layer=per_layer)))
    return jobs


def compare_at_matched_compute(model, sample: RouterSample, eval_ids: torch.Tensor, targets, k_values,
                               baseline_ppl: float, kinds=("EntropyAdaptiveK", "TopP", "RatioSkip"), fixed_ks=None,
                               per_layer: bool = False, progress: bool = True, sensitivity=None, lu: bool = False,
                               kl: bool = False, **eval_kw) -> pd.DataFrame:
    """Measured perplexity vs compute of each kind matched to each target (`matched_policies`), plus lower fixed
    k's and, with lu, `lu_median`, in one pass over eval_ids; rows keep window_nll for `compare_rules`."""
    kv = check_k_values(k_values, sample.k_cap)
    if fixed_ks is None:
        fixed_ks = list(range(max(1, kv[0]), sample.native_k))
    fixed_ks = check_fixed_ks(fixed_ks, sample.k_cap)
    jobs = matched_policies(sample, targets, kv, kinds, per_layer, sensitivity)
    jobs += [(1 - k / sample.native_k, "TopK", TopK(int(k))) for k in fixed_ks]
    if lu:
        pol = lu_median(sample, kv[0], kv[-1])
        jobs.append((sample.estimate(pol)["expert_reduction"], "LuMedian", pol))
    evs = evaluate_many(model, [p for *_, p in jobs], eval_ids, baseline_ppl=baseline_ppl, kl=kl, progress=progress,
                        **eval_kw)
    return pd.DataFrame([{**ev.summary, "kind": kind, "target_reduction": t,
                          "est_expert_reduction": sample.estimate(pol)["expert_reduction"],
                          "window_nll": ev.window_nll, "window_tokens": ev.window_tokens}
                         for (t, kind, pol), ev in zip(jobs, evs)])


def _weights(g: pd.DataFrame, n: int, t: float) -> np.ndarray:
    """Weights over the n rows whose product with their perplexities interpolates curve g (sorted) at t."""
    w = np.zeros(n)
    x = g["expert_reduction"].to_numpy(float)
    for j, i in enumerate(g.index):
        w[i] = np.interp(t, x, np.eye(len(x))[j])
    return w


def compare_rules(frame: pd.DataFrame, resamples: int = 2000, seed: int = 0, tol: float = 0.03,
                  level: float = 0.95) -> pd.DataFrame:
    """Every pair of rules at each matched level of `compare_at_matched_compute`'s frame, with the paired bootstrap
    interval of ppl_a / ppl_b - 1. Curves are interpolated in measured reduction at the targets moved into the
    range all cover (as `verdict`); points (lower fixed k, LuMedian) meet each curve at their own reduction."""
    f = frame.reset_index(drop=True)
    if not {"window_nll", "window_tokens", "kind", "expert_reduction"} <= set(f.columns):
        raise ValueError("frame without window_nll / window_tokens: pass compare_at_matched_compute's rows")
    ppl_BR = bootstrap_ppl(np.stack(f["window_nll"].to_numpy()), f["window_tokens"].iloc[0], resamples, seed)
    ppl_R = f["ppl"].to_numpy(float)
    curves = {k: g.sort_values("expert_reduction") for k, g in f.groupby("kind", sort=False) if k not in POINT_KINDS}
    spans = {k: (g["expert_reduction"].min(), g["expert_reduction"].max()) for k, g in curves.items()}
    lo, hi = max((a for a, _ in spans.values()), default=0), min((b for _, b in spans.values()), default=0)
    levels = {}  # level -> its target
    for t in sorted(f.loc[f["kind"].isin(list(curves)), "target_reduction"].unique()):
        levels.setdefault(round(float(np.clip(t, lo, hi) if lo < hi else t), 4), float(t))
    pairs = [(t, target, {k: _weights(g, len(f), t) for k, g in curves.items()
                          if spans[k][0] - tol <= t <= spans[k][1] + tol}) for t, target in levels.items()]
    for i, r in f[f["kind"].isin(POINT_KINDS)].iterrows():
        t = float(r["expert_reduction"])
        here = {k: _weights(g, len(f), t) for k, g in curves.items() if spans[k][0] - tol <= t <= spans[k][1] + tol}
        name = r["label"] if r["kind"] == "TopK" else r["kind"]
        pairs += [(t, float(r["target_reduction"]), {name: np.eye(len(f))[i], k: w}) for k, w in here.items()]
    rows = []
    for t, target, ws in pairs:
        names = list(ws)
        for x in range(len(names)):
            for y in range(x + 1, len(names)):
                a, b = sorted((names[x], names[y]), key=lambda n: float(ppl_R @ ws[n]))
                pa, pb = float(ppl_R @ ws[a]), float(ppl_R @ ws[b])
                diff, c_lo, c_hi = interval(ppl_BR @ ws[a], ppl_BR @ ws[b], pa, pb, level)
                win = c_hi < 0 or c_lo > 0
                ci, at = f"{100 * diff:+.2f}% [{100 * c_lo:+.2f}, {100 * c_hi:+.2f}]", f"{100 * t:.3g}%"
                rows.append({"level": t, "target": target, "a": a, "b": b, "ppl_a": pa, "ppl_b": pb, "diff": diff,
                             "ci_lo": c_lo, "ci_hi": c_hi, "win": win, "windows": len(f["window_tokens"].iloc[0]),
                             "resamples": resamples, "bootstrap_seed": seed,
                             "verdict": (f"{a} lower than {b} at {at}: {ci}" if win
                                         else f"no difference between {a} and {b} at {at}: {ci}")})
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
    """Which signal had the lowest perplexity at matched compute: each kind's curve interpolated at the targets
    moved into the range all curves cover (else a curve's end stands in up to `tol` beyond it)."""
    need = ["kind", "target_reduction", "expert_reduction", "ppl"]
    need += ["k_max"] if "kind" in frame.columns and frame["kind"].eq("TopK").any() else []
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise ValueError(f"frame without columns {missing}: pass compare_at_matched_compute's frame")
    f = frame[frame["kind"].isin(kinds)]
    curves = {kind: (g["expert_reduction"].to_numpy(float), g["ppl"].to_numpy(float))
              for kind, g in ((k, g.sort_values("expert_reduction")) for k, g in f.groupby("kind"))}

    def at(t):
        return {kind: float(np.interp(t, x, y)) for kind, (x, y) in curves.items()
                if len(x) and x.min() - tol <= t <= x.max() + tol}

    wins = {k: 0 for k in curves}
    lines = []
    points = sorted(t for t in f["target_reduction"].unique() if t == t)
    if len(curves) >= 2:  # measured reductions drift from the calibrated targets
        lo, hi = max(x.min() for x, _ in curves.values()), min(x.max() for x, _ in curves.values())
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
