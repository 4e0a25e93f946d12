"""Routing policies: examples of each rule, ties and 16-bit logits on the kernel, unchecked non-finite rows, and
errors for bad input (tests/test_routing_properties.py checks every rule against a float64 reference)."""

import math
import os

import numpy as np
import pytest
import torch

from moelab.routing import (
    EntropyAdaptiveK,
    RatioSkip,
    TopK,
    TopP,
    choose_k,
    get_backend,
    route,
    route_torch,
    set_backend,
)

INF, NAN = float("inf"), float("nan")


def test_topp_stops_at_the_prefix_whose_mass_is_p():
    # p equal to a prefix's mass keeps that prefix: the rule sums the masses (cumsum - probs rounded
    # below p for 13% of such p and kept one expert more)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(400, 8, generator=g) * 2, -1).sort(-1, descending=True).values
    csum = torch.cumsum(probs, -1)
    for j in range(7):
        for row in range(0, 400, 7):
            pol = TopP(float(csum[row, j]), k_max=8)
            assert choose_k(pol, probs[row : row + 1], torch.zeros(1)).item() == j + 1, (row, j)


def test_topp_and_ratio_rules():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]]))
    assert route(logits, TopP(0.79, k_max=4), renormalize=False).k.tolist() == [2, 1]
    assert route(logits, TopP(0.81, k_max=4), renormalize=False).k.tolist() == [3, 1]
    assert route(logits, TopP(0.81, k_max=4, k_min=2), renormalize=False).k.tolist() == [3, 2]
    assert route(logits, RatioSkip(0.29, k_max=4), renormalize=False).k.tolist() == [3, 1]
    assert route(logits, RatioSkip(0.29, k_max=2), renormalize=False).k.tolist() == [2, 1]


def test_ties_break_by_lower_index():
    logits = torch.zeros(3, 8)
    plan = route(logits, TopK(3), renormalize=True)
    assert plan.expert_ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(plan.entropy, torch.full((3,), math.log(8)))


@pytest.fixture
def triton_backend():
    """route() forced onto the Triton kernel (the torch reference is what it runs on a CPU otherwise): compiled
    on a GPU, interpreted on a CPU, where tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is
    imported (as for tests/test_kernels.py). Yields the device to put logits on; the backend is restored after."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on a CPU"
    before = get_backend()
    set_backend("triton")
    try:
        yield "cuda" if torch.cuda.is_available() else "cpu"
    finally:
        set_backend(before)


@pytest.mark.parametrize("select", ["rowwise", "rowsort"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_give_the_same_plan(dtype, select, triton_backend, monkeypatch):
    """16-bit logits (the 16-bit row kernel: keys inserted, or 8-key chunks sorted and merged) give the plan of
    the same values in fp32 (the fp32 row kernel) and the reference's: the same experts and k; weights and
    entropies within the kernels' rounding (the two kernels sum in chunks of 8 and 4 logits: 1-2 ulp apart)."""
    import moelab.kernels.routing as kr

    monkeypatch.setitem(kr.LAUNCH, "select", select)
    g = torch.Generator().manual_seed(64)
    logits = torch.randn(16, 64, generator=g) * 3
    logits[::4] = logits[::4].round()  # exact ties
    logits[1::2] -= 9.0  # rows of negative logits (the 16-bit keys order their sign-magnitude bits)
    logits = logits.to(torch.bfloat16).to(triton_backend)  # exactly representable in all three
    pol = EntropyAdaptiveK((2, 5, 8), (1.3, 1.7))
    ref = route(logits.float(), pol, renormalize=False)
    got = route(logits.to(dtype), pol, renormalize=False)
    want = route_torch(logits.float(), pol, False)
    for plan in (ref, got):
        assert torch.equal(plan.expert_ids, want.expert_ids)
        assert torch.equal(plan.k, want.k)
        assert (plan.weights - want.weights).abs().max().item() <= 1e-6
        torch.testing.assert_close(plan.entropy, want.entropy, atol=1e-5, rtol=1e-6)
    assert (got.weights - ref.weights).abs().max().item() <= 1e-6


def test_empty_batch():
    plan = route(torch.empty(0, 8), EntropyAdaptiveK((1, 2), (1.0,)), renormalize=True)
    assert plan.expert_ids.shape == (0, 2) and plan.k.shape == (0,)


