"""Grouped expert GEMMs in Triton over the padded pair layout: the layer's work scales with the kept pairs.

Two launches of one kernel, with row tiles sized to the rows per expert:
- A, gate_up + SwiGLU: rows of x gathered through token_idx straight into the GEMM (no x_PD copy), gate and up
  accumulated side by side for the same F columns, a_PF = silu(gate) * up written once;
- B, down: y_PD = a_PF @ down_EDF[e].T;
then `combine_rows` (moelab.kernels.experts) sums each token's rows.

Tile map, on the device (no host sync, so a CUDA graph runs with any number of kept pairs): the grid has an
upper bound of row tiles; each program reads the E group ends `offsets`, counts cdiv(count_e, BLOCK_M) tiles per
expert, and finds its expert and rows from the cumsum of those counts. A tile never crosses an expert boundary;
programs past the total return at once.

Launch configurations: `DEFAULT` (BLOCK_M 64) and `FEW_ROWS` (BLOCK_M 16 / 32 for few rows per expert), from
vLLM fused_moe's bf16 table for the H200, updated key by key by the device's tuned entries (`TUNED` at many rows
per expert, `FEW_TUNED` at decode sizes; kernels/configs/*.json); `launch_config` picks. A configuration with TMA
loads weight tiles through tensor descriptors (Hopper's bulk copies) instead of pointer loads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # host-side tensor descriptors (Triton 3.4+): the TMA weight loads of the expert GEMMs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from moelab.kernels import cdiv, device_table, interpreting, launch, load_tables, on_device_of, own_table, pow2
from moelab.kernels.experts import combine_rows
from moelab.plan import PairLayout, RoutingPlan, check_experts

__all__ = ["fused_experts", "gate_up_swiglu", "down_proj", "tile_map", "launch_config", "max_tiles",
           "tma_supported", "tuned_beats_cutlass", "DEFAULT", "FEW_ROWS", "FEW_TUNED", "TUNED", "MAX_EXPERTS"]

MAX_EXPERTS = 256  # every program loads all E group ends (padded to a power of two)
_INTERPRET = interpreting()

# per kernel: BLOCK_M rows (of one expert) x BLOCK_N output columns, BLOCK_K of the reduction per step.
# gate_up: BLOCK_N columns of F for gate and up each (two accumulators), so BLOCK_N 64 here is vLLM's 128
# columns of the fused 2F output.
DEFAULT = {
    "gate_up": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 16},
    "down": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 16},
}
# fewer padded rows per expert (N / E, N = T * k_max): smaller row tiles waste less on each group
FEW_ROWS = [
    (64, {"gate_up": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
          "down": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}}),
    (128, {"gate_up": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
           "down": {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}}),
]
# device name -> {(D, F): [(N rows up to, {"gate_up": {...}, "down": {...}, "beats_cutlass": bool})]}, many rows per
# expert (N > FEW_ROWS' last bound); beats_cutlass: the tuning run measured these GEMMs faster than torch._grouped_mm
# (with its gather and SwiGLU passes) on every plan it timed, so set_gemm('auto') takes them there too.
TUNED: dict[str, dict[tuple[int, int], list]] = load_tables("grouped")
# device name -> {(D, F): {"gate_up": {...}, "down": {...}}}: the few-row class (FEW_ROWS[0], decode sizes); a device
# takes only its own entries here.
FEW_TUNED: dict[str, dict[tuple[int, int], dict]] = load_tables("few_rows")


def launch_config(N: int, E: int, D: int, Fd: int, device: torch.device | None = None) -> dict:
    """{"gate_up": {...}, "down": {...}} for N = T * k_max padded rows, E experts, hidden D, expert width F:
    by rows per expert (FEW_ROWS, else DEFAULT), updated by the device's tuned entry for (D, F) if any."""
    cuda = -1 if device is None or device.type != "cuda" else (device.index or 0)
    return {name: dict(c) for name, c in _launch_config(N, E, D, Fd, cuda).items()}


@functools.lru_cache(maxsize=64)
def _launch_config(N: int, E: int, D: int, Fd: int, cuda: int) -> dict:
    base = next((c for rows, c in FEW_ROWS if N <= rows * E), DEFAULT)
    cfg = {name: dict(c) for name, c in base.items()}
    tuned = None
    if base is DEFAULT:  # many rows per expert
        tuned = _tuned_entry(N, D, Fd, cuda)
    elif base is FEW_ROWS[0][1] and cuda >= 0:  # decode sizes: the device's own entry only (not a same-SM device's)
        tuned = own_table(FEW_TUNED, cuda).get((D, Fd))
    for name in cfg:
        cfg[name].update((tuned or {}).get(name, {}))
    return cfg


