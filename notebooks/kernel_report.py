"""The kernel study's targets checked against benchmark results, and the tables notebook 04 shows.

Targets: routing time (`routing-kernel` documents) and the adaptive layer's time against its kept pairs
(`moe-layer`); tables: the layer step by step (`layer-stages`), the expert GEMMs' tuning (`experts-tune`, and
`least_regret`, the rule the tuning benchmark picks launches by) and the pair layout's launch rule
(`pair-layout-sweep`). Nothing is measured here: the numbers come from results files written on a GPU by the
benchmarks, and the machine they came from travels with them. Imported by notebook 04 (whose working folder is
notebooks/) and by benchmarks/moe_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.results import machine_line  # noqa: F401  (notebook 04 takes it from here)

GRAPH_LIMIT_US = 5.0  # routing in a CUDA graph, T <= 4096
HBM_FRACTION = 0.5  # routing at T = 65536, E = 64 and 128: fraction of the HBM bound
EAGER_SPEEDUP = 8.0  # eager call against the torch version's eager call
LAYER_SLACK = 1.1  # adaptive layer time <= slack * kept/native * native layer time (T = 4096)
DECODE_TOKENS = (1, 16, 64)  # decode sizes, where weight reads dominate


def _rows(doc: dict, topic: str, *cols: str) -> pd.DataFrame:
    """The rows of a `topic` document as a frame, with the columns `cols`; another topic's document, or rows
    without them, raise ValueError naming the topic expected and what was given (a document without `topic`,
    as the tests and batch_targets build, is taken for one of `topic`)."""
    if not isinstance(doc, dict):
        raise TypeError(f"doc: a {type(doc).__name__}, needs a results document (a dict) of topic {topic!r}")
    if not isinstance(doc.get("rows"), list):
        raise ValueError(f"doc (keys {list(doc)}): needs a results document of topic {topic!r}, with a 'rows' list")
    if doc.get("topic", topic) != topic:
        raise ValueError(f"doc of topic {doc['topic']!r}: needs a results document of topic {topic!r}")
    df = pd.DataFrame(doc["rows"])
    missing = [c for c in cols if c not in df]
    if missing:
        raise ValueError(f"doc: its rows lack {missing} (have {list(df.columns)}): not {topic!r} rows")
    return df


def _row(target, shape, T, measured, limit, met, unit):
    return {"target": target, "shape": shape, "T": T, "measured": measured, "limit": limit, "unit": unit,
            "met": bool(met)}


def routing_targets(doc: dict) -> pd.DataFrame:
    """Graph time <= 5 us (T <= 4096), >= half the HBM bound (T = 65536, E >= 64), eager >= 8x."""
    df = _rows(doc, "routing-kernel", "shape", "T", "method", "E")
    out = []
    for (shape, T), g in df.groupby(["shape", "T"]):
        by = g.set_index("method")
        E = int(g["E"].iloc[0])
        for method in ("triton_topk", "triton_adaptive", "triton_adaptive_stats"):
            us = by.loc[method, "graph_us"]
            if T <= 4096:
                out.append(_row(f"graph time {method}", shape, T, us, GRAPH_LIMIT_US, us <= GRAPH_LIMIT_US, "us"))
            elif E >= 64:
                frac = by.loc[method, "hbm_bound_us"] / us
                # the memory-only reference kernel: what a kernel that does no work reaches at this size
                floor = ""
                if "memory_floor" in by.index:
                    ref = by.loc["memory_floor"]
                    floor = f" (memory-only kernel {ref['hbm_bound_us'] / ref['graph_us']:.2f})"
                out.append(_row(f"fraction of HBM bound {method}{floor}", shape, T, frac, HBM_FRACTION,
                                frac >= HBM_FRACTION, "x"))
        pairs = (("triton_adaptive", "trtllm_adaptive"), ("triton_adaptive_stats", "trtllm_adaptive_stats"))
        for mine, theirs in pairs:
            speedup = by.loc[theirs, "eager_us"] / by.loc[mine, "eager_us"]
            out.append(_row(f"eager speed-up {mine} vs {theirs}", shape, T, speedup, EAGER_SPEEDUP,
                            speedup >= EAGER_SPEEDUP, "x"))
    return pd.DataFrame(out)


def layer_targets(doc: dict, tokens: int = 4096) -> pd.DataFrame:
    """Adaptive layer time <= 1.1 x kept/native x native time; native no slower than hf grouped_mm. Runs
    timed in interleaved rounds also give each ratio's lowest, median and highest round (round_min,
    round_median, round_max: the same round's adaptive and native times, taken side by side).
    Layers with a shared expert get a second row that counts its work as kept pairs (shared_ffn / F per token)."""
    df = _rows(doc, "moe-layer", "shape", "T", "variant")
    out = []
    for (shape, T), g in df.groupby(["shape", "T"]):
        by = g.set_index("variant")
        nat = by.loc["moelab_topk"]
        if "hf_grouped_mm" in by.index:  # (a further input batch times ours only: see batch_targets)
            hf = by.loc["hf_grouped_mm"]
            out.append(_row("native layer time / hf grouped_mm", shape, T, nat["time_us"] / hf["time_us"], 1.0,
                            nat["time_us"] <= hf["time_us"], "x"))
        if T != tokens:
            continue
        # every adaptive policy measured at this T; the qwen15 `_routed_only` rows leave out the shared
        # expert, whose time does not shrink with k, and compare with the native layer without it too;
        # the `_cutlass` / `_triton` rows (expert GEMMs pinned to torch._grouped_mm / moelab.kernels.grouped)
        # with the native layer of the same path
        for var in [v for v in by.index if "adaptive" in v]:
            ada = by.loc[var]
            base = nat
            for suffix in ("routed_only", "cutlass", "triton"):
                if var.endswith(suffix):
                    base = by.loc[f"moelab_topk_{suffix}"]
            kept = ada["kept_pairs"] / ada["native_pairs"]
            rows = _row_tile(var, ada, doc.get("experts_tuned"))
            tiles = ada[f"gemm_tiles_{rows}"] / base[f"gemm_tiles_{rows}"]
            # a shared expert (Qwen-like) does shared_ffn / F routed experts' work for every token and never
            # shrinks with k: a second row counts it as that many always-kept pairs per token
            shared = None if var.endswith("routed_only") else ada.get("shared_ffn")
            for col in ("time_us", "graph_us"):
                if pd.notna(ada[col]) and pd.notna(base[col]):
                    ratio = ada[col] / base[col]
                    out.append(_row(f"{var} / native layer {col} (kept {kept:.3f}, {rows}-row tiles {tiles:.3f})",
                                    shape, T, ratio, LAYER_SLACK * kept, ratio <= LAYER_SLACK * kept, "x"))
                    out[-1].update(_round_ratios(ada, base, col.replace("_us", "_rounds_us")),
                                   variant=var, timer=col, kept=kept, tiles=tiles)
                    if pd.notna(shared) and shared > 0:
                        per_tok = shared / ada["F"]
                        fixed = T * per_tok
                        kept_s = (ada["kept_pairs"] + fixed) / (ada["native_pairs"] + fixed)
                        out.append(_row(f"{var}, shared expert as kept pairs / native layer {col} (kept {kept_s:.3f}: "
                                        f"{per_tok:g} per token)", shape, T, ratio, LAYER_SLACK * kept_s,
                                        ratio <= LAYER_SLACK * kept_s, "x"))
    cols = ["variant", "timer", "kept", "tiles"]  # present also when the run has no T = tokens (a quick run)
    return pd.DataFrame(out).reindex(columns=list(dict.fromkeys([*pd.DataFrame(out).columns, *cols])))


def decode_table(doc: dict, tokens=DECODE_TOKENS) -> pd.DataFrame:
    """The layer at decode sizes (batch 0), one row per (shape, T): native and adaptive time in a CUDA graph, the
    adaptive / native time (graph and eager) beside the share of pairs kept and of experts used. There the expert
    weights are read whatever the rows, so only experts that no token of the batch uses save time."""
    df = _rows(doc, "moe-layer", "shape", "T", "variant", "experts_used", "kept_pairs", "native_pairs")
    df = df[df["T"].isin(tokens)]
    if "batch" in df:
        df = df[df["batch"].fillna(0) == 0]
    nat = df[df["variant"] == "moelab_topk"].set_index(["shape", "T"])
    ada = df[df["variant"] == "moelab_adaptive"].set_index(["shape", "T"])
    both = nat.index.intersection(ada.index)
    nat, ada = nat.loc[both], ada.loc[both]
    graph = "graph_us" in df
    return pd.DataFrame({
        "native_graph_us": nat["graph_us"] if graph else np.nan,
        "adaptive_graph_us": ada["graph_us"] if graph else np.nan,
        "time_ratio_graph": ada["graph_us"] / nat["graph_us"] if graph else np.nan,
        "time_ratio_eager": ada["time_us"] / nat["time_us"],
        "kept_pairs_ratio": ada["kept_pairs"] / ada["native_pairs"],
        "experts_native": nat["experts_used"].astype(int),
        "experts_adaptive": ada["experts_used"].astype(int),
        "experts_used_ratio": ada["experts_used"] / nat["experts_used"],
    }, index=both).reset_index()


def _row_tile(var: str, row, tuned: dict | None) -> int:
    """Rows per GEMM tile on the variant's expert path, whose tile share the report shows beside the ratio:
    128 for CUTLASS (and rows without 64-row tile counts); on the Triton path (pinned, or 'auto' where the run's
    tuned entry beats CUTLASS) the tuned gate_up BLOCK_M (gate_up does two thirds of the FLOPs), 64 where the run
    recorded no table."""
    if var.endswith("cutlass") or pd.isna(row.get("gemm_tiles_64")):
        return 128
    entry = (tuned or {}).get(f"({int(row['D'])}, {int(row['F'])})") if "D" in row and "F" in row else None
    entry = entry[-1][1] if entry else None
    if not var.endswith("triton") and not (entry or {}).get("beats_cutlass"):
        return 128  # 'auto' on CUTLASS at many rows per expert
    return 128 if entry and entry["gate_up"].get("BLOCK_M") == 128 else 64


def batch_targets(doc: dict, tokens: int = 4096) -> pd.DataFrame:
    """The adaptive-layer rows of `layer_targets` per input batch: batch 0 from the document's rows (only the
    variants that the further batches time too), batches 1.. from doc["batches"]; a `batch` column. Empty where
    the run timed no further batch."""
    extra = doc.get("batches") or []
    if not extra:
        return pd.DataFrame()
    timed = {(r["shape"], r["variant"]) for r in extra}
    groups = {0: [r for r in doc["rows"] if r["T"] == tokens and (r["shape"], r["variant"]) in timed]}
    for r in extra:
        groups.setdefault(r["batch"], []).append(r)
    frames = []
    for b, rows in sorted(groups.items()):
        t = layer_targets({"rows": rows, "experts_tuned": doc.get("experts_tuned")}, tokens)
        frames.append(t[t["T"] == tokens].assign(batch=b))
    return pd.concat(frames, ignore_index=True)


def batch_summary(doc: dict, tokens: int = 4096) -> pd.DataFrame:
    """Per shape, adaptive layer and timer (eager time_us / graph_us): on how many input batches the target
    held, the ratio's lowest, median and highest value over the batches, the limits' range and the share of
    128-row tiles beside the share of kept pairs (what moves the ratio from batch to batch)."""
    t = batch_targets(doc, tokens)
    if t.empty:
        return t
    t = t[t["variant"].notna()]  # the rows that count a shared expert as kept pairs stay in batch_targets
    g = t.groupby(["shape", "variant", "timer"], sort=False)
    return pd.DataFrame({
        "met": g["met"].sum().astype(int), "batches": g["batch"].nunique(),
        "ratio_min": g["measured"].min(), "ratio_median": g["measured"].median(), "ratio_max": g["measured"].max(),
        "limit_min": g["limit"].min(), "limit_max": g["limit"].max(),
        "kept_median": g["kept"].median(), "tiles_median": g["tiles"].median(),
    }).reset_index()


def _round_ratios(ada: pd.Series, base: pd.Series, col: str) -> dict:
    """Lowest, median and highest ratio of the same round's times (runs with interleaved rounds: `*_rounds_us`)."""
    a, b = ada.get(col), base.get(col)
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not a:
        return {}
    r = [x / y for x, y in zip(a, b)]
    return {"round_min": min(r), "round_median": float(np.median(r)), "round_max": max(r)}


