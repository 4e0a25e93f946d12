# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Routing quickstart
#
# Router logits `[T, E]` go through each routing policy of `moelab.routing` and come out as a
# `RoutingPlan`: which experts every token keeps, with what weight. From the plan we count the
# (token, expert) pairs the expert GEMMs must compute, the k histogram, and the compute saved
# **against the model's native top-k** (`moelab.compute.policy_stats`).
#
# Policies: `TopK` at the native k and one lower, `EntropyAdaptiveK` (low router entropy -> fewer
# experts), `TopP` (smallest set reaching a probability mass) and `RatioSkip` (keep expert i while
# p_i >= beta * p_1).
#
# Sections: (1) random logits with a spread of router confidence; (2) router logits recorded from an
# embedded trained model on WikiText-2 test; (3) real expert-load counts of OLMoE and Mixtral from
# AllenAI's routing data; (4) an interactive explorer (`interactive=True`).

# %% tags=["parameters"]
seed: int = 0  # random seed of the random router logits
tokens: int = 8192  # tokens of random router logits (GPU-sized: 1000000)
num_experts: int = 8  # experts E of the random layer (Mixtral 8, Qwen1.5-MoE 60, OLMoE 64)
native_k: int = 2  # the model's own top-k; every saving is counted against it (Mixtral 2, OLMoE 8)
renormalize: bool = True  # renormalise kept weights (Mixtral, Qwen3-MoE) or not (OLMoE, Qwen1.5-MoE)
logit_scale: float = 1.5  # median spread of the random logits; per-token temperatures vary around it
adaptive_k_values: list[int] = [1, 2]  # EntropyAdaptiveK k values, strictly ascending
adaptive_quantiles: list[float] = [0.5]  # entropy quantiles that set its thresholds, one fewer than k values
top_p: float = 0.7  # TopP: smallest expert set reaching this probability mass
ratio_beta: float = 0.3  # RatioSkip: keep expert i while its probability is at least beta times the top one
model: str = "tiny-mixtral"  # embedded model (tiny-mixtral, tiny-qwen-moe, tiny-olmoe) or a local checkpoint; empty skips
device: str = "auto"  # auto (CUDA when this machine has it), cpu, cuda or cuda:N
dtype: str = "float32"  # model weights: float32 (as the committed tables), bfloat16, float16 or auto (bf16 on CUDA)
eval_tokens: int = 1024  # WikiText-2 test tokens whose router logits are recorded (GPU-sized: 250000)
calib_tokens: int = 1024  # held-out training-text tokens that place EntropyAdaptiveK's thresholds per layer
seq_len: int = 256  # tokens per forward while recording (clipped to the model's context)
counts_model: str = "olmoe"  # real routing counts to show: olmoe or mistral
interactive: bool = False  # show ipywidgets explorers (never in headless runs)

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from moelab import results
from moelab.compute import policy_stats
from moelab.models import pick_device, pick_dtype
from moelab.data import COUNT_LAYERS, DOMAINS, load_routing_counts, normalised_entropy
from moelab.plots import explorer, figure, plot_policy_stats, save_table, savefig
from moelab.params import check_bools, check_ints, check_real
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP, route

check_ints(1, tokens=tokens, num_experts=num_experts, native_k=native_k, eval_tokens=eval_tokens,
           calib_tokens=calib_tokens, seq_len=seq_len)
check_ints(0, seed=seed)
check_bools(renormalize=renormalize, interactive=interactive)
check_real("logit_scale", logit_scale, 0.0)
kv = adaptive_k_values
if not (isinstance(kv, list) and kv and all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= num_experts
                                          for k in kv) and kv == sorted(set(kv))):
    raise ValueError(f"adaptive_k_values={kv!r}: must be strictly ascending ints in [1, num_experts={num_experts}]")
if not isinstance(adaptive_quantiles, list) or len(adaptive_quantiles) != len(kv) - 1:
    raise ValueError(f"adaptive_quantiles={adaptive_quantiles!r}: need one per threshold, len(adaptive_k_values) - 1"
                     f" = {len(kv) - 1} for adaptive_k_values={kv}")
if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in adaptive_quantiles):
    raise ValueError(f"adaptive_quantiles={adaptive_quantiles}: each must be a number in [0, 1]")
if counts_model not in ("olmoe", "mistral"):
    raise ValueError(f"counts_model={counts_model!r}: must be 'olmoe' or 'mistral'")
if model:  # before section 1 writes anything
    pick_dtype(dtype, pick_device(device))
_ = torch.manual_seed(seed)

# %% [markdown]
# ## 1 · Random router logits
# Gaussian logits with a per-token temperature (log-normal around `logit_scale`), so that some tokens
# have a confident router (low entropy) and others a flat one, as trained routers do.

# %%
scale_T = logit_scale * torch.exp(0.75 * torch.randn(tokens, 1))
logits_TE = torch.randn(tokens, num_experts) * scale_T