def test_numpy_integers_are_ints():
    """k values from a sweep's table (numpy integers) are accepted and kept as Python ints."""
    pols = [TopK(np.int64(2)), EntropyAdaptiveK((np.int32(1), np.int64(3)), (1.0,)), TopP(0.5, np.int64(4), np.int8(2))]
    assert pols[0].k == 2 and pols[1].k_values == (1, 3) and (pols[2].k_max, pols[2].k_min) == (4, 2)
    assert all(type(v) is int for v in (pols[0].k, *pols[1].k_values, pols[2].k_max, pols[2].k_min))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: EntropyAdaptiveK((1, 2, 4), (1.2, 0.6)), "strictly ascending"),
        (lambda: EntropyAdaptiveK((2, 1), (0.5,)), "k_values"),
        (lambda: EntropyAdaptiveK((1, 2, 4), (0.6,)), "need len"),
        (lambda: TopK(0), "k=0"),
        (lambda: TopP(0.0, k_max=2), "p=0.0"),
        (lambda: TopP(1.5, k_max=2), r"\(0, 1\]"),
        (lambda: RatioSkip(-0.1, k_max=2), "beta"),
        (lambda: TopP(0.5, k_max=2, k_min=3), "k_min"),
        (lambda: TopP(True, k_max=2), "p=True: must be a real number, not bool"),
        (lambda: RatioSkip("0.5", k_max=2), "beta='0.5': must be a real number, not str"),
        (lambda: EntropyAdaptiveK((1, 2), 1.0), "thresholds=1.0: must be a tuple or list"),
        (lambda: EntropyAdaptiveK(4, ()), "k_values=4: must be a tuple or list"),
        (lambda: EntropyAdaptiveK((1, 2), ("1.5",)), r"thresholds\[0\]='1.5': must be a real number"),
        (lambda: EntropyAdaptiveK((1, 2), (None,)), r"thresholds\[0\]=None"),
        (lambda: EntropyAdaptiveK((1, 2.5), (0.5,)), r"k_values\[1\]=2.5: must be an int"),
    ],
)
def test_bad_configuration(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_input():
    pol = TopK(2, renormalize=True)
    with pytest.raises(ValueError, match="k_max=9"):
        route(torch.randn(4, 8), TopK(9, renormalize=True))
    with pytest.raises(ValueError, match="rank 2"):
        route(torch.randn(2, 4, 8), pol)
    with pytest.raises(ValueError, match="num_experts=16"):
        route(torch.randn(4, 8), pol, num_experts=16)
    bad = torch.randn(4, 8)
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"logits\[2, 3\]=nan"):
        route(bad, pol)
    bad[2, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        route(bad, pol)
    with pytest.raises(ValueError, match="renormalize"):
        route(torch.randn(4, 8), TopK(2))
    wide = torch.randn(4, 8)
    wide[1, :2] = torch.tensor([3e38, -3e38])  # finite, but max - min overflows float32
    with pytest.raises(ValueError, match=r"logits\[1\] span .* float32 range"):
        route(wide, pol)
    with pytest.raises(ValueError, match=r"policy=None: must be a TopK, EntropyAdaptiveK, TopP or RatioSkip"):
        route(torch.randn(4, 8), None, renormalize=True)
    with pytest.raises(ValueError, match=r"renormalize='yes': must be True, False or None"):
        route(torch.randn(4, 8), TopK(2), renormalize="yes")
    with pytest.raises(ValueError, match=r"num_experts='8': must be an int"):
        route(torch.randn(4, 8), pol, num_experts="8")
    assert route(torch.randn(4, 8), pol, num_experts=np.int64(8)).num_experts == 8


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    """Forcing the kernel on CPU tensors without TRITON_INTERPRET names the fix, not '0 active drivers'."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = get_backend()
    set_backend("triton")
    try:
        with pytest.raises(ValueError, match=r"set_backend\('triton'\) on a cpu tensor: .*TRITON_INTERPRET=1"):
            route(torch.randn(4, 8), TopK(2, renormalize=True))
    finally:
        set_backend(before)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                      ("false", False), ("", False), ("2", False)])
def test_interpreter_switch_read_as_triton_reads_it(monkeypatch, value, on):
    """TRITON_INTERPRET=true / on / yes turn Triton's interpreter on as 1 does: moelab's CPU-input check agrees."""
    from moelab.kernels import check_kernel_input, interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on
    if on:
        check_kernel_input(torch.zeros(1), "x")
    else:
        with pytest.raises(ValueError, match="x on a cpu tensor"):
            check_kernel_input(torch.zeros(1), "x")


def test_numpy_scalars_and_extreme_rows():
    np = pytest.importorskip("numpy")
    assert TopP(np.float32(0.5), k_max=2) == TopP(0.5, k_max=2)  # stored as a float: same policy, same key
    assert RatioSkip(np.float64(0.25), k_max=2).beta == 0.25
    # unchecked, a row whose spread overflows (log-probabilities -inf) still has the entropy of the rest
    x = torch.tensor([[3e38, 3e38, -3e38, -3e38]])
    plan = route_torch(x, EntropyAdaptiveK((1, 3), (0.5,)), True)
    assert torch.isfinite(plan.entropy).all() and abs(float(plan.entropy[0]) - math.log(2)) < 1e-6
    assert plan.k.tolist() == [3]
    # unchecked, -inf logits beside a finite maximum are experts of probability 0 (ranked last, by index)
    plan = route(torch.tensor([[-INF, 0.0, -INF, 0.0]]), TopK(3), renormalize=False, check=False)
    assert plan.expert_ids.tolist() == [[1, 3, 0]] and plan.weights.tolist() == [[0.5, 0.5, 0.0]]
    assert abs(float(plan.entropy[0]) - math.log(2)) < 1e-6


def undefined_rows(dtype=torch.float32) -> torch.Tensor:
    """A finite row, then rows whose softmax is undefined: a NaN logit, a +inf one, all -inf, +inf beside -inf."""
    x = torch.arange(5 * 8, dtype=torch.float32).reshape(5, 8) % 7 / 2
    x[1, 3], x[2, 5], x[3], x[4, :2] = NAN, INF, -INF, torch.tensor([INF, -INF])
    return x.to(dtype)


# a finite row keeps more than k_min under each (entropy >= 0 > -1; beta = 0 keeps every finite probability)
UNDEFINED_POLICIES = [TopK(3), EntropyAdaptiveK((2, 3), (-1.0,)), TopP(0.9, k_max=4, k_min=2),
                      RatioSkip(0.0, k_max=4, k_min=2)]


def assert_undefined_rows(plan, policy, E: int, torch_ids: bool) -> None:
    """route()'s docstring on undefined rows (all but row 0): entropy NaN, k = k_min, NaN weights in the used
    slots, experts in [0, E) there (0, 1, ... in the torch reference), id -1 and weight 0 in the unused slots."""
    k, bad = policy.k_min, slice(1, None)
    assert plan.entropy[bad].isnan().all()
    assert plan.k[bad].tolist() == [k] * 4
    assert plan.weights[bad, :k].isnan().all()
    ids = plan.expert_ids[bad, :k]
    assert ((ids >= 0) & (ids < E)).all()
    if torch_ids:
        assert ids.tolist() == [list(range(k))] * 4
    assert (plan.expert_ids[bad, k:] == -1).all() and (plan.weights[bad, k:] == 0).all()


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("policy", UNDEFINED_POLICIES, ids=lambda p: type(p).__name__)
def test_unchecked_undefined_rows(policy, renorm):
    """check=False on rows with a NaN, a +inf or only -inf logits: as route() documents it, and the finite row
    beside them routes as it does alone (checked)."""
    x = undefined_rows()
    plan = route(x, policy, renormalize=renorm, check=False)
    assert_undefined_rows(plan, policy, 8, torch_ids=True)
    alone = route(x[:1], policy, renormalize=renorm)
    assert plan.k[0] > policy.k_min or isinstance(policy, TopK)
    for got, want in zip((plan.expert_ids, plan.weights, plan.k, plan.entropy),
                         (alone.expert_ids, alone.weights, alone.k, alone.entropy)):
        assert torch.equal(got[:1], want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter, on the NaN rows
@pytest.mark.parametrize("select, dtype", [("rounds", torch.float32), ("rowwise", torch.float32),
                                           ("rowwise", torch.bfloat16), ("rowsort", torch.bfloat16)])
def test_kernel_unchecked_undefined_rows(select, dtype, triton_backend, monkeypatch):
    """The Triton kernel (interpreted on a CPU) on the same rows, unchecked: what route() documents, with its own
    (unspecified) choice of experts in the used slots; the finite row as the torch reference routes it."""
    import moelab.kernels.routing as kr

    monkeypatch.setitem(kr.LAUNCH, "select", select)
    x = undefined_rows(dtype).to(triton_backend)
    for policy, renorm in ((UNDEFINED_POLICIES[1], True), (UNDEFINED_POLICIES[3], False)):
        plan = route(x, policy, renormalize=renorm, check=False)
        assert_undefined_rows(plan.to("cpu"), policy, 8, torch_ids=False)
        want = route_torch(x[:1].float(), policy, renorm)
        assert torch.equal(plan.expert_ids[:1], want.expert_ids) and torch.equal(plan.k[:1], want.k)


def test_reference_matches_route(triton_backend):
    """route() on the Triton kernel gives the torch reference's plan, also where probabilities tie (the lower
    expert index first)."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(32, 8, generator=g) * 2
    logits[::2] = logits[::2].round()  # exact ties on every other token
    logits[0] = 0.0  # all eight tied
    logits = logits.to(triton_backend)
    for pol in (TopK(2), TopP(0.6, k_max=4), EntropyAdaptiveK((1, 3), (1.5,))):
        a = route(logits, pol, renormalize=True)
        b = route_torch(logits, pol, True)
        assert torch.equal(a.expert_ids, b.expert_ids), pol
        assert torch.equal(a.k, b.k), pol
        assert (a.weights - b.weights).abs().max().item() <= 1e-6, pol
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-6)


