"""Routing: router logits [T, E] -> RoutingPlan. `route()` validates, then runs the Triton kernel on CUDA within its
limits (`set_backend`) or the torch reference `route_torch`. The contract types of `moelab.plan` are re-exported.
"""

from __future__ import annotations

import torch

from moelab.plan import (
    KERNEL_MAX_EXPERTS,
    KERNEL_MAX_K,
    KERNEL_MAX_K_VALUES,
    EntropyAdaptiveK,
    Policy,
    RatioSkip,
    RoutingPlan,
    TopK,
    TopP,
    check_int,
    check_policy,
    resolve_renormalize,
)

__all__ = ["RoutingPlan", "TopK", "EntropyAdaptiveK", "TopP", "RatioSkip", "Policy", "check_policy",
           "resolve_renormalize", "choose_k", "route", "route_torch", "quantile", "set_backend", "get_backend",
           "LOGIT_DTYPES", "KERNEL_MAX_EXPERTS", "KERNEL_MAX_K", "KERNEL_MAX_K_VALUES"]


def choose_k(policy: Policy, probs_TK: torch.Tensor, entropy_T: torch.Tensor) -> torch.Tensor:
    """k [T] int32 of each token under `policy`, from its ranked top-k_max probabilities [T, k_max] and entropy [T].
    Built from Python scalars only (no host-to-device copy), so it can be captured in a CUDA graph."""
    if isinstance(policy, TopK):
        return torch.full_like(entropy_T, policy.k, dtype=torch.int32)
    if isinstance(policy, EntropyAdaptiveK):
        # k_values[number of thresholds at or below the entropy] (thresholds ascend)
        k_T = torch.full_like(entropy_T, policy.k_values[0], dtype=torch.int32)
        for t, k_lo, k_hi in zip(policy.thresholds, policy.k_values, policy.k_values[1:]):
            k_T += (entropy_T >= t).to(torch.int32) * (k_hi - k_lo)
        return k_T
    if isinstance(policy, TopP):
        # 1 + the prefixes still short of p (the sums themselves: cumsum - probs could round one expert more)
        k_T = (torch.cumsum(probs_TK, dim=-1) < policy.p).sum(-1) + 1
    elif isinstance(policy, RatioSkip):
        k_T = (probs_TK >= policy.beta * probs_TK[:, :1]).sum(-1)
    else:
        check_policy(policy)
    return k_T.clamp(policy.k_min, policy.k_max).to(torch.int32)


LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what route() and the routing kernel take


def check_logits(logits: torch.Tensor, policy: Policy, num_experts: int | None = None, finite: bool = True):
    """Validate shape, dtype and (optionally, one host sync) finiteness and range of router logits."""
    check_policy(policy)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits of type {type(logits).__name__}: must be a torch.Tensor [T, E]")
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: must have rank 2 [T, E]")
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits.dtype={logits.dtype}: must be float32, float16 or bfloat16")
    E = logits.shape[1]
    if num_experts is not None and check_int("num_experts", num_experts) != E:
        raise ValueError(f"logits have E={E} experts but the layer has num_experts={num_experts}")
    if not 1 <= policy.k_max <= E:
        raise ValueError(f"k_max={policy.k_max}: must be in [1, E={E}]")
    if finite and logits.numel():
        # finite, and each row's spread within fp32 range (else x - max is -inf and the entropy NaN): one sync
        x = logits.float()
        finite_TE, spread_T = torch.isfinite(logits), x.amax(-1) - x.amin(-1)
        if not bool(finite_TE.all() & torch.isfinite(spread_T).all()):
            if not bool(finite_TE.all()):
                bad = (~torch.isfinite(logits)).nonzero()[0].tolist()
                raise ValueError(f"logits[{bad[0]}, {bad[1]}]={logits[bad[0], bad[1]].item()}: logits must be finite")
            t = int((~torch.isfinite(spread_T)).nonzero()[0])
            raise ValueError(f"logits[{t}] span [{x[t].min().item():.3g}, {x[t].max().item():.3g}]: a row's max - min "
                             "must be within the float32 range (else its softmax underflows to -inf log-probabilities)")