STAGES = ("router", "routing", "layout", "gather", "gate_up", "swiglu", "down", "combine", "shared")
PLANS = ("native", "adaptive_q50", "adaptive")


def stage_paths(doc: dict) -> list[str]:
    """The expert paths a `layer-stages` document times: 'grouped' (torch._grouped_mm, also rows without a `gemm`
    field) and 'triton'."""
    _rows(doc, "layer-stages", "shape", "T", "plan", "stage")
    return list(dict.fromkeys(r.get("gemm") or "grouped" for r in doc["rows"]))


def _stage_rows(doc: dict, gemm: str) -> pd.DataFrame:
    """The document's rows of one expert path at its largest T."""
    paths = stage_paths(doc)
    if gemm not in paths:
        raise ValueError(f"gemm={gemm!r}: this layer-stages document times {paths}")
    df = _rows(doc, "layer-stages")
    df["gemm"] = df["gemm"].fillna("grouped") if "gemm" in df else "grouped"
    df = df[df["gemm"] == gemm]
    return df[df["T"] == df["T"].max()]


STAGE_TIMES = ("graph_us", "time_us")


def stage_time(doc: dict, gemm: str = "grouped") -> str:
    """The time column the stage tables use: `graph_us` (GPU time in a CUDA graph) where every row of the path
    has it, else `time_us` (the eager call, CUDA events: a short stage shows its host launch time there)."""
    return _stage_col(_stage_rows(doc, gemm), None)


