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
# # 06 · CUDA-graph memory pool reuse
#
# Decode steps run as CUDA graphs, one per batch-size bucket, all captured (largest first) into
# **one** `torch.cuda.MemPool`. The eager forward (a prompt chunk) can borrow that pool's free blocks
# instead of growing the ordinary allocator's pool, so the process holds max(graph pool, eager
# scratch) instead of their sum (`moelab.graphs`, `moelab.scratch`). It only works when the eager
# allocations run on the graphs' capture stream, and it is only safe when no eager buffer is live
# across a replay: `GraphRunner` refuses such a replay. Decode and prefill return what a server needs
# (greedy next-token ids of the last position, argmax inside the graph), and every bucket's static
# output is a slice of one buffer allocated outside the pool, so no output pins pool blocks.
#
# Numbers come from `benchmarks/graph_pool.py`, run on the GPU machine; this notebook plots the
# committed results file and says where it came from. Four arms, everything else fixed: eager only;
# graphs with a private pool per bucket; graphs sharing one pool; shared pool + eager reuse (the
# runner's default `capture(prime='auto')`: both pool layouts tried, the smaller kept; two more arms
# force the primed and the unprimed layout). On a machine with
# CUDA (`live`, on by default) it also runs a small runner here and shows the proof that reuse is on.

# %% tags=["parameters"]
model: str = "all"  # model rows to chart: all, tiny-mixtral, tiny-qwen-moe, tiny-olmoe or synthetic
arms: list[str] = ["eager", "private", "shared", "shared+reuse", "shared+reuse-primed", "shared+reuse-unprimed"]  # in order
results_dir: str = ""  # directory with the graph-pool results (default data/results, the committed results)
live: bool = True  # also run a small GraphRunner on this machine's GPU when it has CUDA (skipped without)
live_model: str = "tiny-mixtral"  # live run: an embedded name or MoE family, its config with fresh weights (synthetic: benchmarks/graph_pool.py)
buckets: list[int] = [1, 2, 4, 8, 16, 32, 64]  # decode buckets of the live run (GPU-sized: up to 256)
interactive: bool = False  # show ipywidgets explorers (never in headless runs)

# %%
import pandas as pd
import torch
from IPython.display import display

from moelab import results
from moelab.graphs import REUSE_PEAK_LIMIT, REUSE_SPEED_FLOOR, check_buckets
from moelab.models import FAMILIES, NAMES
from moelab.params import check_bools
from moelab.plots import figure, save_table, savefig
from moelab.results import machine_line

check_bools(live=live, interactive=interactive)
buckets = check_buckets(buckets)
for name, v in (("model", model), ("live_model", live_model), ("results_dir", results_dir)):
    if not isinstance(v, str):
        raise ValueError(f"{name}={v!r}: must be a str")
if live_model not in FAMILIES and live_model not in NAMES:  # checked here, also where no GPU runs the live cell
    raise ValueError(f"live_model={live_model!r}: must be an embedded name {list(NAMES)} or a family "
                     f"{sorted(FAMILIES)}; the live run builds its config with fresh weights (no checkpoint path)")
doc = results.load_results("graph-pool", results_dir or None)
m = doc["machine"]
src = (f"{m['device']} · torch {m['torch']} · transformers {m['transformers']} · commit {str(doc['commit'])[:7]} · "
       f"{doc['created'][:10]}")  # where the results come from: on every figure and table
print(f"results: {doc['topic']} created {doc['created']} at commit {doc['commit']}")
print(f"machine: {m['device']}, torch {m['torch']}, CUDA {m['cuda']}, transformers {m['transformers']}, "
      f"triton {m['triton']}, Python {m['python']}")
print(f"command: {doc['command']}")
print(f"notes: {doc['notes']}")
rows = results.rows_frame(doc)
models = [x for x in dict.fromkeys(rows["model"]) if model in ("all", x)]
if not models:
    raise ValueError(f"model={model!r}: not in the results; choose all or one of {sorted(set(rows['model']))}")
known_arms = list(dict.fromkeys(a for a in rows["arm"] if not str(a).startswith(("adaptive", "summary"))))
if isinstance(arms, str) or not arms or [a for a in arms if a not in known_arms]:
    raise ValueError(f"arms={arms!r}: must be a non-empty list of the results' arms {known_arms}")
