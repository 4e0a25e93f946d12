"""Expert-sorted pair layout without a host sync, sized for the worst case T * k_max.

The torch reference (`moelab.experts.pair_layout`) sizes its output by the number of kept pairs P,
which needs P on the host. Here the buffers hold N = T * k_max rows: rows [0, P) are the kept pairs,
sorted by expert and, within an expert, by token (the reference's order, exactly); rows [P, N) are
padding (token T, expert E, weight 0). `slot_row[t, j]` is the row of the plan's slot (t, j), -1
where the slot is unused: the combine step gathers through it instead of scattering. `offsets[E-1]`
= P lives on the device, and torch._grouped_mm reads it there, so a captured CUDA graph runs with
any number of kept pairs.

Three launches: (1) per token block, how many pairs go to each expert; (2) one program per 64
experts scans those counts over the blocks, in tiles of blocks with a running carry between tiles:
every block's count of earlier pairs per expert, and each expert's total; (3) each pair's row = its
expert's start (a cumsum of the totals, which the first program also stores as `offsets`) + the
earlier blocks' pairs of that expert + its rank among the block's earlier tokens of the same expert
(a cumsum inside the tile). Step (2) was two torch.cumsum calls before, the one over the blocks
(dim 0) scanning one block after another: the layout took 40 us of GPU time at T = 4096, E = 64 on
the H200 (data/results/archive/layer-stages-20261130-84b21d3.json), against 2.4 us for the routing call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab.experts import PairLayout
from moelab.kernels import cdiv, launch, on_device_of, pow2
from moelab.routing import RoutingPlan

__all__ = ["pair_layout_padded"]


@triton.jit
def _expert_hits(ids_ptr, rows, row_ok, cols, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_T, BLOCK_E] int32: 1 where the token uses the expert (a token's experts are distinct)."""
    hit = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
    for j in range(K):
        e = tl.load(ids_ptr + rows.to(tl.int64) * K + j, mask=row_ok, other=-1)
        hit += (e[:, None] == cols[None, :]).to(tl.int32)
    return hit


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    hit = _expert_hits(ids_ptr, rows, rows < T, cols, K, BLOCK_T, BLOCK_E)
    tl.store(counts_ptr + pid * E + cols, tl.sum(hit, axis=0), mask=cols < E)


@triton.jit
def _scan_kernel(counts_ptr, cum_ptr, tot_ptr, NB, E, CB: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_C experts per program: cum[b, e] = pairs of expert e in blocks before b, tot[e] = all its pairs."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < E
    carry = tl.zeros((BLOCK_C,), tl.int32)  # pairs per expert in the blocks scanned so far
    for b0 in range(0, NB, CB):
        b = b0 + tl.arange(0, CB)
        ok = (b < NB)[:, None] & col_ok[None, :]
        c = tl.load(counts_ptr + b[:, None] * E + cols[None, :], mask=ok, other=0)
        tl.store(cum_ptr + b[:, None] * E + cols[None, :], carry[None, :] + tl.cumsum(c, axis=0) - c, mask=ok)
        carry += tl.sum(c, axis=0)
    tl.store(tot_ptr + cols, carry, mask=col_ok)


@triton.jit
def _scatter_kernel(
    ids_ptr, w_ptr, cum_ptr, tot_ptr, offs_ptr, tok_ptr, exp_ptr, wout_ptr, slot_row_ptr,
    T, E, N,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    hit = _expert_hits(ids_ptr, rows, row_ok, cols, K, BLOCK_T, BLOCK_E)
    rank = tl.cumsum(hit, axis=0) - hit  # earlier tokens of this block with the same expert
    tot = tl.load(tot_ptr + cols, mask=col_ok, other=0)
    ends = tl.cumsum(tot, axis=0)  # group ends (every program derives them; the first one stores them)
    if pid == 0:
        tl.store(offs_ptr + cols, ends, mask=col_ok)
    before = tl.load(cum_ptr + pid * E + cols, mask=col_ok, other=0)  # earlier blocks' pairs
    base = ends - tot + before  # first row of this block's pairs, per expert
    pos_tile = base[None, :] + rank
    for j in range(K):
        src = rows.to(tl.int64) * K + j
        e = tl.load(ids_ptr + src, mask=row_ok, other=-1)
        pos = tl.sum(tl.where(cols[None, :] == e[:, None], pos_tile, 0), axis=1)
        ok = row_ok & (e >= 0)
        w = tl.load(w_ptr + src, mask=ok, other=0.0)
        tl.store(tok_ptr + pos, rows.to(tl.int64), mask=ok)
        tl.store(exp_ptr + pos, e.to(tl.int64), mask=ok)
        tl.store(wout_ptr + pos, w, mask=ok)
        tl.store(slot_row_ptr + src, tl.where(ok, pos, -1), mask=row_ok)
    # padding rows [P, N): each program fills its own stretch of BLOCK_T * K rows
    P = tl.sum(tot, axis=0)
    q_local = tl.arange(0, BLOCK_Q)
    q = pid * (BLOCK_T * K) + q_local
    pad = (q_local < BLOCK_T * K) & (q < N) & (q >= P)
    tl.store(tok_ptr + q, tl.zeros((BLOCK_Q,), tl.int64) + T, mask=pad)
    tl.store(exp_ptr + q, tl.zeros((BLOCK_Q,), tl.int64) + E, mask=pad)
    tl.store(wout_ptr + q, tl.zeros((BLOCK_Q,), tl.float32), mask=pad)


_MAX_BLOCKS = 512  # token blocks the scan should see at most (larger blocks at many tokens)
_SCAN_COLS = 64  # experts per scan program
_SCAN_TILE = 16384  # counts per tile of the scan (blocks x experts; blocks rounded down to a power of two)


def _blocks(T: int, E: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E): tiles of about 2048 (token, expert) cells, and at many tokens larger ones, up to 8192
    cells and 128 tokens, so that at most about 512 blocks go through the scan (benchmarks/pair_layout.py)."""
    block_e = pow2(max(E, 2))
    block_t = max(1, min(128, max(2048 // block_e, pow2(cdiv(T, _MAX_BLOCKS))), max(1, 8192 // block_e)))
    return min(block_t, pow2(max(T, 1))), block_e


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
    block_t, block_e = _blocks(T, E)
    nb = cdiv(T, block_t)
    counts = torch.empty(nb, E, dtype=torch.int32, device=dev)
    cum = torch.empty(nb, E, dtype=torch.int32, device=dev)
    tot = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E, dtype=torch.int32, device=dev)
    block_c = min(block_e, _SCAN_COLS)
    cb = min(pow2(nb), 1 << (max(1, _SCAN_TILE // block_c).bit_length() - 1))
    with on_device_of(ids):
        launch(_count_kernel, (nb,), (ids, counts, T, E), dict(K=K, BLOCK_T=block_t, BLOCK_E=block_e))
        launch(_scan_kernel, (cdiv(E, block_c),), (counts, cum, tot, nb, E), dict(CB=cb, BLOCK_C=block_c),
               num_warps=8)
        launch(_scatter_kernel, (nb,), (ids, weights, cum, tot, offsets, tok, exp, w, slot_row, T, E, N),
               dict(K=K, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_Q=pow2(block_t * K)))
    return PairLayout(tok, exp, w, offsets, padded=True, slot_row=slot_row)