def test_quantile_beyond_torch_quantiles_limit(monkeypatch):
    """routing.quantile is torch.quantile bit for bit, also on its own sort path, which it takes above torch.quantile's
    2^24-value limit (here with the limit lowered); evaluate's entropy quantiles go through it."""
    import moelab.routing as c
    from moelab.evaluate import entropy_quantiles

    monkeypatch.setattr(c, "QUANTILE_MAX", 0)  # the sort path at sizes torch.quantile also takes
    for n, dt in ((1, torch.float32), (7, torch.float32), (12345, torch.float64), (99991, torch.float32)):
        x = torch.randn(n, dtype=dt, generator=torch.Generator().manual_seed(n))
        q = torch.tensor([0.0, 0.05, 0.123456789, 0.5, 0.95, 1.0], dtype=dt)
        assert torch.equal(c.quantile(x, q), torch.quantile(x, q))
    monkeypatch.setattr(c, "QUANTILE_MAX", 5000)
    big = torch.rand(5001, generator=torch.Generator().manual_seed(0))
    got = entropy_quantiles(big)
    want = np.quantile(big.numpy().astype(np.float64), [0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95])
    assert list(got) == ["ent_q05", "ent_q10", "ent_q25", "ent_q50", "ent_q75", "ent_q90", "ent_q95"]
    np.testing.assert_allclose(list(got.values()), want, rtol=1e-6)


