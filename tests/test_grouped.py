"""Triton grouped expert GEMMs (moelab.kernels.grouped): the same layer output as the torch reference.

On a CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py) on small shapes, in fp32 and fp16:
the interpreter's bf16 tl.dot is wrong (garbage sums, triton 3.9), so bf16 is left to the `gpu` test.
Small row tiles (BLOCK_M 16) via the config override give experts with several tiles.
"""

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on a CPU"

pytest.importorskip("triton")

from conftest import fill_empty  # noqa: E402

import moelab.experts as ex  # noqa: E402
import moelab.kernels as kernels  # noqa: E402
import moelab.kernels.grouped as gk  # noqa: E402
from moelab.kernels.grouped import fused_experts, max_tiles, tile_map  # noqa: E402
from moelab.kernels.layout import pair_layout_padded  # noqa: E402
from moelab.routing import EntropyAdaptiveK, RoutingPlan, TopK, route  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")

TILE16 = {"gate_up": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2},  # swizzled program order,
          "down": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 3}}  # partial last groups


def layer(T, D, Fd, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(DEV, dtype)
    gu = (torch.randn(E, 2 * Fd, D, generator=g) / D**0.5).to(DEV, dtype)
    dn = (torch.randn(E, D, Fd, generator=g) / Fd**0.5).to(DEV, dtype)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEV)
    return x, gu, dn, logits


def reference(x, plan, gu, dn):
    """The torch reference: exact layout, a per-expert loop of matmuls."""
    ex.set_gemm("loop")
    ex.set_layout("exact")
    try:
        return ex.run_experts(x, plan, gu, dn)
    finally:
        ex.set_gemm("auto")
        ex.set_layout("auto")


# The down GEMM's TMA loads read whole [BLOCK_M, BLOCK_K] boxes of a_PF from a group's first row, so a group's
# last tile also reads rows past offsets[-1] that gate_up never wrote (torch.empty: any bits, inf too). Their sums
# reach only rows that are not stored (test_down_rows_past_the_pairs_never_reach_outputs), but NumPy's matmul in
# the interpreter warns when such a row makes inf - inf.
UNWRITTEN_ROWS = pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")


