"""Compute accounting: the expert work a routing plan really does, and FLOPs of a whole forward; savings are
against the model's native k, never a policy's k_max."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from moelab.params import check_int, is_real
from moelab.routing import RoutingPlan, route


def plan_stats(plan: RoutingPlan, native_k: int) -> dict:
    """Kept pairs, mean k, k histogram (k_hist[j]: tokens that kept j experts) and routed-expert reduction of one
    plan (one host sync)."""
    check_int("native_k", native_k)
    if not isinstance(plan, RoutingPlan):
        raise ValueError(f"plan={plan!r}: must be a RoutingPlan")
    if plan.k.shape != plan.expert_ids.shape[:1]:
        raise ValueError(f"plan k {tuple(plan.k.shape)}, expert_ids {tuple(plan.expert_ids.shape)}: k must be [T]")
    T = plan.num_tokens
    hist = torch.bincount(plan.k.long().cpu(), minlength=plan.k_max + 1).tolist() if T else [0] * (plan.k_max + 1)
    kept = int(sum(i * n for i, n in enumerate(hist)))
    mean_k = kept / T if T else float("nan")
    return {"tokens": T, "kept_pairs": kept, "native_pairs": T * native_k, "mean_k": mean_k, "k_hist": hist,
            "expert_reduction": expert_reduction(mean_k, native_k)}


def policy_stats(logits_TE: torch.Tensor, policies: dict, native_k: int, renormalize: bool) -> pd.DataFrame:
    """One row per policy ({label: policy}) routing the same logits: kind, plan_stats' keys, and the mean weight a
    token's kept experts get in all (1 with renormalize; else the probability mass kept)."""
    if not isinstance(policies, Mapping):
        raise ValueError(f"policies={policies!r}: must be a dict {{label: policy}}")
    check_int("native_k", native_k)
    rows = []
    for label, policy in policies.items():
        plan = route(logits_TE, policy, renormalize=renormalize)
        rows.append({"policy": label, "kind": type(policy).__name__, **plan_stats(plan, native_k),
                     "mean_weight_sum": float(plan.weights.sum(-1).mean()) if plan.num_tokens else float("nan")})
    return pd.DataFrame(rows)


def pool_layers(per_layer: pd.DataFrame, native_k: int, shapes: ModelShapes | None = None, context: int | None = None,
                prefill: int = 0) -> pd.DataFrame:
    """plan_stats rows of several MoE layers (with layer, policy, kind) pooled per (policy, kind); with shapes, also
    the whole-forward reduction from each layer's mean k."""
    if shapes is not None and context is None:
        raise ValueError("context=None: the whole-forward reduction needs the attended context length")
    rows = []
    for (label, kind), g in per_layer.groupby(["policy", "kind"], sort=False):
        width = max(native_k + 1, *(len(h) for h in g.k_hist))
        hist = np.sum([np.pad(np.asarray(h), (0, width - len(h))) for h in g.k_hist], axis=0)
        row = {"policy": label, "kind": kind, "tokens": int(g.tokens.sum()), "k_hist": hist.tolist(),
               "kept_pairs": int(g.kept_pairs.sum()), "native_pairs": int(g.native_pairs.sum()),
               "mean_k": float(g.kept_pairs.sum() / g.tokens.sum()),
               "expert_reduction": float(1 - g.kept_pairs.sum() / g.native_pairs.sum())}
        if shapes is not None:
            row["forward_reduction"] = shapes.forward_reduction(g.sort_values("layer").mean_k.tolist(),
                                                                context=context, prefill=prefill)
        rows.append(row)
    return pd.DataFrame(rows)


def expert_reduction(mean_k: float, native_k: int) -> float:
    """Fraction of routed-expert FLOPs saved against the native top-k (negative if more is spent)."""
    return 1.0 - mean_k / check_int("native_k", native_k)


def check_context(context, name: str = "context") -> None:
    """An attended context length (keys per token; an average may be fractional): a finite number >= 1."""
    if not is_real(context) or not 1 <= context < math.inf:
        raise ValueError(f"{name}={context!r}: must be a finite number >= 1 (keys a token attends, itself included)")


