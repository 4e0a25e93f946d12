"""Expert-sorted pair layout without a host sync, sized for the worst case T * k_max.

The torch reference (`moelab.experts.pair_layout`) sizes its output by the number of kept pairs P,
which needs P on the host. Here the buffers hold N = T * k_max rows: rows [0, P) are the kept pairs,
sorted by expert and, within an expert, by token (the reference's order, exactly); rows [P, N) are
padding (token T, expert E, weight 0). `slot_row[t, j]` is the row of the plan's slot (t, j), -1
where the slot is unused: the combine step gathers through it instead of scattering. `offsets[E-1]`
= P lives on the device, and torch._grouped_mm reads it there, so a captured CUDA graph runs with
any number of kept pairs.

Three launches over blocks of Q consecutive plan slots (a power of two; a block may cut a token's slots):
(1) each block's pairs per expert (tl.histogram), stored expert-major [E, blocks]; (2) an exclusive scan
of those counts along the blocks, the contiguous axis, a few experts per program with a running carry:
each block's count of earlier pairs per expert, and each expert's total; (3) each block sorts its
(expert, slot) keys (tl.sort, Q elements), so a pair's row is its expert's start (a cumsum of the totals,
which the first program also stores as `offsets`) + the earlier blocks' pairs of that expert + its place
in the sorted block less the place of the expert's first pair there; stores in sorted order land in runs
of consecutive rows. The sort does the same work at any E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab.kernels import cdiv, launch, on_device_of, pow2
from moelab.plan import PairLayout, RoutingPlan

__all__ = ["pair_layout_padded", "launch_config", "LAUNCH"]


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, N, NB, E, Q: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[e, b]: block b's pairs of expert e (unused slots and slots past N go to bin BLOCK_E, not stored)."""
    pid = tl.program_id(0)
    src = pid * Q + tl.arange(0, Q)
    e = tl.load(ids_ptr + src, mask=src < N, other=-1)
    h = tl.histogram(tl.where(e >= 0, e, BLOCK_E), 2 * BLOCK_E)
    bins = tl.arange(0, 2 * BLOCK_E)
    tl.store(counts_ptr + bins * NB + pid, h, mask=bins < E)


