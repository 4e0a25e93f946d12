"""The whole-model serving study's targets, tables and figures, from `benchmarks/serving.py` results (topics
`serving` and `serving-mixtral`). Nothing is measured here. Imported by notebooks 04 and 06 (whose working folder
is notebooks/) and by tools/report.py, so the docs and the notebooks draw the same figures.
"""

from __future__ import annotations

import pandas as pd

from moelab import results

TOPICS = ("serving", "serving-mixtral")
PREFILL_SPEEDUP = 1.5  # native prefill against transformers as shipped, every model and shape
AMDAHL_TOL = 0.10  # adaptive prefill time within 10% of the Amdahl prediction at these kept fractions:
AMDAHL_KEEP = (75, 60)
POOL_PEAK = 1.05  # reuse peak <= 1.05 x max(graph pool, eager peak)
POOL_SPEED = 0.98  # decode tokens/s with reuse >= 0.98 x without
NAMES = {"olmoe-1b-7b": "OLMoE-1B-7B", "qwen1.5-moe-a2.7b": "Qwen1.5-MoE-A2.7B", "mixtral-8x7b": "Mixtral-8x7B"}
POLICY = {"eak": "EntropyAdaptiveK", "ratio": "RatioSkip"}


def frame(docs=None) -> pd.DataFrame:
    """Every row of the serving documents (default: the committed `TOPICS`), with `model` the display name,
    `shape` 'BxL' for prefill rows, and `policy`/`keep` (nominal % kept) for the adaptive arms."""
    docs = docs if docs is not None else [results.load_results(t) for t in TOPICS]
    df = pd.concat([results.rows_frame(d) for d in docs], ignore_index=True)
    if bad := sorted(set(df["model"]) - set(NAMES)):
        raise ValueError(f"models {bad}: not serving models (have {list(NAMES)})")
    if "error" in df and df["error"].notna().any():
        raise ValueError(f"rows with errors: {df.loc[df['error'].notna(), ['model', 'part', 'arm']].values.tolist()}")
    df["model"] = df["model"].map(NAMES)
    adaptive = df["arm"].str.match(r"(eak|ratio)-\d+$")
    df.loc[adaptive, "policy"] = df.loc[adaptive, "arm"].str.split("-").str[0].map(POLICY)
    df.loc[adaptive, "keep"] = df.loc[adaptive, "arm"].str.split("-").str[1].astype(int)
    pre = df["part"] == "prefill"
    df.loc[pre, "shape"] = [f"{int(b)}x{int(n)}" for b, n in zip(df.loc[pre, "batch"], df.loc[pre, "length"])]
    return df


def layers(df: pd.DataFrame) -> dict:
    """{model: 'all 16 layers' or '20 of 32 layers'}."""
    first = df.groupby("model", sort=False)[["layers", "layers_full"]].first()
    return {m: f"all {int(r.layers)} layers" if r.layers == r.layers_full else f"{int(r.layers)} of "
            f"{int(r.layers_full)} layers" for m, r in first.iterrows()}