arm_rows = rows[rows["arm"].isin(arms) & rows["model"].isin(models)].copy()

# %% [markdown]
# ## 1 · Targets per model
# `graph_pool_mib`: the graph pool after capture in the `shared` arm (the graphs alone, no eager
# forward in it); `max_mib` = max(`graph_pool_mib`, eager-only reserved peak); `sum_mib` their sum.
# With reuse the serving loop's reserved peak should be at most `REUSE_PEAK_LIMIT` x max (memory
# target: `reuse_over_max`), and decode tokens/s at least `REUSE_SPEED_FLOOR` x the shared pool's
# without reuse (speed target); both limits live in `moelab.graphs` and are printed below.
# `saved_mib` / `saved_pct`: against the shared pool without reuse.
#
# The graph pool of the `shared+reuse` arm (`capture(prime='auto')` with the prefill as eager example)
# is measured at two points. `reuse_pool_after_capture_mib`: when `capture()` returned. The 'auto'
# trial ends with one prefill in the layout it keeps, so this already includes the prefill's segments:
# with the unprimed layout those the prefill added after the graphs, with the primed layout the
# prefill-sized segments the graphs were captured into. `reuse_pool_over_graphs_mib` = that minus
# `graph_pool_mib`: what holding the prefill adds to the pool over the graphs alone.
# `reuse_pool_growth_mib`: the pool at the end of the serving loop minus the pool after capture
# (allocator snapshots): growth during the serving loop, where only the eager forwards allocate in
# the pool. It is 0 whenever the trial prefill already sized the pool, so it does not say what the
# prefill costs the pool (the runner's own counter, `eager_growth_bytes`, is likewise reset to 0 when
# `capture('auto')` returns).
# `reuse_layout`: the layout `capture('auto')` kept (the smaller pool after one prefill, unprimed on a
# tie). Arms that force one layout: `primed_*`: one prefill runs in the pool before capture, so the
# graphs are captured into segments sized for the eager forward; `unprimed_*`: graph segments first,
# the serving loop's first prefill adds its own.

# %%
summary = rows[(rows["arm"] == "summary") & rows["model"].isin(models)].dropna(axis=1, how="all")
reuse_after = rows[rows["arm"] == "shared+reuse"].set_index("model")["graph_pool_mib_after_capture"]
summary = summary.assign(reuse_pool_after_capture_mib=summary["model"].map(reuse_after))
summary["reuse_pool_over_graphs_mib"] = summary["reuse_pool_after_capture_mib"] - summary["graph_pool_mib"]
cols = ["model", "prefill_tokens", "graph_pool_mib", "eager_reserved_peak_mib", "max_mib", "sum_mib",
        "no_reuse_reserved_peak_mib", "reuse_reserved_peak_mib", "reuse_over_max", "reuse_pool_after_capture_mib",
        "reuse_pool_over_graphs_mib", "reuse_pool_growth_mib", "saved_mib", "saved_pct",
        "tokens_per_s_reuse_over_no_reuse", "memory_target_met", "speed_target_met",
        "reuse_layout", "primed_reserved_peak_mib", "primed_over_max", "primed_tokens_per_s_over_no_reuse",
        "unprimed_reserved_peak_mib", "unprimed_over_max", "unprimed_tokens_per_s_over_no_reuse"]
summary = summary[[c for c in cols if c in summary]]
print(f"targets: reuse_over_max <= {REUSE_PEAK_LIMIT:g}; tokens_per_s_reuse_over_no_reuse >= {REUSE_SPEED_FLOOR:g}")
save_table(summary, "06_graph_pool_targets", caption=f"graph pool reuse: memory and speed targets per model; {src}")
results.save("06_graph_pool_targets", summary)
print(src)
summary.set_index("model").T  # one column per model: every row visible (pandas elides columns past 20)