def _tuned_entry(N: int, D: int, Fd: int, cuda: int) -> dict | None:
    """The device's TUNED entry for (D, F) that covers N rows, if any."""
    if cuda < 0:
        return None
    return next((t for n_max, t in device_table(TUNED, cuda).get((D, Fd), []) if N <= n_max), None)


def tuned_beats_cutlass(N: int, E: int, D: int, Fd: int, device: torch.device) -> bool:
    """The TUNED entry's 'beats_cutlass' for (D, F) at many rows per expert: then set_gemm('auto') runs the Triton
    GEMMs there too."""
    if device.type != "cuda" or N <= FEW_ROWS[-1][0] * E:
        return False
    return bool((_tuned_entry(N, D, Fd, device.index or 0) or {}).get("beats_cutlass", False))


def max_tiles(N: int, E: int, block_m: int) -> int:
    """Upper bound of sum_e cdiv(count_e, BLOCK_M) over any counts summing to at most N: at most
    min(E, N) groups are non-empty, each adds at most BLOCK_M - 1 rows of padding to its last tile."""
    return (N + min(E, N) * (block_m - 1)) // block_m


# ------------------------------------------------------------------ kernels


@triton.jit
def _groups(offs_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per expert (padded to BLOCK_E): first row, end row, row tiles, inclusive cumsum of the tiles; and the
    total number of row tiles, from the group ends offsets_E."""
    e_i = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e_i, mask=e_i < E, other=0)
    starts = tl.load(offs_ptr + e_i - 1, mask=(e_i > 0) & (e_i < E), other=0)
    counts = tl.where(e_i < E, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)  # inclusive: tiles of experts 0..e
    return starts, ends, tiles, cum, tl.sum(tiles, 0)


@triton.jit
def _find(pid_m, starts, ends, tiles, cum, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile pid_m of the expert-grouped rows: (expert, first row, group end row). Tiles of expert e cover
    [start_e + m * BLOCK_M, min(end_e, start_e + (m + 1) * BLOCK_M))."""
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)  # experts whose tiles all come before pid_m
    sel = tl.arange(0, BLOCK_E) == e
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    start = tl.sum(tl.where(sel, starts, 0), 0)
    end = tl.sum(tl.where(sel, ends, 0), 0)
    return e, start + (pid_m - first_tile) * BLOCK_M, end