def test_ratio_skip_keeps_an_expert_at_exactly_beta_times_the_top():
    """p_i >= beta * p_1 keeps expert i: the boundary is kept (exact binary fractions), and beta = 1 on a flat
    router keeps every tied expert up to k_max."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    assert choose_k(RatioSkip(0.5, k_max=4), probs, torch.zeros(1)).item() == 2
    assert choose_k(RatioSkip(0.25, k_max=4), probs, torch.zeros(1)).item() == 4
    assert route(torch.zeros(2, 8), RatioSkip(1.0, k_max=4), renormalize=True).k.tolist() == [4, 4]


def test_contract_types_live_in_the_leaf_module():
    """moelab.routing re-exports the contract of moelab.plan (the same objects), and choose_k refuses what is no
    policy, naming it (tests/test_architecture.py checks that moelab.plan imports no other moelab module)."""
    import moelab.experts
    import moelab.plan
    import moelab.routing

    for name in ("RoutingPlan", "TopK", "EntropyAdaptiveK", "TopP", "RatioSkip", "Policy", "check_policy",
                 "resolve_renormalize", "KERNEL_MAX_EXPERTS", "KERNEL_MAX_K", "KERNEL_MAX_K_VALUES"):
        assert getattr(moelab.routing, name) is getattr(moelab.plan, name), name
    assert moelab.experts.PairLayout is moelab.plan.PairLayout
    with pytest.raises(ValueError, match="policy='top2': must be a TopK"):
        choose_k("top2", torch.zeros(1, 2), torch.zeros(1))