def prefill(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and shape: transformers and native ms, native's speedup, the routed experts' share of the native
    forward, and the best adaptive arm at 60% kept against native."""
    p = df[df["part"] == "prefill"]
    t = p.pivot_table(index=["model", "shape"], columns="arm", values="ms", sort=False)
    share = p[p["arm"] == "native"].set_index(["model", "shape"])["expert_share"]
    out = pd.DataFrame({"hf_ms": t["hf"], "native_ms": t["native"], "speedup": t["hf"] / t["native"],
                        "expert_share": share})
    out["met"] = out["speedup"] >= PREFILL_SPEEDUP
    for keep in (75, 60):
        out[f"saving_{keep}"] = 1 - t[[f"eak-{keep}", f"ratio-{keep}"]].min(axis=1) / t["native"]
    return out.reset_index()


def amdahl(df: pd.DataFrame) -> pd.DataFrame:
    """Each adaptive prefill arm: kept fraction, predicted and measured saving against native, the time's
    deviation from the prediction, and `met` (within AMDAHL_TOL) where the arm keeps one of AMDAHL_KEEP."""
    a = df[(df["part"] == "prefill") & df["policy"].notna()]
    out = a[["model", "shape", "policy", "keep", "kept_fraction", "amdahl_saving", "saving_vs_native",
             "vs_amdahl"]].reset_index(drop=True)
    out["checked"] = out["keep"].isin(AMDAHL_KEEP)
    out["met"] = out["vs_amdahl"].abs() <= AMDAHL_TOL
    return out


def decode(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and batch: ms/step of transformers eager, transformers in CUDA graphs (hf-graph), native, and the
    faster adaptive policy at each kept level; native over hf-graph and adaptive over native (speedups)."""
    d = df[df["part"] == "decode"]
    t = d.pivot_table(index=["model", "batch"], columns="arm", values="ms_per_step", sort=False)
    out = pd.DataFrame({"hf_ms": t["hf"], "hf_graph_ms": t["hf-graph"], "native_ms": t["native"],
                        "native_vs_graph": t["hf-graph"] / t["native"]})
    for keep in (90, 75, 60):
        out[f"adaptive_{keep}"] = t["native"] / t[[f"eak-{keep}", f"ratio-{keep}"]].min(axis=1)
    out["tokens_per_s"] = out.index.get_level_values("batch") / out["native_ms"] * 1e3
    return out.reset_index().astype({"batch": int})


def pool(df: pd.DataFrame) -> pd.DataFrame:
    """Per model: the pool arms' summary (peaks in MiB, reuse / max, saved, tokens/s ratio) with the reuse arm's
    share of eager scratch bytes in the pool and its stress checks."""
    p = df[df["part"] == "pool"]
    s = p[p["arm"] == "summary"].set_index("model")
    r = p[p["arm"] == "shared+reuse"].set_index("model")
    cols = ["graph_pool_mib", "eager_reserved_peak_mib", "private_reserved_peak_mib", "no_reuse_reserved_peak_mib",
            "reuse_reserved_peak_mib", "reuse_over_max", "saved_mib", "saved_pct", "tokens_per_s_reuse_over_no_reuse"]
    out = s[cols].join(r[["scratch_fraction_in_pool", "steady_reserved_mib", "stress_rounds", "stress_checks",
                          "stress_mismatches"]])
    out["met"] = ((out["reuse_over_max"] <= POOL_PEAK) & (out["tokens_per_s_reuse_over_no_reuse"] >= POOL_SPEED)
                  & (out["stress_mismatches"] == 0))
    return out.reset_index()


# ---- figures: each draws on the axes it is given --------------------------------------------------------------

def plot_prefill(ax, df: pd.DataFrame) -> None:
    """Native and the best adaptive arm at 75% and 60% kept, prefill speedup over transformers as shipped."""
    p = prefill(df)
    x = range(len(p))
    for i, (col, label) in enumerate((("speedup", "native"), ("saving_75", "adaptive, 75% kept"),
                                      ("saving_60", "adaptive, 60% kept"))):
        y = p["speedup"] if col == "speedup" else p["speedup"] / (1 - p[col])
        ax.bar([j + 0.27 * (i - 1) for j in x], y, width=0.27, label=label, color=f"C{i}")
    ax.axhline(PREFILL_SPEEDUP, color="black", lw=0.8)
    ax.set_xticks(list(x), [f"{m.split('-')[0]}\n{s}" for m, s in zip(p["model"], p["shape"])], fontsize=6)
    ax.set(ylabel="prefill speedup over transformers")
    ax.legend(fontsize=6)


def plot_amdahl(axes, df: pd.DataFrame) -> None:
    """Per model: measured against predicted whole-model saving of every adaptive arm and shape."""
    a = amdahl(df)
    marks = {"1x2048": "o", "8x1024": "s", "4x4096": "^"}
    for ax, (model, g) in zip(axes, a.groupby("model", sort=False)):
        for (shape, policy), h in g.groupby(["shape", "policy"], sort=False):
            ax.plot(100 * h["amdahl_saving"], 100 * h["saving_vs_native"], marks[shape], ms=4,
                    color="C0" if policy == "EntropyAdaptiveK" else "C1", mfc="none" if shape == "1x2048" else None,
                    label=f"{policy}, {shape}")
        hi = 100 * max(g["amdahl_saving"].max(), g["saving_vs_native"].max()) * 1.1
        ax.plot([0, hi], [0, hi], color="black", lw=0.8)
        ax.set(title=model, xlabel="predicted saving (%)")
    axes[0].set_ylabel("measured saving against native (%)")
    axes[0].legend(fontsize=5)


def plot_decode(axes, df: pd.DataFrame) -> None:
    """Per model: decode tokens/s of native and the adaptive arms over transformers in CUDA graphs, per batch."""
    d = df[df["part"] == "decode"]
    arms = ["native", "eak-75", "ratio-75", "eak-60", "ratio-60"]
    for ax, (model, g) in zip(axes, d.groupby("model", sort=False)):
        t = g.pivot_table(index="batch", columns="arm", values="tokens_per_s")
        for i, arm in enumerate(arms):
            ax.bar([j + 0.16 * (i - 2) for j in range(len(t))], t[arm] / t["hf-graph"], width=0.16, label=arm,
                   color=f"C{i}")
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xticks(range(len(t)), [f"batch {int(b)}" for b in t.index])
        ax.set(title=model, ylim=(0.9, None))
    axes[0].set_ylabel("decode tokens/s over transformers in graphs")
    axes[0].legend(fontsize=5)


def plot_pool(ax, df: pd.DataFrame) -> None:
    """Per model: the reserved peak of each pool arm over max(graph pool, eager peak)."""
    p = pool(df).set_index("model")
    mx = p[["graph_pool_mib", "eager_reserved_peak_mib"]].max(axis=1)
    cols = {"private_reserved_peak_mib": "private pools", "no_reuse_reserved_peak_mib": "one shared pool",
            "reuse_reserved_peak_mib": "shared pool, prefill borrows it"}
    p[list(cols)].div(mx, axis=0).rename(columns=cols).plot.bar(ax=ax, rot=0)
    ax.axhline(POOL_PEAK, color="black", lw=0.8)
    ax.set(ylabel="serving peak / max(graph pool, eager peak)", xlabel="", ylim=(0.9, None))
    ax.legend(fontsize=6)