def _stage_pivot(df: pd.DataFrame, col: str) -> pd.DataFrame:
    t = df.pivot_table(index=["shape", "plan"], columns="stage", values=col)
    plans = [p for p in PLANS if p in t.index.get_level_values("plan")]
    t = t.reindex(pd.MultiIndex.from_product([list(dict.fromkeys(df["shape"])), plans], names=["shape", "plan"]))
    cols = [c for c in STAGES if c in t.columns] + [c for c in t.columns if c not in STAGES]
    return t[cols]


def _stage_col(df: pd.DataFrame, col: str | None) -> str:
    """col, checked; None: `graph_us` where every row of `df` has it, else `time_us`."""
    if col is None:
        return "graph_us" if "graph_us" in df and df["graph_us"].notna().all() else "time_us"
    if col not in STAGE_TIMES:
        raise ValueError(f"col={col!r}: must be one of {STAGE_TIMES} or None (graph_us where the run has it)")
    return col


def stage_table(doc: dict, gemm: str = "grouped", col: str | None = None) -> pd.DataFrame:
    """us per step of one expert path, one row per (shape, plan) at the document's largest T: the STAGES
    present, then `layer` (the whole layer in one call) and the dense references. col: `graph_us` or
    `time_us`; None: `stage_time(doc, gemm)`."""
    df = _stage_rows(doc, gemm)
    return _stage_pivot(df, _stage_col(df, col))