def assert_matches(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    else:  # 16-bit: GEMM sums in another order; rounding points are the reference's
        torch.testing.assert_close(y.float(), ref.float(), atol=4e-3, rtol=4e-3)


def counts_of(layout):
    return torch.diff(layout.offsets.long(), prepend=torch.zeros(1, dtype=torch.long, device=layout.offsets.device))


# ---------------------------------------------------------------- tile map


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=12), st.integers(0, 40), st.sampled_from([16, 32, 64]))
def test_tile_map_covers_every_kept_row_once(counts, slack, block_m):
    """The tiles the kernels compute from the group ends: every kept row once, each tile inside one
    expert's group and at most BLOCK_M rows, tiles of an expert BLOCK_M apart, exactly
    sum cdiv(count_e, BLOCK_M) of them and all before the programs that return at once."""
    E = len(counts)
    c = torch.tensor(counts)
    offsets = torch.cumsum(c, 0).to(torch.int32).to(DEV)
    P = int(c.sum())
    N = P + slack  # padded layout: rows past P are padding
    got = tile_map(offsets, N, block_m).cpu().long()
    assert got.shape == (max_tiles(N, E, block_m), 3)
    want_tiles = int(((c + block_m - 1) // block_m).sum())
    valid = got[:, 0] >= 0
    assert int(valid.sum()) == want_tiles and bool(valid[:want_tiles].all())
    assert (got[want_tiles:] == -1).all()
    e, r0, r1 = got[valid].T
    starts = torch.cumsum(c, 0) - c
    assert (r0 < r1).all() and (r1 - r0 <= block_m).all()
    assert (r0 >= starts[e]).all() and (r1 <= starts[e] + c[e]).all()
    assert ((r0 - starts[e]) % block_m == 0).all()
    cover = torch.zeros(max(N, 1), dtype=torch.long)
    for a, b in zip(r0.tolist(), r1.tolist()):
        cover[a:b] += 1
    assert (cover[:P] == 1).all() and (cover[P:] == 0).all()


def test_max_tiles_is_an_upper_bound():
    """Against the most tiles any counts summing to at most N can need (all of them, small cases), and
    no more than the simple bound cdiv(N, BLOCK_M) + E."""
    for N, E, bm in [(0, 3, 2), (1, 4, 4), (7, 3, 2), (9, 4, 3), (12, 2, 4), (10, 4, 4)]:
        worst = max(sum(-(-c // bm) for c in cs) for cs in itertools.product(range(N + 1), repeat=E) if sum(cs) <= N)
        assert worst <= max_tiles(N, E, bm) <= -(-N // bm) + E
        if N <= E:  # at most N groups non-empty, one row each at worst: N tiles, exactly the worst case
            assert max_tiles(N, E, bm) == worst == N
    assert max_tiles(3, 64, 16) == 3  # decode: 3 rows over 64 experts
    assert max_tiles(32768, 64, 64) == 575  # T = 4096, k = 8, E = 64: 512 full tiles + at most 63 partial


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "T,D,Fd,E,policy",
    [
        (16, 32, 48, 4, TopK(3)),  # 48 pairs over 4 experts: groups of several 16-row tiles
        (13, 40, 36, 8, EntropyAdaptiveK((1, 2, 3), (1.2, 1.6))),  # D, F not multiples of the tiles
    ],
)
def test_matches_reference(T, D, Fd, E, policy, dtype):
    x, gu, dn, logits = layer(T, D, Fd, E, dtype, seed=T)
    plan = route(logits, policy, renormalize=True)
    lay = pair_layout_padded(plan)
    ref = reference(x, plan, gu, dn)
    assert_matches(fused_experts(x, lay, gu, dn, plan, config=TILE16), ref)
    if dtype == torch.float32:  # the launch table's own config (16-row tiles, BLOCK_K 128 > D: masked K tail)
        assert_matches(fused_experts(x, lay, gu, dn, plan), ref)


@UNWRITTEN_ROWS
@pytest.mark.parametrize("T,D,Fd,E,policy", [
    (16, 32, 48, 4, TopK(3)),  # F = 48 not a multiple of BLOCK_N 32: down's last column tile reads past N
    (13, 40, 24, 8, EntropyAdaptiveK((1, 2, 3), (1.2, 1.6))),  # D = 40: K tail past the descriptor (zeros)
])
def test_tma_loads_match_pointer_loads(T, D, Fd, E, policy):
    """Tensor-descriptor loads (weights; the down GEMM's rows too): the same layer as the pointer loads and
    the reference, where tiles read past an expert, past N, past K and past the last row (fp16: the
    interpreter's bf16 dot is wrong)."""
    x, gu, dn, logits = layer(T, D, Fd, E, torch.float16, seed=T + 1)
    plan = route(logits, policy, renormalize=True)
    lay = pair_layout_padded(plan)
    assert gk.tma_supported(x, gu) and not gk.tma_supported(x.float(), gu.float())
    tma = {name: {**c, "TMA": True} for name, c in TILE16.items()}
    y = fused_experts(x, lay, gu, dn, plan, config=tma)
    assert torch.equal(y, fused_experts(x, lay, gu, dn, plan, config=TILE16))
    assert_matches(y, reference(x, plan, gu, dn))


@UNWRITTEN_ROWS
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("T,D,Fd,E,policy", [
    (16, 32, 48, 4, TopK(3)),  # 48 rows in 16-row tiles over 3 programs: each loops over several tiles
    (13, 40, 24, 8, EntropyAdaptiveK((1, 2, 3), (1.2, 1.6))),  # tiles of different experts in one program
    (5, 32, 16, 8, TopK(1)),  # fewer tiles than programs: some programs do nothing
])
def test_persistent_programs_match_one_program_per_tile(T, D, Fd, E, policy, tma):
    """PERSISTENT: INTERPRET_PROGRAMS programs loop over the tiles that exist (strided, in the swizzled order)
    and give the one-program-per-tile layer bit for bit, with pointer and with TMA loads (FLATTEN too: the
    interpreter runs its loops as written, so this checks the plumbing; the gpu test checks the pipelining)."""
    x, gu, dn, logits = layer(T, D, Fd, E, torch.float16, seed=T + 2)
    plan = route(logits, policy, renormalize=True)
    lay = pair_layout_padded(plan)
    base = {name: {**c, "TMA": tma} for name, c in TILE16.items()}
    per = {name: {**c, "PERSISTENT": True} for name, c in base.items()}
    y = fused_experts(x, lay, gu, dn, plan, config=per)
    assert torch.equal(y, fused_experts(x, lay, gu, dn, plan, config=base))
    flat = {name: {**c, "FLATTEN": True} for name, c in per.items()}  # tile and K loops as one (same sums)
    assert torch.equal(fused_experts(x, lay, gu, dn, plan, config=flat), y)
    assert_matches(y, reference(x, plan, gu, dn))


@pytest.mark.parametrize("tma", [False, True])
def test_down_rows_past_the_pairs_never_reach_outputs(tma):
    """Rows of a_PF at and past offsets[-1] (left unwritten by gate_up) filled with +-inf: down_proj's written rows
    are the same, bit for bit, and finite, with pointer loads (which never read them) and TMA loads (whose
    boxes do: in the interpreter their inf - inf shows as NumPy's matmul warning)."""
    T, D, Fd, E = 13, 32, 24, 4
    x, gu, dn, logits = layer(T, D, Fd, E, torch.float16, seed=5)
    lay = pair_layout_padded(route(logits, EntropyAdaptiveK((1, 2, 3), (0.6, 1.0)), renormalize=True))
    P, N = int(lay.offsets[-1]), lay.token_idx.shape[0]  # kept pairs, T * k_max rows
    assert P % 16 and N - P >= 16 - P % 16, "the last group's tile must reach rows past P that a_PF holds"
    cfg = {**TILE16["down"], "num_warps": 4, "num_stages": 2, "TMA": tma}
    assert gk.tma_supported(x, dn) or not tma
    a = gk.gate_up_swiglu(x, lay.token_idx, lay.offsets, gu, {**TILE16["gate_up"], "num_warps": 4, "num_stages": 2})
    a[P:] = 0
    clean = gk.down_proj(a, lay.offsets, dn, cfg)[:P]
    a[P:, 0::2], a[P:, 1::2] = float("inf"), float("-inf")  # their sums: inf - inf = NaN
    if tma and not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="invalid value encountered in matmul"):
            poisoned = gk.down_proj(a, lay.offsets, dn, cfg)[:P]
    else:
        poisoned = gk.down_proj(a, lay.offsets, dn, cfg)[:P]
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


def same_with_empty_filled(monkeypatch, x, gu, dn, logits, policy, config=None):
    """Route (Triton), lay out and run the layer twice, torch.empty's buffers filled with 0 and then with NaN / -7:
    the same plan and output, bit for bit and finite; the output is returned."""
    from moelab.kernels.routing import route_triton
    runs = []
    for value in (0.0, float("nan")):
        with monkeypatch.context() as m:
            fill_empty(m.setattr, value)
            plan = route_triton(logits, policy, renormalize=True)
            runs.append((plan, fused_experts(x, pair_layout_padded(plan), gu, dn, plan, config=config)))
    (p0, y0), (p1, y1) = runs
    assert 0 < p0.kept_pairs() < p0.num_tokens * policy.k_max, "some tokens must keep fewer than k_max experts"
    for name in ("expert_ids", "weights", "k", "entropy"):
        assert torch.equal(getattr(p1, name), getattr(p0, name)), name
    assert torch.isfinite(y1).all() and torch.equal(y1, y0)
    return y0


@UNWRITTEN_ROWS
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tma", [False, True])
def test_outputs_never_depend_on_unwritten_memory(tma, logit_dtype, monkeypatch):
    """The whole Triton path (routing kernel, pair layout, grouped GEMMs, combine) with every buffer that
    torch.empty hands out filled with NaN (floats) / -7 (integers) instead of 0: the same plan and layer
    output, bit for bit and finite, so nothing it returns is read from memory it did not write first
    (`pytest --fill-empty` does the same for a whole session)."""
    x, gu, dn, logits = layer(13, 40, 24, 8, torch.float16, seed=9)
    policy = EntropyAdaptiveK((1, 2, 3), (0.6, 1.0))
    cfg = {name: {**c, "TMA": tma} for name, c in TILE16.items()}
    y = same_with_empty_filled(monkeypatch, x, gu, dn, logits.to(logit_dtype), policy, cfg)
    assert_matches(y, reference(x, route(logits, policy, renormalize=True), gu, dn))


def test_swiglu_rounds_like_the_unfused_path():
    """Kernel A's epilogue: gate and up rounded to the data type (as the GEMM output is), silu(gate)
    rounded too, then the product: the unfused GEMM -> swiglu_rows numbers, bit for bit but for the
    odd last-bit tie of the fp32 sums (not rounding silu first changes about a quarter of them)."""
    T, D, Fd, E = 16, 32, 48, 4
    x, gu, _, logits = layer(T, D, Fd, E, torch.float16, seed=1)
    lay = pair_layout_padded(route(logits, TopK(2), renormalize=True))
    cfg = {**TILE16["gate_up"], "num_warps": 4, "num_stages": 2}
    a = gk.gate_up_swiglu(x, lay.token_idx, lay.offsets, gu, cfg)
    P = int(lay.offsets[-1])
    h = torch.einsum("pd,phd->ph", x[lay.token_idx[:P]].float(), gu[lay.expert_idx[:P]].float()).half()
    ref = torch.nn.functional.silu(h[:, :Fd]) * h[:, Fd:]
    assert (a[:P] == ref).float().mean() > 0.99
    torch.testing.assert_close(a[:P], ref, atol=1e-5, rtol=1e-3)


def test_empty_experts_and_groups_longer_than_a_tile():
    T, D, Fd, E = 24, 32, 32, 6
    x, gu, dn, logits = layer(T, D, Fd, E, torch.float32, seed=7)
    logits[:, 1:3] *= 0.3
    logits[:12, 0] = 20  # sure tokens: expert 0 alone (k = 1)
    logits[12:, 0] = 2  # unsure tokens: expert 0 first, then expert 1 or 2 (k = 2)
    logits[:, 3:] = -40  # experts 3..5 never chosen
    plan = route(logits, EntropyAdaptiveK((1, 2), (0.3,)), renormalize=False)
    lay = pair_layout_padded(plan)
    counts = counts_of(lay).cpu()
    assert counts[0] == T and (counts[3:] == 0).all() and counts[1:3].sum() == 12  # 24 rows: two 16-row tiles
    assert int(lay.offsets[-1]) < lay.num_pairs  # some pairs dropped: padding rows follow
    assert_matches(fused_experts(x, lay, gu, dn, plan, config=TILE16), reference(x, plan, gu, dn))


def test_no_tokens_and_all_pairs_dropped():
    D, Fd, E, K = 32, 48, 4, 2
    x, gu, dn, logits = layer(5, D, Fd, E, torch.float32)
    plan0 = route(logits[:0], TopK(K), renormalize=True)
    y0 = fused_experts(x[:0], pair_layout_padded(plan0), gu, dn, plan0)
    assert y0.shape == (0, D) and y0.dtype == x.dtype
    none = RoutingPlan(
        expert_ids=torch.full((5, K), -1, dtype=torch.int32, device=DEV),
        weights=torch.zeros(5, K, device=DEV),
        k=torch.zeros(5, dtype=torch.int32, device=DEV),
        entropy=torch.zeros(5, device=DEV),
        num_experts=E,
    )
    lay = pair_layout_padded(none)
    assert int(lay.offsets[-1]) == 0
    y = fused_experts(x, lay, gu, dn, none, config=TILE16)
    assert torch.equal(y, torch.zeros_like(x))
    assert torch.equal(reference(x, none, gu, dn), y)


def test_set_gemm_triton_dispatch(monkeypatch):
    x, gu, dn, logits = layer(12, 32, 32, 4, torch.float32, seed=3)
    plan = route(logits, TopK(2), renormalize=True)
    ref = reference(x, plan, gu, dn)
    calls = []
    real = gk.fused_experts
    monkeypatch.setattr(gk, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not ex.fused_supported(x, gu, dn)  # CPU: 'auto' keeps the torch paths
    ex.set_layout("padded")
    try:
        ex.run_experts(x, plan, gu, dn)
        assert calls == []
        ex.set_gemm("triton")
        assert ex.get_gemm() == "triton"
        assert_matches(ex.run_experts(x, plan, gu, dn), ref)
        assert calls == [1]
        ex.set_layout("exact")
        with pytest.raises(ValueError, match="padded layout with slot_row"):
            ex.run_experts(x, plan, gu, dn)
        ex.set_layout("padded")
        with pytest.raises(ValueError, match="act_fn"):
            ex.run_experts(x, plan, gu, dn, act_fn=torch.nn.functional.gelu)
        # the SiLU modules of torch and transformers (a patched HF block passes its experts.act_fn) fuse too
        from transformers.activations import ACT2FN

        for act in (torch.nn.SiLU(), ACT2FN["silu"]):
            assert ex.is_silu(act)
            assert_matches(ex.run_experts(x, plan, gu, dn, act_fn=act), ref)
        assert calls == [1, 1, 1] and not ex.is_silu(torch.nn.GELU())
    finally:
        ex.set_gemm("auto")
        ex.set_layout("auto")
    with pytest.raises(ValueError, match="'triton'"):
        ex.set_gemm("cutlass")


def test_bad_input():
    """What the kernels assume beyond the layer's own checks (moelab.plan.check_experts) is named too."""
    import dataclasses

    x, gu, dn, logits = layer(6, 32, 16, 4, torch.float32)
    plan = route(logits, TopK(2), renormalize=True)
    lay = pair_layout_padded(plan)
    with pytest.raises(ValueError, match=r"dtypes x torch.float32, gate_up torch.float16, down torch.float32: must"):
        fused_experts(x, lay, gu.half(), dn, plan)
    with pytest.raises(ValueError, match=r"down on \S+, contiguous=False: must be contiguous"):
        fused_experts(x, lay, gu, dn.transpose(1, 2).contiguous().transpose(1, 2), plan)
    with pytest.raises(ValueError, match=r"down \(4, 32, 15\): must be \[E, 2F, D\] / \[E, D, F\]"):
        fused_experts(x, lay, gu, dn[:, :, :15].contiguous(), plan)
    with pytest.raises(ValueError, match=r"gate_up \(4, 32, 31\) .*must be \[E, 2F, D\]"):
        fused_experts(x, lay, gu[:, :, :31].contiguous(), dn, plan)
    with pytest.raises(ValueError, match="dtypes x torch.int64"):
        fused_experts(x.long(), lay, gu, dn, plan)
    with pytest.raises(ValueError, match=r"x dtype=torch.float64: must be one of"):
        fused_experts(x.double(), lay, gu.double(), dn.double(), plan)
    with pytest.raises(ValueError, match="layout has no slot_row"):
        fused_experts(x, ex.pair_layout(plan), gu, dn, plan)
    with pytest.raises(ValueError, match="plan has 6 tokens"):
        fused_experts(x[:5], lay, gu, dn, plan)
    big = torch.zeros(257, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="E=257 experts: must be 1..256"):
        fused_experts(x, lay, big, torch.zeros(257, 32, 1, device=DEV), dataclasses.replace(plan, num_experts=257))


def test_precision_and_tuned_beats_cutlass(monkeypatch):
    """fp32 operands go to tl.dot in full precision (not TF32). tuned_beats_cutlass: only a TUNED entry's
    'beats_cutlass' says yes, above FEW_ROWS' rows per expert, and no entry means no (test_report checks the
    table's flags against the committed tuning run)."""
    assert gk._precision(torch.float32) == "ieee" and gk._precision(torch.float16) == "tf32"
    monkeypatch.setattr(kernels, "device_identity", lambda i: ("NVIDIA H200", (9, 0, 132)))
    cuda, N, E = torch.device("cuda", 0), 4096 * 8, 64
    flags = {shape: entries[-1][1].get("beats_cutlass", False) for shape, entries in gk.TUNED["NVIDIA H200"].items()}
    assert set(flags.values()) == {True, False}  # both answers are exercised
    for (D, F), beats in flags.items():
        assert gk.tuned_beats_cutlass(N, E, D, F, cuda) == beats, (D, F)
    assert not gk.tuned_beats_cutlass(N, E, 2048, 512, cuda)  # no entry for this (D, F)
    assert not gk.tuned_beats_cutlass(gk.FEW_ROWS[-1][0] * E, E, 2048, 1024, cuda)  # few rows per expert
    assert not gk.tuned_beats_cutlass(N, E, 2048, 1024, torch.device("cpu"))
    monkeypatch.setattr(kernels, "device_identity", lambda i: ("Another GPU", (8, 0, 108)))
    assert not gk.tuned_beats_cutlass(N, E, 2048, 1024, cuda)


def test_launch_config(monkeypatch):
    # by padded rows per expert N / E: 16-row tiles up to 64, 32-row up to 128, then DEFAULT's 64
    assert gk.launch_config(64 * 64, 64, 2048, 1024)["gate_up"]["BLOCK_M"] == 16
    assert gk.launch_config(64 * 65, 64, 2048, 1024)["down"]["BLOCK_M"] == 32
    cfg = gk.launch_config(32768, 64, 2048, 1024)  # T = 4096, k = 8: 512 rows per expert
    assert cfg == gk.DEFAULT and cfg["down"]["BLOCK_M"] == 64
    cfg["down"]["BLOCK_M"] = 1  # callers get copies
    assert gk.DEFAULT["down"]["BLOCK_M"] == 64 and gk.launch_config(32768, 64, 2048, 1024) == gk.DEFAULT
    gk._launch_config.cache_clear()
    monkeypatch.setattr(kernels, "device_identity", lambda i: ("Fake GPU", (9, 0, 132)))
    monkeypatch.setitem(gk.TUNED, "Fake GPU", {(2048, 1024): [(32768, {"down": {"BLOCK_N": 256}})]})
    try:
        got = gk._launch_config(32768, 64, 2048, 1024, 0)
        assert got["down"] == {**gk.DEFAULT["down"], "BLOCK_N": 256} and got["gate_up"] == gk.DEFAULT["gate_up"]
        assert gk._launch_config(32769, 64, 2048, 1024, 0) == gk.DEFAULT
        assert gk._launch_config(32768, 64, 2048, 512, 0) == gk.DEFAULT  # another (D, F)
        # few rows per expert: FEW_ROWS' tiles, the tuned entry (tuned at many rows per expert) not applied
        assert gk._launch_config(64 * 64, 64, 2048, 1024, 0) == gk._launch_config(64 * 64, 64, 2048, 1024, -1)
        assert gk._launch_config(64 * 64, 64, 2048, 1024, 0)["down"] == gk.FEW_ROWS[0][1]["down"]
    finally:
        gk._launch_config.cache_clear()


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
def test_gpu_matches_reference_at_real_shapes():
    """bf16 at an OLMoE-like width (16-, 32- and 64-row tiles at T = 8, 1024, 2048), against the loop
    reference and the torch._grouped_mm path; also inside a CUDA graph."""
    D, Fd, E = 1024, 512, 64
    for T in (8, 1024, 2048):
        x, gu, dn, logits = layer(T, D, Fd, E, torch.bfloat16, seed=T)
        ent = route(logits, TopK(8), renormalize=False).entropy
        pol = EntropyAdaptiveK((2, 4, 8), tuple(float(q) for q in ent.quantile(torch.tensor([0.33, 0.67], device=DEV))))
        plan = route(logits, pol, renormalize=False)
        lay = pair_layout_padded(plan)
        y = fused_experts(x, lay, gu, dn, plan)
        ref = reference(x, plan, gu, dn)
        assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 5e-3
        ex.set_gemm("grouped")
        try:
            cutlass = ex.run_experts(x, plan, gu, dn, layout=lay)
        finally:
            ex.set_gemm("auto")
        torch.testing.assert_close(y.float(), cutlass.float(), atol=2e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = fused_experts(x, lay, gu, dn, plan)
        graph.replay()
        assert torch.equal(y_g, y)


@gpu
@pytest.mark.gpu
def test_gpu_tma_loads_at_real_shapes():
    """bf16, OLMoE-like width, 64- and 128-row tiles: tensor-descriptor loads give the pointer loads' layer
    (same tiles, same sums) on native and adaptive plans, also replayed in a CUDA graph; from the second
    call on, the descriptors go through moelab's direct launch too. Persistent programs (one per SM), also
    with the tile and K loops flattened, give the same layer bit for bit, in the graph too."""
    from moelab import kernels

    D, Fd, E, T = 2048, 1024, 64, 2048
    x, gu, dn, logits = layer(T, D, Fd, E, torch.bfloat16, seed=5)
    assert gk.tma_supported(x, gu) == (torch.cuda.get_device_capability()[0] >= 9)
    if not gk.tma_supported(x, gu):
        pytest.skip("no TMA on this GPU")
    for pol in (TopK(8), EntropyAdaptiveK((2, 4, 8), (3.9, 4.0))):
        plan = route(logits, pol, renormalize=False)
        lay = pair_layout_padded(plan)
        for bm, bn in ((64, 64), (128, 128)):
            # num_stages pinned: the tuned table's 5 stages at 128 x 256 do not fit in shared memory
            ptr = {"gate_up": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 8, "num_stages": 3, "TMA": False},
                   "down": {"BLOCK_M": bm, "BLOCK_N": 2 * bn, "num_warps": 8, "num_stages": 3, "TMA": False}}
            tma = {name: {**c, "TMA": True} for name, c in ptr.items()}
            y_ptr = fused_experts(x, lay, gu, dn, plan, config=ptr)
            y = fused_experts(x, lay, gu, dn, plan, config=tma)
            lau = kernels._LAUNCHERS[gk._expert_gemm_kernel]
            n0 = lau.direct_calls
            assert torch.equal(fused_experts(x, lay, gu, dn, plan, config=tma), y)
            assert not lau.disabled and lau.direct_calls == n0 + 2  # gate_up and down
            torch.testing.assert_close(y.float(), y_ptr.float(), atol=1e-2, rtol=1e-2)
            per = {name: {**c, "PERSISTENT": True} for name, c in tma.items()}  # one program per SM, looping
            assert torch.equal(fused_experts(x, lay, gu, dn, plan, config=per), y)
            flat = {name: {**c, "FLATTEN": True} for name, c in per.items()}  # tile and K loops pipelined as one
            assert torch.equal(fused_experts(x, lay, gu, dn, plan, config=flat), y)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_g = fused_experts(x, lay, gu, dn, plan, config=tma)
                y_pg = fused_experts(x, lay, gu, dn, plan, config=per)
                y_fg = fused_experts(x, lay, gu, dn, plan, config=flat)
            graph.replay()
            assert torch.equal(y_g, y) and torch.equal(y_pg, y) and torch.equal(y_fg, y)


@gpu
@pytest.mark.gpu
def test_gpu_direct_launch_of_layout_row_and_gemm_kernels():
    """The layout, row and GEMM kernels run through `moelab.kernels.launch`: from the second call of a
    specialisation on, the compiled launcher directly, with the same results; a misaligned input view
    gets its own compiled kernel instead of one that assumes alignment."""
    from moelab import kernels
    from moelab.kernels.experts import gather_rows

    x, gu, dn, logits = layer(16, 256, 128, 8, torch.bfloat16, seed=2)
    plan = route(logits, TopK(2), renormalize=True)
    runs = []
    for _ in range(3):
        lay = pair_layout_padded(plan)
        runs.append((lay.token_idx.clone(), lay.slot_row.clone(), fused_experts(x, lay, gu, dn, plan)))
    for lay_tok, lay_slot, y in runs[1:]:
        assert torch.equal(lay_tok, runs[0][0]) and torch.equal(lay_slot, runs[0][1]) and torch.equal(y, runs[0][2])
    used = {fn.__name__: lau.direct_calls for fn, lau in kernels._LAUNCHERS.items()}
    for name in ("_count_kernel", "_scatter_kernel", "_expert_gemm_kernel", "_combine_kernel"):
        assert used.get(name, 0) >= 2, (name, used)
    assert not any(lau.disabled for lau in kernels._LAUNCHERS.values())
    big = torch.randn(17 * 256 + 1, device=DEV).to(torch.bfloat16)
    lay = pair_layout_padded(plan)
    for view in (big[1:].view(17, 256)[:16], big[:16 * 256].view(16, 256)):
        for _ in range(2):  # compile, then the direct path
            rows = gather_rows(view, lay.token_idx, lay.offsets)
            P = int(lay.offsets[-1])
            assert torch.equal(rows[:P], view[lay.token_idx[:P]])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 1024, 64), (1024, 4096, 14336, 8)])  # OLMoE-like, Mixtral-like
def test_gpu_outputs_never_depend_on_unwritten_memory(shape, monkeypatch):
    """At the tuned launches (64- and 128-row TMA tiles, persistent down): the adaptive plan and layer output
    are the same, bit for bit and finite, with every torch.empty buffer filled with NaN / -7 as with 0."""
    x, gu, dn, logits = layer(*shape, torch.bfloat16, seed=4)
    policy = EntropyAdaptiveK((1, 2), (1.0,)) if shape[3] == 8 else EntropyAdaptiveK((4, 6, 8), (2.0, 3.0))
    same_with_empty_filled(monkeypatch, x, gu, dn, logits.to(torch.bfloat16), policy)


@gpu
@pytest.mark.gpu
def test_gpu_fused_supported_boundaries():
    """'auto' takes the fused Triton experts on CUDA for 16-bit operands of at most MAX_EXPERTS experts, up to
    FUSED_MAX_ROWS_PER_EXPERT padded rows per expert, and above that only where a tuned entry beats CUTLASS."""
    E, D, F = 8, 64, 32  # no tuned entry for (64, 32): above the decode rows, CUTLASS
    x = torch.zeros(4, D, dtype=torch.bfloat16, device="cuda")
    gu = torch.zeros(E, 2 * F, D, dtype=torch.bfloat16, device="cuda")
    dn = torch.zeros(E, D, F, dtype=torch.bfloat16, device="cuda")
    rows = ex.FUSED_MAX_ROWS_PER_EXPERT * E
    assert ex.fused_supported(x, gu, dn, rows) and not ex.fused_supported(x, gu, dn, rows + 1)
    assert not ex.fused_supported(x.float(), gu.float(), dn.float(), 1)  # fp32: the torch paths
    assert not ex.fused_supported(x, gu.transpose(1, 2).contiguous().transpose(1, 2), dn, 1)  # not contiguous
    wide = gk.MAX_EXPERTS + 1
    gu_w = torch.zeros(wide, 2 * F, D, dtype=torch.bfloat16, device="cuda")
    dn_w = torch.zeros(wide, D, F, dtype=torch.bfloat16, device="cuda")
    assert not ex.fused_supported(x, gu_w, dn_w, 1)
    assert ex.fused_supported(x, gu_w[: gk.MAX_EXPERTS], dn_w[: gk.MAX_EXPERTS], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bf16 guard is for CPU tensors")
def test_bf16_under_the_interpreter_is_refused_not_garbage():
    """The interpreter's bf16 tl.dot returns wrong sums: a bf16 CPU layer is refused, naming the dtypes that work."""
    x, gu, dn, logits = layer(8, 32, 16, 4, torch.bfloat16, seed=3)
    plan = route(logits, TopK(2), renormalize=True)
    with pytest.raises(ValueError, match=r"bfloat16 under TRITON_INTERPRET: .* need float32 or float16 on the CPU"):
        fused_experts(x, pair_layout_padded(plan), gu, dn, plan)