# families whose softmax-attention q_proj also yields a sigmoid output gate (its output is twice as wide)
GATED_QUERY_FAMILIES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class LinearMixer:
    """FLOPs per token of a linear-attention token mixer: projections, short convolution and core, recurrent at a
    decode step (`core`); a prefill chunk of b tokens adds `quad` * b^2 to its `core` * b."""

    proj: float
    conv: float
    core: float
    chunk: int = 0  # tokens per chunk of the prefill form (0: none modelled)
    quad: float = 0.0
    pad: bool = False  # the last chunk is padded to `chunk` tokens (gated DeltaNet) or runs short (lightning)

    def total(self, prefill: int = 0) -> float:
        """Per token: at a decode step (prefill = 0) or averaged over a prefill of `prefill` tokens."""
        return self.proj + self.conv + self.core_flops(prefill)

    def core_flops(self, prefill: int = 0) -> float:
        """The core's FLOPs per token at a decode step (prefill = 0) or averaged over a chunked prefill."""
        if prefill < 0:
            raise ValueError(f"prefill={prefill}: must be >= 0 (0: a decode step)")
        if prefill == 0 or self.chunk == 0:
            return self.core
        full, rest = divmod(prefill, self.chunk)
        last = self.chunk if self.pad and rest else rest
        return sum(n * (self.quad * b * b + self.core * b) for n, b in ((full, self.chunk), (1, last))) / prefill

    @classmethod
    def from_config(cls, cfg) -> "LinearMixer | None":
        """Gated DeltaNet (Qwen3-Next, Qwen3.5) or lightning attention (MiniMax); None for another kind."""
        D = cfg.hidden_size
        if getattr(cfg, "linear_num_value_heads", None):  # gated DeltaNet
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            qkv = 2 * nk * dk + nv * dv  # the convolved channels
            # in: q, k, v, the output gate z (nv * dv), beta and the decay a (nv each); out: nv * dv -> D
            proj = 2.0 * D * (qkv + nv * dv + 2 * nv) + 2.0 * nv * dv * D
            # recurrent, per value head: S^T k, the rank-1 update k (v - S^T k)^T beta and S^T q, each 2 dk dv.
            # chunked (64-token chunks, as transformers' torch_chunk_gated_delta_rule and the FLA kernels), per
            # value head and chunk of C: the C x C products k_beta k^T and q k^T (2 C^2 dk each), the unit-lower
            # system applied to v_beta and the decayed k_beta (2 C^2 (dv + dk), as the explicit inverse's products;
            # the inverse itself is left out), the intra-chunk attention on the new values (2 C^2 dv), and the
            # state's three products (k_cumdecay S, q S, k^T v_new: the recurrent 6 C dk dv)
            return cls(proj=proj, conv=2.0 * qkv * cfg.linear_conv_kernel_dim, core=6.0 * nv * dk * dv,
                       chunk=64, quad=2.0 * nv * (3 * dk + 2 * dv), pad=True)
        if getattr(cfg, "model_type", None) == "minimax":  # lightning attention: heads of head_dim, a kv state
            H = cfg.num_attention_heads
            hd = getattr(cfg, "head_dim", None) or D // H
            # qkv_proj, output_gate and out_proj; per head k^T v into the state and q S, each 2 hd^2; a prefill
            # block of b tokens adds q k^T and its product with v (2 b^2 hd each), the last block short
            return cls(proj=2.0 * D * 3 * H * hd + 2.0 * 2 * D * H * hd, conv=0.0, core=4.0 * H * hd * hd,
                       chunk=int(getattr(cfg, "block_size", 256)), quad=4.0 * H * hd, pad=False)
        return None


