"""Compute accounting counts against the model's native k, never against k_max."""

import inspect
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
    # k_hist has k_max + 1 entries (k = 0..k_max) whatever the tokens keep: all at k = 1 here (entropy < 50 nats)
    low = plan_stats(route(logits, EntropyAdaptiveK((1, 2, 4), (50.0, 60.0)), renormalize=True), native_k=2)
    assert low["k_hist"] == [0, 100, 0, 0, 0] and low["kept_pairs"] == 100
    empty = plan_stats(route(logits[:0], EntropyAdaptiveK((1, 2, 4), (1.0, 1.6)), renormalize=True), native_k=2)
    assert empty["k_hist"] == [0] * 5 and empty["tokens"] == empty["kept_pairs"] == 0 and math.isnan(empty["mean_k"])


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


def test_shapes_count_only_sparse_layers():
    """decoder_sparse_step s: layer i (from 0) is MoE when (i + 1) % s == 0; first_k_dense_replace n: layers
    0..n-1 are dense."""
    from transformers import DeepseekV3Config

    step2 = Qwen2MoeConfig(hidden_size=64, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                           vocab_size=100, decoder_sparse_step=2)
    assert ModelShapes.from_config(step2).moe_layers == 1  # layer 1 only, of 0, 1, 2
    first1 = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              num_experts_per_tok=2, vocab_size=100, first_k_dense_replace=1)
    assert ModelShapes.from_config(first1).moe_layers == 2  # layers 1 and 2


def _counted(model, ids, **kw):
    """FLOPs torch's FlopCounterMode counts in one forward (matrix products and convolutions), and per module.
    The rotary tables' outer product (a matrix product in transformers 5.17, not in 5.2x) is left out: it is
    position bookkeeping, 2 * head_dim / 2 FLOPs per token for the whole model.
    The parameters stop requiring grad while counting: with the `kernels` package (a dependency of
    transformers since 5.25) the hybrid families' causal conv runs as a module that takes a view of its weight
    made under no_grad, and the counter's module tracker cannot hook such a view for backward (it raises)."""
    from torch.utils.flop_counter import FlopCounterMode

    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.requires_grad_(False)
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            out = model(ids, **kw)
    finally:
        for p, g in grads:
            p.requires_grad_(g)
    per_module = {name: {str(op): n for op, n in d.items()} for name, d in fc.get_flop_counts().items()}
    rotary = sum(sum(d.values()) for name, d in per_module.items() if name.endswith(".rotary_emb"))
    return fc.get_total_flops() - rotary, per_module, out


# families with 8 experts instead of their dozens or hundreds (the counter's cost grows with the experts a forward
# runs; the FLOP model's expert part does not depend on E), and MiniMax with lightning blocks of 32 tokens
SMALL = {family: dict(num_experts=8, num_experts_per_tok=2) for family in ("qwen2_moe", "olmoe", "qwen3_next",
                                                                          "qwen3_5_moe")}
SMALL["minimax"] = dict(num_local_experts=8, block_size=32)


def _eager(family, **overrides):
    """A tiny random model (a family, or an embedded model's config by its registry name) whose attention and
    experts run as plain matrix products the counter sees (it does not count torch._grouped_mm), with the model's
    own top-k routing: native_k pairs per token."""
    from moelab import models

    overrides = {**SMALL.get(family, {}), **overrides}

    try:
        m = models.build(family, **overrides) if family in models.TINY else models.tiny_random(family, **overrides)
    except ValueError:  # a transformers without the family
        pytest.skip(f"no {family} in this transformers")
    m.set_attn_implementation("eager")
    m.set_experts_implementation("eager")
    return m


SLOW_TINY = [pytest.param(n, marks=pytest.mark.slow) for n in ("tiny-qwen-moe", "tiny-olmoe")]  # 60 and 64 experts


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "tiny-mixtral",
                                    *SLOW_TINY])
def test_whole_forward_flops_equal_what_torch_counts(family):
    """ModelShapes' FLOP model is exact for softmax-attention models: a prefill of L tokens with the native top-k
    counts L * forward_flops(native_k, context=L) matrix-product FLOPs (eager attention computes all L x L
    scores), dense layers, shared experts and their gates included; also for the embedded models' configs, whose
    whole-forward shares the notebooks and the README report."""
    torch.manual_seed(0)
    m = _eager(family)
    s = ModelShapes.from_config(m.config)
    L = 24
    got, _, _ = _counted(m, torch.randint(0, m.config.vocab_size, (1, L)))
    assert got == pytest.approx(L * s.forward_flops(float(s.native_k), context=L), rel=1e-12)
    if family == "qwen2_moe":  # the same with a dense first layer
        m = _eager(family, mlp_only_layers=[0])
        s = ModelShapes.from_config(m.config)
        assert s.moe_layers == 1
        got, _, _ = _counted(m, torch.randint(0, m.config.vocab_size, (1, L)))
        assert got == pytest.approx(L * s.forward_flops(float(s.native_k), context=L), rel=1e-12)


