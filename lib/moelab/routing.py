"""Routing policies: router logits [T, E] -> RoutingPlan.

This is the torch reference. `moelab.kernels.routing` computes the same plan in one Triton launch;
`route()` dispatches to it on CUDA for up to 512 experts (see `set_backend`). Everything downstream
(experts, accounting, statistics, kernels) speaks `RoutingPlan` and nothing else.

Conventions shared by every policy and by the kernel:
- softmax over all E experts in fp32, whatever the logits' dtype;
- entropy in nats of that full softmax;
- a policy's thresholds, p and beta are compared in fp32, the dtype of the entropies and probabilities
  (the kernel takes them as fp32 scalars): a value within an fp32 rounding of a token's counts as equal;
- experts ranked by probability, ties broken by the lower expert index;
- a token keeps the first k[t] ranked experts; unused slots hold id -1 and weight 0;
- kept weights are the softmax probabilities, renormalised over the kept experts when the
  model's convention renormalises (Mixtral, Qwen3-MoE) and left as they are otherwise (OLMoE,
  Qwen1.5-MoE).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Union

import torch

__all__ = [
    "RoutingPlan",
    "TopK",
    "EntropyAdaptiveK",
    "TopP",
    "RatioSkip",
    "Policy",
    "route",
    "route_torch",
    "set_backend",
    "get_backend",
    "KERNEL_MAX_EXPERTS",
    "KERNEL_MAX_K",
    "KERNEL_MAX_K_VALUES",
]


@dataclass
class RoutingPlan:
    """Which experts each token uses, with what weight. Shapes: T tokens, K = policy.k_max slots."""

    expert_ids: torch.Tensor  # [T, K] int32, -1 in unused slots
    weights: torch.Tensor  # [T, K] float32, 0 in unused slots
    k: torch.Tensor  # [T] int32, kept experts per token
    entropy: torch.Tensor  # [T] float32, nats, full softmax
    num_experts: int  # E

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def k_max(self) -> int:
        return self.expert_ids.shape[1]

    def kept_pairs(self) -> int:
        """Number of (token, expert) pairs the experts must compute (one host sync)."""
        return int(self.k.sum())

    def to(self, device) -> "RoutingPlan":
        return dataclasses.replace(
            self,
            expert_ids=self.expert_ids.to(device),
            weights=self.weights.to(device),
            k=self.k.to(device),
            entropy=self.entropy.to(device),
        )


def _check_int(name: str, value, lo: int = 1) -> int:
    """An int field (Python or numpy integers, e.g. from a sweep's table; bools refused) as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r}: must be an int")
    if value < lo:
        raise ValueError(f"{name}={value}: must be >= {lo}")
    return int(value)


def _real(name: str, value) -> float:
    """A policy's real-valued field as a float (Python or numpy numbers; bools and strings refused)."""
    if isinstance(value, (bool, str)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: must be a real number, not {type(value).__name__}")
    return float(value)


def _check_bounds(policy) -> None:
    """k_min and k_max of a clamped policy (TopP, RatioSkip)."""
    object.__setattr__(policy, "k_max", _check_int("k_max", policy.k_max))
    object.__setattr__(policy, "k_min", _check_int("k_min", policy.k_min))
    if policy.k_min > policy.k_max:
        raise ValueError(f"k_min={policy.k_min} > k_max={policy.k_max}: need k_min <= k_max")
    _check_renorm(policy.renormalize)


def _check_renorm(renormalize) -> None:
    if renormalize is not None and not isinstance(renormalize, bool):
        raise ValueError(f"renormalize={renormalize!r}: must be True, False or None (model's convention)")


@dataclass(frozen=True)
class TopK:
    """The model's own rule: the k most probable experts. A lower fixed k is TopK with another k."""

    k: int
    renormalize: bool | None = None  # None: the model's convention, filled in by route()/patching

    def __post_init__(self):
        object.__setattr__(self, "k", _check_int("k", self.k))
        _check_renorm(self.renormalize)

    @property
    def k_max(self) -> int:
        return self.k

    @property
    def k_min(self) -> int:
        return self.k

    def choose_k(self, probs_TK: torch.Tensor, entropy_T: torch.Tensor) -> torch.Tensor:
        return torch.full_like(entropy_T, self.k, dtype=torch.int32)


@dataclass(frozen=True)
class EntropyAdaptiveK:
    """Entropy-guided k: k_values[i] for the first i with entropy < thresholds[i], else k_values[-1].

    k_values ascend strictly; thresholds (nats) ascend strictly and are one fewer than k_values. A threshold
    below 0 is allowed: every token's entropy reaches it (calibrate's u = 0 nudges one there on peaked routers).
    """

    k_values: tuple[int, ...]
    thresholds: tuple[float, ...]
    renormalize: bool | None = None

    def __post_init__(self):
        for name in ("k_values", "thresholds"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)):
                raise ValueError(f"{name}={v!r}: must be a tuple or list")
        kv = tuple(self.k_values)
        th = tuple(_real(f"thresholds[{i}]", t) for i, t in enumerate(self.thresholds))
        object.__setattr__(self, "k_values", kv)
        object.__setattr__(self, "thresholds", th)
        _check_renorm(self.renormalize)
        if len(kv) == 0:
            raise ValueError("k_values=(): need at least one k value")
        kv = tuple(_check_int(f"k_values[{i}]", k) for i, k in enumerate(kv))
        object.__setattr__(self, "k_values", kv)
        if any(b <= a for a, b in zip(kv, kv[1:])):
            raise ValueError(f"k_values={list(kv)}: must be strictly ascending")
        if len(th) != len(kv) - 1:
            raise ValueError(
                f"thresholds={list(th)}: need len(k_values) - 1 = {len(kv) - 1} thresholds, got {len(th)}"
            )
        if any(t != t or t in (float("inf"), float("-inf")) for t in th):
            raise ValueError(f"thresholds={list(th)}: must be finite")
        if any(b <= a for a, b in zip(th, th[1:])):
            raise ValueError(f"thresholds={list(th)}: must be strictly ascending")

    @property
    def k_max(self) -> int:
        return self.k_values[-1]

    @property
    def k_min(self) -> int:
        return self.k_values[0]

    def choose_k(self, probs_TK: torch.Tensor, entropy_T: torch.Tensor) -> torch.Tensor:
        # k_values[number of thresholds at or below the entropy] (thresholds ascend), built from Python
        # scalars: no host-to-device copy of a k_values tensor, so it can be captured in a CUDA graph
        k_T = torch.full_like(entropy_T, self.k_values[0], dtype=torch.int32)
        for t, k_lo, k_hi in zip(self.thresholds, self.k_values, self.k_values[1:]):
            k_T += (entropy_T >= t).to(torch.int32) * (k_hi - k_lo)
        return k_T


@dataclass(frozen=True)
class TopP:
    """Smallest set of ranked experts whose probability reaches p, clamped to [k_min, k_max]."""

    p: float
    k_max: int
    k_min: int = 1
    renormalize: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "p", _real("p", self.p))
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p={self.p!r}: must be in (0, 1]")
        _check_bounds(self)

    def choose_k(self, probs_TK: torch.Tensor, entropy_T: torch.Tensor) -> torch.Tensor:
        # ranked experts while the mass before them is < p: 1 + the prefixes still short of p (the sums
        # themselves, not cumsum - probs, whose rounding could keep one more expert when p is a prefix's mass)
        k = (torch.cumsum(probs_TK, dim=-1) < self.p).sum(-1) + 1
        return k.clamp(self.k_min, self.k_max).to(torch.int32)


