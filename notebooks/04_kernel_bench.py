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
# # 04 · Routing kernel and MoE layer at hardware speed
#
# The fused Triton routing kernel (`moelab.kernels.routing`) and the no-sync expert path
# (`moelab.kernels.layout`, `moelab.kernels.experts`) against their baselines: a faithful torch
# re-implementation of the proposed TensorRT-LLM `AdaptiveKMoeRoutingMethod` (with and without its
# host-syncing statistics), plain torch softmax + top-k, moelab's own torch reference, and the
# transformers 5 sparse MoE blocks (experts implementation `eager` and `grouped_mm`).
#
# On a GPU with `run_benchmark=True` this notebook first runs `benchmarks/moe_kernels.py` with the
# shapes below (it writes the `routing-kernel` and `moe-layer` results). On a CPU it plots the committed
# results, and every figure names the machine they were measured on. The target checks and tables come from
# `kernel_report.py` beside this notebook.

# %% tags=["parameters"]
run_benchmark: bool = False  # True needs a GPU: run benchmarks/moe_kernels.py first (about 1 min on an H200); False: plot only
parts: str = "routing,layer"  # benchmark parts: routing, host, layer, tune, tune-gemm, tune-few, cutlass-tiles (--help of the script)
tokens: str = "1,16,64,512,4096,65536"  # token counts T of the benchmark
quick: bool = False  # benchmark fewer shapes (routing at E 64 and 128; the OLMoE-like layer only)
results_dir: str = ""  # read results from (and with run_benchmark write them to) this folder; topics it lacks: data/results
interactive: bool = False  # show ipywidgets explorers (never in headless runs)

# %%
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display
from kernel_report import (GRAPH_LIMIT_US, HBM_FRACTION, LAYER_SLACK, STAGES, batch_summary, batch_targets,
                           decode_table, expert_gemms, gemm_scaling, layer_targets, layout_sweep, machine_line,
                           routing_targets, stage_paths, stage_table, stage_time)
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from moelab import results
from moelab.params import check_bools
from moelab.plots import explorer, figure, save_table, savefig

check_bools(run_benchmark=run_benchmark, quick=quick, interactive=interactive)
REPO = results.REPO
if run_benchmark:
    if not torch.cuda.is_available():
        raise ValueError("run_benchmark=True needs CUDA: on a CPU leave it False to plot the committed results")
    cmd = [sys.executable, str(REPO / "benchmarks" / "moe_kernels.py"), "--parts", parts, "--tokens", tokens]
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, PYTHONPATH=str(REPO / "lib"), PYTHONUNBUFFERED="1")
    if results_dir:  # the benchmark writes where this notebook reads
        env["MOELAB_RESULTS_DIR"] = results_dir
    subprocess.run(cmd, check=True, env=env)

# the folder read: results_dir, else where a benchmark run just wrote (MOELAB_RESULTS_DIR or data/results)
rdir = Path(results_dir) if results_dir else (results.results_dir() if run_benchmark else None)
routing_doc = results.load_results("routing-kernel", rdir, fallback=True)  # a part not run: the committed file
layer_doc = results.load_results("moe-layer", rdir, fallback=True)
routing = results.rows_frame(routing_doc)
layer = results.rows_frame(layer_doc)
print("routing:", machine_line(routing_doc))
print("layer:  ", machine_line(layer_doc))
print("command:", routing_doc["command"])

# %% [markdown]
# ## 1 · Routing: GPU time per call inside a CUDA graph
# One graph holds at least 20 calls, cycling over input sets larger than three times the L2, so
# large T reads HBM. The dotted grey line is the HBM bound: logits read once and the plan written once,
# at the copy bandwidth measured in the same run. The memory-only kernel reads the logits and writes a
# plan of the same size with no softmax or selection: what moving the same bytes costs at this size,
# launch and ramp included (at T = 65536, how much of the bound a kernel of a few microseconds reaches).
# Methods that cannot be captured (host syncs, host-to-device copies per call) have no graph time. The thin
# black line is the graph-time target for T <= 4096 (`kernel_report.GRAPH_LIMIT_US`).

