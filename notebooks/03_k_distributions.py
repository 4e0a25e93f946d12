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
# # 03 · Per-layer entropy, k and expert load
#
# Where does an entropy rule spend its experts? Per MoE layer of one model: the router entropy
# distribution on five text domains (the last 5% of AllenAI's domain texts; those files repeat their
# text, so the models saw it in training: `moelab.data.heldout_repeats`) and WikiText-2 test; the k
# distribution a published configuration and a calibrated one produce (thresholds from held-out text
# the models never saw; estimated from recorded router outputs, then measured with patched forwards);
# and the expert load, compared with
# the real OLMoE-1B-7B / Mixtral-8x7B routing counts on the same five domains.

# %% tags=["parameters"]
model: str = "tiny-olmoe"  # embedded model (tiny-mixtral, tiny-qwen-moe, tiny-olmoe) or a local checkpoint path
device: str = "auto"  # auto (CUDA when this machine has it), cpu, cuda or cuda:N
dtype: str = "float32"  # model weights: float32 (as the committed tables), bfloat16, float16 or auto (bf16 on CUDA)
tokens_per_domain: int = 512  # tokens recorded per domain (GPU-sized: 16384)
eval_tokens: int = 512  # WikiText-2 test tokens for the measured k histograms (GPU-sized: 0, meaning all)
context: int = 2048  # window length, clipped to the model's max_position_embeddings
batch_size: int = 4  # windows per forward (GPU-sized: 64)
preset: str = "auto"  # published configuration (moelab.paper.PUBLISHED) or auto for the family's SDK preset
calibrated_target: float = 0.25  # routed-expert reduction for the calibrated thresholds (held-out text)
cal_tokens: int = 1024  # calibration tokens, equal shares of the held-out slices no model trained on (GPU-sized: 32768)
counts_model: str = "auto"  # real routing counts to compare: olmoe, mistral or auto (by family)
interactive: bool = False  # show ipywidgets explorers and progress bars (never in headless runs)

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from moelab import results
from moelab.calibrate import calibrate_thresholds, calibration_ids
from moelab.data import COUNT_LAYERS, DOMAINS, eval_text, heldout_texts, load_routing_counts
from moelab.data import normalised_entropy as load_entropy
from moelab.evaluate import entropy_quantiles, evaluate, model_dtype, router_sample
from moelab.models import load, moe_info
from moelab.paper import PUBLISHED, calibration_k_values, sdk_preset
from moelab.plots import POLICY_COLORS, explorer, figure, save_table, savefig
from moelab.params import check_bools, check_ints, check_real
from moelab.routing import EntropyAdaptiveK

check_ints(1, tokens_per_domain=tokens_per_domain, batch_size=batch_size)
check_ints(0, "0: all of WikiText-2 test", eval_tokens=eval_tokens)
check_ints(2, cal_tokens=cal_tokens, context=context)
check_real("calibrated_target", calibrated_target, 1e-9, 1 - 1e-9)
check_bools(interactive=interactive)
if counts_model not in ("olmoe", "mistral", "auto"):
    raise ValueError(f"counts_model={counts_model!r}: must be 'olmoe', 'mistral' or 'auto'")
net, tok = load(model, device=device, dtype=dtype)
info = moe_info(net)
E, native_k, family = info["num_experts"], info["native_k"], info["family"]
tag = model.rstrip("/").split("/")[-1]
run_dtype = model_dtype(net)  # said in every title and caption: bf16 / fp16 entropies and k differ from fp32 ones
if preset == "auto":
    preset = sdk_preset(family)
if preset not in PUBLISHED:
    raise ValueError(f"preset={preset!r}: choose auto or one of {sorted(PUBLISHED)}")
if counts_model == "auto":
    counts_model = "mistral" if family == "mixtral" else "olmoe"
kv_cal = calibration_k_values(family, native_k)
if calibrated_target > 1 - kv_cal[0] / native_k:  # checked before any recording: every token at the lowest k
    raise ValueError(f"calibrated_target={calibrated_target}: at most 1 - {kv_cal[0]}/{native_k} = "
                     f"{1 - kv_cal[0] / native_k:.3f} with the calibration's k values {list(kv_cal)}")
domain_slices = heldout_texts(unseen_only=False)  # the five domain files repeat text: seen in training
texts = {d: domain_slices[name] for d, name in DOMAINS.items()}
texts["wikitext2-test"] = eval_text()


def ids_of(text: str, n: int) -> torch.Tensor:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n] if n else ids, dtype=torch.long)


samples = {d: router_sample(net, ids_of(t, tokens_per_domain), context=context, batch_size=batch_size,
                            k_cap=min(E, max(16, native_k)), progress=interactive) for d, t in texts.items()}
print(f"{model} in {run_dtype}: {info}; {len(samples)} domains x {tokens_per_domain} tokens;"
      f" max entropy log E = {np.log(E):.3f}")

# %% [markdown]
# ## 1 · Router entropy per layer and domain (nats; divided by log E in the plot)