def gemm_scaling(doc: dict, gemm: str = "grouped", col: str | None = None) -> pd.DataFrame:
    """Adaptive / native per expert GEMM of one path: grouped (as the layer runs it), dense (the same kept
    rows through one GEMM) and the kept-pair fraction; a grouped GEMM that scaled as well as the dense one
    would turn every pair saved into time saved. col as in `stage_table`."""
    df = _stage_rows(doc, gemm)
    t = _stage_pivot(df, _stage_col(df, col))
    kept = df.groupby(["shape", "plan"])["kept_pairs"].first()
    out = []
    for shape, plan in t.index:
        if plan == "native":
            continue
        for step in ("gate_up", "down"):
            out.append({"shape": shape, "plan": plan, "gemm": step,
                        "grouped": t.loc[(shape, plan), step] / t.loc[(shape, "native"), step],
                        "dense": t.loc[(shape, plan), f"dense_{step}"] / t.loc[(shape, "native"), f"dense_{step}"],
                        "kept pairs": kept[(shape, plan)] / kept[(shape, "native")]})
    return pd.DataFrame(out)


GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M", "TMA", "PERSISTENT", "FLATTEN")


def least_regret(rows: list[dict], keys: tuple = GEMM_KEYS, over: str = "plan") -> tuple:
    """The configuration (its values of `keys`) whose worst slowdown against the fastest configuration,
    over the groups of `over` (e.g. the native and the adaptive plan), is smallest: one launch
    configuration has to serve them all."""
    if not rows:
        raise ValueError("rows=[]: need timed configurations to pick from")
    best: dict = {}
    for r in rows:
        g = r.get(over)
        best[g] = min(best.get(g, float("inf")), r["time_us"])
    regret: dict = {}
    for r in rows:
        cfg = tuple(r.get(k, False) for k in keys)
        regret[cfg] = max(regret.get(cfg, 0.0), r["time_us"] / best[r.get(over)])
    return min(regret, key=regret.get)