# %%
METHODS = {
    "triton_topk": ("moelab Triton, native top-k", "-", "o"),
    "triton_adaptive": ("moelab Triton, adaptive-k", "-", "s"),
    "triton_adaptive_stats": ("moelab Triton, adaptive-k + stats", "--", "s"),
    "trtllm_adaptive": ("TRT-LLM proposal (torch)", "-", "^"),
    "torch_softmax_topk": ("torch softmax + top-k", "-", "v"),
    "memory_floor": ("memory-only kernel (floor)", ":", "x"),
}


def routing_figure(frame: pd.DataFrame, doc: dict, name: str):
    """Graph time per call against T, a panel per router shape, with the HBM bound and the graph-time target."""
    shapes = list(dict.fromkeys(frame["shape"]))
    fig, axes = figure("full", aspect=0.3 * ((len(shapes) + 1) // 2), ncols=2, nrows=(len(shapes) + 1) // 2,
                       squeeze=False, sharex=True, layout="constrained")
    for ax, shape in zip(axes.flat, shapes):
        d = frame[frame["shape"] == shape]
        for m, (label, ls, mk) in METHODS.items():
            dm = d[(d["method"] == m) & d["graph_us"].notna()].sort_values("T")
            ax.plot(dm["T"], dm["graph_us"], ls=ls, marker=mk, ms=3, label=label)
        hb = d[d["method"] == "triton_topk"].sort_values("T")
        ax.plot(hb["T"], hb["hbm_bound_us"], ":", color="grey", label="HBM bound")
        ax.axhline(GRAPH_LIMIT_US, color="black", lw=0.6, alpha=0.5,
                   label=f"target: {GRAPH_LIMIT_US:g} us (T <= 4096)")
        ax.set(xscale="log", yscale="log", title=f"{shape}: E={d['E'].iloc[0]}, k={d['native_k'].iloc[0]}",
               xlabel="tokens T", ylabel="us per call (graph)", ylim=(0.3, None))
    for ax in axes.flat[len(shapes):]:
        ax.axis("off")
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=6)
    fig.suptitle(machine_line(doc), fontsize=7)
    savefig(fig, name)
    plt.show()


routing_figure(routing, routing_doc, "04_routing_graph_time")

# %% [markdown]
# Where the time goes at T = 65536 (`benchmarks/routing_ablation.py`, run on its own): the kernel
# recompiled without its chunk selection, without exp, without both, beside the memory-only kernel.
# The dashed line is the target: `kernel_report.HBM_FRACTION` of the HBM bound, i.e. the bound's time over that
# fraction.

# %%
abl_doc = results.load_optional("routing-ablation", rdir)
if abl_doc is not None:
    abl = results.rows_frame(abl_doc)
    variants = {"memory_floor": "memory-only kernel", "neither": "no selection, no exp",
                "no_selection": "no selection", "no_exp": "no exp", "full": "full kernel (shipped)"}
    colors = ["grey"] + ["C0"] * 3 + ["C1"]
    fig, axes = figure("full", aspect=0.28, ncols=abl["E"].nunique(), squeeze=False)
    for ax, (E, d) in zip(axes.flat, abl.groupby("E")):
        d = d.set_index("variant").loc[list(variants)]
        ax.barh(list(variants.values()), d["graph_us"], color=colors)
        ax.axvline(d["hbm_bound_us"].iloc[0] / HBM_FRACTION, ls="--", color="black", lw=0.8, zorder=1,
                   label=f"target: {HBM_FRACTION:g} of the HBM bound (bound time / {HBM_FRACTION:g})")
        for y, (us, frac) in enumerate(zip(d["graph_us"], d["frac_of_hbm_bound"])):
            ax.text(us, y, f" {us:.2f} us ({frac:.0%} of the bound)", va="center", fontsize=6, zorder=4,
                    bbox=dict(fc="white", ec="none", pad=0.3))
        ax.set(title=f"E={E}, k={d['k'].iloc[0]}, T={d['T'].iloc[0]}", xlabel="us per call (graph)",
               xlim=(0, d["graph_us"].max() * 1.6))
    key = [Patch(color="C1", label="shipped kernel"), Patch(color="C0", label="recompiled with parts taken out"),
           Patch(color="grey", label="reads logits, writes the plan, nothing else")]
    fig.legend(handles=key + axes.flat[0].get_legend_handles_labels()[0], loc="outside lower center", ncols=2,
               fontsize=6)
    fig.suptitle(machine_line(abl_doc), fontsize=7)
    savefig(fig, "04_routing_ablation")
    plt.show()

