"""Triton routing kernel and padded pair layout: identical to the torch reference, no host sync.

On a CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py, before any kernel
module is imported) on small shapes; on a GPU they run compiled, and the `gpu` tests add large random shapes,
CUDA-graph capture and a no-host-sync check.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on a CPU"

pytest.importorskip("triton")
import triton  # noqa: E402

import moelab.experts as ex  # noqa: E402
import moelab.kernels.routing as kr  # noqa: E402
from moelab.kernels.layout import pair_layout_padded  # noqa: E402
from moelab.kernels.routing import RoutingStats, route_triton  # noqa: E402
from moelab.plan import KERNEL_MAX_EXPERTS as MAX_EXPERTS  # noqa: E402
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP, route, route_torch, set_backend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def policies(E: int, rng: torch.Generator):
    kmax = min(E, 1 + int(torch.randint(8, (1,), generator=rng)))
    ks = sorted({1, max(1, kmax // 2), kmax})
    hmax = math.log(E)
    th = sorted(float(v) for v in torch.rand(len(ks) - 1, generator=rng) * hmax)
    if len(set(th)) != len(th):
        ks, th = [kmax], []
    return [
        TopK(kmax),
        EntropyAdaptiveK(tuple(ks), tuple(th)),
        TopP(float(torch.rand(1, generator=rng)) * 0.95 + 0.05, k_max=kmax, k_min=min(2, kmax)),
        RatioSkip(float(torch.rand(1, generator=rng)), k_max=kmax),
    ]


def near_boundary(logits: torch.Tensor, policy, tol: float = 1e-5) -> torch.Tensor:
    """Tokens whose k the reference decides within rounding of a threshold (either answer is right)."""
    ref = route_torch(logits, TopK(policy.k_max), False)
    p = ref.weights
    if isinstance(policy, EntropyAdaptiveK):
        t = torch.tensor(policy.thresholds or [float("inf")], device=logits.device)
        return ((ref.entropy[:, None] - t).abs() < tol).any(-1)
    if isinstance(policy, TopP):
        return ((torch.cumsum(p, -1) - policy.p).abs() < tol).any(-1)
    if isinstance(policy, RatioSkip):
        return ((p - policy.beta * p[:, :1]).abs() < tol).any(-1)
    return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)


def assert_same_plan(logits, policy, renorm, stats=None):
    ref = route_torch(logits, policy, renorm)
    got = route_triton(logits, policy, renorm, stats)
    assert got.expert_ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert got.k.dtype == torch.int32 and got.entropy.dtype == torch.float32
    assert got.expert_ids.shape == ref.expert_ids.shape and got.num_experts == ref.num_experts
    if logits.shape[0] == 0:
        return ref, got
    ok = ~near_boundary(logits, policy)
    assert ok.float().mean() > 0.9
    assert torch.equal(got.k[ok], ref.k[ok]), policy
    assert torch.equal(got.expert_ids[ok], ref.expert_ids[ok]), policy
    assert (got.weights[ok] - ref.weights[ok]).abs().max().item() <= 1e-6, policy
    torch.testing.assert_close(got.entropy, ref.entropy, atol=1e-5, rtol=1e-6)
    return ref, got


@pytest.fixture(params=list(kr.SELECTS))
def select(request, monkeypatch):
    """Every top-k selection of the routing kernel: rounds of an int64 key max on tiles, one row per thread with
    keys inserted, and one row per thread with 8-key chunks sorted and merged."""
    monkeypatch.setitem(kr.LAUNCH, "select", request.param)
    return request.param


# each selection on the logit dtypes where it is its own kernel: the tile kernel reads every dtype as fp32, and for
# fp32 logits 'rowsort' is 'rowwise' (the int64-key row kernel)
SELECT_DTYPES = [("rounds", torch.float32), ("rounds", torch.bfloat16), ("rowwise", torch.float32),
                 ("rowwise", torch.bfloat16), ("rowwise", torch.float16), ("rowsort", torch.bfloat16),
                 ("rowsort", torch.float16)]


@pytest.mark.parametrize("E", [2, 8, 60, 64, 128, 256, 512])
@pytest.mark.parametrize("sel,dtype", SELECT_DTYPES)
def test_kernel_matches_reference(E, sel, dtype, monkeypatch):
    if dtype == torch.float32 and sel != "rounds" and E > kr.MAX_ROWWISE_E:
        pytest.skip("the fp32 row kernel takes E <= 64: 'rounds' covers these")
    monkeypatch.setitem(kr.LAUNCH, "select", sel)
    if E >= 128:  # interpreted, a piece's chunk loop costs: a wide row in 4 pieces (test_rows16_* split them more)
        monkeypatch.setitem(kr.LAUNCH, "split", 4)
    rng = torch.Generator().manual_seed(E * 7 + dtype.itemsize)
    # T = 19: two programs of the row kernels' 16-row tile (E > 8), the second part masked; the interpreter's cost
    # is per program, so a third adds nothing
    for T in (0, 1, 19) if E <= 64 else (0, 6) if E <= 256 else (3,):
        scale = float(torch.rand(1, generator=rng)) * 4
        logits = (torch.randn(T, E, generator=rng) * scale).to(dtype).to(DEV)
        pols = policies(E, rng)
        if E == 512:  # Qwen3-Next's router: 512 experts, top-10 (beyond the row kernels' k <= 8)
            pols = [pols[0], pols[3], EntropyAdaptiveK((2, 5, 10), (5.0, 5.8))]
        for i, pol in enumerate(pols):  # each policy with and without renormalisation over the T
            assert_same_plan(logits, pol, (i + T) % 2 == 1)


def test_ties_break_by_lower_index(select):
    rng = torch.Generator().manual_seed(1)
    # few distinct values: many exact ties, in every dtype, plus an all-equal row
    logits = torch.randint(-2, 3, (40, 16), generator=rng).float()
    logits[0] = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for pol in (TopK(5), TopP(0.5, k_max=6), RatioSkip(0.9, k_max=6), EntropyAdaptiveK((2, 5), (2.0,))):
            _, got = assert_same_plan(logits.to(dtype).to(DEV), pol, True)
            assert got.expert_ids[0, :5].tolist() == [0, 1, 2, 3, 4] or pol.k_max == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_distinct_logits_of_equal_probability(dtype, select):
    """The documented exception: logits 0 and 1e-7 differ, but x - max rounds to the same fp32 value (and
    -120 / -110 both underflow), so their probabilities tie. The reference and the fp32-key selections take
    the lower index; the 16-bit row kernels rank by logit and take the larger one: the true order."""
    x = torch.tensor([[8.0, 0.0, 1e-7, -20.0], [0.0, -120.0, -110.0, -130.0]], dtype=dtype).to(DEV)
    ref = route_torch(x, TopK(3), True)
    got = route_triton(x, TopK(3), True)
    assert ref.expert_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    by_logit = select in ("rowwise", "rowsort")
    assert got.expert_ids.tolist() == ([[0, 2, 1], [0, 2, 1]] if by_logit else ref.expert_ids.tolist())
    assert (got.weights - ref.weights).abs().max().item() <= 1e-6  # the tied weights are equal either way


@pytest.mark.parametrize("split", [1, 2])
def test_a_row_spanning_the_fp32_range_keeps_finite_sums(select, split, monkeypatch):
    """bf16 logits can span 3e38 (route's check admits any row whose spread fits fp32): when a later chunk raises
    the running max that far, the online sums' rescale must not make 0 * -inf = NaN. Entropy, k and the
    statistics match the reference, with the max in a later chunk (or row piece) than the first."""
    monkeypatch.setitem(kr.LAUNCH, "split", split)
    x = torch.zeros(3, 16)
    x[:, :8] = -1.5e38  # the first chunk: tied logits far below the row's max
    x[:, 12] = 1.5e38
    x[1, :8] = -1e30
    x[2, 12] = 3.0  # an ordinary row beside them
    x = x.to(torch.bfloat16).to(DEV)
    pol = EntropyAdaptiveK((1, 4), (-1.0,))  # every finite entropy keeps 4
    stats = RoutingStats.zeros(4, DEV)
    ref, got = route_torch(x, pol, True), route_triton(x, pol, True, stats)
    assert torch.isfinite(got.entropy).all() and got.k.tolist() == ref.k.tolist() == [4, 4, 4]
    torch.testing.assert_close(got.entropy, ref.entropy, atol=1e-5, rtol=1e-6)
    assert (got.weights - ref.weights).abs().max().item() <= 1e-6  # which of the tied zero-probability
    assert got.expert_ids[:, 0].tolist() == [12, 12, 12]  # experts fill slots 2-4 is the documented exception
    assert math.isfinite(stats.summary()["mean_entropy"])


def test_stats_accumulate_on_device():
    """The device statistics over several calls: the k histogram, kept pairs and nats per token of the plans."""
    rng = torch.Generator().manual_seed(2)
    pol = EntropyAdaptiveK((1, 2, 4), (1.2, 1.7))
    mine = RoutingStats.zeros(4, DEV)
    kept, ks, ents = 0, [], []
    for T in (0, 5, 33, 64):
        logits = (torch.randn(T, 8, generator=rng) * 2).to(DEV)
        kept += int(route_triton(logits, pol, True, stats=mine).k.sum())
        ref = route_torch(logits, pol, True)
        ks.append(ref.k.long())
        ents.append(ref.entropy.double())
    a = mine.summary()
    assert a["tokens"] == 102
    assert a["k_hist"] == torch.bincount(torch.cat(ks), minlength=5).tolist() and a["k_hist"][0] == a["k_hist"][3] == 0
    assert a["mean_k"] == pytest.approx(kept / 102)  # kept pairs per token
    assert a["mean_entropy"] == pytest.approx(float(torch.cat(ents).mean()), rel=1e-6)  # nats per token
    mine.reset()
    assert mine.summary()["tokens"] == 0


def test_dispatch_switch():
    logits = (torch.randn(20, 8) * 2).to(DEV)
    pol = TopP(0.7, k_max=3)
    try:
        set_backend("triton")
        a = route(logits, pol, renormalize=False)
        set_backend("torch")
        b = route(logits, pol, renormalize=False)
    finally:
        set_backend("auto")
    assert torch.equal(a.expert_ids, b.expert_ids)
    assert (a.weights - b.weights).abs().max() <= 1e-6


def test_bad_input():
    with pytest.raises(ValueError, match=f"E={MAX_EXPERTS + 1}"):
        route_triton(torch.zeros(2, MAX_EXPERTS + 1, device=DEV), TopK(2), True)
    with pytest.raises(ValueError, match="k_max=257: the Triton routing kernel takes at most 256 slots"):
        route_triton(torch.zeros(2, 300, device=DEV), TopK(257), True)
    with pytest.raises(ValueError, match="at most 8 k values"):
        route_triton(torch.zeros(2, 16, device=DEV), EntropyAdaptiveK(tuple(range(1, 10)), tuple(range(8))), True)
    with pytest.raises(ValueError, match=r"slots, k_max \+ 1 = 3"):
        route_triton(torch.zeros(2, 16, device=DEV), TopK(2), True, stats=RoutingStats.zeros(3, DEV))
    with pytest.raises(ValueError, match="stats on meta"):  # the direct launch passes bare addresses
        route_triton(torch.zeros(2, 16, device=DEV), TopK(2), True, stats=RoutingStats.zeros(2, "meta"))
    with pytest.raises(ValueError, match="k_max"):
        RoutingStats.zeros(0, DEV)


def check_layout(plan):
    ref = ex.pair_layout(plan.to("cpu"))
    got = pair_layout_padded(plan)
    T, K = plan.expert_ids.shape
    P = ref.num_pairs
    assert got.padded and got.num_pairs == T * K
    assert torch.equal(got.offsets.cpu(), ref.offsets)
    assert torch.equal(got.token_idx[:P].cpu(), ref.token_idx)
    assert torch.equal(got.expert_idx[:P].cpu(), ref.expert_idx)
    assert torch.equal(got.weights[:P].cpu(), ref.weights)
    assert (got.token_idx[P:] == T).all() and (got.weights[P:] == 0).all()
    assert (got.expert_idx[P:] == plan.num_experts).all()
    # slot_row: each used plan slot points at its own pair, unused slots at -1
    ids = plan.expert_ids.long()
    row = got.slot_row.long()
    assert torch.equal(row >= 0, ids >= 0)
    t = torch.arange(T, device=ids.device)[:, None].expand(T, K)
    used = ids >= 0
    assert torch.equal(got.token_idx[row[used]], t[used]) and torch.equal(got.expert_idx[row[used]], ids[used])


@pytest.mark.parametrize("E", [2, 8, 60, 256])
def test_padded_layout_matches_reference(E):
    rng = torch.Generator().manual_seed(E)
    for T in (0, 1, 9, 150):
        logits = (torch.randn(T, E, generator=rng) * 2).to(DEV)
        check_layout(route_torch(logits, TopP(0.6, k_max=min(4, E)), False))


@pytest.mark.parametrize("E,k_max,slots,cells", [(8, 4, 16, 2), (60, 3, 8, 4), (24, 4, 4, 1), (256, 8, 64, 256)])
def test_padded_layout_small_blocks_and_scan_tiles(E, k_max, slots, cells, monkeypatch):
    """Blocks of a few plan slots (k_max = 3: blocks cut tokens), scan tiles of 1 to 256 counts with a running
    carry, several experts or one per scan program: the layout is still the reference's."""
    import moelab.kernels.layout as lk

    monkeypatch.setitem(lk.LAUNCH, "block_slots", slots)
    monkeypatch.setitem(lk.LAUNCH, "scan_cells", cells)
    logits = (torch.randn(48, E, generator=torch.Generator().manual_seed(3)) * 2).to(DEV)
    check_layout(route_torch(logits, TopP(0.6, k_max=k_max), False))
    check_layout(route_torch(logits[:1], TopK(1), False))  # one slot: blocks of two, the second past N


def test_padded_layout_block_sizes():
    """Plan slots per block: a power of two from 2 to 512, at most the slots there are (rounded up)."""
    import moelab.kernels.layout as lk

    for E in (2, 8, 60, 64, 128, 256):
        for N in (1, 2, 7, 4096, 32768, 1 << 19, 1 << 23):
            q = lk._block_slots(N, E)
            assert q == lk.pow2(q) and 2 <= q <= 512 and q <= max(2, lk.pow2(N))
    assert lk._block_slots(4096 * 8, 64) == 256 and lk._block_slots(65536 * 8, 64) == 512
    assert lk._block_slots(4096 * 4, 60) == 128 and lk._block_slots(65536 * 2, 8) == 128
    assert lk.launch_config(65536 * 8, 64) == (512, 4, 1024)


def test_padded_layout_launch_overrides(monkeypatch):
    """LAUNCH overrides Q, warps and scan tile; Q is still cut to the slots there are; bad values name the rule."""
    import moelab.kernels.layout as lk

    monkeypatch.setitem(lk.LAUNCH, "block_slots", 1024)
    monkeypatch.setitem(lk.LAUNCH, "warps", 2)
    assert lk.launch_config(4096, 8) == (1024, 2, 1024) and lk.launch_config(5, 8) == (8, 2, 1024)
    for key, bad in (("block_slots", 96), ("block_slots", 1), ("warps", 0), ("scan_cells", 3), ("warps", True)):
        monkeypatch.setitem(lk.LAUNCH, key, bad)
        with pytest.raises(ValueError, match=rf"LAUNCH\['{key}'\]=.*power of two"):
            lk.launch_config(4096, 8)
        monkeypatch.setitem(lk.LAUNCH, key, {"block_slots": 1024, "warps": 2}.get(key))


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_layout_runs_the_same_experts(gemm, dtype):
    g = torch.Generator().manual_seed(3)
    T, D, Fd, E = 48, 16, 24, 8
    x = torch.randn(T, D, generator=g).to(DEV, dtype)
    gu = (torch.randn(E, 2 * Fd, D, generator=g) / 4).to(DEV, dtype)
    dn = (torch.randn(E, D, Fd, generator=g) / 5).to(DEV, dtype)
    plan = route_torch((torch.randn(T, E, generator=g) * 2).to(DEV), EntropyAdaptiveK((1, 2), (1.5,)), True)
    assert plan.kept_pairs() < T * 2  # tokens at k = 1: the padded layout has padding rows
    ex.set_gemm(gemm)
    try:
        ex.set_layout("exact")
        exact = ex.run_experts(x, plan, gu, dn)
        exact_gelu = ex.run_experts(x, plan, gu, dn, act_fn=F.gelu)
        ex.set_layout("padded")
        padded = ex.run_experts(x, plan, gu, dn)
        padded_gelu = ex.run_experts(x, plan, gu, dn, act_fn=F.gelu)  # not SiLU: the torch ops on padded rows
    finally:
        ex.set_layout("auto")
        ex.set_gemm("auto")
    assert padded.dtype == exact.dtype == padded_gelu.dtype == dtype  # run_experts returns x's dtype
    for p, e in ((padded, exact), (padded_gelu, exact_gelu)):
        if dtype == torch.float32:
            torch.testing.assert_close(p, e, atol=1e-5, rtol=1e-5)
        else:  # bf16 intermediates rounded at other points: compare as a whole
            assert float((p.float() - e.float()).norm() / e.float().norm()) < 1e-2


# ---------------------------------------------------------------- GPU: in full


def test_swiglu_rows_round_like_torch():
    """swiglu_rows: silu(gate) rounded to the data type (as F.silu(gate) is), then the product rounded: in fp16
    the same bits as F.silu(g) * u on the rows below P = offsets[-1]."""
    from moelab.kernels.experts import swiglu_rows

    g = torch.Generator().manual_seed(4)
    Fd = 48
    h = (torch.randn(40, 2 * Fd, generator=g) * 3).to(DEV, torch.float16)
    offsets = torch.tensor([10, 10, 29], dtype=torch.int32, device=DEV)  # P = 29 of 40 rows
    a = swiglu_rows(h, offsets)
    assert a.shape == (40, Fd) and a.dtype == torch.float16
    ref = F.silu(h[:29, :Fd]) * h[:29, Fd:]
    assert torch.equal(a[:29], ref)


def test_launch_config_overrides(monkeypatch):
    assert kr.launch_config(4096, 64) == {"select": "rounds", "warps": 4, "tile": 1024, "split": 1}
    assert kr.launch_config(4096, 8)["warps"] == 8
    monkeypatch.setitem(kr.LAUNCH, "select", "rowsort")
    assert kr.launch_config(16, 64)["select"] == "rowsort"
    with pytest.raises(ValueError, match=r"select='bitonic': must be one of \('rounds', 'rowwise', 'rowsort'\)"):
        kr._rows_select(4, "bitonic")
    # the tuned table is keyed on (BLOCK_E, BLOCK_K); another k_max takes the nearest BLOCK_K of its BLOCK_E
    table = {(64, 4): ["k4"], (64, 8): ["k8"], (8, 2): ["e8"]}
    assert kr._tuned_entries(table, 64, 4) == ["k4"] and kr._tuned_entries(table, 64, 16) == ["k8"]
    assert kr._tuned_entries(table, 64, 2) == ["k4"] and kr._tuned_entries(table, 128, 8) == []
    # equally near BLOCK_Ks (one power of two either side): the larger
    assert kr._tuned_entries({(64, 2): ["k2"], (64, 8): ["k8"]}, 64, 4) == ["k8"]
    # rows: up to k_max 8; fp32 logits (int64 keys, unrolled: compile time grows with E) up to BLOCK_E 64,
    # 16-bit logits (32-bit keys, a loop over chunks) any E; else rounds
    assert kr._rows_select(8, "rowwise", 64) and kr._rows_select(8, "rowwise", 256, 2)
    assert not any((kr._rows_select(9, "rowwise", 64), kr._rows_select(8, "rowwise", 128),
                    kr._rows_select(9, "rowwise", 64, 2), kr._rows_select(4, "rounds", 8, 2)))
    assert kr._rows_select(12, "rowsort", 64, 2) and not kr._rows_select(12, "rowsort", 64)


def test_a_device_without_tuned_launches_takes_a_same_sm_devices(monkeypatch):
    """A GPU's own TUNED entries, else, shape by shape, those of a TUNED_ON device with the same compute
    capability and SM count (the H100 SXM has its own routing and GEMM tables, and takes the H200's for the
    256- and 512-expert routers it was not tuned on), else none (the defaults); launch configurations follow."""
    import moelab.kernels as kernels
    import moelab.kernels.grouped as gk

    def as_device(name, arch):
        monkeypatch.setattr(kernels, "device_identity", lambda i: (name, arch))
        kr.clear_launch_caches()
        gk._launch_config.cache_clear()

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    last = {d: {key: entries[-1][1] for key, entries in kr.TUNED[d].items()} for d in (h100, h200)}  # T = 65536
    assert last[h100][(128, 8)] != last[h200][(128, 8)] and (512, 16) not in kr.TUNED[h100]
    try:
        as_device(h100, (9, 0, 132))
        assert kernels.tuned_tables(kr.TUNED, 0) == [h100, h200] and kernels.tuned_for(gk.TUNED, 0) == h100
        assert kr._launch_config(65536, 128, 8, 0, (None,) * 4) == {**kr.DEFAULT, **last[h100][(128, 8)]}
        assert kr._launch_config(65536, 512, 10, 0, (None,) * 4) == {**kr.DEFAULT, **last[h200][(512, 16)]}
        olmoe = gk._launch_config(32768, 64, 2048, 1024, 0)
        assert olmoe["gate_up"] == {**gk.DEFAULT["gate_up"], **gk.TUNED[h100][(2048, 1024)][0][1]["gate_up"]}
        assert kernels.device_table(gk.TUNED, 0) == gk.TUNED[h100]
        few = gk._launch_config(128, 8, 4096, 14336, 0)  # Mixtral-like T = 64: the H100's own few-row launch
        assert few["gate_up"]["BLOCK_M"] == few["down"]["BLOCK_M"] == 32 and few["down"]["TMA"]
        as_device(h200, (9, 0, 132))  # its own few-row launch (gate_up through TMA too), not the H100's
        few200 = gk._launch_config(128, 8, 4096, 14336, 0)
        assert few200["gate_up"]["BLOCK_M"] == 32 and few200["gate_up"]["TMA"] and few200 != few
        assert gk._launch_config(32768, 64, 2048, 1024, 0)["gate_up"]["BLOCK_M"] == 64  # its many-row table
        as_device("Another GH100", (9, 0, 132))  # no table of its own: the same-SM devices', the first listed
        # but the few-row launches are per device only: FEW_ROWS[0], as off CUDA
        assert gk._launch_config(128, 8, 4096, 14336, 0) == gk.FEW_ROWS[0][1] == gk._launch_config(128, 8, 4096,
                                                                                                    14336, -1)
        assert kernels.tuned_for(kr.TUNED, 0) == h200 and kernels.device_table(kr.TUNED, 0) == {
            **kr.TUNED[h100], **kr.TUNED[h200]}
        assert kr._launch_config(65536, 128, 8, 0, (None,) * 4) == {**kr.DEFAULT, **last[h200][(128, 8)]}
        assert gk._launch_config(32768, 64, 2048, 1024, 0) != gk._launch_config(32768, 64, 2048, 1024, -1)
        assert kernels.tuned_for(kr.TUNED, -1) is None and kernels.device_table(kr.TUNED, -1) == {}  # not CUDA
        as_device("NVIDIA H100 PCIe", (9, 0, 114))  # another SM count: defaults
        assert kernels.tuned_for(kr.TUNED, 0) is None
        assert kr._launch_config(65536, 128, 8, 0, (None,) * 4) == kr._launch_config(65536, 128, 8, -1, (None,) * 4)
        as_device("NVIDIA A100-SXM4-80GB", (8, 0, 108))
        assert kernels.tuned_for(gk.TUNED, 0) is None
        as_device("Own GPU", (9, 0, 132))  # a device with its own table (a tuning run adds one) keeps it
        monkeypatch.setitem(kr.TUNED, "Own GPU", {(128, 8): [(2**62, {"split": 4})]})
        assert kernels.tuned_for(kr.TUNED, 0) == "Own GPU" and kernels.tuned_for(gk.TUNED, 0) == h200
        assert kr._launch_config(65536, 128, 8, 0, (None,) * 4)["split"] == 4
    finally:
        kr.clear_launch_caches()
        gk._launch_config.cache_clear()



def test_tuned_tables_round_trip_through_their_json_files(tmp_path):
    """Every device's config file reads back as the tables the kernels run with, writes back to the same file, and
    an edited table round-trips too (integer keys, bounds with null for 'any size', nested launches)."""
    import moelab.kernels as kernels
    import moelab.kernels.grouped as gk

    files = sorted(kernels.CONFIGS.glob("*.json"))
    assert {kernels.read_config(f)["device"] for f in files} == set(kr.TUNED) == set(gk.TUNED) == set(gk.FEW_TUNED)
    for f in files:
        cfg = kernels.read_config(f)
        dev = cfg["device"]
        assert (cfg["routing"], cfg["grouped"], cfg["few_rows"]) == (kr.TUNED[dev], gk.TUNED[dev], gk.FEW_TUNED[dev])
        assert kernels.write_config(dev, cfg, tmp_path).read_text() == f.read_text()
    mine = {"routing": {(64, 8): [(16, {"select": "rowwise", "warps": 2, "tile": 512, "split": 8}),
                                  (kernels.UNBOUNDED, dict(kr.DEFAULT, warps=4))]},
            "grouped": {(2048, 1024): [(4096, {"down": {"BLOCK_N": 256}, "beats_cutlass": True})]},
            "few_rows": {(64, 32): {"gate_up": {"BLOCK_M": 32, "TMA": True}}}}
    path = kernels.write_config("My GPU 2", mine, tmp_path)
    assert path.name == "My_GPU_2.json" and "null" in path.read_text()
    assert kernels.read_config(path) == {"device": "My GPU 2", **mine}


@pytest.mark.parametrize("device,expected", [
    ("NVIDIA H200", [("rounds", 4, 1024, 1), ("rowsort", 4, 2048, 4), ("rowsort", 4, 8192, 2),
                     ("rowsort", 4, 4096, 8), ("rowsort", 2, 4096, 8)]),
    ("NVIDIA H100 80GB HBM3", [("rounds", 4, 1024, 1), ("rowsort", 4, 2048, 4), ("rowsort", 2, 4096, 2),
                               ("rowsort", 4, 4096, 8), ("rowsort", 2, 4096, 8)]),
])
def test_tuned_lookup_picks_the_launches_of_the_tables_it_was_converted_from(device, expected, monkeypatch):
    """The launches a device looks up for a few routing shapes (T, E, k_max) and expert-GEMM shapes (N rows, E, D,
    F) from the JSON tables: what the Python tables they replaced gave (the H100 takes the H200's wide routers)."""
    import moelab.kernels as kernels
    import moelab.kernels.grouped as gk

    monkeypatch.setattr(kernels, "device_identity", lambda i: (device, (9, 0, 132)))
    kr.clear_launch_caches()
    gk._launch_config.cache_clear()
    try:
        shapes = ((16, 8, 2), (4096, 64, 8), (65536, 128, 8), (1000, 256, 8), (65536, 512, 10))
        got = [tuple(kr._launch_config(T, E, K, 0, (None,) * 4).values()) for T, E, K in shapes]
        assert got == expected
        mixtral_decode = gk._launch_config(128, 8, 4096, 14336, 0)
        assert mixtral_decode["down"] == {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8,
                                          "num_stages": 4, "TMA": True}
        assert mixtral_decode["gate_up"].get("TMA", False) == (device == "NVIDIA H200")
        olmoe = gk._launch_config(32768, 64, 2048, 1024, 0)
        assert olmoe["down"] == {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 5,
                                 "GROUP_M": 16, "TMA": True, "PERSISTENT": True, "FLATTEN": True}
        assert olmoe["gate_up"]["BLOCK_M"] == (64 if device == "NVIDIA H200" else 128)
    finally:
        kr.clear_launch_caches()
        gk._launch_config.cache_clear()

def test_launch_spec_separates_what_triton_specialises_on():
    """The direct launch's cache key (`_spec`): ints by == 1, % 16 and 32 / 64 bits, bools apart from ints,
    tensors by dtype and 16-byte alignment, int subclasses as ints, floats not at all."""
    import enum

    from moelab.kernels import _spec

    class N(enum.IntEnum):
        SIXTEEN = 16

    assert len({_spec(1), _spec(2), _spec(16), _spec(2**31), _spec(2**31 + 1)}) == 5
    assert _spec(8) != _spec(16) and _spec(24) != _spec(32) and _spec(8) == _spec(24)  # % 16, not % 8
    assert _spec(2**31) == _spec(-(2**31) - 16) != _spec(-(2**31))  # 64-bit either side, -2^31 fits 32
    assert _spec(3) == _spec(5) and _spec(32) == _spec(48) and _spec(N.SIXTEEN) == _spec(16)
    assert _spec(True) != _spec(1) and _spec(False) != _spec(0)
    assert _spec(0.5) == _spec(2.0) and _spec(None) != _spec(0.5)
    t = torch.zeros(16, dtype=torch.bfloat16)
    assert _spec(t) == (torch.bfloat16, True) and _spec(t[1:]) == (torch.bfloat16, False)
    assert t.data_ptr() % 16 == 0 and _spec(t[4:]) == (torch.bfloat16, False)  # 8 bytes in: not 16-byte aligned
    assert _spec(t[8:]) == _spec(t)  # 16 bytes in
    assert _spec(t.float()) != _spec(t)


def test_prepared_call_keyed_on_what_the_launch_derives_from(monkeypatch):
    """route_triton derives a call's launch once per (dtype, alignment, shape, policy, renormalisation,
    overrides): an equal policy (another object) reuses it; a change in any of them prepares its own, and
    every plan still matches the torch reference. Calls with statistics are prepared each time."""
    monkeypatch.setattr(kr, "_PREPARED", {})
    rng = torch.Generator().manual_seed(5)
    big = torch.randn(9 * 16 + 8, generator=rng).to(DEV)
    x = big[:144].view(9, 16)
    assert_same_plan(x, TopK(3), False)
    assert len(kr._PREPARED) == 1
    assert_same_plan(x, TopK(3), False)  # an equal policy, another object
    assert len(kr._PREPARED) == 1
    assert_same_plan(x, TopK(4), False)
    assert_same_plan(x, TopK(3), True)
    assert_same_plan(x[:5], TopK(3), False)
    assert_same_plan(x.to(torch.bfloat16), TopK(3), False)
    assert_same_plan(big[1:145].view(9, 16), TopK(3), False)  # 4-byte aligned, not 16
    assert len(kr._PREPARED) == 6
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    assert_same_plan(x, TopK(3), False)
    assert len(kr._PREPARED) == 7
    assert_same_plan(x, EntropyAdaptiveK((1, 3), (2.0,)), False, RoutingStats.zeros(3, DEV))
    assert len(kr._PREPARED) == 7


# Masked columns read as -inf: their lanes compute 0 * -inf, and in a piece with no column at all -inf - -inf
# (NaN), which tl.where discards; the interpreter (numpy) warns about them, the GPU does not. Plans are checked exactly.
EMPTY_PIECE = pytest.mark.filterwarnings("ignore:invalid value encountered in (multiply|subtract):RuntimeWarning")


@pytest.mark.parametrize("split", [1, 2, 8])
@pytest.mark.parametrize("sel", ["rowwise", "rowsort"])
@EMPTY_PIECE
def test_rows16_split_rows(split, sel, monkeypatch):
    """16-bit logits, a row cut into pieces scanned by separate threads and merged (tl.reduce): the same plan,
    also where the pieces do not divide E (masked columns, a piece with no column at all) and with -0 / +0;
    'rowsort' sorts each piece's 8-key chunks and merges them (E = 64, k = 8 here)."""
    monkeypatch.setitem(kr.LAUNCH, "select", sel)
    monkeypatch.setitem(kr.LAUNCH, "split", split)
    rng = torch.Generator().manual_seed(split)
    for (E, K), dtype in zip([(5, 3), (33, 6), (60, 4), (64, 8)], [torch.bfloat16, torch.float16] * 2):
        logits = torch.randn(13, E, generator=rng) * 3  # one 16-row tile: the pieces, not the rows, are the point
        logits[::4] = logits[::4].round()  # exact ties
        logits[1, :3] = torch.tensor([0.0, -0.0, 0.0])  # -0 and +0 tie (equal probabilities)
        for pol in (TopK(K), TopP(0.7, k_max=K, k_min=1)):
            assert_same_plan(logits.to(dtype).to(DEV), pol, E % 2 == 0)


@pytest.mark.parametrize("split", [1, 4, 16])
@EMPTY_PIECE
def test_rows16_wide_k(split, monkeypatch):
    """8 < k <= 16 on 16-bit logits ('rowsort'): each piece keeps its best eight and next eight, chunks merge
    into both and the pieces merge pairwise; the same plan as the reference, with exact ties, masked columns
    and pieces with no column (E = 40 in 4 or 16 pieces). A row stride that is no multiple of eight logits
    takes the tile kernel instead."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowsort")
    monkeypatch.setitem(kr.LAUNCH, "split", split)
    rng = torch.Generator().manual_seed(split)
    shapes = [(16, 9), (40, 12), (64, 16), (24, 10), (32, 11)] if split < 16 else [(40, 12), (64, 16)]
    for (E, K), dtype in zip(shapes, [torch.bfloat16, torch.float16] * 3):
        logits = torch.randn(13, E, generator=rng) * 3
        logits[::3] = logits[::3].round()  # exact ties
        x = logits.to(dtype).to(DEV)
        launch = kr._shape_launch(13, E, K, -1, tuple(kr.LAUNCH.values()), 2, E)
        assert launch[0] is kr._launch_rows16 and launch[2]["SORT"], (E, K, launch)
        for pol in (TopK(K), TopP(0.7, k_max=K, k_min=1)):
            assert_same_plan(x, pol, E % 16 == 0)
        stats = RoutingStats.zeros(K, DEV)  # with device statistics: the histogram of the plan's own k
        _, got = assert_same_plan(x, EntropyAdaptiveK((2, K // 2, K), (1.5, 2.5)), E % 16 == 0, stats)
        assert stats.summary()["k_hist"] == torch.bincount(got.k.long(), minlength=K + 1).tolist()
    x = (torch.randn(5, 60, generator=rng) * 3).to(torch.bfloat16).to(DEV)
    assert kr._shape_launch(5, 60, 12, -1, tuple(kr.LAUNCH.values()), 2, 60)[0] is kr._launch
    assert_same_plan(x, TopK(12), True)


@pytest.fixture
def unroll_at(monkeypatch):
    """Sets the fp32 row kernel's unrolling threshold (ROWS_UNROLL_T) for a test; the launches derived from
    it are forgotten at each change and after the test, whatever its outcome."""
    def set_threshold(t):
        monkeypatch.setattr(kr, "ROWS_UNROLL_T", t)
        kr.clear_launch_caches()

    yield set_threshold
    monkeypatch.undo()
    kr.clear_launch_caches()


@pytest.mark.parametrize("unroll_t", [0, 10**9])
def test_fp32_rows_on_a_column_slice(unroll_t, unroll_at, monkeypatch):
    """The fp32 row kernel on logits that are a column slice of a wider tensor (row stride 64, E = 62: the last
    16-byte chunk half masked) and on E = 3 (one-logit chunks): the reference plan for every policy kind, with
    the chunk loops unrolled and as loops (E = 62; BLOCK_E <= 16 always unrolls)."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    unroll_at(unroll_t)
    rng = torch.Generator().manual_seed(62)
    wide = (torch.randn(19, 64, generator=rng) * 2).to(DEV)
    for x in (wide[:, :62], wide[:, 5:8]):
        launch, _, meta, _ = kr._shape_launch(19, x.shape[1], 3, -1, tuple(kr.LAUNCH.values()), 4, 64)
        assert x.stride(0) == 64 and launch is kr._launch_rows
        assert meta["UNROLL"] == (unroll_t > 0 or x.shape[1] <= 16)
        for pol in (TopK(3), EntropyAdaptiveK((1, 2, 3), (0.4, 0.8)), TopP(0.6, k_max=3), RatioSkip(0.3, k_max=3)):
            assert_same_plan(x, pol, True)


def test_fp32_rows_unroll_only_decode_sized_batches(monkeypatch):
    """The default switch: decode-sized batches (T <= 64) get the unrolled chunk loops, the notebooks' eager
    evaluation batches (512 tokens and more) the loops, which compile in a fraction of the time; E <= 16 always
    unrolls."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    kr.clear_launch_caches()
    try:
        for T, E, unrolled in ((1, 64, True), (64, 64, True), (65, 64, False), (65, 60, False), (512, 64, False),
                               (512, 8, True)):
            launch, _, meta, _ = kr._shape_launch(T, E, 8 if E > 8 else 2, -1, tuple(kr.LAUNCH.values()), 4, E)
            assert launch is kr._launch_rows and meta["UNROLL"] is unrolled, (T, E)
    finally:
        kr.clear_launch_caches()


def _decode_launches(E: int, K: int, tokens, elsize: int, launcher) -> dict:
    """T -> (constexprs, warps) of the row kernel's launch for T tokens of E logits (elsize bytes), with the
    grid checked against the tile."""
    out = {}
    for T in tokens:
        launch, grid, meta, warps = kr._shape_launch(T, E, K, -1, tuple(kr.LAUNCH.values()), elsize, E)
        assert launch is launcher and grid == (-(-T // meta["BLOCK_T"]),), (T, E)
        out[T] = (tuple(meta.items()), warps)
    return out


def _not_specialised(fn, names) -> None:
    """Triton does not specialise `fn` (a JITFunction, or under TRITON_INTERPRET an InterpretedFunction) on these
    arguments."""
    dns = getattr(fn, "do_not_specialize", None) or fn.kwargs["do_not_specialize"]
    for name in names:
        assert name in dns or fn.arg_names.index(name) in dns, name


def test_fp32_rows_one_launch_for_every_decode_batch(monkeypatch):
    """A decode loop's batch sizes (T = 1-64) share the fp32 row kernel's launch: its whole tile at every T and
    T not specialised on, so one compile per k_max (an unrolled E = 64 kernel takes seconds to compile)."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    kr.clear_launch_caches()
    try:
        for E, K in ((64, 8), (60, 4), (24, 4)):
            metas = _decode_launches(E, K, (1, 2, 3, 16, 17, 64), 4, kr._launch_rows)
            assert len(set(metas.values())) == 1, (E, metas)
        _not_specialised(kr._route_rows_kernel, ("T",))
    finally:
        kr.clear_launch_caches()


def test_rows16_one_launch_per_token_tile(monkeypatch):
    """The bf16 / fp16 row kernel shrinks its tile to pow2(T) at decode sizes (a 1-token call stays as fast as
    it was), but T and the policy's packed k values and k_min are not specialised on: batch sizes that
    share a tile share one compile (Triton would split T == 1 and T % 16 == 0 off)."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    kr.clear_launch_caches()
    try:
        for E, K in ((64, 8), (60, 4), (8, 2)):
            per_tile = {}
            for launch in _decode_launches(E, K, (17, 24, 32, 33, 48, 64), 2, kr._launch_rows16).values():
                per_tile.setdefault(dict(launch[0])["BLOCK_T"], set()).add(launch)
            assert all(len(v) == 1 for v in per_tile.values()), (E, per_tile)
        _not_specialised(kr._route_rows16_kernel, ("T", "kv_packed", "KMIN"))
    finally:
        kr.clear_launch_caches()


def test_rows_kernel_takes_float64_logits(unroll_at, monkeypatch):
    """route() casts logits to a supported dtype, but route_triton called directly with fp64 logits runs the
    int64-key row kernel (8-byte chunks of 2) with its chunk loops unrolled or not: the reference plan."""
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    x = (torch.randn(7, 24, generator=torch.Generator().manual_seed(64), dtype=torch.float64) * 2).to(DEV)
    for unroll_t in (0, 10**9):
        unroll_at(unroll_t)
        launch, _, meta, _ = kr._shape_launch(7, 24, 4, -1, tuple(kr.LAUNCH.values()), 8, 24)
        assert launch is kr._launch_rows and meta["UNROLL"] == (unroll_t > 0) and meta["CH"] == 2
        for pol in (TopK(4), EntropyAdaptiveK((1, 2, 4), (1.5, 2.5))):
            assert_same_plan(x, pol, True)


@gpu
@pytest.mark.gpu
def test_gpu_auto_backend_routes_more_levels_than_the_kernel_takes_in_torch():
    """'auto' takes the torch reference for an EntropyAdaptiveK with more levels than the kernel's scalars hold
    (as for wider routers), instead of raising; 'triton' forced names the limit."""
    from moelab.routing import KERNEL_MAX_K_VALUES

    ks = tuple(range(1, KERNEL_MAX_K_VALUES + 2))
    pol = EntropyAdaptiveK(ks, tuple(0.4 * i for i in range(1, len(ks))))
    x = torch.randn(64, 16, device="cuda") * 2
    got, ref = route(x, pol, renormalize=True), route_torch(x, pol, True)
    assert torch.equal(got.k, ref.k) and torch.equal(got.expert_ids, ref.expert_ids)
    set_backend("triton")
    try:
        with pytest.raises(ValueError, match="at most 8 k values"):
            route(x, pol, renormalize=True)
    finally:
        set_backend("auto")


@gpu
@pytest.mark.gpu
def test_gpu_direct_launch_is_used_and_specialises(monkeypatch):
    """The cached launch path runs after the first call and gives the same plan; a misaligned or
    differently-shaped input gets its own compiled kernel (the cache key holds Triton's specialisation).
    For the tile kernel (fp32, 'rounds') and the 16-bit row kernel (bf16, a row over 4 threads)."""
    pol = EntropyAdaptiveK((2, 4, 8), (3.0, 3.6))
    for launcher, dtype, select in ((kr._launch, torch.float32, "rounds"),
                                    (kr._launch_rows16, torch.bfloat16, "rowwise")):
        monkeypatch.setitem(kr.LAUNCH, "select", select)
        monkeypatch.setitem(kr.LAUNCH, "split", 4)
        x = (torch.randn(1000, 64) * 2).to(dtype).cuda()
        first = route_triton(x, pol, False)
        n0 = launcher.direct_calls
        again = route_triton(x, pol, False)
        assert not launcher.disabled and launcher.direct_calls == n0 + 1
        assert torch.equal(first.expert_ids, again.expert_ids) and torch.equal(first.weights, again.weights)
        big = torch.randn(1001 * 64 + 1).to(dtype).cuda()
        for view in (big[1:].view(1001, 64), big[:16 * 64].view(16, 64), big[:64].view(1, 64)):
            for _ in range(2):  # compile, then the direct path
                assert_same_plan(view, pol, False)
                assert_same_plan(view, TopP(0.5, k_max=8), True)


@gpu
@pytest.mark.gpu
def test_gpu_bound_launch_from_a_keys_third_call(monkeypatch):
    """From a key's third call on, route_triton launches the bound kernel (Launcher.bind) with nothing but
    fresh plan buffers: the reference plan every call, a new buffer each time, the launch counted, launched
    on the current stream (captured into a CUDA graph, it replays on new logits), and not once the launcher
    is switched to the public path."""
    monkeypatch.setattr(kr, "_PREPARED", {})
    pol = EntropyAdaptiveK((2, 4, 8), (3.0, 3.6))
    static = (torch.randn(300, 64) * 2).to(torch.bfloat16).cuda()
    assert_same_plan(static, pol, False)
    assert_same_plan(static, pol, False)
    (prep,) = kr._PREPARED.values()
    assert prep.direct is not None and prep.direct.launcher is prep.launch
    n0 = prep.launch.direct_calls
    plans = [assert_same_plan(static, pol, False)[1] for _ in range(3)]
    assert prep.launch.direct_calls == n0 + 3 and len(kr._PREPARED) == 1
    assert len({p.expert_ids.data_ptr() for p in plans}) == 3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route_triton(static, pol, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_g = route_triton(static, pol, False)
    assert prep.launch.direct_calls == n0 + 5
    prep.launch.disabled = "test: public launch path"  # switched off at run time: the bound launch too
    try:
        assert_same_plan(static, pol, False)
        assert prep.launch.direct_calls == n0 + 5
    finally:
        prep.launch.disabled = ""
    for scale in (0.5, 4.0):
        static.copy_((torch.randn(300, 64) * scale).to(torch.bfloat16))
        graph.replay()
        ref = route_torch(static, pol, False)
        assert torch.equal(plan_g.k, ref.k) and torch.equal(plan_g.expert_ids, ref.expert_ids)


@gpu
@pytest.mark.gpu
def test_gpu_random_shapes_in_full(select):
    rng = torch.Generator().manual_seed(11)
    for trial in range(10):  # each trial compiles its own kernels: keep the count modest
        E = int(torch.randint(2, MAX_EXPERTS + 1, (1,), generator=rng))
        T = [0, 1, 16, 64, 512, 4096, 65536, 3000, 77, 20000][trial]
        dtype = [torch.float32, torch.bfloat16, torch.float16][trial % 3]
        logits = torch.randn(T, E, generator=rng) * float(torch.rand(1, generator=rng) * 6)
        if T > 512 or dtype != torch.float32:  # large T: bf16-representable values (no 1-ulp near-ties)
            logits = logits.to(torch.bfloat16).float()
        if trial % 4 == 0 and T:
            logits = logits.round()  # many exact ties
        logits = logits.to(dtype).cuda()
        for pol in policies(E, rng):
            ref, got = assert_same_plan(logits, pol, bool(trial % 2))
            if T:
                check_layout(got)


def check_tuned_shape(E: int, K: int, split: int, sel: str, T: int, monkeypatch):
    """The row kernels at a shape of the tuned table (selection, threads per row, and the table's tile of 64 rows
    per program): bf16 logits with exact ties on every third token, and the same values in fp32, under TopP and
    an EntropyAdaptiveK split at the median entropy (with device statistics): the reference's plan."""
    monkeypatch.setitem(kr.LAUNCH, "select", sel)
    monkeypatch.setitem(kr.LAUNCH, "split", split)
    monkeypatch.setitem(kr.LAUNCH, "tile", 64 * triton.next_power_of_2(E) // split)
    launch, _, meta, _ = kr._shape_launch(T, E, K, -1, tuple(kr.LAUNCH.values()), 2, E)
    assert launch is kr._launch_rows16 and meta["SPLIT"] == split and meta["SORT"] == (sel == "rowsort")
    rng = torch.Generator().manual_seed(E)
    logits = (torch.randn(T, E, generator=rng) * 2).to(torch.bfloat16)
    logits[::3] = logits[::3].round()  # exact ties on every third token
    x = logits.to(DEV)
    ent = route_torch(x, TopK(K), False).entropy
    policies = [TopP(0.6, k_max=K, k_min=1), EntropyAdaptiveK(tuple(sorted({1, K})), (float(ent.median()),)[: K > 1])]
    stats = RoutingStats.zeros(K, DEV)
    for pol in policies:
        assert_same_plan(x, pol, E == 8, stats if isinstance(pol, EntropyAdaptiveK) else None)
        assert_same_plan(x.float(), pol, False)  # fp32 logits: 4 per 16-byte chunk
    assert stats.summary()["tokens"] == T


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("E,K,split,sel", [(8, 2, 1, "rowwise"), (60, 4, 4, "rowwise"), (64, 8, 2, "rowwise"),
                                         (128, 8, 4, "rowwise"), (256, 8, 8, "rowwise"), (64, 8, 2, "rowsort"),
                                         (128, 8, 8, "rowsort"), (128, 6, 1, "rowsort"), (512, 10, 8, "rowsort"),
                                         (512, 10, 16, "rowsort"), (512, 10, 2, "rowsort"), (128, 11, 4, "rowsort"),
                                         (256, 16, 4, "rowsort")])
def test_gpu_rowwise_at_the_tuned_shapes(E, K, split, sel, monkeypatch):
    """The one-row-per-thread selection compiled, at the shapes the tuned table gives it (few compiles: the
    random-shapes test above covers it too, but compiles a kernel per E, k and policy)."""
    check_tuned_shape(E, K, split, sel, 3000, monkeypatch)


@pytest.mark.parametrize("E,K,split,sel", [(128, 8, 4, "rowwise"), (256, 8, 8, "rowwise"), (512, 10, 16, "rowsort"),
                                         (128, 11, 4, "rowsort"), (256, 16, 4, "rowsort")])
def test_rowwise_at_the_tuned_shapes_few_tokens(E, K, split, sel, monkeypatch):
    """Five of the GPU test's tuned shapes (wide routers, 4-16 threads per row, k up to 16) at 12 tokens: on a
    CPU the only run of these E, split and tile overrides."""
    check_tuned_shape(E, K, split, sel, 12, monkeypatch)


@gpu
@pytest.mark.gpu
def test_gpu_fp32_rows_one_compile_for_every_policy(monkeypatch):
    """fp32 logits on the row kernel take the policy at run time: TopK, EntropyAdaptiveK with one or two
    thresholds, TopP and RatioSkip of one k_max share one compiled kernel, each with the reference plan, on its
    first (compiling or public) call and on the direct calls after it."""
    monkeypatch.setattr(kr, "_PREPARED", {})
    monkeypatch.setitem(kr.LAUNCH, "select", "rowwise")
    before = set(kr._launch_rows.cache)
    x = (torch.randn(777, 40, generator=torch.Generator().manual_seed(40)) * 2).cuda()
    pols = (TopK(6), EntropyAdaptiveK((2, 6), (2.5,)), EntropyAdaptiveK((1, 3, 6), (2.0, 3.0)),
            TopP(0.7, k_max=6, k_min=2), RatioSkip(0.2, k_max=6))
    for _ in range(3):
        for pol in pols:
            assert_same_plan(x, pol, False)
    # one compiled kernel (Launcher keys still part by the scalars' values, each finding Triton's kernel)
    assert len({id(v[0]) for key, v in kr._launch_rows.cache.items() if key not in before}) == 1


@gpu
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")  # torch's own note
def test_gpu_no_host_sync_and_graph_capture():
    T, E, D, Fd = 512, 64, 256, 128
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).cuda().bfloat16()
    gu = (torch.randn(E, 2 * Fd, D, generator=g) / 16).cuda().bfloat16()
    dn = (torch.randn(E, D, Fd, generator=g) / 11).cuda().bfloat16()
    logits = (torch.randn(T, E, generator=g) * 2).cuda()
    pol = EntropyAdaptiveK((2, 4, 8), (3.0, 3.6))
    stats = RoutingStats.zeros(8, "cuda")

    def step(lg):
        plan = route_triton(lg, pol, False, stats)
        return plan, ex.run_experts(x, plan, gu, dn, layout=pair_layout_padded(plan))

    step(logits)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats.reset()
    static = logits.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_g, y_g = step(static)
    stats.reset()
    for scale in (0.3, 3.0):  # different numbers of kept pairs through the same graph
        static.copy_(torch.randn(T, E, generator=g).cuda() * scale)
        graph.replay()
        ref_plan = route_torch(static, pol, False)
        assert torch.equal(plan_g.expert_ids, ref_plan.expert_ids)
        ex.set_layout("exact")
        try:
            y_ref = ex.run_experts(x, ref_plan, gu, dn)
        finally:
            ex.set_layout("auto")
        torch.testing.assert_close(y_g.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert stats.summary()["tokens"] == 2 * T