# %%
q_rows = []
for d, s in samples.items():
    for layer in range(s.num_layers):
        q_rows.append({"domain": d, "layer": layer, **entropy_quantiles(s.entropy[layer])})
quant = pd.DataFrame(q_rows)
results.save("03_entropy_quantiles", quant)
save_table(quant.pivot(index="domain", columns="layer", values="ent_q50").reset_index()
           .rename(columns=lambda c: f"layer {c}" if isinstance(c, (int, np.integer)) else c),
           f"03_entropy_median_{tag}", caption=f"Median router entropy (nats) per layer and domain, {tag}, {run_dtype}")

n_layers = samples["wikitext2-test"].num_layers
fig, ax = figure("full", aspect=0.3)
width = 0.8 / len(samples)
for j, (d, s) in enumerate(samples.items()):
    pos = np.arange(n_layers) + (j - (len(samples) - 1) / 2) * width
    data = [(s.entropy[layer] / np.log(E)).numpy() for layer in range(n_layers)]
    bp = ax.boxplot(data, positions=pos, widths=width * 0.9, showfliers=False, patch_artist=True,
                    medianprops=dict(color="black", lw=1))
    for box in bp["boxes"]:
        box.set(facecolor=f"C{j}", alpha=0.6, lw=0.5)
    ax.plot([], [], color=f"C{j}", label=d, lw=4, alpha=0.6)
ax.set(xticks=np.arange(n_layers), xticklabels=[f"layer {i}" for i in range(n_layers)],
       ylabel="router entropy / log E",
       title=f"{tag} ({run_dtype}): per-token router entropy, {tokens_per_domain} tokens per domain")
ax.legend(frameon=False, fontsize=6, ncol=len(samples), loc="upper center", bbox_to_anchor=(0.5, -0.12))
savefig(fig, f"03_entropy_by_layer_{tag}")
plt.show()
quant[quant.domain == "wikitext2-test"]

# %% [markdown]
# ## 2 · k per layer: published and calibrated thresholds
# Estimated from router outputs recorded on the evaluation tokens (no forward with the policy), then
# measured on the same WikiText-2 test tokens with patched forwards (later layers see changed inputs,
# so the two can differ). The calibrated thresholds come from held-out text no model trained on: their
# label names the reduction they reach there, and on WikiText-2 test they reach what the table measures,
# which can differ because the router's entropies differ between the texts.

# %%
kv_pub, th_pub = PUBLISHED[preset]
policies = {}
if kv_pub[-1] <= E:
    policies[f"{preset} {list(kv_pub)}/{list(th_pub)}"] = EntropyAdaptiveK(kv_pub, th_pub)
else:
    print(f"preset {preset} {list(kv_pub)} left out: its k_max {kv_pub[-1]} exceeds the model's {E} experts")
cal_sample = router_sample(net, calibration_ids(tok, cal_tokens), context=context, batch_size=batch_size,
                           progress=interactive)
cal_pol = calibrate_thresholds(cal_sample, kv_cal, calibrated_target)
policies[f"calibrated {calibrated_target:.0%} {list(kv_cal)}"] = cal_pol

eval_ids = ids_of(texts["wikitext2-test"], eval_tokens)
wt = router_sample(net, eval_ids, context=context, batch_size=batch_size, k_cap=min(E, max(16, native_k)),
                   progress=interactive)  # the estimate's router outputs: the tokens the measurement runs on
hist_rows, summary = [], []
for label, pol in policies.items():
    est = wt.estimate(pol)
    ev = evaluate(net, pol, eval_ids, context=context, stride=context, batch_size=batch_size, progress=interactive)
    for layer in range(wt.num_layers):
        k_est = wt.k(pol, layer)
        for k in pol.k_values:
            hist_rows.append({"policy": label, "layer": layer, "k": k, "source": "estimated",
                              "fraction": float((k_est == k).float().mean())})
    for r in ev.k_hist.itertuples():
        if r.k in pol.k_values:
            hist_rows.append({"policy": label, "layer": r.layer, "k": r.k, "source": "measured", "fraction": r.fraction})
    summary.append({"policy": label, "est_mean_k": est["mean_k"], "mean_k": ev.summary["mean_k"],
                    "expert_reduction": ev.summary["expert_reduction"], "native_k": native_k})
hists = pd.DataFrame(hist_rows)
results.save("03_k_histograms", hists)
summary = pd.DataFrame(summary)
results.save("03_k_summary", summary)
save_table(summary, f"03_k_summary_{tag}", caption=f"Mean k, estimated and measured, {tag}, {run_dtype}")