@dataclass(frozen=True)
class RatioSkip:
    """Keep ranked expert i while p_i >= beta * p_1 (Lu et al. 2024), clamped to [k_min, k_max]."""

    beta: float
    k_max: int
    k_min: int = 1
    renormalize: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "beta", _real("beta", self.beta))
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta!r}: must be in [0, 1]")
        _check_bounds(self)

    def choose_k(self, probs_TK: torch.Tensor, entropy_T: torch.Tensor) -> torch.Tensor:
        keep = probs_TK >= self.beta * probs_TK[:, :1]
        return keep.sum(-1).clamp(self.k_min, self.k_max).to(torch.int32)


Policy = Union[TopK, EntropyAdaptiveK, TopP, RatioSkip]


def check_policy(policy) -> None:
    """ValueError unless `policy` is one of the four policies."""
    if not isinstance(policy, (TopK, EntropyAdaptiveK, TopP, RatioSkip)):
        raise ValueError(f"policy={policy!r}: must be a TopK, EntropyAdaptiveK, TopP or RatioSkip instance")


def resolve_renormalize(policy: Policy, renormalize: bool | None) -> bool:
    """The policy's own setting wins; otherwise the caller's (the model's convention)."""
    r = policy.renormalize if policy.renormalize is not None else renormalize
    if r is None:
        raise ValueError(
            f"{type(policy).__name__}.renormalize is None and no model convention was given: "
            "pass renormalize=True (Mixtral, Qwen3-MoE) or False (OLMoE, Qwen1.5-MoE)"
        )
    if not isinstance(r, bool):
        raise ValueError(f"renormalize={r!r}: must be True, False or None")
    return r


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
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral)):
        raise ValueError(f"num_experts={num_experts!r}: must be an int (or None)")
    if num_experts is not None and E != num_experts:
        raise ValueError(f"logits have E={E} experts but the layer has num_experts={num_experts}")
    if not 1 <= policy.k_max <= E:
        raise ValueError(f"k_max={policy.k_max}: must be in [1, E={E}]")
    if finite and logits.numel():
        # finite, and each row's spread within fp32 range (else x - max is -inf and the entropy NaN): one sync
        x = logits.float()
        spread_T = x.amax(-1) - x.amin(-1)
        if not bool(torch.isfinite(logits).all() & torch.isfinite(spread_T).all()):
            if not bool(torch.isfinite(logits).all()):
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
    entropy_T = -torch.where(probs_TE > 0, probs_TE * logp_TE, 0.0).sum(-1)  # 0 log 0 = 0 (also at logp -inf)
    # stable sort: equal probabilities keep ascending expert index
    probs_sorted, idx_sorted = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
    top_p_TK, top_i_TK = probs_sorted[:, :K], idx_sorted[:, :K]
    k_T = policy.choose_k(top_p_TK, entropy_T).to(torch.int32)
    keep_TK = torch.arange(K, device=logits.device)[None, :] < k_T[:, None]
    weights_TK = torch.where(keep_TK, top_p_TK, torch.zeros_like(top_p_TK))
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    ids_TK = torch.where(keep_TK, top_i_TK, torch.full_like(top_i_TK, -1)).to(torch.int32)
    return RoutingPlan(ids_TK, weights_TK.float(), k_T, entropy_T.float(), E)