@dataclass(frozen=True)
class ModelShapes:
    """What the FLOP count of one token's forward needs to know about a decoder-only MoE model."""

    hidden: int  # D
    expert_ffn: int  # F, routed expert intermediate size
    num_experts: int  # E
    native_k: int
    num_layers: int
    moe_layers: int  # layers with routed experts; the rest are dense MLPs of dense_ffn
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dense_ffn: int = 0
    shared_ffn: int = 0  # shared expert intermediate size (Qwen2-MoE), 0 if none
    linear_attention_layers: int = 0  # layers whose token mixer is not softmax attention (Qwen3-Next, MiniMax)
    linear_mixer: LinearMixer | None = None  # their mixer's FLOPs, where the kind is known
    query_gate: bool = False  # q_proj also yields an output gate (Qwen3-Next, Qwen3.5)

    @property
    def models_forward(self) -> bool:
        """Whether the whole forward's FLOPs are modelled: only softmax attention, or linear attention of a known
        kind."""
        return self.linear_attention_layers == 0 or self.linear_mixer is not None

    @classmethod
    def from_config(cls, cfg) -> "ModelShapes":
        """Read the shapes from a transformers MoE config (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
        def g(*names, default=None):
            return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default)

        E = g("num_local_experts", "num_experts", "n_routed_experts")
        k = g("num_experts_per_tok", "moe_top_k")
        if E is None or k is None:
            raise ValueError(f"{type(cfg).__name__}: no expert count / top-k found; not an MoE config")
        heads, L = cfg.num_attention_heads, cfg.num_hidden_layers
        moe_layers = L
        step = g("decoder_sparse_step", default=1)
        dense_ids = set(g("mlp_only_layers", default=[]) or [])
        first_dense = g("first_k_dense_replace", default=0)
        layer_types = g("layer_types", default=None) or []
        linear = sum(1 for t in layer_types if t not in ("full_attention", "sliding_attention"))
        if step and step > 1 or dense_ids or first_dense:
            moe_layers = sum(1 for i in range(L)
                             if i not in dense_ids and i >= first_dense and (step <= 1 or (i + 1) % step == 0))
        return cls(hidden=cfg.hidden_size, expert_ffn=g("moe_intermediate_size", "intermediate_size"), num_experts=E,
                   native_k=k, num_layers=L, moe_layers=moe_layers, num_heads=heads,
                   num_kv_heads=g("num_key_value_heads", default=heads),
                   head_dim=g("head_dim", default=cfg.hidden_size // heads), vocab=cfg.vocab_size,
                   dense_ffn=g("intermediate_size", default=0),
                   shared_ffn=g("shared_expert_intermediate_size", default=0), linear_attention_layers=linear,
                   linear_mixer=LinearMixer.from_config(cfg) if linear else None,
                   query_gate=getattr(cfg, "model_type", None) in GATED_QUERY_FAMILIES)

    # FLOPs per token (multiply-add = 2 FLOPs), forward only.
    def expert_flops(self) -> float:
        """One (token, expert) pair: gate, up and down projections."""
        return 2.0 * 3 * self.hidden * self.expert_ffn

    def attention_flops(self, context: int) -> float:
        """One softmax-attention layer per token: projections and the scores and values over `context` keys."""
        check_context(context)
        D, hd, H = self.hidden, self.head_dim, self.num_heads
        proj = 2.0 * D * hd * ((3 if self.query_gate else 2) * H + 2 * self.num_kv_heads)
        return proj + 2.0 * 2 * context * H * hd

    def fixed_flops(self, context: int, prefill: int = 0) -> float:
        """Everything but the routed experts, per token, at an average attended context (`LinearMixer` for prefill)."""
        if not self.models_forward:
            raise ValueError(f"{self.linear_attention_layers} of {self.num_layers} layers mix tokens without softmax "
                             "attention, of a kind whose FLOPs are not modelled (known: gated DeltaNet, lightning "
                             "attention): only the routed experts' are")
        D = self.hidden
        linear = self.linear_attention_layers
        mixers = (self.num_layers - linear) * self.attention_flops(context)
        if linear:
            mixers += linear * self.linear_mixer.total(prefill)
        router = 2.0 * D * self.num_experts
        shared = 2.0 * 3 * D * self.shared_ffn + (2.0 * D if self.shared_ffn else 0.0)
        dense = 2.0 * 3 * D * self.dense_ffn
        mlps = self.moe_layers * (router + shared) + (self.num_layers - self.moe_layers) * dense
        return mixers + mlps + 2.0 * D * self.vocab

    def forward_flops(self, mean_k_per_layer, context: int, prefill: int = 0) -> float:
        """Whole-forward FLOPs per token given each MoE layer's mean k (a float applies to all)."""
        if is_real(mean_k_per_layer):
            mean_k_per_layer = [float(mean_k_per_layer)] * self.moe_layers
        try:
            n = len(mean_k_per_layer)
        except TypeError:
            raise ValueError(f"mean_k_per_layer={mean_k_per_layer!r}: must be a number or a list (one per MoE "
                             "layer)") from None
        if n != self.moe_layers:
            raise ValueError(f"mean_k_per_layer has {n} entries: need one per MoE layer ({self.moe_layers})")
        return self.fixed_flops(context, prefill) + self.expert_flops() * float(sum(mean_k_per_layer))

    def forward_reduction(self, mean_k_per_layer, context: int, prefill: int = 0) -> float:
        """Fraction of whole-forward FLOPs saved against the native k; NaN where the forward is not modelled."""
        check_context(context)
        if not self.models_forward:
            return float("nan")
        native = self.forward_flops(float(self.native_k), context, prefill)
        return 1.0 - self.forward_flops(mean_k_per_layer, context, prefill) / native