# %% [markdown]
# The shipped launch as compiled (`profile`): registers, how many programs fit
# on an SM, how many waves the grid takes (below 1: every program resident from the start), and the
# instructions of the chunk loop per logit (min / max: the selection and the running max).

# %%
if abl_doc is not None and abl_doc.get("profile"):
    prof = pd.DataFrame(abl_doc["profile"]).set_index("E")
    display(prof[["warps", "regs", "spills", "programs", "programs_per_sm", "waves", "loop_instructions",
                  "instructions_per_logit", "minmax_per_logit", "mufu_per_logit"]].round(2))

# %% [markdown]
# ## 1c · Wider routers: 256 and 512 experts
# Qwen3.5-35B-A3B routes over 256 experts (top-8); Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B over 512 (top-10),
# where the row kernel keeps each row piece's best eight and next eight keys (8 < k <= 16).
# `benchmarks/moe_kernels.py --parts routing-wide` times the same methods at these shapes (topic `routing-wide`).
# The targets were set for E <= 128; they are drawn for scale.

# %%
wide_doc = results.load_optional("routing-wide", rdir)
if wide_doc is not None:
    wide = results.rows_frame(wide_doc)
    print("routing-wide:", machine_line(wide_doc), "| command:", wide_doc["command"])
    routing_figure(wide, wide_doc, "04_routing_wide")
    display(wide.pivot_table(index=["shape", "T"], columns="method", values="graph_us", sort=False).round(2))

# %% [markdown]
# ## 2 · Routing: eager call, Python launch included
# A host loop of calls, synchronised at the end. The TRT-LLM proposal's statistics call `.item()`
# per k value and for the entropy sum: each is a host sync.

# %%
eager = routing.pivot_table(index=["shape", "T"], columns="method", values="eager_us").reset_index()
fig, ax = figure("full", aspect=0.35, layout="constrained")
labels = {m: label for m, (label, _, _) in METHODS.items()}
labels |= {"trtllm_adaptive_stats": "TRT-LLM proposal + stats (torch)",
           "torch_reference_adaptive": "moelab torch reference, adaptive-k"}
order = [m for m in ["triton_adaptive", "triton_adaptive_stats", "torch_softmax_topk", "trtllm_adaptive",
                     "trtllm_adaptive_stats", "torch_reference_adaptive"] if m in eager]
lab = [f"{s}\nT={t}" for s, t in zip(eager["shape"], eager["T"])]
width = 0.8 / len(order)
for i, m in enumerate(order):  # bars centred on their group's tick
    ax.bar([j + (i - (len(order) - 1) / 2) * width for j in range(len(eager))], eager[m], width, label=labels[m])
ax.set_xticks(range(len(eager)), lab, fontsize=5, rotation=90)
ax.set(yscale="log", ylabel="us per eager call", xlim=(-0.6, len(eager) - 0.4))
fig.legend(loc="outside lower center", fontsize=6, ncols=3)
ax.set_title(machine_line(routing_doc), fontsize=7)
savefig(fig, "04_routing_eager_time")
plt.show()

# %% [markdown]
# Where the eager call's host time goes (`--parts host`): moelab's call with its direct launch, the
# same call through Triton's public launch path, the four plan allocations alone, and the torch
# version, all timed in turn in the same host loops.

