"""Expert execution that skips: only the kept (token, expert) pairs go through the expert GEMMs.

Weights as transformers 5 fuses them: gate_up_EHD [E, 2F, D] (gate rows first, then up) and down_EDF [E, D, F].
Flow: plan -> expert-sorted pairs -> gather -> grouped GEMM (gate/up) -> act(gate) * up -> grouped GEMM (down)
-> scale by routing weight -> scatter-add into [T, D].

Expert GEMMs (`set_gemm`):
- 'triton': `moelab.kernels.grouped.fused_experts`, Triton grouped GEMMs with the gather and SwiGLU fused into
  gate_up, then down and a per-token combine (padded layouts with slot_row and a SiLU act_fn only);
- 'grouped': torch._grouped_mm (CUTLASS) between Triton gather / SwiGLU / combine steps on padded layouts,
  torch ops on exact ones;
- 'loop': a per-expert loop of matmuls (the reference);
- 'auto' (default): 'triton' on CUDA for padded 16-bit layouts with at most FUSED_MAX_ROWS_PER_EXPERT rows per
  expert, or above where the device's tuned entry says it beats CUTLASS; else 'grouped' where supported (bf16 on
  sm90+, or the CPU), else the loop.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moelab.plan import PairLayout, RoutingPlan, check_experts


def pair_layout(plan: RoutingPlan) -> PairLayout:
    """Torch reference layout: exact size P (one host sync). The Triton version pads to T * k_max."""
    ids_N = plan.expert_ids.reshape(-1).long()
    keep_N = ids_N >= 0
    flat = keep_N.nonzero().squeeze(-1)  # [P] positions in the flattened [T * K] plan
    experts_P = ids_N[flat]
    order = torch.argsort(experts_P, stable=True)  # stable: tokens ascend within an expert
    flat, experts_P = flat[order], experts_P[order]
    counts_E = torch.bincount(experts_P, minlength=plan.num_experts)
    return PairLayout(token_idx=flat // plan.k_max, expert_idx=experts_P, weights=plan.weights.reshape(-1)[flat],
                      offsets=torch.cumsum(counts_E, 0).to(torch.int32))


def _rows_aligned(w: torch.Tensor) -> bool:
    """torch._grouped_mm's kernels (CPU and CUTLASS) need 16-byte rows of both operands: K and N of w [E, N, K]."""
    return all(n * w.element_size() % 16 == 0 for n in w.shape[-2:])


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can run these operands (else a per-expert loop is used)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    aligned = _rows_aligned(w)
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _cpu_grouped_mm_runs(x.dtype)
    if x.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(x.device)
        return aligned and x.dtype == torch.bfloat16 and major >= 9  # CUTLASS path: bf16 on sm90+
    return False


@functools.lru_cache(maxsize=None)
def _cpu_grouped_mm_runs(dtype: torch.dtype) -> bool:
    """One tiny call, once per dtype: torch releases that have _grouped_mm without a CPU kernel raise."""
    x_PK = torch.ones(3, 16, dtype=dtype, device="cpu")
    w_ENK = torch.ones(2, 8, 16, dtype=dtype, device="cpu")  # as `grouped_gemm` calls it: two groups, K != N
    try:
        torch._grouped_mm(x_PK, w_ENK.transpose(1, 2), offs=torch.tensor([1, 3], dtype=torch.int32, device="cpu"))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


_LAYOUT_MODE = "auto"  # "auto" | "exact" | "padded"


def set_layout(mode: str) -> None:
    """Force the pair layout: 'auto' (padded Triton layout on CUDA, exact torch layout elsewhere),
    'exact' (torch, sized by the kept pairs: one host sync) or 'padded' (Triton, no host sync)."""
    global _LAYOUT_MODE
    if mode not in ("auto", "exact", "padded"):
        raise ValueError(f"layout mode={mode!r}: must be 'auto', 'exact' or 'padded'")
    _LAYOUT_MODE = mode


_GEMM_MODE = "auto"  # "auto" | "triton" | "grouped" | "loop"


def set_gemm(mode: str) -> None:
    """Force the expert GEMM: 'auto', 'triton', 'grouped' or 'loop' (see the module docstring)."""
    global _GEMM_MODE
    if mode not in ("auto", "triton", "grouped", "loop"):
        raise ValueError(f"gemm mode={mode!r}: must be 'auto', 'triton', 'grouped' or 'loop'")
    _GEMM_MODE = mode


def get_gemm() -> str:
    """The current expert GEMM mode (to restore after a temporary set_gemm)."""
    return _GEMM_MODE


# 'auto' takes the Triton experts up to this many padded rows (T * k_max) per expert (decode sizes)
FUSED_MAX_ROWS_PER_EXPERT = 32


