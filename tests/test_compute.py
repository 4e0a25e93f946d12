"""Compute accounting counts against the model's native k, never against k_max."""

import math

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig

from moelab.compute import ModelShapes, expert_reduction, plan_stats
from moelab.routing import EntropyAdaptiveK, TopK, route


def test_reduction_is_against_native_k():
    # the published 52.5% for Mixtral is 1 - 3.8/8: counted against 8 experts, not Mixtral's 2
    assert expert_reduction(3.8, 8) == pytest.approx(0.525)
    assert expert_reduction(1.5, 2) == 0.25
    assert expert_reduction(3.0, 2) == -0.5  # a k_max=8 policy can spend MORE than native top-2
    with pytest.raises(ValueError, match="native_k=0"):
        expert_reduction(1.0, 0)


def test_plan_stats_histogram():
    logits = torch.randn(100, 8) * 2
    plan = route(logits, EntropyAdaptiveK((1, 2, 4), (1.0, 1.6)), renormalize=True)
    s = plan_stats(plan, native_k=2)
    assert sum(s["k_hist"]) == 100 and s["kept_pairs"] == int(plan.k.sum())
    assert s["mean_k"] == pytest.approx(plan.k.float().mean().item())
    assert s["expert_reduction"] == pytest.approx(1 - s["mean_k"] / 2)
    assert plan_stats(route(logits, TopK(2), renormalize=True), 2)["expert_reduction"] == 0


def test_policy_stats_rows_route_the_same_logits():
    """One row per policy; each row is that policy's plan on the shared logits, counted against the native k;
    the kept weights sum to 1 with renormalize and to the kept probability mass without."""
    from moelab.compute import policy_stats
    from moelab.routing import TopP

    logits = torch.randn(64, 8) * 2
    pols = {"TopK k=2 (native)": TopK(2), "TopK k=1": TopK(1), "ada": EntropyAdaptiveK((1, 2), (1.2,)),
            "top-p": TopP(0.5, k_max=2)}
    df = policy_stats(logits, pols, native_k=2, renormalize=False).set_index("policy")
    assert list(df.index) == list(pols) and df.loc["ada", "kind"] == "EntropyAdaptiveK"
    for label, pol in pols.items():
        plan = route(logits, pol, renormalize=False)
        assert df.loc[label, "kept_pairs"] == int(plan.k.sum()) and df.loc[label, "native_pairs"] == 128
        assert df.loc[label, "mean_weight_sum"] == pytest.approx(float(plan.weights.sum(-1).mean()))
    assert df.loc["TopK k=2 (native)", "expert_reduction"] == 0 and df.loc["TopK k=1", "expert_reduction"] == 0.5
    assert df.loc["TopK k=1", "mean_weight_sum"] < df.loc["TopK k=2 (native)", "mean_weight_sum"] < 1
    renorm = policy_stats(logits, pols, native_k=2, renormalize=True)
    assert renorm.mean_weight_sum.tolist() == pytest.approx([1.0] * 4)


@pytest.mark.parametrize(
    "cfg, moe_layers, shared",
    [
        (MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=100), 4, 0),
        (Qwen2MoeConfig(hidden_size=64, intermediate_size=256, moe_intermediate_size=32,
                        shared_expert_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=4, num_experts=60, num_experts_per_tok=4, vocab_size=100,
                        mlp_only_layers=[0]), 3, 128),
        (OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_experts=64, num_experts_per_tok=8, vocab_size=100), 2, 0),
    ],
)
def test_shapes_from_config_and_whole_forward(cfg, moe_layers, shared):
    s = ModelShapes.from_config(cfg)
    assert s.moe_layers == moe_layers and s.shared_ffn == shared
    assert s.forward_reduction(float(s.native_k), context=256) == pytest.approx(0.0)
    # halving k saves half the routed-expert FLOPs, and less of the whole forward
    whole = s.forward_reduction(s.native_k / 2, context=256)
    assert 0 < whole < 0.5
    expert_part = s.expert_flops() * s.native_k * s.moe_layers / s.forward_flops(float(s.native_k), 256)
    assert whole == pytest.approx(0.5 * expert_part)
    with pytest.raises(ValueError, match="one per MoE layer"):
        s.forward_flops([1.0] * (moe_layers + 1), 256)


def test_shapes_of_a_hybrid_model_leave_the_whole_forward_unmodelled():
    """Linear-attention layers (Qwen3-Next, MiniMax) are not modelled: the whole-forward share is NaN and the
    FLOP count refuses, naming the layers; softmax-only configs (sliding windows too) are modelled."""
    from moelab.models import tiny_random

    for fam, linear in (("qwen3_next", 1), ("minimax", 1), ("mixtral", 0)):
        try:
            cfg = tiny_random(fam).config
        except ValueError:  # a transformers without the family
            continue
        s = ModelShapes.from_config(cfg)
        assert s.linear_attention_layers == linear and s.models_forward == (linear == 0)
        assert s.expert_flops() == 2.0 * 3 * s.hidden * s.expert_ffn  # the routed experts are counted all the same
        if linear:
            assert math.isnan(s.forward_reduction(s.native_k / 2, context=64))
            with pytest.raises(ValueError, match="1 of 2 layers mix tokens without softmax attention"):
                s.forward_flops(float(s.native_k), 64)
        else:
            assert 0 < s.forward_reduction(s.native_k / 2, context=64) < 0.5


def test_pool_layers_sums_pairs_and_histograms_per_policy():
    """Pooling plan_stats over layers: pairs and tokens add, the reduction is that of the sums, histograms of
    different widths add, and the whole-forward reduction comes from each layer's own mean k."""
    import pandas as pd

    from moelab.compute import pool_layers

    torch.manual_seed(0)
    rows = []
    for layer in range(3):
        logits = torch.randn(64, 8) * (layer + 1)
        for label, pol in (("native", TopK(2)), ("ead", EntropyAdaptiveK((1, 2), (1.0,))), ("k1", TopK(1))):
            rows.append({"layer": layer, "policy": label, "kind": type(pol).__name__,
                         **plan_stats(route(logits, pol, renormalize=True), 2)})
    per_layer = pd.DataFrame(rows)
    cfg = MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_local_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    shapes = ModelShapes.from_config(cfg)
    pooled = pool_layers(per_layer, 2, shapes, context=32).set_index("policy")
    g = per_layer[per_layer.policy == "ead"]
    assert pooled.loc["ead", "kept_pairs"] == g.kept_pairs.sum() and pooled.loc["ead", "tokens"] == 192
    assert pooled.loc["ead", "expert_reduction"] == pytest.approx(1 - g.kept_pairs.sum() / (192 * 2))
    assert pooled.loc["ead", "k_hist"] == [sum(h[j] for h in g.k_hist) for j in range(3)]
    assert pooled.loc["ead", "forward_reduction"] == pytest.approx(shapes.forward_reduction(g.mean_k.tolist(), 32))
    assert pooled.loc["native", "expert_reduction"] == 0.0 and pooled.loc["native", "forward_reduction"] == 0.0
    assert pooled.loc["k1", "k_hist"] == [0, 192, 0]  # k_hist of width 2 padded to native k + 1
    mixed = per_layer[per_layer.policy == "k1"].copy()  # one policy, histograms of different widths
    mixed["k_hist"] = [[0, 64], [0, 64, 0], [0, 64, 0, 0]]
    assert pool_layers(mixed, 2).loc[0, "k_hist"] == [0, 192, 0, 0]
    with pytest.raises(ValueError, match="context=None"):
        pool_layers(per_layer, 2, shapes)