# %%
host_doc = results.load_optional("routing-host", rdir)
if host_doc is not None:
    host_all = results.rows_frame(host_doc)
    host = host_all.pivot_table(index=["shape", "T"], columns="method", values="eager_us")
    host.index = [f"{sh}\nT={t}" for sh, t in host.index]
    host_methods = ["route_triton", "route_triton_public_launch", "plan_buffers"]
    host_r = host[host_methods].dropna()
    decode = host[["experts", "experts_public_launch"]].dropna() if "experts" in host else None
    fig, axes = figure("full", aspect=0.35, ncols=2 if decode is not None else 1, squeeze=False,
                       width_ratios=[4, 3] if decode is not None else None)
    ax = axes[0, 0]
    host_r.plot.bar(ax=ax, width=0.8, rot=0)
    ax.set(ylabel="us per eager call", xlabel="routing call", ylim=(0, 1.4 * host_r.values.max()))
    ax.legend(["moelab call (direct launch)", "moelab call (Triton's public launch)", "plan allocations alone"],
              fontsize=6, loc="upper left")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title(machine_line(host_doc) + f"; torch version {host['trtllm_adaptive'].min():.0f}-"
                 f"{host['trtllm_adaptive'].max():.0f} us", fontsize=7)
    if decode is not None:
        ax = axes[0, 1]
        decode.plot.bar(ax=ax, width=0.8, rot=0)
        ax.set(ylabel="us per eager call", xlabel="routing + layout + fused experts")
        ax.legend(["direct launch", "Triton's public launch"], fontsize=6)
        ax.tick_params(axis="x", labelsize=6)
    savefig(fig, "04_routing_host_time")
    plt.show()

# %% [markdown]
# ## 3 · MoE layer time
# Same weights for every variant. moelab: router GEMM, Triton routing, padded pair layout (no host
# sync), expert GEMMs as `moelab.experts.set_gemm('auto')` picks them: moelab's Triton grouped GEMMs
# (gather and SwiGLU fused in) up to 32 padded rows per expert, and above where the device's tuning
# run measured them faster than `torch._grouped_mm` (CUTLASS) on both plans (section 3b), else
# CUTLASS; `_triton` / `_cutlass`: native top-k pinned to one of the two. Solid: eager launch (CUDA
# events); dashed: ours inside a CUDA graph (T <= 4096).

# %%
VARIANT_LABELS = {"moelab_topk": "moelab, native top-k", "moelab_adaptive": "moelab, adaptive-k",
                  "moelab_topk_triton": "moelab, native top-k, Triton GEMMs",
                  "moelab_topk_cutlass": "moelab, native top-k, CUTLASS GEMMs",
                  "hf_grouped_mm": "transformers, grouped_mm experts", "hf_eager": "transformers, eager experts"}
VARIANTS = [v for v in VARIANT_LABELS if v in set(layer["variant"])]
lshapes = list(dict.fromkeys(layer["shape"]))
fig, axes = figure("full", aspect=0.32, ncols=len(lshapes), squeeze=False, layout="constrained")
for ax, shape in zip(axes.flat, lshapes):
    d = layer[layer["shape"] == shape]
    for v in VARIANTS:
        dv = d[d["variant"] == v].sort_values("T")
        line = ax.plot(dv["T"], dv["time_us"] / 1e3, marker="o", ms=3, label=VARIANT_LABELS[v])[0]
        if dv["graph_us"].notna().any():
            ax.plot(dv["T"], dv["graph_us"] / 1e3, "--", color=line.get_color(), lw=0.8)
    r = d.iloc[0]
    extra = f" +shared {r.shared_ffn}" if r.shared_ffn else ""
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms per layer",
           title=f"{shape}\nD={r.D} F={r.F} E={r.E} k={r.native_k}{extra}")
timers = [Line2D([], [], color="black", marker="o", ms=3, label="eager launch (CUDA events)"),
          Line2D([], [], color="black", ls="--", lw=0.8, label="inside a CUDA graph (ours, T <= 4096)")]
fig.legend(handles=axes.flat[0].get_legend_handles_labels()[0] + timers, loc="outside lower center", ncols=4,
           fontsize=6)
fig.suptitle(machine_line(layer_doc), fontsize=7)
savefig(fig, "04_moe_layer_time")
plt.show()

# %% [markdown]
# ## 3b · Expert GEMMs: Triton against CUTLASS
# `benchmarks/moe_kernels.py --parts tune-gemm` at T = 4096 on the native and the adaptive plan: CUTLASS
# (gate_up with its gather and SwiGLU passes, which the Triton gate_up fuses), the fastest Triton
# configuration with pointer loads, with TMA tensor-descriptor loads, in persistent programs (one per
# SM, looping over the tiles that exist) and in persistent programs whose tile and K loops Triton pipelines as
# one (`FLATTEN`), and the tuned pick (the least worst slowdown over the plans, what the device's
# `lib/moelab/kernels/configs/*.json` holds).