@triton.jit
def _tile_of(pid_m, offs_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile pid_m: (expert, first row, group end row, total tiles)."""
    starts, ends, tiles, cum, total = _groups(offs_ptr, E, BLOCK_M, BLOCK_E)
    e, row0, end = _find(pid_m, starts, ends, tiles, cum, BLOCK_M, BLOCK_E)
    return e, row0, end, total


@triton.jit
def _swizzle(pid, NUM_M, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, GROUP_M row tiles at a time over all columns: programs in
    flight share weight columns (a large expert's weights are read from HBM about once, not once per
    row tile) and rows (from L2)."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(NUM_M - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _tile_map_kernel(offs_ptr, out_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of each program's tile, (-1, -1, -1) past the total: the map the
    GEMM kernels use, written out (tests)."""
    pid = tl.program_id(0)
    e, row0, end, total = _tile_of(pid, offs_ptr, E, BLOCK_M, BLOCK_E)
    ok = pid < total
    row1 = tl.minimum(end, row0 + BLOCK_M)
    tl.store(out_ptr + pid * 3 + 0, tl.where(ok, e, -1))
    tl.store(out_ptr + pid * 3 + 1, tl.where(ok, row0, -1))
    tl.store(out_ptr + pid * 3 + 2, tl.where(ok, row1, -1))


@triton.jit
def _expert_gemm_kernel(
    a_ptr, a_desc, tok_ptr, offs_ptr, w_ptr, w_desc, out_ptr,
    KD, N, E, NUM_M,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr, GATED: tl.constexpr,
    TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr = False,
):
    """out[r, n] = a[r] . w[e, n] (w: [E, N, KD]) for the rows r of one expert's tile: the down GEMM.
    GATED: the gate_up GEMM + SwiGLU, rows of a gathered through tok, w: [E, 2N, KD],
    out[r, n] = silu(a[tok[r]] . w[e, n]) * (a[tok[r]] . w[e, N + n]).
    TMA: weight tiles (and the down GEMM's contiguous rows of a) come through tensor descriptors over
    w as [E * rows, KD] and a as [rows, KD]: bulk copies, zero past the tensor's end; rows a tile reads
    past its expert or past N only reach outputs that are not stored. Gathered rows stay pointer loads.
    PERSISTENT: a few programs (one per SM) loop over the tiles that exist, in the same swizzled order;
    otherwise one program per tile of the upper bound NUM_M, and those past the total return at once
    (with fewer kept pairs, more of them: each still takes an SM's turn)."""
    starts, ends, tiles, cum, total = _groups(offs_ptr, E, BLOCK_M, BLOCK_E)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        # FLATTEN: the tile loop and the K loop software-pipelined as one, so the next tile's first loads
        # are in flight during this tile's last steps and its stores
        for t in tl.range(tl.program_id(0), total * num_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _swizzle(t, total, num_n, GROUP_M)
            e, row0, end = _find(pid_m, starts, ends, tiles, cum, BLOCK_M, BLOCK_E)
            _gemm_tile(a_ptr, a_desc, tok_ptr, w_ptr, w_desc, out_ptr, KD, N, e, row0, end, pid_n,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, GATED, TMA)
    else:
        pid_m, pid_n = _swizzle(tl.program_id(0), NUM_M, num_n, GROUP_M)
        if pid_m >= total:
            return
        e, row0, end = _find(pid_m, starts, ends, tiles, cum, BLOCK_M, BLOCK_E)
        _gemm_tile(a_ptr, a_desc, tok_ptr, w_ptr, w_desc, out_ptr, KD, N, e, row0, end, pid_n,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, GATED, TMA)


@triton.jit
def _gemm_tile(
    a_ptr, a_desc, tok_ptr, w_ptr, w_desc, out_ptr, KD, N, e, row0, end, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, GATED: tl.constexpr, TMA: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of expert e: rows row0.. (below end), columns pid_n * BLOCK_N.."""
    r = row0 + tl.arange(0, BLOCK_M)
    r_ok = r < end
    if GATED:
        src = tl.load(tok_ptr + tl.where(r_ok, r, row0)).to(tl.int64)  # rows past the group: a valid token
    else:
        src = tl.where(r_ok, r, row0).to(tl.int64)  # rows past the group read a row that exists
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # columns past N wrap (never stored)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * KD + k[None, :]
    w_e = w_ptr + e.to(tl.int64) * ((2 * N) if GATED else N) * KD
    w_ptrs = w_e + n[None, :].to(tl.int64) * KD + k[:, None]  # [BLOCK_K, BLOCK_N] of w[e, n, :].T
    u_ptrs = w_e + (n[None, :] + N).to(tl.int64) * KD + k[:, None]  # GATED: w[e, N + n, :].T
    w_row = e * ((2 * N) if GATED else N) + pid_n * BLOCK_N  # TMA: the tile's first row of w as [E * rows, KD]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kk in range(0, tl.cdiv(KD, BLOCK_K)):
        if TMA and not GATED:
            a = a_desc.load([row0, kk * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k < KD - kk * BLOCK_K)[None, :], other=0.0)
        if TMA:
            w = w_desc.load([w_row, kk * BLOCK_K]).T
            if GATED:
                wu = w_desc.load([w_row + N, kk * BLOCK_K]).T
        elif EVEN_K:
            w = tl.load(w_ptrs)
            if GATED:
                wu = tl.load(u_ptrs)
        else:
            k_ok = k < KD - kk * BLOCK_K
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if GATED:
            u_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    if GATED:  # the numerics of GEMM -> swiglu_rows: gate and up rounded to the data type, silu rounded too
        g = acc.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        val = (act * u).to(dt)
    else:
        val = acc.to(dt)
    n_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = out_ptr + r[:, None].to(tl.int64) * N + n_out[None, :]
    tl.store(out, val, mask=r_ok[:, None] & (n_out < N)[None, :])


# ------------------------------------------------------------------ host side


def _precision(dtype: torch.dtype) -> str:
    """fp32 operands in full precision (tl.dot would use TF32 on the GPU); 16-bit ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_map(offsets_E: torch.Tensor, N: int, block_m: int) -> torch.Tensor:
    """[max_tiles, 3] int32: (expert, first row, end row) of each row tile as the GEMM kernels compute
    it from the group ends offsets_E; (-1, -1, -1) for programs past the total (they return at once)."""
    E = offsets_E.shape[0]
    n_tiles = max_tiles(N, E, block_m)
    out = torch.empty(n_tiles, 3, dtype=torch.int32, device=offsets_E.device)
    if n_tiles:
        with on_device_of(offsets_E):
            launch(_tile_map_kernel, (n_tiles,), (offsets_E, out, E), dict(BLOCK_M=block_m, BLOCK_E=pow2(max(E, 2))))
    return out


def _launch_gemm(a: torch.Tensor, tok: torch.Tensor | None, offsets_E: torch.Tensor, w: torch.Tensor, n_out: int,
                 rows: int, cfg: dict) -> torch.Tensor:
    """[rows, n_out] from _expert_gemm_kernel (GATED when tok is given), rows < offsets[-1] written."""
    E, KD = w.shape[0], a.shape[1]
    out = torch.empty(rows, n_out, dtype=a.dtype, device=a.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_m = max_tiles(rows, E, bm)
    grid = (num_m * cdiv(n_out, bn),)
    if not grid[0]:
        return out
    persistent = bool(cfg.get("PERSISTENT"))
    if persistent:  # one program per SM (the tuned tiles fill an SM's shared memory), looping over the tiles
        grid = (min(grid[0], _programs(a)),)
    rows_from = offsets_E if tok is None else tok
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=pow2(max(E, 2)), EVEN_K=KD % bk == 0,
                PRECISION=_precision(a.dtype), GROUP_M=cfg.get("GROUP_M", 1), GATED=tok is not None)
    a_desc = w_desc = None
    if cfg.get("TMA") and tma_supported(a, w):
        # host-built descriptors (faster than building them in every program); their block shapes and data type
        # follow from the constexprs and a's dtype, which the launcher's cache key holds
        w_desc = TensorDescriptor.from_tensor(w.view(-1, KD), [bn, bk])
        a_desc = None if tok is not None else TensorDescriptor.from_tensor(a, [bm, bk])  # gathered rows: pointers
    args = (a, a if a_desc is None else a_desc, rows_from, offsets_E, w, w if w_desc is None else w_desc, out,
            KD, n_out, E, num_m)
    launch(_expert_gemm_kernel, grid, args, dict(meta, TMA=w_desc is not None, PERSISTENT=persistent,
                                                  FLATTEN=persistent and bool(cfg.get("FLATTEN"))),
           cfg["num_warps"], cfg["num_stages"])
    return out


INTERPRET_PROGRAMS = 3  # persistent programs under TRITON_INTERPRET: several, so each loops over strided tiles


def _programs(a: torch.Tensor) -> int:
    """Persistent programs for a's device: its SM count (INTERPRET_PROGRAMS on the CPU interpreter)."""
    return _sm_count(a.get_device()) if a.is_cuda else INTERPRET_PROGRAMS


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_supported(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Tensor-descriptor loads for these operands: Triton has them, 16-bit data, rows of a multiple of 16
    bytes (the descriptor's stride rule), and a GPU with TMA (compute capability 9+) or the interpreter."""
    if TensorDescriptor is None or a.dtype not in (torch.bfloat16, torch.float16) or (a.shape[1] * 2) % 16:
        return False
    if w.dtype != a.dtype:
        return False
    if a.is_cuda:
        return _capability(a.get_device())[0] >= 9
    return _INTERPRET


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gate_up_swiglu(x_TD: torch.Tensor, token_idx: torch.Tensor, offsets_E: torch.Tensor, gate_up_EHD: torch.Tensor,
                   cfg: dict) -> torch.Tensor:
    """a_PF = silu(x[tok] @ gate.T) * (x[tok] @ up.T) per expert group, rows < offsets[-1] written
    ([N, F], later rows left unwritten). Inputs already checked by fused_experts."""
    return _launch_gemm(x_TD, token_idx, offsets_E, gate_up_EHD, gate_up_EHD.shape[1] // 2, token_idx.shape[0], cfg)


def down_proj(a_PF: torch.Tensor, offsets_E: torch.Tensor, down_EDF: torch.Tensor, cfg: dict) -> torch.Tensor:
    """y_PD = a_PF @ down[e].T per expert group, rows < offsets[-1] written ([N, D], later rows unwritten)."""
    return _launch_gemm(a_PF, None, offsets_E, down_EDF, down_EDF.shape[1], a_PF.shape[0], cfg)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x_TD, layout, gate_up_EHD, down_EDF, plan) -> None:
    """Beyond `check_experts`, what the kernels assume: dtypes, contiguity, devices, at most MAX_EXPERTS experts,
    a padded layout."""
    check_experts(x_TD, plan, gate_up_EHD, down_EDF)
    (T, _), E = x_TD.shape, gate_up_EHD.shape[0]
    if x_TD.dtype not in _DTYPES:
        raise ValueError(f"x dtype={x_TD.dtype}: must be one of {_DTYPES}")
    if x_TD.dtype == torch.bfloat16 and not x_TD.is_cuda and _INTERPRET:
        raise ValueError("x dtype=torch.bfloat16 under TRITON_INTERPRET: the interpreter's bf16 tl.dot returns wrong "
                         "sums, so these GEMMs need float32 or float16 on the CPU (or a GPU)")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"E={E} experts: must be 1..{MAX_EXPERTS}")
    if tuple(layout.offsets.shape) != (E,) or layout.offsets.dtype != torch.int32:
        raise ValueError(f"layout.offsets {tuple(layout.offsets.shape)} {layout.offsets.dtype}: must be [E={E}] int32")
    if layout.slot_row is None:
        raise ValueError("layout has no slot_row: need a padded layout (moelab.kernels.layout.pair_layout_padded)")
    if tuple(layout.slot_row.shape) != (T, plan.k_max) or layout.slot_row.dtype != torch.int32:
        raise ValueError(f"layout.slot_row {tuple(layout.slot_row.shape)} {layout.slot_row.dtype}: must be "
                         f"[T, k_max] = {(T, plan.k_max)} int32")
    if layout.token_idx.dim() != 1 or layout.token_idx.dtype != torch.int64:
        raise ValueError(f"layout.token_idx {tuple(layout.token_idx.shape)} {layout.token_idx.dtype}: must be [N] "
                         "int64")
    for name, t in (("gate_up", gate_up_EHD), ("down", down_EDF), ("layout.offsets", layout.offsets),
                    ("layout.token_idx", layout.token_idx), ("layout.slot_row", layout.slot_row)):
        if t.device != x_TD.device or not t.is_contiguous():
            raise ValueError(f"{name} on {t.device}, contiguous={t.is_contiguous()}: must be contiguous on "
                             f"{x_TD.device}")


def fused_experts(x_TD: torch.Tensor, layout: PairLayout, gate_up_EHD: torch.Tensor, down_EDF: torch.Tensor,
                  plan: RoutingPlan, config: dict | None = None) -> torch.Tensor:
    """Sum over kept experts of weight * down(silu(gate(x)) * up(x)), [T, D] in x's dtype: gate_up_swiglu
    (gather + gate_up + SwiGLU), down_proj, combine_rows. layout: padded, with slot_row
    (moelab.kernels.layout.pair_layout_padded). config: {"gate_up": {...}, "down": {...}} entries
    overriding `launch_config`'s (e.g. {"gate_up": {"BLOCK_M": 16}})."""
    _check(x_TD, layout, gate_up_EHD, down_EDF, plan)
    T, D = x_TD.shape
    E, H, _ = gate_up_EHD.shape
    N = layout.token_idx.shape[0]
    if T == 0 or D == 0 or N == 0 or H == 0:
        return x_TD.new_zeros(T, D)
    x_TD = x_TD.contiguous()
    cfg = launch_config(N, E, D, H // 2, x_TD.device)
    if config:
        cfg = {name: {**c, **config.get(name, {})} for name, c in cfg.items()}
    with on_device_of(x_TD):
        a_PF = gate_up_swiglu(x_TD, layout.token_idx, layout.offsets, gate_up_EHD, cfg["gate_up"])
        y_PD = down_proj(a_PF, layout.offsets, down_EDF, cfg["down"])
    return combine_rows(y_PD, layout.slot_row, plan, x_TD.dtype)