def route_torch(logits: torch.Tensor, policy: Policy, renormalize: bool) -> RoutingPlan:
    """Reference implementation (no validation; see `route`)."""
    T, E = logits.shape
    K = policy.k_max
    logp_TE = torch.log_softmax(logits.float(), dim=-1)
    probs_TE = logp_TE.exp()
    # 0 log 0 = 0 (also at logp -inf); a NaN row (unchecked input) keeps its NaN
    entropy_T = -torch.where(probs_TE == 0, 0.0, probs_TE * logp_TE).sum(-1)
    # stable sort: equal probabilities keep ascending expert index
    probs_sorted, idx_sorted = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
    top_p_TK, top_i_TK = probs_sorted[:, :K], idx_sorted[:, :K]
    k_T = choose_k(policy, top_p_TK, entropy_T)
    keep_TK = torch.arange(K, device=logits.device)[None, :] < k_T[:, None]
    weights_TK = torch.where(keep_TK, top_p_TK, 0.0)
    if renormalize:  # masked again: unused slots stay 0 where the kept sum is NaN (unchecked input)
        weights_TK = torch.where(keep_TK, weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(1e-20), 0.0)
    ids_TK = torch.where(keep_TK, top_i_TK, torch.full_like(top_i_TK, -1)).to(torch.int32)
    return RoutingPlan(ids_TK, weights_TK.float(), k_T, entropy_T.float(), E)


QUANTILE_MAX = 2**24  # torch.quantile refuses more values than this


def quantile(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """torch.quantile of a 1-D tensor (linear interpolation), also above its 2^24-value limit (a long evaluation's
    entropies of one layer): there from one sort, with torch.quantile's ranks and lerp."""
    if x.numel() <= QUANTILE_MAX:
        return torch.quantile(x, q)
    s = x.flatten().sort().values
    rank = q.to(s.dtype) * (s.numel() - 1)  # in the values' dtype, as torch.quantile
    lo, hi = rank.floor(), rank.ceil()
    return torch.lerp(s[lo.long()], s[hi.long()], rank - lo)


_BACKEND = "auto"


def set_backend(name: str) -> None:
    """'auto' (the Triton kernel on CUDA within the KERNEL_MAX_* limits, else torch), 'torch' or 'triton'."""
    global _BACKEND
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={name!r}: must be 'auto', 'torch' or 'triton'")
    _BACKEND = name


def get_backend() -> str:
    return _BACKEND


def _use_kernel(logits: torch.Tensor, policy: Policy) -> bool:
    if _BACKEND == "torch":
        return False
    if _BACKEND == "triton":
        from moelab.kernels import check_kernel_input

        check_kernel_input(logits, "set_backend('triton')")
        return True
    return (logits.is_cuda and logits.shape[1] <= KERNEL_MAX_EXPERTS and policy.k_max <= KERNEL_MAX_K
            and not (isinstance(policy, EntropyAdaptiveK) and len(policy.k_values) > KERNEL_MAX_K_VALUES))


def route(logits: torch.Tensor, policy: Policy, *, renormalize: bool | None = None, num_experts: int | None = None,
          check: bool = True) -> RoutingPlan:
    """Route router logits [T, E] with a policy. renormalize: the model's convention, where the policy has None.
    check: logits finite with each row's spread within float32 (one host sync; False inside CUDA-graph capture).
    Unchecked, a row whose softmax is undefined gets entropy NaN and k = k_min, NaN weights in its used slots and
    id -1, weight 0 in the unused ones."""
    check_logits(logits, policy, num_experts, finite=check)
    renorm = resolve_renormalize(policy, renormalize)
    if _use_kernel(logits, policy):
        from moelab.kernels.routing import route_triton

        return route_triton(logits, policy, renorm)
    return route_torch(logits, policy, renorm)
