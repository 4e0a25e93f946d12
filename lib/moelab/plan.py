"""The contract every stage speaks: the routing plan, the four policies, the pair layout and the kernel limits.
A leaf module (no torch ops beyond checks); the torch reference of each policy's k is `moelab.routing.choose_k`.

Conventions shared by every policy, the torch reference and the kernel:
- softmax over all E experts in fp32, whatever the logits' dtype; entropy in nats of that full softmax;
- thresholds, p and beta are compared in fp32 (a value within an fp32 rounding of a token's counts as equal);
- experts ranked by probability, ties broken by the lower expert index;
- a token keeps the first k[t] ranked experts; unused slots hold id -1 and weight 0 (in every row: see
  `moelab.routing.route` for rows of non-finite logits routed unchecked);
- kept weights are the softmax probabilities, renormalised over the kept experts when the model's convention
  renormalises (Mixtral, Qwen3-MoE) and left as they are otherwise (OLMoE, Qwen1.5-MoE).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Union

import torch

KERNEL_MAX_EXPERTS = 512  # the routing kernel holds a token's logits in one tile row; wider routers route in torch
KERNEL_MAX_K = 256  # its k values travel as bytes; more slots route in torch
KERNEL_MAX_K_VALUES = 8  # EntropyAdaptiveK levels it takes as scalars; more route in torch


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

    def to(self, device) -> RoutingPlan:
        return dataclasses.replace(self, expert_ids=self.expert_ids.to(device), weights=self.weights.to(device),
                                   k=self.k.to(device), entropy=self.entropy.to(device))


@dataclass
class PairLayout:
    """Kept (token, expert) pairs sorted by expert; P pairs in all."""

    token_idx: torch.Tensor  # [P] int64, token of each pair
    expert_idx: torch.Tensor  # [P] int64, expert of each pair (ascending)
    weights: torch.Tensor  # [P] float32, routing weight of each pair
    offsets: torch.Tensor  # [E] int32, cumulative end row of each expert's group
    padded: bool = False  # True: T * k_max rows, rows from offsets[-1] on are padding (token T, weight 0)
    slot_row: torch.Tensor | None = None  # [T, K] int32 row of each plan slot, -1 if unused (padded layouts)

    @property
    def num_pairs(self) -> int:
        """Rows in the layout: the kept pairs, or the worst case T * k_max when padded."""
        return self.token_idx.shape[0]


def check_experts(x_TD: torch.Tensor, plan: RoutingPlan, gate_up_EHD: torch.Tensor, down_EDF: torch.Tensor) -> None:
    """Shapes and dtypes of x [T, D], its plan and fused weights gate_up [E, 2F, D] / down [E, D, F]; expert ids are
    range-checked on CPU only (no host sync on CUDA, so a forward stays capturable)."""
    if x_TD.dim() != 2 or gate_up_EHD.dim() != 3 or down_EDF.dim() != 3:
        raise ValueError(f"x {tuple(x_TD.shape)}, gate_up {tuple(gate_up_EHD.shape)}, down {tuple(down_EDF.shape)}: "
                         "must be [T, D], [E, 2F, D] and [E, D, F]")
    (T, D), (E, H, _) = x_TD.shape, gate_up_EHD.shape
    if not isinstance(plan, RoutingPlan):
        raise ValueError(f"plan={plan!r}: must be a RoutingPlan (moelab.routing.route)")
    ids, w, k = plan.expert_ids, plan.weights, plan.k
    if ids.dim() != 2 or w.shape != ids.shape or k.shape != ids.shape[:1]:
        raise ValueError(f"plan expert_ids {tuple(ids.shape)}, weights {tuple(w.shape)}, k {tuple(k.shape)}: "
                         "must be [T, K], [T, K] and [T]")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or not w.dtype.is_floating_point:
        raise ValueError(f"plan expert_ids {ids.dtype}, weights {w.dtype}: must be integer ids and float weights")
    if plan.num_tokens != T:
        raise ValueError(f"plan has {plan.num_tokens} tokens but x has T={T}")
    if plan.num_experts != E:
        raise ValueError(f"plan has num_experts={plan.num_experts} but the weights have E={E}")
    if ids.device.type == "cpu":
        bad = ids[(ids < -1) | (ids >= E)]
        if bad.numel():
            raise ValueError(f"plan.expert_ids holds {int(bad[0])}: must be -1 (unused) or an expert in [0, E={E})")
    if gate_up_EHD.shape[2] != D or H % 2 or tuple(down_EDF.shape) != (E, D, H // 2):
        raise ValueError(f"weights gate_up {tuple(gate_up_EHD.shape)} / down {tuple(down_EDF.shape)}: must be "
                         f"[E, 2F, D] / [E, D, F] with E={E}, hidden D={D} (from x) and one F")
    if not x_TD.dtype == gate_up_EHD.dtype == down_EDF.dtype or not x_TD.dtype.is_floating_point:
        raise ValueError(f"dtypes x {x_TD.dtype}, gate_up {gate_up_EHD.dtype}, down {down_EDF.dtype}: "
                         "must be one dtype, a floating-point one")


def check_int(name: str, value, lo: int = 1) -> int:
    """An int (Python or numpy integers, e.g. from a sweep's table; bools refused) >= lo, as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r}: must be an int")
    if value < lo:
        raise ValueError(f"{name}={value}: must be >= {lo}")
    return int(value)


def check_real(name: str, value) -> float:
    """A real number (Python or numpy; bools and strings refused) as a float."""
    if isinstance(value, (bool, str)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r}: must be a real number, not {type(value).__name__}")
    return float(value)


def _check_renorm(renormalize) -> None:
    if renormalize is not None and not isinstance(renormalize, bool):
        raise ValueError(f"renormalize={renormalize!r}: must be True, False or None (model's convention)")


def _check_bounds(policy) -> None:
    """k_min and k_max of a clamped policy (TopP, RatioSkip), and its renormalize."""
    object.__setattr__(policy, "k_max", check_int("k_max", policy.k_max))
    object.__setattr__(policy, "k_min", check_int("k_min", policy.k_min))
    if policy.k_min > policy.k_max:
        raise ValueError(f"k_min={policy.k_min} > k_max={policy.k_max}: need k_min <= k_max")
    _check_renorm(policy.renormalize)


@dataclass(frozen=True)
class TopK:
    """The model's own rule: the k most probable experts. A lower fixed k is TopK with another k."""

    k: int
    renormalize: bool | None = None  # None: the model's convention, filled in by route()/patching

    def __post_init__(self):
        object.__setattr__(self, "k", check_int("k", self.k))
        _check_renorm(self.renormalize)

    @property
    def k_max(self) -> int:
        return self.k

    @property
    def k_min(self) -> int:
        return self.k


@dataclass(frozen=True)
class EntropyAdaptiveK:
    """Entropy-guided k: k_values[i] for the first i with entropy < thresholds[i], else k_values[-1]; both strictly
    ascending, thresholds (nats, any finite value) one fewer than k_values."""

    k_values: tuple[int, ...]
    thresholds: tuple[float, ...]
    renormalize: bool | None = None

    def __post_init__(self):
        for name in ("k_values", "thresholds"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)):
                raise ValueError(f"{name}={v!r}: must be a tuple or list")
        th = tuple(check_real(f"thresholds[{i}]", t) for i, t in enumerate(self.thresholds))
        object.__setattr__(self, "thresholds", th)
        _check_renorm(self.renormalize)
        if len(self.k_values) == 0:
            raise ValueError("k_values=(): need at least one k value")
        kv = tuple(check_int(f"k_values[{i}]", k) for i, k in enumerate(self.k_values))
        object.__setattr__(self, "k_values", kv)
        if any(b <= a for a, b in zip(kv, kv[1:])):
            raise ValueError(f"k_values={list(kv)}: must be strictly ascending")
        if len(th) != len(kv) - 1:
            raise ValueError(f"thresholds={list(th)}: need len(k_values) - 1 = {len(kv) - 1} thresholds, got {len(th)}")
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