# %% [markdown]
# ## 2 · Proof that reuse is on
# One more prefill after the serving loop, its allocations traced (allocator history; the copied-out
# results excluded). `scratch_fraction_in_pool`: share of its allocated bytes whose addresses fall
# inside the graph pool's segments (expected: 1 with reuse, 0 without).
# `scratch_fraction_in_captured_segments`: inside the segments the pool had right after the graphs
# were captured, i.e. memory shared with the graphs. Those are recorded before the trial prefill of
# `capture('auto')`: with the primed layout they include the priming prefill's segments; with the
# unprimed layout the rest of the bytes lie in segments a prefill added to the pool (for `shared+reuse`
# the trial prefill inside `capture()`, for `shared+reuse-unprimed` the serving loop's first prefill).
# `scratch_fraction_on_graph_blocks` (results since this column exists): on the very addresses the
# graphs' own allocations used during capture (the allocator's records of the captures), which a
# primed pool's segments alone do not show; a prefill far larger than the decode graphs has most of
# its bytes elsewhere. `graph_blocks_reused`: the other way round, the share of those graph addresses
# (`graph_block_mib`) that the prefill's allocations covered.

# %%
proof_cols = ["model", "arm", "scratch_mib_traced", "scratch_fraction_in_pool", "scratch_fraction_in_captured_segments",
              "scratch_fraction_on_graph_blocks", "graph_block_mib", "graph_blocks_reused", "eager_fallbacks"]
proof = arm_rows[arm_rows["arm"].str.startswith("shared")]
proof = proof[[c for c in proof_cols if c in proof]]
results.save("06_graph_pool_proof", proof.reset_index(drop=True))
print(src)
proof


# %% [markdown]
# ## 3 · Memory and throughput per arm
# Reserved peak of the serving loop (after capture), split into the graph pools and the ordinary
# pool at the end of the loop; dashed: max(graph pool, eager peak), dotted: their sum. The figure's
# title names the machine and commit of the results.