@triton.jit
def _scan_kernel(counts_ptr, cum_ptr, tot_ptr, NB, E, CB: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_C experts per program: cum[e, b] = pairs of expert e in blocks before b, tot[e] = all its pairs."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < E
    carry = tl.zeros((BLOCK_C,), tl.int32)  # pairs per expert in the blocks scanned so far
    for b0 in range(0, NB, CB):
        b = b0 + tl.arange(0, CB)
        ok = col_ok[:, None] & (b < NB)[None, :]
        off = cols[:, None] * NB + b[None, :]
        c = tl.load(counts_ptr + off, mask=ok, other=0)
        tl.store(cum_ptr + off, carry[:, None] + tl.cumsum(c, axis=1) - c, mask=ok)
        carry += tl.sum(c, axis=1)
    tl.store(tot_ptr + cols, carry, mask=col_ok)


@triton.jit
def _scatter_kernel(
    ids_ptr, w_ptr, counts_ptr, cum_ptr, tot_ptr, offs_ptr, tok_ptr, exp_ptr, wout_ptr, slot_row_ptr,
    T, E, N, NB,
    K: tl.constexpr, Q: tl.constexpr, LOG_Q: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    f = tl.arange(0, Q)  # slot within the block
    e = tl.load(ids_ptr + pid * Q + f, mask=pid * Q + f < N, other=-1)
    e = tl.where(e >= 0, e, BLOCK_E)  # unused slots and slots past N sort last
    key = tl.sort((e << LOG_Q) | f)  # by expert, then slot (= token: a token's experts are distinct)
    se = key >> LOG_Q
    src = pid * Q + (key & (Q - 1))  # the plan slot at sorted place f
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    tot = tl.load(tot_ptr + cols, mask=col_ok, other=0)
    ends = tl.cumsum(tot, axis=0)  # group ends (every program derives them; the first one stores them)
    if pid == 0:
        tl.store(offs_ptr + cols, ends, mask=col_ok)
    before = tl.load(cum_ptr + cols * NB + pid, mask=col_ok, other=0)  # earlier blocks' pairs
    cnt = tl.load(counts_ptr + cols * NB + pid, mask=col_ok, other=0)
    first = tl.cumsum(cnt, axis=0) - cnt  # sorted place of each expert's first pair in this block
    base = ends - tot + before - first  # row of the pair at sorted place f = base[expert] + f
    ok = se < E
    pos = tl.gather(base, tl.where(ok, se, 0), 0) + f
    w = tl.load(w_ptr + src, mask=ok, other=0.0)
    tl.store(tok_ptr + pos, (src // K).to(tl.int64), mask=ok)
    tl.store(exp_ptr + pos, se.to(tl.int64), mask=ok)
    tl.store(wout_ptr + pos, w, mask=ok)
    tl.store(slot_row_ptr + src, tl.where(ok, pos, -1), mask=src < N)
    # padding rows [P, N): each program fills its own stretch of Q rows
    P = tl.sum(tot, axis=0)
    q = pid * Q + f
    pad = (q < N) & (q >= P)
    tl.store(tok_ptr + q, tl.zeros((Q,), tl.int64) + T, mask=pad)
    tl.store(exp_ptr + q, tl.zeros((Q,), tl.int64) + E, mask=pad)
    tl.store(wout_ptr + q, tl.zeros((Q,), tl.float32), mask=pad)


_SCAN_CELLS = 1024  # counts per tile of the scan (experts x blocks, both powers of two)
# overrides of the launch rule below (benchmarks/pair_layout.py --sweep and the tests set them): plan slots per
# block Q, warps of the count and scatter programs, counts per scan tile; None = the rule
LAUNCH = {"block_slots": None, "warps": None, "scan_cells": None}


def _block_slots(N: int, E: int) -> int:
    """Plan slots per block Q (sorted by one program of Q / 128 warps): 128 for E <= 16 or up to 2^14 slots,
    512 above 2^18 slots, else 256 (`benchmarks/pair_layout.py --sweep` measures the rule against the others)."""
    q = 128 if E <= 16 or N <= 1 << 14 else (512 if N > 1 << 18 else 256)
    return max(2, min(q, pow2(N)))  # a sort of one element is not compiled


def _pow2_at_least(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
        raise ValueError(f"LAUNCH[{name!r}]={v!r}: must be a power of two >= {lo}")
    return v


def launch_config(N: int, E: int) -> tuple[int, int, int]:
    """(Q plan slots per block, warps, counts per scan tile) for N plan slots and E experts: the rule, or
    LAUNCH's overrides (Q is still cut to the slots there are, rounded up to a power of two)."""
    q, warps, cells = LAUNCH["block_slots"], LAUNCH["warps"], LAUNCH["scan_cells"]
    q = _block_slots(N, E) if q is None else max(2, min(_pow2_at_least("block_slots", q, 2), pow2(N)))
    warps = max(1, q // 128) if warps is None else _pow2_at_least("warps", warps, 1)
    cells = _SCAN_CELLS if cells is None else _pow2_at_least("scan_cells", cells, 1)
    return q, warps, cells


def pair_layout_padded(plan: RoutingPlan) -> PairLayout:
    """Kept pairs sorted by expert in T * k_max rows, padding after offsets[-1]; no host sync."""
    ids = plan.expert_ids
    T, K = ids.shape
    E = plan.num_experts
    dev = ids.device
    N = T * K
    tok = torch.empty(N, dtype=torch.int64, device=dev)
    exp = torch.empty(N, dtype=torch.int64, device=dev)
    w = torch.empty(N, dtype=torch.float32, device=dev)
    slot_row = torch.empty(T, K, dtype=torch.int32, device=dev)
    if T == 0:
        return PairLayout(tok, exp, w, torch.zeros(E, dtype=torch.int32, device=dev), padded=True, slot_row=slot_row)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"plan.expert_ids dtype={ids.dtype}, contiguous={ids.is_contiguous()}: need contiguous int32")
    weights = plan.weights.contiguous()
    block_e = pow2(max(E, 2))
    q, warps, cells = launch_config(N, E)
    nb = cdiv(N, q)
    counts = torch.empty(E, nb, dtype=torch.int32, device=dev)
    cum = torch.empty(E, nb, dtype=torch.int32, device=dev)
    tot = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E, dtype=torch.int32, device=dev)
    cb = min(pow2(nb), cells)
    block_c = max(1, min(block_e, cells // cb))
    with on_device_of(ids):
        launch(_count_kernel, (nb,), (ids, counts, N, nb, E), dict(Q=q, BLOCK_E=block_e), num_warps=warps)
        launch(_scan_kernel, (cdiv(E, block_c),), (counts, cum, tot, nb, E), dict(CB=cb, BLOCK_C=block_c))
        launch(_scatter_kernel, (nb,), (ids, weights, counts, cum, tot, offsets, tok, exp, w, slot_row, T, E, N, nb),
               dict(K=K, Q=q, LOG_Q=q.bit_length() - 1, BLOCK_E=block_e), num_warps=warps)
    return PairLayout(tok, exp, w, offsets, padded=True, slot_row=slot_row)