# %%
tune_doc = results.load_optional("experts-tune", rdir)
if tune_doc is not None:
    gemms = expert_gemms(tune_doc)
    gshapes = list(dict.fromkeys(gemms["shape"]))
    plan_names = {"native": "native", "adaptive": "terciles", "adaptive_q50": "median"}
    tune_T = max(r["T"] for r in tune_doc["rows"])
    fig, axes = figure("full", aspect=0.3, ncols=len(gshapes), squeeze=False)
    colors = {"cutlass": "grey", "triton_pointer": "C0", "triton_tma": "C1", "triton_persistent": "C2",
              "triton_flatten": "C4", "tuned": "C3"}
    for ax, shape in zip(axes.flat, gshapes):
        d = gemms[gemms["shape"] == shape].set_index(["kernel", "plan"])
        cols = [c for c in colors if c in d and d[c].notna().any()]  # older runs: no persistent or flattened ones
        d.index = [f"{kernel}\n{plan_names.get(plan, plan)}" for kernel, plan in d.index]
        d[cols].plot.bar(ax=ax, width=0.8, legend=False, color=[colors[c] for c in cols], rot=0)
        ax.set(title=f"{shape}, T={tune_T}, bf16", xlabel="GEMM, routing plan",
               ylabel="us per GEMM (CUDA events)" if shape == gshapes[0] else "")
        ax.tick_params(axis="x", labelsize=5)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=6, fontsize=6)
    fig.suptitle(machine_line(tune_doc), fontsize=7)
    savefig(fig, "04_expert_gemms")
    plt.show()
    save_table(gemms.round(1), "04_expert_gemms", caption=machine_line(tune_doc))

# %% [markdown]
# ## 3c · Pair layout
# `benchmarks/pair_layout.py`: the padded pair layout alone (per-block expert counts, a scan over the
# blocks, a per-block sort and scatter; no host sync), GPU time per call in a CUDA graph, on native and adaptive plans.
# Dotted: the time to move the bytes it must read and write at the measured copy bandwidth (the axis starts
# at 0.1 us, so each dotted line starts where its copy time passes that; the E = 64, 128 and 256 shapes, all
# k = 8, move nearly the same bytes: one line). The table below gives every copy time.

# %%
layout_doc = results.load_optional("pair-layout", rdir)
if layout_doc is not None:
    pl = pd.DataFrame(layout_doc["rows"])
    fig, ax = figure("column", aspect=0.8)
    for i, (shape, d) in enumerate(pl[pl["plan"] == "native"].groupby("shape", sort=False)):
        d = d.sort_values("T")
        ax.plot(d["T"], d["graph_us"], marker="o", ms=3, color=f"C{i}", label=f"{shape} (E={d['E'].iloc[0]})")
        ax.plot(d["T"], d["copy_us"], ":", color=f"C{i}", lw=0.8)
    ax.set(xscale="log", yscale="log", ylim=(0.1, None), xlabel="tokens T", ylabel="us per call (graph)",
           title="pair layout, native plan")  # the copy time of a few tokens lies far below 0.1 us
    ax.legend(handles=ax.get_legend_handles_labels()[0]
              + [Line2D([], [], color="grey", ls=":", lw=0.8, label="dotted: its bytes at the copy bandwidth")],
              fontsize=6, loc="upper left")
    fig.suptitle(machine_line(layout_doc), fontsize=7)
    savefig(fig, "04_pair_layout")
    plt.show()
    display(pl.pivot_table(index=["shape", "T"], columns="plan", values=["graph_us", "copy_us"]).round(2))

# %% [markdown]
# Its launch choice (plan slots per block, warps), `benchmarks/pair_layout.py --sweep`: the rule
# `moelab.kernels.layout.launch_config` against the fastest configuration swept at each point.

# %%
sweep_doc = results.load_optional("pair-layout-sweep", rdir)
if sweep_doc is not None:
    print(machine_line(sweep_doc))
    display(layout_sweep(sweep_doc).round(3))

# %% [markdown]
# ## 4 · Do compute savings become wall-clock savings?
# Adaptive-k layer time over native top-k layer time, against the fraction of (token, expert) pairs
# kept and the fraction of 128-row GEMM tiles kept. The target: at most `kernel_report.LAYER_SLACK` x the
# fraction of pairs kept at T = 4096 (thin grey line; the limit the target checks is marked at its T).
# At decode sizes the weights dominate: there only experts that no token of the batch uses
# are saved, so the right comparison is the fraction of experts used.