def entropy_of(logits_TE: torch.Tensor) -> torch.Tensor:
    """Full-softmax router entropy per token (nats), as every policy computes it."""
    return route(logits_TE, TopK(1), renormalize=True).entropy


def make_policies(calib_entropy_T: torch.Tensor, native_k: int, k_values, quantiles) -> dict:
    """The policies compared; EntropyAdaptiveK's thresholds sit at entropy quantiles of calibration tokens."""
    if len(quantiles) != len(k_values) - 1:
        raise ValueError(f"quantiles={list(quantiles)}: need len(k_values) - 1 = {len(k_values) - 1} for "
                         f"k_values={list(k_values)}")
    q = torch.tensor(quantiles, dtype=torch.float32)
    thresholds = torch.quantile(calib_entropy_T.float(), q).tolist()
    out = {f"TopK k={native_k} (native)": TopK(native_k)}
    if native_k > 1:
        out[f"TopK k={native_k - 1}"] = TopK(native_k - 1)
    out["EntropyAdaptiveK"] = EntropyAdaptiveK(tuple(k_values), tuple(thresholds))
    out[f"TopP p={top_p}"] = TopP(top_p, k_max=native_k)
    out[f"RatioSkip beta={ratio_beta}"] = RatioSkip(ratio_beta, k_max=native_k)
    return out


entropy_T = entropy_of(logits_TE)
policies = make_policies(entropy_T, native_k, adaptive_k_values, adaptive_quantiles)  # same tokens: a demo
stats = policy_stats(logits_TE, policies, native_k, renormalize)
print(f"router entropy (nats, max log E = {np.log(num_experts):.2f}): quantiles 10/50/90% =",
      np.round(np.quantile(entropy_T.numpy(), [0.1, 0.5, 0.9]), 3))
stats[["policy", "tokens", "kept_pairs", "native_pairs", "mean_k", "expert_reduction", "mean_weight_sum"]]


# %%
name = f"01_quickstart_random_E{num_experts}_k{native_k}"
fig = plot_policy_stats(stats, f"Random logits: T={tokens}, E={num_experts}, native top-{native_k}", native_k)
paths = savefig(fig, name)
results.save("01_policy_stats_random", stats.assign(k_hist=stats.k_hist.map(str)))
results.save("01_summary_random", {row.policy: row.expert_reduction for row in stats.itertuples()})
print("figure:", paths["pdf"].name, paths["png"].name)
plt.show()

# %% [markdown]
# ## 2 · Router logits recorded from a trained model
# An embedded model (`moelab.models.load`) reads WikiText-2 test, the evaluation set, and
# `moelab.hf.record_router` keeps every MoE layer's router logits of the unchanged forward. Each
# policy then routes them layer by layer. EntropyAdaptiveK's thresholds sit at entropy quantiles of
# *held-out training text* (never the evaluation tokens), per layer, with k values half and full
# native k and the thresholds at evenly spaced entropy quantiles (the median for two k values). The whole-forward saving adds attention, router and LM head FLOPs from the model's shapes
# (`ModelShapes.forward_reduction`). These are compute counts of the plans only: what routing does to
# perplexity needs the patched forward (notebook 02).

