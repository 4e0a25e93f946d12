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
# # 02 · Entropy sweep: compute against perplexity, and calibrated thresholds
#
# 1. Router outputs are recorded **once** on held-out text (unchanged forwards); the compute of any
#    threshold grid is then **estimated** from them without another forward. Estimates ignore that
#    later layers' inputs change once earlier layers route differently, so:
# 2. a few grid points are **confirmed** with real patched forwards (routing changed, skipped pairs
#    not computed);
# 3. thresholds are calibrated on held-out text to compute targets and to a perplexity budget;
# 4. EntropyAdaptiveK, TopP, RatioSkip and lower fixed k are compared **at matched compute** on the
#    evaluation text (WikiText-2 test): the Pareto plot and a plain verdict say which signal wins.

# %% tags=["parameters"]
model: str = "tiny-olmoe"  # embedded model (tiny-mixtral, tiny-qwen-moe, tiny-olmoe) or a local checkpoint path
device: str = "auto"  # auto (CUDA when this machine has it), cpu, cuda or cuda:N
dtype: str = "float32"  # model weights: float32 (as the committed tables), bfloat16, float16 or auto (bf16 on CUDA)
eval_tokens: int = 512  # WikiText-2 test tokens for measured perplexity (GPU-sized: 0, meaning all)
cal_tokens: int = 1024  # calibration tokens, equal shares of the held-out slices no model trained on (GPU-sized: 32768)
context: int = 2048  # sliding-window length, clipped to the model's max_position_embeddings
stride: int = 512  # new tokens scored per window
batch_size: int = 4  # windows per forward (GPU-sized: 64)
k_values: list[int] = []  # EntropyAdaptiveK k values; empty: the model's calibration ladder ending at native k
grid_points: int = 21  # threshold settings in the estimated sweep (estimates are cheap)
confirm_points: int = 2  # grid points confirmed with real patched forwards (GPU-sized: 6)
targets: list[float] = [0.2, 0.4]  # matched-compute routed-expert reductions (GPU-sized: [0.1, 0.2, 0.3, 0.4, 0.5])
budget: float = 0.005  # perplexity budget for calibration, relative (0.005 is +0.5%)
budget_steps: int = 5  # bisection steps of the budget search (GPU-sized: 6); fewer may find no reduction
interactive: bool = False  # show ipywidgets explorers and progress bars (never in headless runs)

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from moelab import results
from moelab.calibrate import (
    budget_search,
    calibrate_thresholds,
    calibration_ids,
    compare_at_matched_compute,
    pareto_mask,
    thresholds_at,
    verdict,
)
from moelab.data import eval_text
from moelab.evaluate import confirm_estimates, evaluate, model_dtype, reference_ppl, router_sample
from moelab.models import load, moe_info
from moelab.paper import calibration_k_values
from moelab.params import check_bools, check_fractions, check_ints, check_real
from moelab.plots import POLICY_COLORS, explorer, figure, save_table, savefig
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopP

check_ints(3, grid_points=grid_points)
check_ints(0, confirm_points=confirm_points, budget_steps=budget_steps)
check_ints(0, "0: all of WikiText-2 test", eval_tokens=eval_tokens)
check_ints(2, cal_tokens=cal_tokens, context=context)
check_ints(1, stride=stride, batch_size=batch_size)
check_fractions(targets=targets)
check_real("budget", budget, 1e-9)
check_bools(interactive=interactive)
if confirm_points > grid_points - 2:  # the confirmed points are distinct inner grid points
    raise ValueError(f"confirm_points={confirm_points}: at most grid_points - 2 = {grid_points - 2}")
net, tok = load(model, device=device, dtype=dtype)
info = moe_info(net)
tag = model.rstrip("/").split("/")[-1]
run_dtype = model_dtype(net)  # said in every title, caption and result: bf16 / fp16 numbers differ from fp32 ones
kv = tuple(k_values) or calibration_k_values(info["family"], info["native_k"])
ids = torch.tensor(tok(eval_text(), add_special_tokens=False)["input_ids"], dtype=torch.long)
eval_ids = ids[:eval_tokens] if eval_tokens else ids
cal_ids = calibration_ids(tok, cal_tokens)
kw = dict(context=context, stride=stride, batch_size=batch_size)
print(f"{model} in {run_dtype}: {info}, k values {list(kv)};"
      f" {len(eval_ids)} evaluation tokens, {len(cal_ids)} calibration tokens")