def _linear_mixer_counts(m, cfg, L: int):
    """A counted prefill of L random tokens through a hybrid model with one linear-attention layer: the total,
    that mixer's projections, convolution and core (the rest of its matrix products), the number of
    torch.linalg.solve_triangular calls in it (which the counter does not count), and the model's output."""
    import unittest.mock

    solve = torch.linalg.solve_triangular
    calls = []

    def counted_solve(*a, **kw):
        calls.append(1)
        return solve(*a, **kw)

    ids = torch.randint(0, cfg.vocab_size, (1, L))
    with unittest.mock.patch.object(torch.linalg, "solve_triangular", counted_solve):
        got, per_module, out = _counted(m, ids, use_cache=True)
    (i,) = [j for j, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    layer = m.model.layers[i]
    attr = "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
    prefix = f"{type(m).__name__}.model.layers.{i}.{attr}"
    mixer = getattr(layer, attr)
    linear_children = [n for n, c in mixer.named_children() if isinstance(c, torch.nn.Linear)]
    proj = sum(sum(per_module.get(f"{prefix}.{n}", {}).values()) for n in linear_children)
    conv = per_module[prefix].get("aten.convolution", 0)
    core = sum(per_module[prefix].values()) - proj - conv
    return got, proj, conv, core, len(calls), out


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "minimax"])
def test_hybrid_forward_flops_match_torch_counts(family):
    """Hybrid models (one linear-attention layer, one softmax): every counted matrix product outside the linear
    mixer's core is modelled exactly (projections, the gated query, the MoE blocks, the LM head); the short
    convolution counts L + K - 1 outputs in the reference kernel (padded both sides, then cut); the core's
    chunked prefill products are the kernel's own, and the recurrent form the model counts is what a decode
    step runs (MiniMax's decode step is matrix products: counted exactly)."""
    torch.manual_seed(0)
    m = _eager(family)
    cfg = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
    s = ModelShapes.from_config(cfg)
    assert s.linear_attention_layers == 1 and s.models_forward and s.linear_mixer is not None
    assert s.query_gate == (family != "minimax")
    L = 24
    got, proj, conv, core, _, out = _linear_mixer_counts(m, cfg, L)
    assert proj == pytest.approx(L * s.linear_mixer.proj, rel=1e-12)
    K = getattr(cfg, "linear_conv_kernel_dim", 0)
    assert conv == pytest.approx((L + K - 1) * s.linear_mixer.conv, rel=1e-12)
    assert core > 0
    modelled = L * s.forward_flops(float(s.native_k), context=L)
    assert got - core - conv == pytest.approx(modelled - L * (s.linear_mixer.core + s.linear_mixer.conv), rel=1e-12)
    if family == "minimax":  # one decode step after the prefill: the recurrent form, all matrix products
        nxt = torch.randint(0, cfg.vocab_size, (1, 1))
        name = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"  # 5.2x / 5.17
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        got, _, _ = _counted(m, nxt, use_cache=True, **{name: cache})
        assert got == pytest.approx(s.forward_flops(float(s.native_k), context=L + 1), rel=1e-12)
    # halving k saves half the routed-expert FLOPs, and less of the whole forward
    assert 0 < s.forward_reduction(s.native_k / 2, context=64) < 0.5


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "minimax"])
def test_hybrid_prefill_core_is_the_chunked_form(family):
    """A prefill runs the linear mixer's chunked form: its core's matrix products are LinearMixer.core_flops(L)
    per token at every length (one partial chunk, whole chunks, several with a rest; gated DeltaNet pads the
    last chunk, lightning attention runs it short). The gated DeltaNet's unit-lower system is modelled as the
    explicit inverse's two products (2 C^2 (dk + dv) per value head and chunk); where transformers solves it
    with torch.linalg.solve_triangular, which the counter does not see, those are the only FLOPs it misses."""
    torch.manual_seed(0)
    m = _eager(family)
    cfg = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
    s = ModelShapes.from_config(cfg)
    mix = s.linear_mixer
    assert mix.chunk > 0 and mix.core_flops(0) == mix.core
    K = getattr(cfg, "linear_conv_kernel_dim", 1)
    for L in (24, mix.chunk, mix.chunk + 36, 2 * mix.chunk + 1):
        got, _, conv, core, solves, _ = _linear_mixer_counts(m, cfg, L)
        unseen = 0.0
        if solves:  # two solves per layer forward, over all chunks and heads at once
            assert family != "minimax" and solves == 2
            nv, dk, dv, C = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, mix.chunk
            unseen = -(-L // C) * nv * 2.0 * C * C * (dk + dv)
        assert core == pytest.approx(L * mix.core_flops(L) - unseen, rel=1e-12), (L, solves)
        # the whole prefill: exact but for those solves and the reference convolution's K - 1 extra outputs
        whole = L * s.forward_flops(float(s.native_k), context=L, prefill=L)
        assert got == pytest.approx(whole - unseen + (K - 1) * mix.conv, rel=1e-12), (L, solves)
        assert mix.core_flops(L) > mix.core  # the intra-chunk products come on top of the recurrent form's
    with pytest.raises(ValueError, match="prefill=-1: must be >= 0"):
        mix.core_flops(-1)


def test_an_unknown_linear_mixer_leaves_the_whole_forward_unmodelled():
    """Linear-attention layers of a kind ModelShapes does not know: the whole-forward share is NaN and the FLOP
    count refuses, naming the layers; the routed experts are counted all the same."""
    from moelab.models import tiny_random

    cfg = tiny_random("mixtral").config
    cfg.layer_types = ["some_linear_attention", "full_attention"]
    s = ModelShapes.from_config(cfg)
    assert s.linear_attention_layers == 1 and s.linear_mixer is None and not s.models_forward
    assert s.expert_flops() == 2.0 * 3 * s.hidden * s.expert_ffn
    assert math.isnan(s.forward_reduction(s.native_k / 2, context=64))
    with pytest.raises(ValueError, match="1 of 2 layers mix tokens without softmax attention"):
        s.forward_flops(float(s.native_k), 64)


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
    assert pooled.loc["ead", "native_pairs"] == 192 * 2
    assert pooled.loc["ead", "mean_k"] == pytest.approx(sum(j * n for j, n in enumerate(pooled.loc["ead", "k_hist"]))
                                                        / 192)
    assert pooled.loc["k1", "mean_k"] == 1.0 and pooled.loc["native", "mean_k"] == 2.0
    assert pooled.loc["ead", "forward_reduction"] == pytest.approx(shapes.forward_reduction(g.mean_k.tolist(), 32))
    assert pooled.loc["native", "expert_reduction"] == 0.0 and pooled.loc["native", "forward_reduction"] == 0.0
    assert pooled.loc["k1", "k_hist"] == [0, 192, 0]  # k_hist of width 2 padded to native k + 1
    mixed = per_layer[per_layer.policy == "k1"].copy()  # one policy, histograms of different widths
    mixed["k_hist"] = [[0, 64], [0, 64, 0], [0, 64, 0, 0]]
    assert pool_layers(mixed, 2).loc[0, "k_hist"] == [0, 192, 0, 0]
    with pytest.raises(ValueError, match="context=None"):
        pool_layers(per_layer, 2, shapes)


def test_bad_native_k_policies_and_context_are_named():
    import numpy as np

    from moelab.compute import policy_stats

    logits = torch.randn(16, 8)
    plan = route(logits, TopK(2), renormalize=True)
    for bad, match in ((2.5, "native_k=2.5: must be an int"), ("2", "native_k='2': must be an int"),
                       (None, "native_k=None: must be an int"), (0, "native_k=0: must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            plan_stats(plan, bad)
        with pytest.raises(ValueError, match=match):
            expert_reduction(1.0, bad)
        with pytest.raises(ValueError, match=match):
            policy_stats(logits, {"a": TopK(1)}, bad, True)
    assert plan_stats(plan, np.int64(2))["expert_reduction"] == expert_reduction(2.0, np.int64(2)) == 0.0
    with pytest.raises(ValueError, match=r"policies=\[TopK\(k=2.*must be a dict \{label: policy\}"):
        policy_stats(logits, [TopK(2)], 2, True)
    s = ModelShapes.from_config(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                              num_experts_per_tok=2, vocab_size=100))
    for bad in (-5, 0, 0.5, float("nan"), float("inf"), True, "64", None):
        with pytest.raises(ValueError, match=rf"context={bad!r}: must be a finite number >= 1".replace("(", r"\(")):
            s.forward_reduction(1.5, context=bad)
    for bad in (0, float("nan"), True):  # each public FLOPs method checks its context itself
        for call in (s.attention_flops, s.fixed_flops, lambda c: s.forward_flops(1.5, c)):
            with pytest.raises(ValueError, match=rf"context={bad!r}: must be a finite number >= 1"):
                call(bad)
    assert s.forward_reduction(np.float32(1.5), context=np.int64(64)) == s.forward_reduction(1.5, context=64) > 0
    assert s.forward_reduction(np.array([1.5, 1.5]), 64) == s.forward_reduction(1.5, 64)
    with pytest.raises(ValueError, match=r"mean_k_per_layer=tensor\(1.5000\): must be a number or a list"):
        s.forward_reduction(torch.tensor(1.5), context=64)
    for call in (s.forward_reduction, s.forward_flops):  # a bool is no mean k
        with pytest.raises(ValueError, match=r"mean_k_per_layer=True: must be a number or a list"):
            call(True, 64)
