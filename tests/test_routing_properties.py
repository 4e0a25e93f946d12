"""Each routing rule against an independent float64 reference, on random shapes, policies and logits.

`check_plan` recomputes from the logits alone, in float64 numpy (no moelab routing code), what plan.py says a
policy keeps: softmax over all E experts; experts ranked by probability, ties to the lower index; then
  TopK               k
  EntropyAdaptiveK   k_values[number of thresholds <= entropy]
  TopP               the smallest ranked prefix whose mass reaches p (all E if none does), clamped to [k_min, k_max]
  RatioSkip          the ranked experts with p_i >= beta * p_1, clamped to [k_min, k_max]
and compares it with route() on the torch path: k per token, the kept ids (as a set and in rank order), the
unused slots (id -1, weight 0), the weights (renormalised over the kept experts or not) and the entropy.

Tolerance rule (the only place the reference and route() may disagree). route() computes the softmax, the entropy
and the sums in fp32, and compares thresholds, p and beta rounded to fp32 (plan.py): the reference rounds those
three to fp32 as well (that is the rule), and takes each quantity route() computes as an interval around its
float64 value:
- p_i +- tol_i, tol_i = u (8 (1 + |log p_i|) + E) p_i + 2^-149 (u = 2^-24; the log term is log-softmax's rounding
  of log p_i, E u the rounding of its sum over E experts, 2^-149 the fp32 subnormal spacing). A p_i whose interval
  lies below 2^-150 rounds to 0 in fp32, where it ties with the other zeros (ranked by index): the reference takes
  it as exactly 0 too, so wide-range rows, where most experts underflow, stay compared exactly;
- the entropy H +- min(u (16 + 2E) (1 + H), H / 4 + E 2^-140) (the second near H = 0, where fp32 loses the top
  expert's share); an fp32 entropy is never below 0;
- a sum of j probabilities: the sum of their intervals, +- j u of itself; beta * p_1: +- one rounding.
On 96,000 random rows of the three dtypes (scales 1e-3 to 3e4, half with a dominant expert) and on rows built to
maximise the rounding of the sum, the fp32 errors stay within half of these bounds. Where the intervals leave an
outcome open, route() may take either:
- k: the rule is evaluated at both ends of those intervals; where the two ends give different clamped k, the
  token's k may be anything between them (`k_lo` <= k <= `k_hi`); elsewhere it must equal the rule's k.
- ids: two experts of different float64 probability whose intervals overlap are near-tied (fp32 may order them
  either way; exact ties are exact in fp32 too and go to the lower index). The kept set must equal the reference's
  unless a kept expert is near-tied with a dropped one, the rank order unless two kept experts are near-tied;
  where they are, the kept experts must still be a top-k within the intervals.
Weights and entropy are always compared, within those intervals. run_property asserts that the exclusions stay
rare (under 10% of tokens with a borderline k, nearly all at p = 1; under 3% with an ambiguous kept set).
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import moelab.routing
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP, get_backend, route, set_backend

U = 2.0**-24  # fp32 unit roundoff
TINY = 2.0**-149  # fp32's smallest subnormal
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POLICIES = (TopK, EntropyAdaptiveK, TopP, RatioSkip)
CI_EXAMPLES = 500


def f32(v: float) -> float:
    """v rounded to fp32, as route() compares thresholds, p and beta."""
    return float(np.float32(v))


def reference(x: np.ndarray):
    """float64 softmax of logits [T, E]: probabilities, their tolerances, entropy and its tolerance."""
    z = x - x.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    pos = p > 0
    H = -np.where(pos, p * logp, 0.0).sum(-1)
    E = x.shape[1]
    rel = np.where(pos, U * (8 * (1 + np.abs(logp)) + E) * p, 0.0)
    zero = p + rel < TINY / 2  # rounds to 0 in fp32 (ties with the other zeros): 0 here too
    tol_H = np.minimum(U * (16 + 2 * E) * (1 + H), H / 4 + E * 2.0**-140)
    return np.where(zero, 0.0, p), np.where(zero, 0.0, rel + TINY), H, tol_H


def k_bounds(policy, ps: np.ndarray, ts: np.ndarray, H: np.ndarray, tol_H: np.ndarray):
    """The rule's k [T] at both ends of the fp32 intervals (k_lo <= k_hi); ps, ts ranked probabilities and their
    tolerances [T, E]. Equal where no fp32 rounding can change the token's k."""
    T, E = ps.shape
    if isinstance(policy, TopK):
        k = np.full(T, policy.k)
        return k, k
    if isinstance(policy, EntropyAdaptiveK):
        kv, th = np.array(policy.k_values), np.array([f32(t) for t in policy.thresholds])
        sure = (th <= 0) | (th <= (H - tol_H)[:, None])  # an fp32 entropy is >= 0 (or -0.0)
        return kv[sure.sum(-1)], kv[(th <= (H + tol_H)[:, None]).sum(-1)]
    j = np.arange(1, E + 1)
    if isinstance(policy, TopP):
        # top-j sums are monotone in each probability: sum the j largest interval ends
        hi = np.cumsum(-np.sort(-(ps + ts), -1), -1) * (1 + j * U)
        lo = np.cumsum(-np.sort(-np.maximum(ps - ts, 0.0), -1), -1) * (1 - j * U)
        p = f32(policy.p)
        n_lo = np.minimum(E, 1 + (hi < p).sum(-1))  # fewest kept: the largest sums
        n_hi = np.minimum(E, 1 + (lo < p).sum(-1))
    else:
        b = f32(policy.beta)
        thr_hi = b * (ps[:, :1] + ts[:, :1]) * (1 + U)  # the product's rounding
        thr_lo = b * np.maximum(ps[:, :1] - ts[:, :1], 0.0) * (1 - U)
        top = ps == ps[:, :1]  # tied with the first: equal in fp32 too, so kept as the first is (beta <= 1)
        n_lo = (top | (np.maximum(ps - ts, 0.0) >= thr_hi)).sum(-1)
        n_hi = (top | (ps + ts >= thr_lo)).sum(-1)
    return np.clip(n_lo, policy.k_min, policy.k_max), np.clip(n_hi, policy.k_min, policy.k_max)