# %% [markdown]
# ## 1 · Estimated sweep from recorded router outputs
# One knob u in [0, 1] places the thresholds at entropy quantiles of the calibration text
# (`moelab.calibrate.thresholds_at`): u = 0 keeps k_max for every token, u = 1 keeps k_min.

# %%
sample = router_sample(net, cal_ids, context=context, batch_size=batch_size, progress=interactive)
grid_u = np.linspace(0.0, 1.0, grid_points)
grid = pd.DataFrame([sample.estimate(thresholds_at(sample, kv, float(u))) for u in grid_u]).assign(u=grid_u)
grid["kind"] = "EntropyAdaptiveK"
other = []
for p in np.linspace(0.05, 1.0, grid_points):
    other.append(sample.estimate(TopP(float(p), kv[-1], kv[0])) | {"kind": "TopP"})
for b in np.linspace(0.0, 1.0, grid_points):
    other.append(sample.estimate(RatioSkip(float(b), kv[-1], kv[0])) | {"kind": "RatioSkip"})  # noqa: E501
est = pd.concat([grid, pd.DataFrame(other)], ignore_index=True)
results.save("02_estimated_sweep", est.drop(columns=["mean_k_layers"]))
print("estimated (no forward pass), EntropyAdaptiveK grid:")
grid[["u", "label", "mean_k", "expert_reduction", "forward_reduction", "estimated"]]

# %% [markdown]
# ## 2 · Confirming estimates with real patched forwards
# On the calibration text itself (same chunks as the recording). The first MoE layer sees the same
# inputs in both, so its estimate should match the measurement; later layers can differ because the
# changed routing above them changed their inputs (`est_error_layers`, first MoE layer first).

# %%
pick = np.linspace(1, grid_points - 2, confirm_points).round().astype(int) if confirm_points else []
same_chunks = dict(context=sample.context, stride=sample.context, batch_size=batch_size)
sampled_ids = cal_ids[: sample.num_tokens]  # the sample's whole chunks: the same tokens in both
cal_base = reference_ppl(net, sampled_ids, progress=interactive, **same_chunks)["ppl"]
conf = confirm_estimates(net, sample, [thresholds_at(sample, kv, float(grid_u[i])) for i in pick], sampled_ids,
                         baseline_ppl=cal_base, progress=interactive, **same_chunks)
results.save("02_confirmed_estimates", conf)
if len(conf):
    layer_err = np.array(conf["est_error_layers"].tolist())
    print(f"largest |estimated - measured| routed-expert reduction: whole model {conf['est_error'].abs().max():.4f}; "
          f"first MoE layer {np.abs(layer_err[:, 0]).max():.4f}, later layers up to {np.abs(layer_err[:, 1:]).max():.4f}")
else:
    print("no confirmation points")
conf

# %% [markdown]
# ## 3 · Calibrated thresholds (held-out text only)

# %%
cal_rows = []
for t in targets:
    for per_layer in (False, True):
        pol = calibrate_thresholds(sample, kv, t, per_layer=per_layer)
        e = sample.estimate(pol)
        cal_rows.append({"target_reduction": t, "per_layer": per_layer, "est_expert_reduction": e["expert_reduction"],
                         "thresholds": str([[round(th, 4) for th in p.thresholds] for p in pol] if per_layer
                                           else [round(th, 4) for th in pol.thresholds])})
bs = budget_search(net, sample, cal_ids, kv, budget=budget, steps=budget_steps, progress=interactive, **kw)
print(f"budget {budget:+.2%}: largest reduction within it on held-out text {bs['target_reduction']:.3f} "
      f"(ppl change {bs['ppl_change']:+.3%}, within budget: {bs['within_budget']}), {bs['policy']}")
calibrated = pd.DataFrame(cal_rows)
save_table(calibrated, f"02_calibrated_thresholds_{tag}",
           caption=f"Thresholds calibrated on held-out text, {tag}, {run_dtype}")
results.save("02_budget_trace", bs["trace"])
calibrated

# %% [markdown]
# ## 4 · Matched compute on the evaluation text: which signal wins?
# Perplexity changes are against the unchanged model in fp32; in bf16 / fp16 against the model's own TopK
# through moelab (`moelab.evaluate.reference_ppl`), since there the patch alone moves perplexity by 1e-4 to 1e-3.

