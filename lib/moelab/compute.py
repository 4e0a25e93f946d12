"""Compute accounting: how much expert work a routing plan really does.

Savings are always counted against the model's native k (Mixtral 2, Qwen1.5-MoE 4, OLMoE 8),
never against a policy's k_max: a policy that keeps 1.5 experts on average on a top-2 model
saves 25%, whatever its k_max.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moelab.routing import RoutingPlan, route


def plan_stats(plan: RoutingPlan, native_k: int) -> dict:
    """Kept pairs, mean k, k histogram and routed-expert reduction of one plan (one host sync)."""
    T = plan.num_tokens
    hist = torch.bincount(plan.k.long().cpu(), minlength=plan.k_max + 1).tolist() if T else [0] * (plan.k_max + 1)
    kept = int(sum(i * n for i, n in enumerate(hist)))
    mean_k = kept / T if T else float("nan")
    return {
        "tokens": T,
        "kept_pairs": kept,
        "native_pairs": T * native_k,
        "mean_k": mean_k,
        "k_hist": hist,  # k_hist[j] = tokens that kept j experts
        "expert_reduction": expert_reduction(mean_k, native_k),
    }


def policy_stats(logits_TE: torch.Tensor, policies: dict, native_k: int, renormalize: bool):
    """One DataFrame row per policy ({label: policy}) routing the same logits: kind, plan_stats' keys, and the
    mean weight a token's kept experts get in all (1 with renormalize; else the probability mass kept)."""
    import pandas as pd

    rows = []
    for label, policy in policies.items():
        plan = route(logits_TE, policy, renormalize=renormalize)
        rows.append({"policy": label, "kind": type(policy).__name__, **plan_stats(plan, native_k),
                     "mean_weight_sum": float(plan.weights.sum(-1).mean()) if plan.num_tokens else float("nan")})
    return pd.DataFrame(rows)


def pool_layers(per_layer, native_k: int, shapes: "ModelShapes | None" = None, context: int | None = None):
    """plan_stats rows of several MoE layers (a DataFrame with columns layer, policy, kind and plan_stats'
    keys) pooled per (policy, kind): pairs and tokens summed, k histograms added, the reduction of the sums;
    with shapes, also the whole-forward reduction from each layer's mean k (attended context `context`)."""
    import numpy as np
    import pandas as pd

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
                                                                context=context)
        rows.append(row)
    return pd.DataFrame(rows)


def expert_reduction(mean_k: float, native_k: int) -> float:
    """Fraction of routed-expert FLOPs saved against the native top-k (negative if more is spent)."""
    if native_k < 1:
        raise ValueError(f"native_k={native_k}: must be >= 1")
    return 1.0 - mean_k / native_k


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
    glu: bool = True  # gate/up/down expert MLPs (3 matrices) vs up/down (2)
    linear_attention_layers: int = 0  # layers whose token mixer is not softmax attention (Qwen3-Next, MiniMax)

    @property
    def models_forward(self) -> bool:
        """Whether the whole forward's FLOPs are modelled: softmax attention (full or sliding) in every layer.
        The routed-expert counts never depend on it."""
        return self.linear_attention_layers == 0

    @classmethod
    def from_config(cls, cfg) -> "ModelShapes":
        """Read the shapes from a transformers MoE config (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
        g = lambda *names, default=None: next(  # noqa: E731
            (getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default
        )
        E = g("num_local_experts", "num_experts", "n_routed_experts")
        k = g("num_experts_per_tok", "moe_top_k")
        if E is None or k is None:
            raise ValueError(f"{type(cfg).__name__}: no expert count / top-k found; not an MoE config")
        heads = cfg.num_attention_heads
        L = cfg.num_hidden_layers
        moe_layers = L
        step = g("decoder_sparse_step", default=1)
        dense_ids = set(g("mlp_only_layers", default=[]) or [])
        first_dense = g("first_k_dense_replace", default=0)
        layer_types = g("layer_types", default=None) or []
        linear = sum(1 for t in layer_types if t not in ("full_attention", "sliding_attention"))
        if step and step > 1 or dense_ids or first_dense:
            moe_layers = sum(
                1
                for i in range(L)
                if i not in dense_ids and i >= first_dense and (step <= 1 or (i + 1) % step == 0)
            )
        return cls(
            hidden=cfg.hidden_size,
            expert_ffn=g("moe_intermediate_size", "intermediate_size"),
            num_experts=E,
            native_k=k,
            num_layers=L,
            moe_layers=moe_layers,
            num_heads=heads,
            num_kv_heads=g("num_key_value_heads", default=heads),
            head_dim=g("head_dim", default=cfg.hidden_size // heads),
            vocab=cfg.vocab_size,
            dense_ffn=g("intermediate_size", default=0),
            shared_ffn=g("shared_expert_intermediate_size", default=0),
            linear_attention_layers=linear,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    # FLOPs per token (multiply-add = 2 FLOPs), forward only.
    def expert_flops(self) -> float:
        """One (token, expert) pair."""
        return 2.0 * (3 if self.glu else 2) * self.hidden * self.expert_ffn

    def fixed_flops(self, context: int) -> float:
        """Everything but the routed experts, per token, at an average attended context length."""
        if not self.models_forward:
            raise ValueError(f"{self.linear_attention_layers} of {self.num_layers} layers mix tokens without softmax "
                             "attention (linear attention): their FLOPs are not modelled, only the routed experts'")
        D, hd = self.hidden, self.head_dim
        attn_proj = 2.0 * D * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn_scores = 2.0 * 2 * context * self.num_heads * hd
        router = 2.0 * D * self.num_experts
        shared = 2.0 * 3 * D * self.shared_ffn + (2.0 * D if self.shared_ffn else 0.0)
        dense = 2.0 * 3 * D * self.dense_ffn
        per_moe = attn_proj + attn_scores + router + shared
        per_dense = attn_proj + attn_scores + dense
        return self.moe_layers * per_moe + (self.num_layers - self.moe_layers) * per_dense + 2.0 * D * self.vocab

    def forward_flops(self, mean_k_per_layer, context: int) -> float:
        """Whole-forward FLOPs per token given each MoE layer's mean k (a float applies to all)."""
        if isinstance(mean_k_per_layer, (int, float)):
            mean_k_per_layer = [float(mean_k_per_layer)] * self.moe_layers
        if len(mean_k_per_layer) != self.moe_layers:
            raise ValueError(
                f"mean_k_per_layer has {len(mean_k_per_layer)} entries: need one per MoE layer ({self.moe_layers})"
            )
        return self.fixed_flops(context) + self.expert_flops() * float(sum(mean_k_per_layer))

    def forward_reduction(self, mean_k_per_layer, context: int) -> float:
        """Fraction of whole-forward FLOPs saved against the native k in every MoE layer; NaN where the
        forward is not modelled (`models_forward`: linear-attention layers)."""
        if not self.models_forward:
            return float("nan")
        native = self.forward_flops(float(self.native_k), context)
        return 1.0 - self.forward_flops(mean_k_per_layer, context) / native