# %%
nat = layer[layer["variant"] == "moelab_topk"].set_index(["shape", "T"])
ada = layer[layer["variant"] == "moelab_adaptive"].set_index(["shape", "T"])
saving = pd.DataFrame({
    "kept_pairs_ratio": ada["kept_pairs"] / ada["native_pairs"],
    "gemm_tiles_ratio": ada["gemm_tiles_128"] / nat["gemm_tiles_128"],
    "experts_used_ratio": ada["experts_used"] / nat["experts_used"],
    "time_ratio_eager": ada["time_us"] / nat["time_us"],
    "time_ratio_graph": ada["graph_us"] / nat["graph_us"],
}).reset_index()
lt = layer_targets(layer_doc)
limit = lt[(lt["variant"] == "moelab_adaptive") & (lt["timer"] == "time_us")].set_index("shape")
SAVING = {"kept_pairs_ratio": ("pairs kept", ":"), "gemm_tiles_ratio": ("128-row GEMM tiles kept", (0, (1, 3))),
          "experts_used_ratio": ("experts used", "-."), "time_ratio_eager": ("layer time, eager", "-"),
          "time_ratio_graph": ("layer time, CUDA graph", "--")}
fig, axes = figure("full", aspect=0.32, ncols=len(lshapes), squeeze=False, sharey=True, layout="constrained")
for ax, shape in zip(axes.flat, lshapes):
    d = saving[saving["shape"] == shape]
    for col, (label, ls) in SAVING.items():
        ax.plot(d["T"], d[col], ls=ls, marker="o", ms=3, label=label)
    ax.plot(d["T"], LAYER_SLACK * d["kept_pairs_ratio"], color="grey", lw=0.8,
            label=f"{LAYER_SLACK:g} x pairs kept (the target's limit)")
    if shape in limit.index:
        ax.plot(limit.loc[shape, "T"], limit.loc[shape, "limit"], "_", color="black", ms=10, mew=1.5,
                label=f"limit at T = {limit.loc[shape, 'T']}")
    ax.set(xscale="log", xlabel="tokens T", title=shape,
           ylim=(0, max(1.3, 1.05 * float(saving[list(SAVING)].max().max()))))  # every ratio on the plot
axes.flat[0].set_ylabel("adaptive / native")
fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=6)
fig.suptitle(machine_line(layer_doc), fontsize=7)
savefig(fig, "04_adaptive_saving")
plt.show()
save_table(saving.round(3), "04_adaptive_saving", caption=machine_line(layer_doc))
saving.round(3)

# %% [markdown]
# The decode sizes as a table: native and adaptive time in a CUDA graph beside the shares of pairs kept and of
# experts used. The decode GEMM launch is tuned per device (`few_rows` in the device's config) and can be newer than
# the whole layer run above; a later run of the decode layer alone on the same device (topic `moe-layer-decode`)
# follows it where there is one.

# %%
display(decode_table(layer_doc).round(3))
decode_doc = results.load_optional("moe-layer-decode", rdir)
if (decode_doc is not None and decode_doc["created"] > layer_doc["created"]
        and decode_doc["machine"]["device"] == layer_doc["machine"]["device"]):
    print("the decode layer alone, later:", machine_line(decode_doc))
    display(decode_table(decode_doc).round(3))

# %% [markdown]
# Where the layer's time goes at T = 4096 (`benchmarks/layer_stages.py`, run on its own): each step
# of the layer timed alone, with native top-k and adaptive-k plans, per expert path: torch._grouped_mm
# (gather, GEMM, SwiGLU, GEMM) and moelab's Triton GEMMs (the gather and SwiGLU fused into gate_up). Right: each expert GEMM's adaptive / native time beside the same kept
# rows through one dense GEMM and the fraction of pairs kept. A grouped GEMM that shrank like the dense
# one would turn the pairs saved into time saved; the weights of every used expert are read whatever
# the rows. Times are GPU time per call in a CUDA graph where the run has them, else the eager call's
# CUDA-event time, where a short stage (routing, layout) shows its host launch time rather than its GPU work.