# %%
base = reference_ppl(net, eval_ids, progress=interactive, **kw)  # in 16-bit the patched native TopK (its docstring)
matched = compare_at_matched_compute(net, sample, eval_ids, sorted({*targets, bs["target_reduction"]} - {0.0}), kv,
                                     base["ppl"], progress=interactive, **kw)
if bs["target_reduction"] > 0:
    bud = evaluate(net, bs["policy"], eval_ids, baseline_ppl=base["ppl"], progress=interactive, **kw).summary
    matched = pd.concat([matched, pd.DataFrame([{**bud, "kind": "EntropyAdaptiveK (budget)"}])], ignore_index=True)
else:  # the unchanged model: nothing to compare
    print(f"no reduction stayed within {budget:+.2%} at {budget_steps} bisection steps: no budget point")
matched["pareto"] = pareto_mask(matched["expert_reduction"], matched["ppl"])
results.save("02_matched_compute", matched)
save_table(matched[["kind", "label", "target_reduction", "mean_k", "expert_reduction", "forward_reduction", "ppl",
                    "ppl_change", "pareto"]], f"02_matched_compute_{tag}",
           caption=f"Perplexity at matched compute, {tag}, {run_dtype}, {len(eval_ids)} WikiText-2 test tokens; "
                   f"ppl_change against the {base['reference']} model")
text = verdict(matched)
results.save("02_verdict", {"model": model, "dtype": run_dtype, "verdict": text, "baseline_ppl": base["ppl"],
                             "baseline": base["reference"], "tokens": len(eval_ids)})
print(f"baseline perplexity {base['ppl']:.3f} ({base['reference']} model) on {base['scored_tokens']} scored tokens")
print(text)

# %%
fig, ax = figure()
for kind, g in matched.groupby("kind"):
    g = g.sort_values("expert_reduction")
    color = POLICY_COLORS.get(kind.split(" ")[0], "grey")
    ax.plot(100 * g["expert_reduction"], 100 * g["ppl_change"], "o" if kind == "TopK" else "o-",
            color=color, label=kind, ms=3, lw=1, mfc="white" if "budget" in kind else color)
ax.axhline(100 * budget, color="black", lw=0.6, ls=":", label=f"budget {budget:+.1%}")
ax.set(xlabel=f"routed-expert FLOPs saved vs native k={info['native_k']} (%)",
       ylabel="perplexity change (%)" + ("\nvs patched native" if base["reference"] == "patched-native" else ""),
       title=f"{tag}: matched compute, measured\n{len(eval_ids)} WikiText-2 test tokens on "
             f"{next(net.parameters()).device.type} ({run_dtype})")
ax.legend(frameon=False, fontsize=6)
savefig(fig, f"02_pareto_{tag}")
plt.show()

# %% [markdown]
# ## 5 · Explorer
# Thresholds as sliders: the k histogram and the estimated compute update from the recorded router
# outputs (no forward pass). Only with `interactive=True`.

# %%
if interactive:
    import ipywidgets as widgets
    from IPython.display import display

    ent = sample.entropy_all()
    lo, hi = float(ent.min()), float(ent.max())
    sliders = [widgets.FloatSlider(value=float(t), min=lo, max=hi, step=(hi - lo) / 200, description=f"thr {i}",
                                   continuous_update=False)
               for i, t in enumerate(thresholds_at(sample, kv, 0.5).thresholds)]

    def show(**thr):
        ths = sorted(thr.values())
        ths = [t + 1e-6 * i for i, t in enumerate(ths)]
        pol = EntropyAdaptiveK(kv, tuple(ths))
        e = sample.estimate(pol)
        ks = torch.cat([sample.k(pol, i) for i in range(sample.num_layers)])
        fig, ax = figure()
        ax.bar(kv, [(ks == k).float().mean().item() for k in kv], color=POLICY_COLORS["EntropyAdaptiveK"])
        ax.set(xlabel="k", ylabel="share of tokens (all layers)", xticks=list(kv),
               title=f"estimated mean k {e['mean_k']:.2f}, saves {e['expert_reduction']:.1%} (estimate)")
        return fig

    display(explorer(show, **{f"t{i}": s for i, s in enumerate(sliders)}))