QUANTILE_MAX = 2**24  # torch.quantile refuses more values than this


def quantile(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """torch.quantile of a 1-D tensor (linear interpolation), also above its 2^24-value limit (a long evaluation
    records more entropies per layer; `calibrate` puts EntropyAdaptiveK's thresholds at entropy quantiles):
    there from one sort, with torch.quantile's ranks and lerp."""
    if x.numel() <= QUANTILE_MAX:
        return torch.quantile(x, q)
    s = x.flatten().sort().values
    rank = q.to(s.dtype) * (s.numel() - 1)  # in the values' dtype, as torch.quantile
    lo, hi = rank.floor(), rank.ceil()
    return torch.lerp(s[lo.long()], s[hi.long()], rank - lo)


_BACKEND = "auto"  # "auto": Triton kernel on CUDA (up to KERNEL_MAX_EXPERTS), torch elsewhere; "torch"; "triton"
KERNEL_MAX_EXPERTS = 512  # the Triton kernel holds a token's logits in one tile row; wider routers route in torch
KERNEL_MAX_K = 256  # its k values travel as bytes; more slots route in torch
KERNEL_MAX_K_VALUES = 8  # EntropyAdaptiveK levels it takes as scalars; more route in torch


def set_backend(name: str) -> None:
    """Force the routing backend: 'auto' (the Triton kernel on CUDA for E <= KERNEL_MAX_EXPERTS, k_max <=
    KERNEL_MAX_K and at most KERNEL_MAX_K_VALUES entropy levels, else the torch reference), 'torch' or 'triton'
    (the Triton kernel, e.g. interpreted)."""
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


def route(
    logits: torch.Tensor,
    policy: Policy,
    *,
    renormalize: bool | None = None,
    num_experts: int | None = None,
    check: bool = True,
) -> RoutingPlan:
    """Route router logits [T, E] with a policy.

    renormalize: the model's convention, used when the policy leaves it as None.
    num_experts: if given, the logits must have that many columns.
    check: validate that the logits are finite and each row's spread fits float32 (one host sync); pass
      False inside CUDA-graph capture (unchecked, a non-finite row gives a NaN entropy).
    """
    check_logits(logits, policy, num_experts, finite=check)
    renorm = resolve_renormalize(policy, renormalize)
    if _use_kernel(logits, policy):
        from moelab.kernels.routing import route_triton

        return route_triton(logits, policy, renorm)
    return route_torch(logits, policy, renorm)