# %%
stages_doc = results.load_optional("layer-stages", rdir)
for path in stage_paths(stages_doc) if stages_doc is not None else []:
    col = stage_time(stages_doc, path)
    stages, scaling = stage_table(stages_doc, path, col), gemm_scaling(stages_doc, path, col)
    sshapes = list(dict.fromkeys(stages.index.get_level_values("shape")))
    fig, axes = figure("full", aspect=0.22 * len(sshapes), nrows=len(sshapes), ncols=2, squeeze=False)
    for (ax, ax2), shape in zip(axes, sshapes):
        d = stages.loc[shape]
        left = pd.Series(0.0, index=d.index)
        for stage in (s for s in STAGES if s in d.columns and d[s].notna().all()):
            ax.barh(d.index, d[stage], left=left, color=f"C{STAGES.index(stage) % 10}", label=stage)
            left += d[stage]
        ax.scatter(d["layer"], d.index, marker="|", s=200, color="black", zorder=3, label="layer, one call")
        ax.set(title=f"{shape}, T={max(r['T'] for r in stages_doc['rows'])}, {path} experts",
               xlabel="us, GPU time in a CUDA graph" if col == "graph_us" else "us, eager call (CUDA events)")
        r = scaling[scaling["shape"] == shape].set_index(["plan", "gemm"])[["grouped", "dense", "kept pairs"]]
        r.index = [f"{gemm}, {plan}" for plan, gemm in r.index]
        r.plot.barh(ax=ax2, width=0.8, color=["C1", "C0", "grey"], legend=shape == sshapes[0])
        ax2.set(title="adaptive / native", xlim=(0, 1.35), ylabel="")
    handles, labels = axes[-1, 0].get_legend_handles_labels()  # the last shape's stages (qwen15: + shared)
    fig.legend(handles, labels, loc="outside lower center", ncols=6, fontsize=6)
    fig.suptitle(machine_line(stages_doc), fontsize=7)
    name = "04_layer_stages" + ("" if path == "grouped" else f"_{path}")
    savefig(fig, name)
    plt.show()
    save_table(stages.round(1), name, caption=machine_line(stages_doc))
    display(scaling.round(3))

# %% [markdown]
# ## 5 · The targets, met or not
# Checked by `kernel_report` on the results above; `met` is False where the target is missed. A layer
# with a shared expert (Qwen-like) also gets rows that count the shared expert's work as always-kept pairs
# (shared width / expert width per token), beside the plain kept / native.

# %%
targets = pd.concat([routing_targets(routing_doc), layer_targets(layer_doc)], ignore_index=True)
summary = targets.assign(kind=targets["target"].str.replace(r" \(.*\)", "", regex=True)).groupby("kind").agg(
    met=("met", "sum"), checks=("met", "size"), lowest=("measured", "min"), highest=("measured", "max"))
save_table(targets.round(3), "04_targets",
           caption=f"routing: {machine_line(routing_doc)}; layer: {machine_line(layer_doc)}")
results.save("04_kernel_targets", targets)
results.save("04_kernel_targets_summary", {k: [int(r.met), int(r.checks)] for k, r in summary.iterrows()})
summary

# %% [markdown]
# ## 5a · The layer target on several input batches
# The layer runs also time the target's layers (ours, native and every adaptive policy) on four
# more input batches at T = 4096 (`batch_targets` / `batch_summary`). The same share of kept pairs makes another
# share of GEMM row tiles on another batch, and the ratio follows the tiles: the right panel puts each batch's
# ratio against its tile share (the tiles of the path 'auto' took: 128 rows on CUTLASS, the tuned gate_up tile
# on the Triton GEMMs, `kernel_report._row_tile`).

# %%
per_batch = batch_targets(layer_doc)
if per_batch.empty:
    print("this moe-layer run timed one input batch")