# %%
def plot_model(name: str):
    r = arm_rows[arm_rows["model"] == name].set_index("arm").reindex([a for a in arms if a in set(arm_rows["arm"])])
    s = summary[summary["model"] == name]
    fig, (ax1, ax2) = figure("full", aspect=0.34, ncols=2, layout="constrained")
    x = range(len(r))
    ax1.bar(x, r["graph_pool_mib_end"], label="graph pool(s)", color="#0173B2")
    ax1.bar(x, r["default_pool_mib_end"], bottom=r["graph_pool_mib_end"], label="ordinary pool", color="#DE8F05")
    ax1.scatter(x, r["reserved_peak_mib"], marker="_", s=200, color="black", label="reserved peak", zorder=3)
    if len(s):
        ax1.axhline(float(s["max_mib"].iloc[0]), ls="--", lw=0.8, color="grey", label="max(pool, eager)")
        ax1.axhline(float(s["sum_mib"].iloc[0]), ls=":", lw=0.8, color="grey", label="pool + eager")
    ax1.set_xticks(list(x), r.index, rotation=20, ha="right", fontsize=6)
    ax1.set_ylabel("MiB over the arm's start")
    ax1.set_title(f"{name}: memory")
    ax1.legend(frameon=False, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax2.bar(x, r["decode_tokens_per_s"] / 1e3, color="#029E73")
    ax2.set_xticks(list(x), r.index, rotation=20, ha="right", fontsize=6)
    ax2.set_ylabel("decode tokens/s (thousands)")
    ax2.set_title(f"{name}: decode throughput")
    fig.suptitle(src, fontsize=7)
    savefig(fig, f"06_graph_pool_memory_{name}")
    return fig


for name in models:
    plot_model(name)

# %%
mem_cols = ["model", "arm", "prefill_tokens", "reserved_peak_mib", "allocated_peak_mib", "driver_used_peak_mib", "graph_pools",
            "graph_pool_mib_after_capture", "graph_pool_mib_end", "default_pool_mib_end", "capture_reserved_peak_mib",
            "decode_tokens_per_s", "prefill_ms"]
arms_table = arm_rows[[c for c in mem_cols if c in arm_rows]].reset_index(drop=True)
save_table(arms_table, "06_graph_pool_arms", caption=f"graph pool arms: memory (MiB) and decode throughput; {src}")
results.save("06_graph_pool_arms", arms_table)
print(src)
arms_table

# %% [markdown]
# ## 4 · Adaptive routing inside the graphs
# Decode through moelab routing (Triton routing kernel) and skipping experts (padded pair layout,
# fixed worst-case capacity T x k_max) captured in the graphs: tokens/s of graphs vs eager, and of
# `EntropyAdaptiveK` vs the native `TopK` through the same path, and the unpatched transformers model
# (its own grouped_mm experts) for reference. `mean_k` / `expert_reduction` are
# counted against the native k on the same decode inputs.

# %%
ad = rows[rows["arm"].astype(str).str.startswith("adaptive:") & rows["model"].isin(models)]
if len(ad):
    ad = ad.assign(mode=ad["arm"].str.split(":").str[1])
    table = ad.pivot_table(index=["model", "policy"], columns="mode", values="decode_tokens_per_s").reset_index()
    table = table.merge(ad.groupby(["model", "policy"])[["mean_k", "expert_reduction"]].first().reset_index())
    table["graphs_over_eager"] = table["graphs"] / table["eager"]
    save_table(table, "06_graph_pool_adaptive", caption=f"adaptive routing in CUDA graphs: decode tokens/s; {src}")
    results.save("06_graph_pool_adaptive", table)
    fig, ax = figure("full", aspect=0.3)
    labels = [f"{a}\n{b}" for a, b in zip(table["model"], table["policy"])]
    xs = range(len(table))
    for dx, mode, color in ((-0.2, "eager", "#DE8F05"), (0.2, "graphs", "#0173B2")):
        bars = ax.bar([i + dx for i in xs], table[mode] / 1e3, width=0.4, label=mode, color=color)
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("decode tokens/s (thousands)")
    ax.margins(y=0.15)
    ax.legend(frameon=False, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(src, fontsize=7)
    savefig(fig, "06_graph_pool_adaptive")
    print(src)
else:
    table = pd.DataFrame()
    print("no adaptive rows in this results file (benchmark run without --adaptive)")
table

# %% [markdown]
# ## 4b · The same arms beside a KV cache (whole models)
# `benchmarks/serving.py --parts pool` runs these arms on OLMoE-1B-7B- and Qwen1.5-MoE-A2.7B-shaped models
# (random bf16 weights) decoding into a static KV cache of 2048 positions, with a 4x1024 eager prefill, and a
# stress of interleaved prefills and replays checked against the plain forward. Plotted by `serving_report.py`
# (the figure `docs/serving.md` shows), from the committed `serving` results or `results_dir`.

# %%
import serving_report as sr

serving_doc = results.load_optional("serving", results_dir or None)
if serving_doc is not None and any(r.get("part") == "pool" for r in serving_doc["rows"]):
    print("serving:", machine_line(serving_doc))
    fig, ax = figure("column", aspect=0.7)
    sr.plot_pool(ax, sr.frame([serving_doc]))
    savefig(fig, "06_serving_pool")
    display(sr.pool(sr.frame([serving_doc])).round(3))
else:
    print("no pool rows in the serving results (benchmarks/serving.py --parts pool)")

# %% [markdown]
# ## 5 · Live run (CUDA only)
# A small `GraphRunner` on this machine: bucket graphs in one shared pool, one eager forward with and
# without reuse, and the share of its bytes that landed in the pool.

# %%
if live and not torch.cuda.is_available():
    print("No CUDA on this machine: the live run is skipped (the charts above are the committed GPU results)")
elif live:
    from moelab import models as mm
    from moelab.graphs import GraphRunner, hf_decode_step

    net = mm.build(live_model).to("cuda", torch.bfloat16)
    vocab = net.config.vocab_size
    step = hf_decode_step(net, "ids")
    runner = GraphRunner(step, lambda b: (torch.randint(0, vocab, (b, 1), device="cuda"),), buckets).capture()
    prompt = torch.randint(0, vocab, (2, 64), device="cuda")
    live_rows = [{"reuse": r, **runner.scratch_fraction_in_pool(prompt, reuse=r)} for r in (False, True)]
    live_df = pd.DataFrame(live_rows)
    print({f"{a}:{b}": v for (a, b), v in runner.pool_bytes().items()})
    results.save("06_graph_pool_live", live_df)
    lm = results.machine()
    print(f"live run: {lm['device']} · torch {lm['torch']} · commit {results.commit()}")
    display(live_df)

# %% [markdown]
# ## 6 · Explorer (`interactive=True`)

# %%
if interactive:
    import ipywidgets as widgets

    pick = widgets.Dropdown(options=models, description="model")
    out = widgets.Output()

    def show(change=None):
        out.clear_output(wait=True)
        with out:
            display(plot_model(pick.value))

    pick.observe(show, names="value")
    show()
    display(widgets.VBox([pick, out]))