def expert_gemms(doc: dict) -> pd.DataFrame:
    """us per expert GEMM of an `experts-tune` document, one row per (shape, plan, kernel): CUTLASS (gate_up
    with its gather and SwiGLU passes), the fastest Triton configuration with pointer loads, with TMA loads, in
    persistent programs and in persistent programs with the tile and K loops flattened (NaN where the run did
    not time them), and the tuned pick (`least_regret` over the plans, as the tuning run chose it)."""
    df = _rows(doc, "experts-tune", "shape", "plan", "kernel", "time_us")
    for k in ("TMA", "PERSISTENT", "FLATTEN", "cutlass"):  # off where a row leaves them out (CUTLASS rows)
        df[k] = df[k].fillna(False).astype(bool) if k in df else False
    out = []
    for (shape, kernel), g in df.groupby(["shape", "kernel"], sort=False):
        ours = g[~g["cutlass"]]
        recs = ours.to_dict("records")
        pick = least_regret(recs)
        tuned = ours[[tuple(r.get(k, False) for k in GEMM_KEYS) == pick for r in recs]]
        for plan, gp in g.groupby("plan", sort=False):
            mine = ours[ours["plan"] == plan]
            out.append({"shape": shape, "plan": plan, "kernel": kernel,
                        "cutlass": gp.loc[gp["cutlass"], "time_us"].min(),
                        "triton_pointer": mine.loc[~mine["TMA"], "time_us"].min(),
                        "triton_tma": mine.loc[mine["TMA"] & ~mine["PERSISTENT"], "time_us"].min(),
                        "triton_persistent": mine.loc[mine["PERSISTENT"] & ~mine["FLATTEN"], "time_us"].min(),
                        "triton_flatten": mine.loc[mine["FLATTEN"], "time_us"].min(),
                        "tuned": tuned.loc[tuned["plan"] == plan, "time_us"].min(),
                        "tuned_config": "x".join(str(int(v)) for v in pick[:3]) + f" w{int(pick[3])} s{int(pick[4])}"
                                        + (" tma" if pick[6] else "") + (" persistent" if pick[7] else "")
                                        + (" flatten" if pick[8] else "")})
    return pd.DataFrame(out)


def layout_sweep(doc: dict) -> pd.DataFrame:
    """Per (shape, T) of a `pair-layout-sweep` document: the rule's launch (plan slots per block, warps) and
    time beside the fastest configuration swept, and their ratio."""
    df = _rows(doc, "pair-layout-sweep", "shape", "T", "graph_us")
    out = []
    for (shape, T), g in df.groupby(["shape", "T"], sort=False):
        best = g.loc[g["graph_us"].idxmin()]
        rule = g[g["rule_pick"]]
        r = rule.iloc[0] if len(rule) else None  # several rows when Q is cut to the slots there are
        out.append({"shape": shape, "E": int(g["E"].iloc[0]), "T": int(T),
                    "rule": f"{int(g['rule_block_slots'].iloc[0])} w{int(g['rule_warps'].iloc[0])}",
                    "rule_us": r["graph_us"] if r is not None else float("nan"),
                    "fastest": f"{int(best['block_slots_used'])} w{int(best['warps'])}", "fastest_us": best["graph_us"],
                    "rule_over_fastest": r["graph_us"] / best["graph_us"] if r is not None else float("nan")})
    return pd.DataFrame(out)