def fused_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: int = 0) -> bool:
    """Whether 'auto' runs the Triton fused experts: CUDA, one 16-bit dtype, contiguous weights, E <= 256, and at
    most FUSED_MAX_ROWS_PER_EXPERT padded rows per expert or a tuned entry that beats CUTLASS here."""
    E, H, D = gate_up.shape
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gate_up.dtype == x.dtype == down.dtype
            and gate_up.is_contiguous() and down.is_contiguous() and E <= 256):
        return False
    if rows <= FUSED_MAX_ROWS_PER_EXPERT * E:
        return True
    from moelab.kernels.grouped import tuned_beats_cutlass

    return tuned_beats_cutlass(rows, E, D, H // 2, x.device)


def is_silu(act_fn) -> bool:
    """F.silu, an nn.SiLU or transformers' SiLUActivation: the activation the fused SwiGLU kernels compute."""
    if act_fn is F.silu:
        return True
    cls = type(act_fn)
    return cls is torch.nn.SiLU or (cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers."))


def grouped_gemm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y[p] = x[p] @ w[e(p)].T for rows grouped by expert; w is [E, N, K] (nn.Linear layout)."""
    auto = _GEMM_MODE in ("auto", "triton")  # 'triton' fuses whole layers (run_experts); single GEMMs as 'auto'
    use_grouped = _GEMM_MODE == "grouped" or (auto and grouped_mm_supported(x_PK, w_ENK))
    if use_grouped:
        if not _rows_aligned(w_ENK):
            raise ValueError(f"set_gemm('grouped'): expert weights [E, N, K] = {list(w_ENK.shape)} in {w_ENK.dtype} "
                             "have rows that are not a multiple of 16 bytes, which torch._grouped_mm needs; use "
                             "set_gemm('auto') (the per-expert loop for such widths) or 'loop'")
        return torch._grouped_mm(x_PK, w_ENK.transpose(1, 2), offs=offsets_E)
    y = x_PK.new_empty(x_PK.shape[0], w_ENK.shape[1])
    ends = offsets_E.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            y[start:end] = x_PK[start:end] @ w_ENK[e].T
        start = end
    return y


def run_experts(x_TD: torch.Tensor, plan: RoutingPlan, gate_up_EHD: torch.Tensor, down_EDF: torch.Tensor,
                act_fn=F.silu, layout: PairLayout | None = None) -> torch.Tensor:
    """Sum over kept experts of weight * down(act(gate(x)) * up(x)); returns [T, D] in x's dtype."""
    check_experts(x_TD, plan, gate_up_EHD, down_EDF)
    T, D = x_TD.shape
    if layout is None and (_LAYOUT_MODE == "padded" or (_LAYOUT_MODE == "auto" and plan.expert_ids.is_cuda)):
        from moelab.kernels import check_kernel_input
        from moelab.kernels.layout import pair_layout_padded

        check_kernel_input(plan.expert_ids, "set_layout('padded')")
        layout = pair_layout_padded(plan)
    layout = layout if layout is not None else pair_layout(plan)
    fusable = layout.padded and layout.slot_row is not None and is_silu(act_fn)
    if _GEMM_MODE == "triton" and not fusable:
        raise ValueError(f"set_gemm('triton') needs a padded layout with slot_row (set_layout('padded') or "
                         f"layout=pair_layout_padded(plan)) and a SiLU act_fn (see is_silu); got padded={layout.padded}"
                         f", slot_row={'set' if layout.slot_row is not None else None}, "
                         f"act_fn={getattr(act_fn, '__name__', act_fn)}")
    if fusable and (_GEMM_MODE == "triton" or (_GEMM_MODE == "auto" and fused_supported(
            x_TD, gate_up_EHD, down_EDF, layout.num_pairs))):
        from moelab.kernels.grouped import fused_experts  # gather + gate_up + SwiGLU, down, combine

        return fused_experts(x_TD, layout, gate_up_EHD, down_EDF, plan)
    if fusable:
        # Triton steps that stop at the kept pairs (P = offsets[-1], on the device)
        from moelab.kernels.experts import combine_rows, gather_rows, swiglu_rows

        x_PD = gather_rows(x_TD, layout.token_idx, layout.offsets)
        a_PF = swiglu_rows(grouped_gemm(x_PD, gate_up_EHD, layout.offsets), layout.offsets)
        return combine_rows(grouped_gemm(a_PF, down_EDF, layout.offsets), layout.slot_row, plan, x_TD.dtype)
    # padded layouts: rows past offsets[-1] gather token T - 1 and land in a dummy output row T
    pad = 1 if layout.padded else 0
    x_PD = x_TD[layout.token_idx.clamp_max(T - 1)] if pad else x_TD[layout.token_idx]
    h_PH = grouped_gemm(x_PD, gate_up_EHD, layout.offsets)
    gate_PF, up_PF = h_PH.chunk(2, dim=-1)
    a_PF = act_fn(gate_PF) * up_PF
    y_PD = grouped_gemm(a_PF, down_EDF, layout.offsets)
    out_TD = torch.zeros(T + pad, D, dtype=torch.float32, device=x_TD.device)
    out_TD.index_add_(0, layout.token_idx, y_PD.float() * layout.weights[:, None])
    return out_TD[:T].to(x_TD.dtype)