@dataclass(frozen=True)
class TopP:
    """Smallest set of ranked experts whose probability reaches p, clamped to [k_min, k_max]."""

    p: float
    k_max: int
    k_min: int = 1
    renormalize: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "p", check_real("p", self.p))
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p={self.p!r}: must be in (0, 1]")
        _check_bounds(self)


@dataclass(frozen=True)
class RatioSkip:
    """Keep ranked expert i while p_i >= beta * p_1 (Lu et al. 2024), clamped to [k_min, k_max]."""

    beta: float
    k_max: int
    k_min: int = 1
    renormalize: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "beta", check_real("beta", self.beta))
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta!r}: must be in [0, 1]")
        _check_bounds(self)


Policy = Union[TopK, EntropyAdaptiveK, TopP, RatioSkip]
POLICIES = (TopK, EntropyAdaptiveK, TopP, RatioSkip)


def check_policy(policy) -> None:
    """ValueError unless `policy` is one of the four policies."""
    if not isinstance(policy, POLICIES):
        raise ValueError(f"policy={policy!r}: must be a TopK, EntropyAdaptiveK, TopP or RatioSkip instance")


def resolve_renormalize(policy: Policy, renormalize: bool | None) -> bool:
    """The policy's own setting wins; otherwise the caller's (the model's convention)."""
    r = policy.renormalize if policy.renormalize is not None else renormalize
    if r is None:
        raise ValueError(f"{type(policy).__name__}.renormalize is None and no model convention was given: "
                         "pass renormalize=True (Mixtral, Qwen3-MoE) or False (OLMoE, Qwen1.5-MoE)")
    if not isinstance(r, bool):
        raise ValueError(f"renormalize={r!r}: must be True, False or None")
    return r
