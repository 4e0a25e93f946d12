"""Expert execution over a padded pair layout where every step's work scales with the kept pairs.

With a padded layout (T * k_max rows, P kept, P only on the device) the torch ops around the grouped
GEMMs (gather, activation, weighting, index_add) would touch all T * k_max rows. Here they stop at P:
- gather: programs whose rows start at or past P return at once;
- SwiGLU: silu(gate) * up on rows < P only;
- combine: out[t] = sum_j w[t, j] * y[row(t, j)], a gather-sum per token (no atomics, no fp32
  [rows, D] temporaries), reading only the kept rows.
torch._grouped_mm already stops at offsets[-1] = P. So skipped pairs cost nothing anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab.kernels import cdiv, launch, on_device_of, pow2
from moelab.plan import RoutingPlan

__all__ = ["gather_rows", "swiglu_rows", "combine_rows"]


@triton.jit
def _gather_kernel(x_ptr, tok_ptr, offs_ptr, out_ptr, D, E, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    P = tl.load(offs_ptr + E - 1)
    if pid_r * BLOCK_R >= P:
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (r < P)[:, None] & (d < D)[None, :]
    t = tl.load(tok_ptr + r, mask=r < P, other=0)
    v = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=ok)
    tl.store(out_ptr + r[:, None].to(tl.int64) * D + d[None, :], v, mask=ok)


@triton.jit
def _swiglu_kernel(h_ptr, offs_ptr, out_ptr, Fd, E, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    P = tl.load(offs_ptr + E - 1)
    if pid_r * BLOCK_R >= P:
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = (r < P)[:, None] & (f < Fd)[None, :]
    base = r[:, None].to(tl.int64) * (2 * Fd) + f[None, :]
    g = tl.load(h_ptr + base, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + base + Fd, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # silu rounded to the data type, as F.silu(gate) is
    a = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + r[:, None].to(tl.int64) * Fd + f[None, :], a.to(u.dtype), mask=ok)


@triton.jit
def _combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    d_ok = d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in tl.static_range(K):  # unrolled: the K row loads are in flight together
        row = tl.load(row_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=-1)
        w = tl.load(w_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0.0)
        use = row >= 0
        y = tl.load(y_ptr + row[:, None].to(tl.int64) * D + d[None, :], mask=use[:, None] & d_ok[None, :], other=0.0)
        acc += y.to(tl.float32) * w[:, None]
    tl.store(out_ptr + t[:, None].to(tl.int64) * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])


_BLOCK_R = 32


def gather_rows(x_TD: torch.Tensor, token_idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x_TD[token_idx[p]] for rows p < offsets[-1]; later rows are left unwritten."""
    N, D = token_idx.shape[0], x_TD.shape[1]
    out = torch.empty(N, D, dtype=x_TD.dtype, device=x_TD.device)
    if N and D:
        block_d = min(256, pow2(D))
        with on_device_of(x_TD):
            launch(_gather_kernel, (cdiv(N, _BLOCK_R), cdiv(D, block_d)),
                   (x_TD.contiguous(), token_idx, offsets, out, D, offsets.shape[0]),
                   dict(BLOCK_R=_BLOCK_R, BLOCK_D=block_d))
    return out


def swiglu_rows(h_PH: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :F]) * h[:, F:] for rows < offsets[-1]; later rows are left unwritten."""
    N, H = h_PH.shape
    if H % 2:
        raise ValueError(f"gate_up rows H={H}: must be even (gate rows then up rows)")
    Fd = H // 2
    out = torch.empty(N, Fd, dtype=h_PH.dtype, device=h_PH.device)
    if N and Fd:
        block_f = min(256, pow2(Fd))
        with on_device_of(h_PH):
            launch(_swiglu_kernel, (cdiv(N, _BLOCK_R), cdiv(Fd, block_f)),
                   (h_PH.contiguous(), offsets, out, Fd, offsets.shape[0]), dict(BLOCK_R=_BLOCK_R, BLOCK_F=block_f))
    return out


def combine_rows(y_PD: torch.Tensor, slot_row: torch.Tensor, plan: RoutingPlan, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j plan.weights[t, j] * y_PD[slot_row[t, j]] (fp32 sum), over the used slots."""
    T, K = slot_row.shape
    D = y_PD.shape[1]
    out = torch.empty(T, D, dtype=dtype, device=y_PD.device)
    if T and D:
        block_d = min(128, pow2(D))
        block_t = 16
        with on_device_of(y_PD):
            launch(_combine_kernel, (cdiv(T, block_t), cdiv(D, block_d)),
                   (y_PD, slot_row, plan.weights.contiguous(), out, T, D), dict(K=K, BLOCK_T=block_t, BLOCK_D=block_d))
    return out
