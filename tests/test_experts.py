"""Skipping expert execution: matches a dense reference, and feeds only kept pairs to the GEMMs."""

import pytest
import torch
import torch.nn.functional as F

import moelab.experts as ex
from moelab.compute import plan_stats
from moelab.routing import EntropyAdaptiveK, TopK, TopP, route


def dense_reference(x_TD, plan, gate_up_EHD, down_EDF):
    """Every expert computed for every token, then masked by the plan (tests only)."""
    E = gate_up_EHD.shape[0]
    h = torch.einsum("td,ehd->teh", x_TD.float(), gate_up_EHD.float())
    g, u = h.chunk(2, -1)
    y_TED = torch.einsum("tef,edf->ted", F.silu(g) * u, down_EDF.float())
    w_TE = torch.zeros(x_TD.shape[0], E)
    ids = plan.expert_ids.long()
    w_TE.scatter_add_(1, ids.clamp_min(0), plan.weights * (ids >= 0))
    return (y_TED * w_TE[..., None]).sum(1)


@pytest.fixture
def layer():
    g = torch.Generator().manual_seed(0)
    T, D, Fd, E = 256, 32, 48, 8
    return (
        torch.randn(T, D, generator=g),
        torch.randn(E, 2 * Fd, D, generator=g) / D**0.5,
        torch.randn(E, D, Fd, generator=g) / Fd**0.5,
        torch.randn(T, E, generator=g) * 1.5,
    )


class RowCounter:
    """Wraps the real grouped GEMM and counts the rows it is fed."""

    def __init__(self):
        self.rows = []
        self.real = ex.grouped_gemm

    def __call__(self, x, w, offs):
        self.rows.append(x.shape[0])
        return self.real(x, w, offs)