else:
    display(batch_summary(layer_doc).round(3))
    pb = per_batch[per_batch["variant"].notna() & per_batch["variant"].isin(["moelab_adaptive", "moelab_adaptive_q50"])]
    fig, (ax1, ax2) = figure("full", aspect=0.35, ncols=2)
    shape_color = {sh: f"C{i}" for i, sh in enumerate(dict.fromkeys(pb["shape"]))}
    marks = {("moelab_adaptive", "time_us"): "o", ("moelab_adaptive", "graph_us"): "x",
             ("moelab_adaptive_q50", "time_us"): "s", ("moelab_adaptive_q50", "graph_us"): "+"}
    for i, ((shape, var), g) in enumerate(pb.groupby(["shape", "variant"], sort=False)):
        for timer in ("time_us", "graph_us"):
            gt = g[g["timer"] == timer]
            kw = dict(color=shape_color[shape], ms=3, ls="none", marker=marks[var, timer])
            if marks[var, timer] == "s":
                kw["mfc"] = "none"
            ax1.plot(gt["batch"] + 0.08 * i, gt["measured"], **kw)
            ax2.plot(gt["tiles"], gt["measured"], **kw)
        ax1.plot(g["batch"] + 0.08 * i, g["limit"], "_", color=shape_color[shape], ms=9)
    key = [Line2D([], [], color=c, marker="o", ls="none", ms=3, label=sh) for sh, c in shape_color.items()]
    key += [Line2D([], [], color="black", ls="none", ms=3, marker=m, mfc="none" if m == "s" else None,
                   label=f"{'terciles' if v == 'moelab_adaptive' else 'median'} policy, "
                         f"{'eager' if t == 'time_us' else 'CUDA graph'}") for (v, t), m in marks.items()]
    key.append(Line2D([], [], color="black", ls="none", marker="_", ms=9, label="limit (left)"))
    ax1.set(xlabel="input batch", ylabel="adaptive / native layer time", xticks=sorted(pb["batch"].unique()))
    ax2.set(xlabel="share of the native plan's GEMM row tiles", ylabel="adaptive / native")
    lo, hi = ax2.get_xlim()
    ax2.plot([lo, hi], [lo * LAYER_SLACK, hi * LAYER_SLACK], ":", color="grey", lw=0.8)
    ax2.text(hi, hi * LAYER_SLACK, f"{LAYER_SLACK:g} x tile share", fontsize=5, ha="right", va="bottom", color="grey")
    fig.legend(handles=key, loc="outside lower center", ncols=4, fontsize=5)
    fig.suptitle(machine_line(layer_doc), fontsize=7)
    savefig(fig, "04_layer_batches")
    plt.show()

# %% [markdown]
# ## 5b · Whole models: prefill, decode and the Amdahl check
# `benchmarks/serving.py` times whole models at published layer shapes (random bf16 weights) on a GPU; here its
# committed results (`serving`, `serving-mixtral`) are plotted by `serving_report.py` beside this notebook, the
# same figures `docs/serving.md` shows. Left: the share s of the native prefill spent in the routed experts
# predicts an arm keeping a fraction f of the pairs to save s (1 - f) of the time; on the diagonal the prediction
# holds. Right: decode in CUDA graphs with a static KV cache, against transformers' forward in CUDA graphs.

# %%
import serving_report as sr

serving_docs = [d for d in (results.load_optional(t, rdir) for t in sr.TOPICS) if d is not None]
if serving_docs:
    serving = sr.frame(serving_docs)
    for d in serving_docs:
        print(f"{d['topic']}:", machine_line(d))
    fig, axes = figure("full", aspect=0.3, ncols=3)
    sr.plot_amdahl(axes, serving)
    savefig(fig, "04_serving_amdahl")
    fig, axes = figure("full", aspect=0.3, ncols=3)
    sr.plot_decode(axes, serving)
    savefig(fig, "04_serving_decode")
    fig, ax = figure("full", aspect=0.35)
    sr.plot_prefill(ax, serving)
    savefig(fig, "04_serving_prefill")
    plt.show()
    display(sr.prefill(serving).round(3), sr.decode(serving).round(3))

# %% [markdown]
# ## 6 · Explorer (`interactive=True`)
# Pick a routing shape and see every method's graph and eager time per T.

# %%
if interactive:
    import ipywidgets as widgets

    def show(shape):
        return routing[routing["shape"] == shape].pivot_table(index="T", columns="method",
                                                              values=["graph_us", "eager_us"]).round(2)

    display(explorer(show, shape=widgets.Dropdown(options=list(dict.fromkeys(routing["shape"])), description="shape")))