fig, axes = figure("full", aspect=0.32, ncols=len(policies), sharey=True, squeeze=False)
for ax, (label, pol) in zip(axes[0], policies.items()):
    h = hists[(hists.policy == label) & (hists.source == "measured")]
    width = 0.8 / len(pol.k_values)
    for j, k in enumerate(pol.k_values):
        g = h[h.k == k].sort_values("layer")
        ax.bar(g.layer + (j - (len(pol.k_values) - 1) / 2) * width, g.fraction, width, label=f"k={k}", color=f"C{j}")
    ax.set(title=label, xlabel="layer", xticks=range(wt.num_layers))
    ax.legend(frameon=False, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside: clear of the x label
axes[0][0].set_ylabel("share of tokens (measured)")
fig.suptitle(f"{tag} ({run_dtype}): k per layer, measured on WikiText-2 test", fontsize=8)
savefig(fig, f"03_k_by_layer_{tag}")
plt.show()
summary

# %% [markdown]
# ## 3 · Expert load against the real models' routing counts
# Normalised entropy of the expert load (1 = balanced) per domain: our model's layers under its native
# top-k and under the calibrated policy, beside AllenAI's counts for the real model (layers 0, 7, 15).

# %%
load_rows = []
for d, s in samples.items():
    for which, pol in (("native", None), ("calibrated", cal_pol)):
        counts = s.expert_load(pol)
        for layer in range(s.num_layers):
            load_rows.append({"domain": d, "source": f"{tag} {which}", "layer": layer,
                              "normalised_entropy": load_entropy(counts[layer])})
    if d in DOMAINS:
        real = load_routing_counts(counts_model, d)
        for li, layer in enumerate(COUNT_LAYERS):
            load_rows.append({"domain": d, "source": f"{counts_model} (real)", "layer": layer,
                              "normalised_entropy": load_entropy(real[li])})
loads = pd.DataFrame(load_rows)
results.save("03_expert_load", loads)
table = loads.pivot_table(index="domain", columns=["source", "layer"], values="normalised_entropy")
table.columns = [f"{s} L{layer}" for s, layer in table.columns]
table = table.reset_index()
save_table(table, f"03_expert_load_{tag}",
           caption=f"Normalised expert-load entropy, {tag} ({run_dtype}) vs {counts_model}")

fig, ax = figure()
for j, (src, g) in enumerate(loads.groupby("source")):
    m = g.groupby("domain")["normalised_entropy"].mean()
    ax.plot(m.index, m.values, "o", ms=4, label=src,  # markers only: the domains are not a sequence
            color=POLICY_COLORS["native"] if "real" in src else f"C{j}")
ax.set(xlabel="text domain", ylabel="expert-load entropy / log E",
       title=f"{tag} ({run_dtype}): mean over its {n_layers} layers, {tokens_per_domain} tokens per domain\n"
             f"{counts_model} "
             f"(AllenAI's counts): mean over layers {', '.join(map(str, COUNT_LAYERS))}")
ax.tick_params(axis="x", rotation=30)
ax.legend(frameon=False, fontsize=6)
savefig(fig, f"03_expert_load_{tag}")
plt.show()
table

# %% [markdown]
# ## 4 · Explorer
# Two entropy thresholds and the k values as sliders; per-layer k histograms and the estimated compute
# on WikiText-2 test update from the recorded router outputs (no forward). Only with `interactive=True`.

# %%
if interactive:
    import ipywidgets as widgets
    from IPython.display import display

    ent = wt.entropy_all()
    lo, hi = float(ent.min()), float(ent.max())

    def show(t1: float, t2: float, k_lo: int, k_mid: int, k_hi: int):
        ks = sorted({k_lo, k_mid, k_hi})
        ths = sorted([t1, t2])[: len(ks) - 1]
        ths = [t + 1e-6 * i for i, t in enumerate(ths)]
        pol = EntropyAdaptiveK(tuple(ks), tuple(ths))
        e = wt.estimate(pol)
        fig, ax = figure("full", aspect=0.3)
        width = 0.8 / len(ks)
        for j, k in enumerate(ks):
            share = [float((wt.k(pol, layer) == k).float().mean()) for layer in range(wt.num_layers)]
            ax.bar(np.arange(wt.num_layers) + (j - (len(ks) - 1) / 2) * width, share, width, label=f"k={k}")
        ax.set(xlabel="layer", ylabel="share of tokens", xticks=range(wt.num_layers),
               title=f"estimated mean k {e['mean_k']:.2f} of native {native_k}: saves {e['expert_reduction']:.1%}")
        ax.legend(frameon=False, fontsize=6)
        return fig

    kmax = wt.k_cap
    display(explorer(
        show,
        t1=widgets.FloatSlider(value=float(ent.quantile(0.3)), min=lo, max=hi, step=(hi - lo) / 200,
                               continuous_update=False),
        t2=widgets.FloatSlider(value=float(ent.quantile(0.7)), min=lo, max=hi, step=(hi - lo) / 200,
                               continuous_update=False),
        k_lo=widgets.IntSlider(value=kv_cal[0], min=1, max=kmax), k_mid=widgets.IntSlider(value=kv_cal[-2], min=1,
                                                                                           max=kmax),
        k_hi=widgets.IntSlider(value=kv_cal[-1], min=1, max=kmax),
    ))