def check_plan(logits: torch.Tensor, policy, renormalize) -> dict:
    """Route `logits` on the torch path and assert the plan against the float64 reference (see the module
    docstring for the tolerance rule). Returns counts: tokens, borderline k, ambiguous sets and orders."""
    plan = route(logits, policy, renormalize=renormalize)
    T, E = logits.shape
    K = policy.k_max
    renorm = policy.renormalize if policy.renormalize is not None else renormalize
    assert plan.expert_ids.shape == (T, K) and plan.expert_ids.dtype == torch.int32
    assert plan.weights.shape == (T, K) and plan.weights.dtype == torch.float32
    assert plan.k.shape == (T,) and plan.k.dtype == torch.int32
    assert plan.entropy.shape == (T,) and plan.entropy.dtype == torch.float32
    assert plan.num_experts == E
    ids, w, k = plan.expert_ids.numpy().astype(np.int64), plan.weights.numpy().astype(np.float64), plan.k.numpy()
    ent = plan.entropy.numpy().astype(np.float64)

    p, tol, H, tol_H = reference(logits.double().numpy())
    order = np.argsort(-p, axis=-1, kind="stable")  # ties: the lower index first
    ps, ts = np.take_along_axis(p, order, -1), np.take_along_axis(tol, order, -1)
    k_lo, k_hi = k_bounds(policy, ps, ts, H, tol_H)
    bad = np.flatnonzero((k < k_lo) | (k > k_hi))
    if bad.size:
        t = bad[0]
        raise AssertionError(f"{policy}, token {t}: k={k[t]} but the rule keeps {k_lo[t]}"
                             + (f"..{k_hi[t]} (borderline)" if k_hi[t] != k_lo[t] else "")
                             + f"; ranked probabilities {ps[t, :K + 1]}, entropy {H[t]}")
    assert ((k >= policy.k_min) & (k <= K)).all()
    if isinstance(policy, EntropyAdaptiveK):  # exact: the rule on the plan's own fp32 entropy and thresholds
        th32 = np.array(policy.thresholds, dtype=np.float32).astype(np.float64)
        np.testing.assert_array_equal(k, np.array(policy.k_values)[(th32 <= ent[:, None]).sum(-1)])

    # slots: the first k used (distinct valid experts), the rest id -1 and weight exactly 0
    used = np.arange(K)[None, :] < k[:, None]
    assert (ids[~used] == -1).all() and (w[~used] == 0).all()
    assert ((ids[used] >= 0) & (ids[used] < E)).all()
    kept_sorted = np.sort(np.where(used, ids, E), -1)
    assert not ((kept_sorted[:, 1:] == kept_sorted[:, :-1]) & (kept_sorted[:, 1:] < E)).any(), "kept experts repeat"

    # kept ids against the reference ranking, with near ties (overlapping intervals, not exact ties) excused
    gap = np.abs(ps[:, :, None] - ps[:, None, :])
    near = (gap > 0) & (gap <= ts[:, :, None] + ts[:, None, :])  # [T, rank, rank]
    kept_rank = np.arange(E)[None, :] < k[:, None]
    set_amb = (near & kept_rank[:, :, None] & ~kept_rank[:, None, :]).any((1, 2))
    order_amb = set_amb | (near & kept_rank[:, :, None] & kept_rank[:, None, :]).any((1, 2))
    want_ids = np.where(used, order[:, :K], -1)
    bad = np.flatnonzero(~set_amb & (kept_sorted != np.sort(np.where(used, want_ids, E), -1)).any(-1))
    assert not bad.size, f"token {bad[:1]}: kept {ids[bad[:1]]}, the reference keeps {want_ids[bad[:1]]}"
    bad = np.flatnonzero(~order_amb & (ids != want_ids).any(-1))
    assert not bad.size, f"token {bad[:1]}: kept {ids[bad[:1]]} in this order, the reference {want_ids[bad[:1]]}"
    # always: a top-k within the intervals, in rank order within them
    safe = np.where(used, ids, 0)
    pk, tk = np.take_along_axis(p, safe, -1), np.take_along_axis(tol, safe, -1)
    dropped = np.ones((T, E), bool)
    dropped[np.nonzero(used)[0], ids[used]] = False
    least_kept = np.where(used, pk + tk, np.inf).min(-1)
    assert (least_kept >= np.where(dropped, p - tol, -np.inf).max(-1)).all(), "a dropped expert ranks above a kept one"
    assert ((pk[:, :-1] + tk[:, :-1] >= pk[:, 1:] - tk[:, 1:]) | ~used[:, 1:]).all(), "kept experts out of rank order"

    # weights: the kept probabilities, renormalised over the kept experts or not
    if renorm:
        S = np.where(used, pk, 0).sum(-1, keepdims=True)
        tS = np.where(used, tk, 0).sum(-1, keepdims=True) + k[:, None] * U * S
        want = pk / np.maximum(S, 1e-300)
        tol_w = (tk + want * tS) / np.maximum(S - tS, 1e-300) + 2 * U * want
    else:
        want, tol_w = pk, tk
    err = np.where(used, np.abs(w - want) - tol_w, 0.0)
    assert (err <= 0).all(), f"weights off by {err.max()} beyond tolerance (renormalize={renorm})"
    # entropy of the full softmax, in nats
    assert (np.abs(ent - H) <= tol_H).all(), np.abs(ent - H).max()
    return {"tokens": T, "k_borderline": int((k_lo != k_hi).sum()), "set_ambiguous": int(set_amb.sum()),
            "order_ambiguous": int(order_amb.sum())}