def median_threshold(logits):
    h = route(logits, TopK(2), renormalize=True).entropy.sort().values
    mid = h.shape[0] // 2
    return float(h[mid - 1] + h[mid]) / 2  # half the tokens strictly below


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_adaptive_mean_k_1p5_feeds_25_percent_fewer_rows(layer, gemm, monkeypatch):
    x, gu, dn, logits = layer
    ex.set_gemm(gemm)
    try:
        counter = RowCounter()
        monkeypatch.setattr(ex, "grouped_gemm", counter)
        # threshold at the median entropy: half the tokens get k=1, half k=2 -> mean k = 1.5
        ada = route(logits, EntropyAdaptiveK((1, 2), (median_threshold(logits),)), renormalize=True)
        top2 = route(logits, TopK(2), renormalize=True)
        assert plan_stats(ada, native_k=2)["mean_k"] == 1.5
        y_ada = ex.run_experts(x, ada, gu, dn)
        rows_ada = counter.rows[:]
        counter.rows.clear()
        y_top2 = ex.run_experts(x, top2, gu, dn)
        rows_top2 = counter.rows[:]
    finally:
        ex.set_gemm("auto")
    T = x.shape[0]
    assert rows_top2 == [2 * T, 2 * T]  # gate/up GEMM and down GEMM
    assert rows_ada == [int(1.5 * T), int(1.5 * T)]
    assert 1 - rows_ada[0] / rows_top2[0] == 0.25
    assert plan_stats(ada, native_k=2)["expert_reduction"] == 0.25
    torch.testing.assert_close(y_ada, dense_reference(x, ada, gu, dn), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y_top2, dense_reference(x, top2, gu, dn), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", [TopK(1), TopK(3), TopP(0.6, k_max=4), EntropyAdaptiveK((1, 2, 4), (1.2, 1.6))])
@pytest.mark.parametrize("renorm", [True, False])
def test_matches_dense_reference(layer, policy, renorm):
    x, gu, dn, logits = layer
    plan = route(logits, policy, renormalize=renorm)
    torch.testing.assert_close(ex.run_experts(x, plan, gu, dn), dense_reference(x, plan, gu, dn), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, D, Fd", [(torch.float32, 6, 8), (torch.float32, 8, 3), (torch.bfloat16, 32, 12)])
def test_rows_not_16_byte_aligned_fall_back_to_the_loop(dtype, D, Fd):
    """torch._grouped_mm needs 16-byte rows on the CPU as on CUDA; other widths take the per-expert loop
    under 'auto' instead of failing inside torch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, D, generator=g).to(dtype)
    gu = (torch.randn(4, 2 * Fd, D, generator=g) / D**0.5).to(dtype)
    dn = (torch.randn(4, D, Fd, generator=g) / Fd**0.5).to(dtype)
    assert not (ex.grouped_mm_supported(x, gu) and ex.grouped_mm_supported(x, dn))
    plan = route(torch.randn(16, 4, generator=g), TopK(2), renormalize=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ex.run_experts(x, plan, gu, dn).float(), dense_reference(x, plan, gu, dn),
                               atol=tol, rtol=tol)


def test_forced_grouped_names_rows_it_cannot_take(monkeypatch):
    monkeypatch.setattr(ex, "_GEMM_MODE", "grouped")
    x, w = torch.randn(5, 20, dtype=torch.float16), torch.randn(3, 24, 20, dtype=torch.float16)  # K: 40 bytes
    with pytest.raises(ValueError, match=r"set_gemm\('grouped'\): .*\[3, 24, 20\].*multiple of 16 bytes"):
        ex.grouped_gemm(x, w, torch.tensor([2, 4, 5], dtype=torch.int32))


def test_bf16_grouped_matches_loop(layer):
    x, gu, dn, logits = (t.to(torch.bfloat16) for t in layer)
    plan = route(logits, TopK(2), renormalize=True)
    ex.set_gemm("loop")
    try:
        loop = ex.run_experts(x, plan, gu, dn)
    finally:
        ex.set_gemm("auto")
    grouped = ex.run_experts(x, plan, gu, dn)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=3e-2, rtol=3e-2)


def test_layout_is_expert_sorted_and_exact(layer):
    _, _, _, logits = layer
    plan = route(logits, TopP(0.5, k_max=4), renormalize=False)
    lay = ex.pair_layout(plan)
    assert lay.num_pairs == plan.kept_pairs()
    assert (lay.expert_idx[1:] >= lay.expert_idx[:-1]).all()
    assert int(lay.offsets[-1]) == lay.num_pairs
    counts = torch.bincount(plan.expert_ids[plan.expert_ids >= 0].long(), minlength=8)
    assert torch.equal(torch.diff(lay.offsets, prepend=torch.zeros(1, dtype=torch.int32)), counts.int())


def test_empty_and_mismatch(layer):
    x, gu, dn, logits = layer
    plan = route(logits[:0], TopK(2), renormalize=True)
    assert ex.run_experts(x[:0], plan, gu, dn).shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="tokens"):
        ex.run_experts(x[:5], route(logits, TopK(2), renormalize=True), gu, dn)


def test_weights_that_do_not_fit_are_named(layer):
    x, gu, dn, logits = layer
    plan = route(logits, TopK(2, renormalize=True))
    with pytest.raises(ValueError, match=r"down \(6, 32, 48\): must be \[E, 2F, D\] / \[E, D, F\] with E=8"):
        ex.run_experts(x, plan, gu, dn[:6])
    with pytest.raises(ValueError, match=r"must be \[E, 2F, D\] / \[E, D, F\]"):
        ex.run_experts(x, plan, gu, dn[:, :, :5])
    with pytest.raises(ValueError, match=r"must be \[T, D\], \[E, 2F, D\] and \[E, D, F\]"):
        ex.run_experts(x[None], plan, gu, dn)
    with pytest.raises(ValueError, match=r"dtypes x torch.bfloat16, gate_up torch.float32.*must be one dtype"):
        ex.run_experts(x.bfloat16(), plan, gu, dn)
    with pytest.raises(ValueError, match=r"dtypes x torch.float32, gate_up torch.float32, down torch.bfloat16"):
        ex.run_experts(x, plan, gu, dn.bfloat16())
    # weights of 6 experts, consistent among themselves, for a plan over 8
    with pytest.raises(ValueError, match=r"plan has num_experts=8 but the weights have E=6"):
        ex.run_experts(x, plan, gu[:6], dn[:6])


def test_a_plan_that_does_not_fit_is_named(layer):
    """Bad plans are refused before any GEMM, naming what is wrong; ids out of range only on CPU (no host sync on
    CUDA, so a forward stays capturable)."""
    import dataclasses

    x, gu, dn, logits = layer
    plan = route(logits, TopK(2, renormalize=True))
    with pytest.raises(ValueError, match="plan=None: must be a RoutingPlan"):
        ex.run_experts(x, None, gu, dn)
    with pytest.raises(ValueError, match=r"weights \(256, 1\).*must be \[T, K\], \[T, K\] and \[T\]"):
        ex.run_experts(x, dataclasses.replace(plan, weights=plan.weights[:, :1]), gu, dn)
    with pytest.raises(ValueError, match=r"k \(2,\): must be \[T, K\]"):
        ex.run_experts(x, dataclasses.replace(plan, k=plan.k[:2]), gu, dn)
    with pytest.raises(ValueError, match="expert_ids torch.float32.*must be integer ids"):
        ex.run_experts(x, dataclasses.replace(plan, expert_ids=plan.expert_ids.float()), gu, dn)
    with pytest.raises(ValueError, match="expert_ids torch.bool.*must be integer ids"):
        ex.run_experts(x, dataclasses.replace(plan, expert_ids=plan.expert_ids > 0), gu, dn)
    with pytest.raises(ValueError, match="weights torch.int64: must be integer ids and float weights"):
        ex.run_experts(x, dataclasses.replace(plan, weights=plan.weights.long()), gu, dn)
    with pytest.raises(ValueError, match="dtypes x torch.int64.*must be one dtype, a floating-point one"):
        ex.run_experts(x.long(), plan, gu.long(), dn.long())
    for bad in (8, -5, -2):
        ids = plan.expert_ids.clone()
        ids[3, 1] = bad
        with pytest.raises(ValueError, match=rf"plan.expert_ids holds {bad}: must be -1 \(unused\) or .*E=8"):
            ex.run_experts(x, dataclasses.replace(plan, expert_ids=ids), gu, dn)
    # num_experts agrees with the weights' 4 experts, but the ids reach 7
    with pytest.raises(ValueError, match=r"plan.expert_ids holds [4-7]: .*E=4"):
        ex.run_experts(x, dataclasses.replace(plan, num_experts=4), gu[:4], dn[:4])
    with pytest.raises(ValueError, match=r"plan k \(2,\), expert_ids \(256, 2\): k must be \[T\]"):
        plan_stats(dataclasses.replace(plan, k=plan.k[:2]), 2)
    assert ex.run_experts(x, dataclasses.replace(plan, weights=plan.weights.half()), gu, dn).shape == x.shape