# %%
recorded = None
if model:
    from moelab import hf, models
    from moelab.compute import ModelShapes, pool_layers
    from moelab.data import eval_text, heldout_texts
    from moelab.evaluate import model_dtype, token_ids

    lm, tokenizer = models.load(model, device=device, dtype=dtype)
    info = models.moe_info(lm)
    m_native_k, m_renorm = info["native_k"], info["renormalize"]
    ctx = min(seq_len, getattr(lm.config, "max_position_embeddings", seq_len) or seq_len)

    def first_ids(text: str, n_tokens: int) -> torch.Tensor:
        ids = token_ids(tokenizer, text[: 40 * n_tokens])[:n_tokens]
        if len(ids) < n_tokens:
            raise ValueError(f"text has {len(ids)} tokens, fewer than the {n_tokens} asked for")
        return ids

    eval_logits = hf.router_logits(lm, first_ids(eval_text(), eval_tokens), ctx)
    calib_logits = hf.router_logits(lm, first_ids("\n".join(heldout_texts().values()), calib_tokens), ctx)
    m_k_values = sorted({max(1, m_native_k // 2), m_native_k})
    m_quantiles = [j / len(m_k_values) for j in range(1, len(m_k_values))]  # evenly spaced
    rows = []
    for layer, logits_le in eval_logits.items():
        pols = make_policies(entropy_of(calib_logits[layer]), m_native_k, m_k_values, m_quantiles)
        rows.append(policy_stats(logits_le, pols, m_native_k, m_renorm).assign(layer=layer))
    per_layer = pd.concat(rows, ignore_index=True)
    recorded = pool_layers(per_layer, m_native_k, ModelShapes.from_config(lm.config), context=ctx // 2, prefill=ctx)
    lm_dtype = model_dtype(lm)
    fig = plot_policy_stats(recorded, f"{model} ({lm_dtype}): router logits on WikiText-2 test, {eval_tokens} tokens x "
                     f"{len(eval_logits)} layers (E={info['num_experts']}, native top-{m_native_k})", m_native_k)
    savefig(fig, f"01_quickstart_recorded_{Path(model).name}")
    results.save("01_policy_stats_recorded", recorded.assign(k_hist=recorded.k_hist.map(str), model=model,
                                                               dtype=lm_dtype))
    results.save("01_policy_stats_recorded_per_layer", per_layer.assign(k_hist=per_layer.k_hist.map(str), model=model,
                                                                           dtype=lm_dtype))
    results.save("01_summary_recorded", {r.policy: {"expert_reduction": r.expert_reduction,
                                                 "forward_reduction": r.forward_reduction}
                                      for r in recorded.itertuples()})
    plt.show()
    display_cols = ["policy", "mean_k", "kept_pairs", "native_pairs", "expert_reduction", "forward_reduction"]
    print(recorded[display_cols].to_string(index=False))

# %% [markdown]
# ## 3 · Real expert load: AllenAI's routing counts
# How often each expert was chosen by OLMoE-1B-7B (64 experts, top-8) or Mixtral-8x7B (8 experts,
# top-2) in layers 0, 7 and 15 on five text domains. Normalised entropy 1 means a perfectly balanced
# load. These are counts, not per-token logits: they show how uneven the real load is, which is what
# a skipping policy redistributes.

# %%
load_rows, shares = [], {}
for domain in DOMAINS:
    counts_LE = load_routing_counts(counts_model, domain)
    for li, layer in enumerate(COUNT_LAYERS):
        load_rows.append({"model": counts_model, "domain": domain, "layer": layer,
                          "tokens_x_k": int(counts_LE[li].sum()),
                          "normalised_entropy": normalised_entropy(counts_LE[li])})
        shares[(domain, layer)] = np.sort(counts_LE[li] / counts_LE[li].sum())[::-1]
load = pd.DataFrame(load_rows)
table = load.pivot(index="domain", columns="layer", values="normalised_entropy").reset_index()
table.columns = ["domain"] + [f"layer {c}" for c in table.columns[1:]]
save_table(table, f"01_expert_load_entropy_{counts_model}",
           caption=f"Normalised entropy of the expert load, {counts_model}, AllenAI routing counts")
results.save("01_expert_load", load)

fig, axes = figure("full", aspect=0.3, ncols=len(COUNT_LAYERS), sharey=True)
for ax, layer in zip(axes, COUNT_LAYERS):
    for domain in DOMAINS:
        s = shares[(domain, layer)]
        ax.plot(np.arange(1, len(s) + 1), 100 * s, label=domain, lw=1)
    ax.set(title=f"layer {layer}", xlabel="expert rank by load")
axes[0].set_ylabel("share of routed pairs (%)")
axes[-1].legend(frameon=False)
source = {"olmoe": "OLMoE-1B-7B", "mistral": "Mixtral-8x7B"}.get(counts_model, counts_model)
fig.suptitle(f"{source}: expert load per layer on five domains (AllenAI's routing counts)", fontsize=9)
savefig(fig, f"01_expert_load_{counts_model}")
plt.show()
table

# %% [markdown]
# ## 4 · Explorer
# Sliders for the EntropyAdaptiveK threshold, TopP's p and RatioSkip's beta; the k histogram and the
# compute saved update from the recorded logits (all layers), or the random ones without a model.
# Only with `interactive=True` (a headless run skips it).

# %%
if interactive:
    import ipywidgets as widgets
    from IPython.display import display

    if recorded is not None:
        x_TE, x_k, x_renorm, source = torch.cat(list(eval_logits.values())), m_native_k, m_renorm, model
        x_kv = m_k_values
    else:
        x_TE, x_k, x_renorm, source, x_kv = logits_TE, native_k, renormalize, "random logits", adaptive_k_values
    x_entropy_T = entropy_of(x_TE)
    lo, hi = float(x_entropy_T.min()), float(x_entropy_T.max())

    def explore(threshold: float, p: float, beta: float):
        pol = {f"TopK k={x_k} (native)": TopK(x_k),
               "EntropyAdaptiveK": EntropyAdaptiveK((x_kv[0], x_kv[-1]), (threshold,)),
               f"TopP p={p:.2f}": TopP(p, k_max=x_k),
               f"RatioSkip beta={beta:.2f}": RatioSkip(beta, k_max=x_k)}
        return plot_policy_stats(policy_stats(x_TE, pol, x_k, x_renorm), f"explorer ({source})", x_k)

    display(explorer(
        explore,
        threshold=widgets.FloatSlider(value=float(x_entropy_T.median()), min=lo, max=hi, step=(hi - lo) / 100,
                                      description="entropy thr", continuous_update=False),
        p=widgets.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.05, description="TopP p",
                              continuous_update=False),
        beta=widgets.FloatSlider(value=ratio_beta, min=0.0, max=1.0, step=0.05, description="beta",
                                 continuous_update=False),
    ))