@st.composite
def logits_st(draw):
    """Logits [T, E] in fp32 / fp16 / bf16: a seeded normal draw at scales up to 1e4 (most probabilities
    underflow), with deliberate ties (a coarse grid, a few shared values, rows of one value) or near ties (fp32
    neighbours)."""
    E, T = draw(st.integers(2, 64)), draw(st.integers(0, 64))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 0.3, 1.0, 4.0, 30.0, 1e3, 1e4]))
    ties = draw(st.sampled_from(["none", "grid", "pool", "equal_rows", "near"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal((T, E)) + rng.standard_normal()) * scale
    if ties == "grid":
        x = np.round(x / scale * 2) * scale / 2
    elif ties == "pool":
        x = rng.choice(rng.standard_normal(3) * scale, size=(T, E))
    elif ties == "equal_rows":
        x[rng.random(T) < 0.5] = rng.standard_normal() * scale
    elif ties == "near":  # in each row, one expert one fp32 step above another
        x = x.astype(np.float32)
        a, b = rng.integers(0, E, T), rng.integers(0, E, T)
        x[np.arange(T), b] = np.nextafter(x[np.arange(T), a], np.float32(np.inf))
    return torch.from_numpy(np.clip(x, -6e4, 6e4).astype(np.float32)).to(dtype)


@st.composite
def case_st(draw, kind):
    """(logits, policy, renormalize for route()) with a random valid policy of type `kind`."""
    logits = draw(logits_st())
    E = logits.shape[1]
    renorm = draw(st.sampled_from([None, True, False]))
    k_max = draw(st.integers(1, E))
    k_min = draw(st.integers(1, k_max))
    if kind is TopK:
        policy = TopK(k_max, renormalize=renorm)
    elif kind is EntropyAdaptiveK:
        kv = sorted({draw(st.integers(1, k_max)) for _ in range(draw(st.integers(0, 4)))} | {k_max})
        th = [draw(st.floats(-0.5, math.log(E) + 0.5))][: len(kv) - 1]  # the first, then steps of >= 1e-6
        while len(th) < len(kv) - 1:
            th.append(th[-1] + draw(st.floats(1e-6, 1.0)))
        policy = EntropyAdaptiveK(tuple(kv), tuple(th), renormalize=renorm)
    elif kind is TopP:
        p = 1.0 if draw(st.integers(0, 9)) == 0 else draw(st.floats(0.0, 1.0, exclude_min=True))
        policy = TopP(p, k_max, k_min, renormalize=renorm)
    else:
        beta = draw(st.sampled_from([0.0, 1.0])) if draw(st.integers(0, 4)) == 0 else draw(st.floats(0.0, 1.0))
        policy = RatioSkip(beta, k_max, k_min, renormalize=renorm)
    call_renorm = draw(st.booleans()) if renorm is None else draw(st.sampled_from([None, True, False]))
    return logits, policy, call_renorm


def run_property(kind, max_examples: int, shrink: bool = True) -> dict:
    """check_plan on `max_examples` derandomized hypothesis cases of policy type `kind` (the first failure is
    raised); returns the summed counts and asserts that every case ran and the borderline tokens are rare."""
    totals = {"cases": 0}

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow],
              phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate])
    @given(case_st(kind))
    def prop(case):
        for name, n in check_plan(*case).items():
            totals[name] = totals.get(name, 0) + n
        totals["cases"] += 1

    before = get_backend()
    set_backend("torch")
    try:
        prop()
    finally:
        set_backend(before)
    assert totals["cases"] >= max_examples, totals
    # the exclusions stay rare (p = 1 is most of the borderline k: the fp32 mass reaches 1 before the tail ends)
    rare = totals["k_borderline"] <= 0.1 * totals["tokens"] and totals["set_ambiguous"] <= 0.03 * totals["tokens"]
    assert rare, totals
    return totals


@pytest.mark.parametrize("kind", POLICIES, ids=lambda c: c.__name__)
def test_rule_matches_the_float64_reference(kind):
    run_property(kind, CI_EXAMPLES)


def mutant_choose_k(kind, delta: int):
    """moelab.routing.choose_k, but a `kind` policy keeps `delta` experts more (or fewer): within [k_min, k_max]
    (a wrong rule, not a wrong bound), except TopK, whose k_min = k_max leaves no room: it goes out of bounds."""
    real = moelab.routing.choose_k

    def choose_k(policy, probs_TK, entropy_T):
        k = real(policy, probs_TK, entropy_T)
        if isinstance(policy, kind):
            k = k + delta
            if kind is not TopK:
                k = k.clamp(policy.k_min, policy.k_max)
        return k.to(torch.int32)

    return choose_k


@pytest.mark.parametrize("delta", [1, -1], ids=["one_more", "one_fewer"])
@pytest.mark.parametrize("kind", POLICIES, ids=lambda c: c.__name__)
def test_a_planted_mutant_fails_the_property(kind, delta, monkeypatch):
    """Each policy's rule, made to keep one expert more or one fewer, fails its property check within 100 cases
    (route_torch looks choose_k up in moelab.routing, so the mutant is what it runs)."""
    monkeypatch.setattr(moelab.routing, "choose_k", mutant_choose_k(kind, delta))
    with pytest.raises(AssertionError, match="but the rule keeps"):
        run_property(kind, 100, shrink=False)
