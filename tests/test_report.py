"""moelab.kernels.report: the issue-5 target checks and the layer-stage tables, on small documents built
here (rows as the benchmarks write them) and on the committed results."""

import pytest

from moelab import results
from moelab.kernels.report import (
    STAGES,
    batch_summary,
    batch_targets,
    decode_table,
    expert_gemms,
    gemm_scaling,
    layer_runs,
    layer_targets,
    layout_sweep,
    least_regret,
    machine_line,
    power_trace,
    routing_targets,
    stage_paths,
    stage_table,
    stage_time,
)


def _stage_rows(shape, plan, kept, times, T=4096):
    return [{"shape": shape, "plan": plan, "T": T, "kept_pairs": kept, "stage": s, "time_us": us}
            for s, us in times.items()]


def test_stage_table_and_gemm_scaling():
    native = {"layer": 100.0, "down": 30.0, "gate_up": 50.0, "router": 2.0, "dense_gate_up": 40.0, "dense_down": 20.0}
    adaptive = {"layer": 80.0, "down": 24.0, "gate_up": 45.0, "router": 2.0, "dense_gate_up": 24.0, "dense_down": 12.0}
    rows = _stage_rows("olmoe", "adaptive", 60, adaptive) + _stage_rows("olmoe", "native", 100, native)
    rows += _stage_rows("olmoe", "native", 100, {"layer": 1.0}, T=16)  # another T: left out
    doc = {"rows": rows}
    t = stage_table(doc)
    assert list(t.index) == [("olmoe", "native"), ("olmoe", "adaptive")]  # native first
    assert list(t.columns) == ["router", "gate_up", "down", "dense_down", "dense_gate_up", "layer"]
    assert [c for c in t.columns if c in STAGES] == ["router", "gate_up", "down"]  # the layer's order
    assert t.loc[("olmoe", "native"), "layer"] == 100.0
    g = gemm_scaling(doc).set_index("gemm")
    assert g.loc["gate_up", "grouped"] == pytest.approx(0.9) and g.loc["gate_up", "dense"] == pytest.approx(0.6)
    assert g.loc["down", "grouped"] == pytest.approx(0.8) and g.loc["down", "kept pairs"] == pytest.approx(0.6)
    assert stage_paths(doc) == ["grouped"]  # rows without a `gemm` field: the torch._grouped_mm path

    # a run timing both paths: each table holds its own path's rows only
    tri = [{**r, "gemm": "triton", "time_us": r["time_us"] / 2} for r in rows if r["T"] == 4096]
    doc = {"rows": [{**r, "gemm": "grouped"} for r in rows] + tri}
    assert stage_paths(doc) == ["grouped", "triton"]
    assert stage_table(doc, "triton").loc[("olmoe", "native"), "layer"] == 50.0
    assert stage_table(doc).loc[("olmoe", "native"), "layer"] == 100.0
    assert gemm_scaling(doc, "triton").set_index("gemm").loc["gate_up", "grouped"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="gemm='cutlass'"):
        stage_table(doc, "cutlass")


def test_stage_tables_take_graph_time_where_the_run_has_it():
    native = {"layer": 100.0, "gate_up": 50.0, "down": 30.0, "layout": 40.0, "dense_gate_up": 40.0, "dense_down": 20.0}
    adaptive = {"layer": 80.0, "gate_up": 45.0, "down": 24.0, "layout": 40.0, "dense_gate_up": 24.0, "dense_down": 12.0}
    rows = _stage_rows("olmoe", "native", 100, native) + _stage_rows("olmoe", "adaptive", 60, adaptive)
    assert stage_time({"rows": rows}) == "time_us"  # runs before graph timing: the eager time
    # graph time: the eager layout time (40 us) was host launch time, its GPU work 5 us; the GEMMs alike
    timed = [{**r, "graph_us": 5.0 if r["stage"] == "layout" else r["time_us"] * 0.9} for r in rows]
    doc = {"rows": timed}
    assert stage_time(doc) == "graph_us"
    assert stage_table(doc).loc[("olmoe", "native"), "layout"] == 5.0
    assert stage_table(doc, col="time_us").loc[("olmoe", "native"), "layout"] == 40.0
    assert gemm_scaling(doc).set_index("gemm").loc["gate_up", "grouped"] == pytest.approx(0.9)
    # one row of the path without graph time (a run cut short): the eager time for all
    assert stage_time({"rows": timed[:-1] + [rows[-1]]}) == "time_us"
    with pytest.raises(ValueError, match="col='events'"):
        stage_table(doc, col="events")


def test_routing_targets_limits():
    def row(method, T, graph, eager, bound=1.0, E=64):
        return {"shape": "olmoe", "E": E, "T": T, "method": method, "graph_us": graph, "eager_us": eager,
                "hbm_bound_us": bound}

    methods = ("triton_topk", "triton_adaptive", "triton_adaptive_stats")
    rows = [row(m, 16, g, 20.0) for m, g in zip(methods, (4.9, 5.0, 5.1))]
    rows += [row("trtllm_adaptive", 16, 50.0, 161.0), row("trtllm_adaptive_stats", 16, None, 159.0)]
    rows += [row(m, 65536, 8.0, 20.0, bound=4.0) for m in methods]
    rows += [row("trtllm_adaptive", 65536, 300.0, 100.0), row("trtllm_adaptive_stats", 65536, None, 400.0)]
    t = routing_targets({"rows": rows}).set_index(["target", "T"])
    assert t.loc[("graph time triton_topk", 16), "met"] and t.loc[("graph time triton_adaptive", 16), "met"]
    assert not t.loc[("graph time triton_adaptive_stats", 16), "met"]  # 5.1 > 5 us
    assert t.loc[("fraction of HBM bound triton_topk", 65536), "measured"] == pytest.approx(0.5)
    assert t.loc[("fraction of HBM bound triton_topk", 65536), "met"]  # exactly half: met
    assert t.loc[("eager speed-up triton_adaptive vs trtllm_adaptive", 16), "met"]  # 8.05x
    assert not t.loc[("eager speed-up triton_adaptive_stats vs trtllm_adaptive_stats", 16), "met"]  # 7.95x
    assert not t.loc[("eager speed-up triton_adaptive vs trtllm_adaptive", 65536), "met"]  # 5x
    # T = 4096 is the largest size the graph-time target covers (T <= 4096), E >= 64 or not
    rows = [{**r, "T": 4096} for r in rows if r["T"] == 16]
    t = routing_targets({"rows": rows}).set_index(["target", "T"])
    assert [m for m in methods if ("graph time " + m, 4096) in t.index] == list(methods)
    assert not any(x.startswith("fraction of HBM bound") for x, _ in t.index)


def test_committed_layer_stages():
    doc = results.load_optional("layer-stages")
    if doc is None:
        pytest.skip("no committed layer-stages results")
    g = gemm_scaling(doc)
    assert len(g) and g[["grouped", "dense"]].gt(0).all().all()
    assert g["kept pairs"].between(0, 1).all()  # adaptive plans keep at most the native pairs
    t = stage_table(doc)
    assert t["layer"].notna().all() and (t.index.get_level_values("plan") == "native").sum() == len(g["shape"].unique())


def _gemm(plan, us, bm=64, tma=False, kernel="gate_up", persistent=None, flatten=None):
    row = {"shape": "olmoe", "T": 4096, "plan": plan, "kernel": kernel, "BLOCK_M": bm, "BLOCK_N": 64,
           "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 16, "TMA": tma, "time_us": us}
    if persistent is not None:  # runs before the persistent programs have no PERSISTENT key
        row["PERSISTENT"] = persistent
    if flatten is not None:  # nor FLATTEN, before 1154eea
        row["FLATTEN"] = flatten
    return row


def test_least_regret_serves_every_plan():
    """Not the fastest on one plan: the one whose worst slowdown over the plans is smallest."""
    rows = [_gemm("native", 100.0, bm=128), _gemm("adaptive", 90.0, bm=128),  # native best, adaptive 1.5x
            _gemm("native", 110.0, bm=64), _gemm("adaptive", 66.0, bm=64),  # 1.1x, 1.1x
            _gemm("native", 105.0, bm=64, tma=True), _gemm("adaptive", 60.0, bm=64, tma=True)]  # 1.05x, best
    assert least_regret(rows) == (64, 64, 64, 4, 3, 16, True, False, False)
    assert least_regret(rows[:2]) == (128, 64, 64, 4, 3, 16, False, False, False)
    with pytest.raises(ValueError, match="rows="):
        least_regret([])


def test_expert_gemms_table():
    rows = [_gemm("native", 100.0, bm=128), _gemm("adaptive", 90.0, bm=128),
            _gemm("native", 110.0, tma=True), _gemm("adaptive", 66.0, tma=True),
            {"shape": "olmoe", "T": 4096, "plan": "native", "kernel": "gate_up", "cutlass": True, "time_us": 95.0},
            {"shape": "olmoe", "T": 4096, "plan": "adaptive", "kernel": "gate_up", "cutlass": True, "time_us": 80.0}]
    t = expert_gemms({"rows": rows}).set_index("plan")
    assert t.loc["native", "cutlass"] == 95.0 and t.loc["native", "triton_pointer"] == 100.0
    assert t.loc["adaptive", "triton_tma"] == 66.0 and t.loc["adaptive", "tuned"] == 66.0
    assert t.loc["native", "tuned"] == 110.0 and t.loc["native", "tuned_config"] == "64x64x64 w4 s3 tma"
    assert t["triton_persistent"].isna().all() and t["triton_flatten"].isna().all()  # not timed in this older run

    rows += [_gemm("native", 104.0, tma=True, persistent=True), _gemm("adaptive", 62.0, tma=True, persistent=True)]
    t = expert_gemms({"rows": rows}).set_index("plan")
    assert t.loc["adaptive", "triton_tma"] == 66.0 and t.loc["adaptive", "triton_persistent"] == 62.0
    assert t.loc["native", "tuned"] == 104.0 and t.loc["native", "tuned_config"] == "64x64x64 w4 s3 tma persistent"

    rows += [_gemm("native", 103.0, tma=True, persistent=True, flatten=True),
             _gemm("adaptive", 63.0, tma=True, persistent=True, flatten=True)]
    t = expert_gemms({"rows": rows}).set_index("plan")
    assert t.loc["adaptive", "triton_persistent"] == 62.0 and t.loc["adaptive", "triton_flatten"] == 63.0
    assert t.loc["native", "tuned_config"] == "64x64x64 w4 s3 tma persistent flatten"  # worst 1.03x, persistent 1.04x


def test_committed_experts_tune_picks_what_grouped_tuned_holds():
    """The tuned picks in the committed experts-tune file are the configurations moelab.kernels.grouped.TUNED
    holds for the H200 (per GEMM shape), and the table has a row per shape, plan and kernel."""
    from moelab.kernels import grouped as gk

    doc = results.load_results("experts-tune", fallback=True)
    t = expert_gemms(doc)
    plans = {(r["shape"], r["plan"]) for r in doc["rows"]}  # native, terciles and (k > 2) median policy
    assert len(plans) == 8 and len(t) == 2 * len(plans)
    assert t[["cutlass", "triton_pointer", "triton_tma", "tuned"]].notna().all().all()
    shapes = {"mixtral": (4096, 14336), "olmoe": (2048, 1024), "qwen15": (2048, 1408)}
    for (shape, kernel), g in t.groupby(["shape", "kernel"]):
        cfg = gk.TUNED["NVIDIA H200"][shapes[shape]][0][1][kernel]
        want = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
        want += (" tma" if cfg["TMA"] else "") + (" persistent" if cfg.get("PERSISTENT") else "")
        want += " flatten" if cfg.get("FLATTEN") else ""
        assert set(g["tuned_config"]) == {want}


def test_grouped_tuned_is_the_tuning_tables_rule_applied_to_the_committed_run():
    """benchmarks/moe_kernels.py's tuned_experts_table on the committed experts-tune rows gives
    moelab.kernels.grouped.TUNED for the H200: every shape, each GEMM's launch keys (a key TUNED leaves out is off)
    and beats_cutlass, which decides whether set_gemm('auto') takes the Triton GEMMs at many rows per expert."""
    import sys

    from moelab.kernels import grouped as gk
    from moelab.kernels.report import GEMM_KEYS

    sys.path.insert(0, str(results.REPO / "benchmarks"))
    import moe_kernels as mk

    def norm(table):
        return {shape: [(n, {**{g: {k: e[g].get(k, False) for k in GEMM_KEYS} for g in ("gate_up", "down")},
                             "beats_cutlass": e["beats_cutlass"]}) for n, e in entries]
                for shape, entries in table.items()}

    got = mk.tuned_experts_table(results.load_results("experts-tune")["rows"])
    want = gk.TUNED["NVIDIA H200"]
    assert norm(got) == norm(want)


def test_wide_router_launches_are_the_committed_tuning_runs_fastest():
    """For the 256- and 512-expert routers, moelab.kernels.routing.TUNED holds, at every tuned T, the fastest
    launch of the committed routing-tune-wide run (one E per key: least regret is the fastest), and the
    committed routing-wide run used those launches (its command tuned them in the same process)."""
    import pandas as pd

    from moelab.kernels import pow2
    from moelab.kernels import routing as kr

    doc = results.load_results("routing-tune-wide")
    rows = pd.DataFrame(doc["rows"])
    assert set(zip(rows.E, rows.k)) == {(256, 8), (512, 10)}
    table = kr.TUNED["NVIDIA H200"]
    for (E, k, T), g in rows.groupby(["E", "k", "T"]):
        best = g.loc[g.graph_us.idxmin()]
        entry = next(cfg for upto, cfg in table[(pow2(E), pow2(k))] if T <= upto)
        assert (entry["select"], entry["warps"], entry["tile"], entry["split"]) == (
            best.select, best.warps, best.tile, best.split), (E, T)
    wide = results.load_results("routing-wide")
    assert "--tune-routing-shapes 256:8,512:10" in wide["command"] and wide["commit"] == doc["commit"]


def test_h100_tables_are_the_tuning_rule_applied_to_its_own_runs():
    """The H100's TUNED tables (routing and expert GEMMs) are what the tuning rules (tuned_table,
    tuned_experts_table) give on its own committed runs (side runs: archive/*-20261205-h100.json.xz), which
    ran on an H100 and timed every selection and plan."""
    import sys

    from moelab.kernels import grouped as gk
    from moelab.kernels import routing as kr

    sys.path.insert(0, str(results.REPO / "benchmarks"))
    import moe_kernels as mk

    name = "NVIDIA H100 80GB HBM3"
    archive = results.REPO / "data" / "results" / "archive"
    routing = results.read_file(archive / "routing-tune-20261205-h100.json.xz")
    gemms = results.read_file(archive / "experts-tune-20261205-h100.json.xz")
    assert routing["machine"]["device"] == gemms["machine"]["device"] == name
    assert {r["select"] for r in routing["rows"]} >= {"rounds", "bitonic", "split", "rowwise", "rowsort"}
    assert mk.tuned_table(routing["rows"]) == kr.TUNED[name]
    assert {(r["shape"], r["plan"]) for r in gemms["rows"]} == {(r["shape"], r["plan"]) for r in
                                                               results.load_results("experts-tune")["rows"]}
    got = mk.tuned_experts_table(gemms["rows"])
    assert got.keys() == gk.TUNED[name].keys()
    for shape, [(n, entry)] in got.items():
        [(n_want, want)] = gk.TUNED[name][shape]
        assert n == n_want and entry["beats_cutlass"] == want["beats_cutlass"]
        for g in ("gate_up", "down"):  # a key TUNED leaves out is off
            assert {k: v for k, v in entry[g].items() if v} == {k: v for k, v in want[g].items() if v}, (shape, g)


def test_tuned_few_table_weighs_every_plan_and_token_count():
    """tuned_few_table picks, per shape and kernel, the configuration with the smallest worst slowdown over every
    (plan, T) case, and reports the current FEW_ROWS[0] launch's worst slowdown beside it; CUTLASS rows are not
    candidates."""
    import sys

    from moelab.kernels import grouped as gk

    sys.path.insert(0, str(results.REPO / "benchmarks"))
    import moe_kernels as mk

    cur = {"GROUP_M": 1, "TMA": False, "PERSISTENT": False, "FLATTEN": False, **gk.FEW_ROWS[0][1]["down"]}  # as timed
    wide = {**cur, "BLOCK_M": 32}
    times = {(16, "native"): (100.0, 102.0), (64, "native"): (140.0, 100.0), (64, "adaptive"): (100.0, 101.0)}
    rows = []
    for (T, plan), (t_cur, t_wide) in times.items():
        base = {"shape": "mixtral", "T": T, "plan": plan, "kernel": "down"}
        rows += [{**base, **cur, "time_us": t_cur}, {**base, **wide, "time_us": t_wide},
                 {**base, "cutlass": True, "time_us": 10.0}]
    entry = mk.tuned_few_table(rows)[(4096, 14336)]["down"]
    assert entry["BLOCK_M"] == 32 and entry["regret"] == 1.02 and entry["current_regret"] == 1.4
    assert "gate_up" not in mk.tuned_few_table(rows)[(4096, 14336)]


def test_h100_few_row_launches_are_the_tuning_rule_applied_to_its_runs():
    """grouped.FEW_TUNED for the H100 is what tuned_few_table gives on its tune-few runs: the Mixtral-like shape
    from the run with 32-row tiles, where the current 16-row launch was over 1.3x the best at T = 64 (an expert
    gets more than 16 rows and its weights are read twice), the other shapes from the 16-row run."""
    import sys

    from moelab.kernels import grouped as gk
    from moelab.kernels.report import GEMM_KEYS

    sys.path.insert(0, str(results.REPO / "benchmarks"))
    import moe_kernels as mk

    name, mixtral = "NVIDIA H100 80GB HBM3", (4096, 14336)
    archive = results.REPO / "data" / "results" / "archive"
    first = results.read_file(archive / "experts-tune-few-20261205-h100.json.xz")
    mix = results.read_file(archive / "experts-tune-few-20261205-h100-mixtral.json.xz")
    assert first["machine"]["device"] == mix["machine"]["device"] == name
    assert {r["T"] for r in first["rows"]} == {r["T"] for r in mix["rows"]} == {16, 64}
    got = {**mk.tuned_few_table(first["rows"]), **mk.tuned_few_table(mix["rows"])}
    assert got.keys() == gk.FEW_TUNED[name].keys() and {r["shape"] for r in mix["rows"]} == {"mixtral"}
    off = {"GROUP_M": 1, "TMA": False, "PERSISTENT": False, "FLATTEN": False}
    for shape, entry in got.items():
        for g in ("gate_up", "down"):
            want = {**off, **gk.FEW_ROWS[0][1][g], **gk.FEW_TUNED[name][shape][g]}
            assert {k: entry[g][k] for k in GEMM_KEYS} == {k: want[k] for k in GEMM_KEYS}, (shape, g)
            assert entry[g]["regret"] <= entry[g]["current_regret"]
            if shape == mixtral:
                assert entry[g]["current_regret"] > 1.3 and entry[g]["BLOCK_M"] == 32
    assert mk.few_entries(got) == gk.FEW_TUNED[name]  # the form the tune-few part installs for a layer part after it


def test_h200_few_row_launches_are_the_tuning_rule_applied_to_its_run():
    """grouped.FEW_TUNED for the H200 is few_entries(tuned_few_table) of its one tune-few run (every candidate, 32-row
    tiles included): the Mixtral-like shape takes 32-row tiles, where the 16-row launch was over 1.4x the best."""
    import sys

    from moelab.kernels import grouped as gk

    sys.path.insert(0, str(results.REPO / "benchmarks"))
    import moe_kernels as mk

    name = "NVIDIA H200"
    archive = results.REPO / "data" / "results" / "archive"
    doc = results.read_file(archive / "experts-tune-few-20261205-h200-few.json.xz")
    assert doc["machine"]["device"] == name and {r["T"] for r in doc["rows"]} == {16, 64}
    got = mk.tuned_few_table(doc["rows"])
    assert mk.few_entries(got) == gk.FEW_TUNED[name]
    for shape, entry in got.items():
        for g in ("gate_up", "down"):
            assert entry[g]["regret"] <= entry[g]["current_regret"]
            if shape == (4096, 14336):
                assert entry[g]["current_regret"] > 1.4 and entry[g]["BLOCK_M"] == 32


def test_layer_targets_limit_and_rounds():
    """Adaptive over native at T = 4096 against 1.1 x kept/native; with interleaved rounds, the lowest, median
    and highest same-round ratio beside the ratio of medians."""
    def row(var, t, g, kept, rounds=None):
        r = {"shape": "olmoe", "T": 4096, "variant": var, "time_us": t, "graph_us": g, "kept_pairs": kept,
             "native_pairs": 100, "gemm_tiles_128": kept // 10, "gemm_tiles_64": kept // 5}
        if rounds:
            r["time_rounds_us"], r["graph_rounds_us"] = rounds
        return r

    rows = [row("moelab_topk", 100.0, 90.0, 100, ([100.0, 90.0, 110.0], [90.0, 90.0, 90.0])),
            row("moelab_adaptive", 65.0, 60.0, 60, ([65.0, 63.0, 70.0], [60.0, 60.0, 61.0])),
            row("hf_grouped_mm", 150.0, None, 100)]
    t = layer_targets({"rows": rows})
    native = t[t["target"].str.startswith("native")].iloc[0]
    assert native["measured"] == pytest.approx(100 / 150) and native["met"]
    eager = t[t["target"].str.contains("time_us")].iloc[0]
    assert eager["limit"] == pytest.approx(0.66) and eager["measured"] == pytest.approx(0.65) and eager["met"]
    assert eager["round_min"] == pytest.approx(70 / 110) and eager["round_max"] == pytest.approx(63 / 90)
    assert eager["round_median"] == pytest.approx(65 / 100)  # the middle of 0.636, 0.65, 0.7
    graph = t[t["target"].str.contains("graph_us")].iloc[0]
    assert graph["measured"] == pytest.approx(60 / 90) and not graph["met"]  # 0.667 > 0.66
    rows[0].pop("time_rounds_us")  # runs before the rounds: no spread
    assert layer_targets({"rows": rows})["round_min"].isna().sum() == 2  # the hf row and the eager ratio


def test_layout_sweep_table():
    """The rule's row (the first when Q is cut and several rows are the rule's) beside the fastest row."""
    def row(q, used, w, us, pick):
        return {"shape": "olmoe", "E": 64, "T": 512, "block_slots": q, "block_slots_used": used, "warps": w,
                "graph_us": us, "rule_pick": pick, "rule_block_slots": 128, "rule_warps": 1}

    doc = {"rows": [row(128, 128, 1, 6.6, True), row(256, 256, 2, 6.0, False), row(512, 512, 4, 7.0, False)]}
    t = layout_sweep(doc).iloc[0]
    assert (t["rule"], t["rule_us"], t["fastest"], t["fastest_us"]) == ("128 w1", 6.6, "256 w2", 6.0)
    assert t["rule_over_fastest"] == pytest.approx(1.1)


def test_committed_layout_sweep_matches_the_layout_rule():
    """The committed sweep was run with the rule moelab.kernels.layout holds now: its rule column is what
    launch_config gives for every shape and T, and the rule's row is there."""
    import moelab.kernels.layout as lk

    doc = results.load_results("pair-layout-sweep")
    t = layout_sweep(doc)
    assert len(t) >= 20 and t["rule_us"].notna().all() and (t["rule_over_fastest"] >= 1.0).all()
    k = {r["shape"]: r["k"] for r in doc["rows"]}
    for r in t.itertuples():
        q, w, _ = lk.launch_config(r.T * k[r.shape], r.E)
        assert r.rule == f"{q} w{w}"


def test_layer_targets_count_a_shared_expert_as_kept_pairs():
    """A shared expert of width 4 F does four routed experts' work per token that never shrinks: the second
    row's bound is 1.1 x (kept + 4 T) / (native + 4 T); routed-only rows get no such row."""
    def row(var, t, kept, shared=4096):
        return {"shape": "qwen15", "T": 100, "variant": var, "time_us": t, "graph_us": None, "kept_pairs": kept,
                "native_pairs": 400, "gemm_tiles_128": 4, "F": 1024, "shared_ffn": shared}

    rows = [row("moelab_topk", 100.0, 400), row("moelab_adaptive", 80.0, 240), row("hf_grouped_mm", 150.0, 400),
            row("moelab_topk_routed_only", 50.0, 400), row("moelab_adaptive_routed_only", 31.0, 240)]
    t = layer_targets({"rows": rows}, tokens=100).set_index("target")
    plain = t.loc["moelab_adaptive / native layer time_us (kept 0.600, 128-row tiles 1.000)"]
    assert plain["measured"] == pytest.approx(0.8) and not plain["met"]  # 0.8 > 1.1 x 0.6
    shared = t.loc["moelab_adaptive, shared expert as kept pairs / native layer time_us (kept 0.800: 4 per token)"]
    assert shared["limit"] == pytest.approx(1.1 * 640 / 800) and shared["met"]
    assert sum("shared expert" in x for x in t.index) == 1  # none for the routed-only rows
    routed = t.loc["moelab_adaptive_routed_only / native layer time_us (kept 0.600, 128-row tiles 1.000)"]
    assert routed["measured"] == pytest.approx(31 / 50) and routed["met"]  # native layer: routed experts only


def test_layer_runs_side_by_side():
    """One column per run that routed the same pairs as the newest, labelled by commit, beside the newest
    limit; a run with other kept pairs (another seed or policy) is left out."""
    def doc(sha, created, nat, ada, kept=60):
        rows = [{"shape": "olmoe", "T": 4096, "variant": v, "time_us": t, "graph_us": t, "kept_pairs": k,
                 "native_pairs": 100, "gemm_tiles_128": k // 10, "gemm_tiles_64": k // 5}
                for v, t, k in (("moelab_topk", nat, 100), ("moelab_adaptive", ada, kept),
                                ("hf_grouped_mm", 200.0, 100))]
        return {"commit": sha + "0" * 33, "created": created, "rows": rows}

    docs = [doc("aaaaaaa", "1", 100.0, 70.0, kept=50), doc("bbbbbbb", "2", 100.0, 65.0),
            doc("ccccccc", "3", 100.0, 68.0), doc("ccccccc", "2026-11-30T23:10:00", 100.0, 64.0)]
    t = layer_runs(docs)
    assert list(t.columns) == ["limit", "bbbbbbb", "ccccccc", "ccccccc 2026-11-30T23:10"]  # aaaaaaa: other pairs
    row = t.loc[("olmoe", "moelab_adaptive / native layer time_us (kept 0.600, 128-row tiles 0.600)")]
    assert row["limit"] == pytest.approx(0.66) and row["bbbbbbb"] == pytest.approx(0.65)
    assert row["ccccccc 2026-11-30T23:10"] == pytest.approx(0.64)
    from moelab.kernels.report import run_docs

    # the runs behind the columns are the ones kept, even where a left-out run shares a commit
    docs.insert(0, doc("bbbbbbb", "0", 100.0, 70.0, kept=50))
    t = layer_runs(docs)
    assert [d["created"] for d in run_docs(t)] == ["2", "3", "2026-11-30T23:10:00"]
    with pytest.raises(ValueError, match="attrs"):
        run_docs(type(t)(t.values))  # a frame rebuilt from the values has no record of the runs
    with pytest.raises(ValueError, match="docs="):
        layer_runs([])


def test_layer_runs_one_row_per_variant_across_tile_records():
    """An older run without 64-row tile counts names its target with 128-row tiles: still one row per
    (shape, variant, timer), named by the newest run, with the newest limit."""
    def doc(sha, created, ada, tiles64=True):
        rows = [{"shape": "olmoe", "T": 4096, "variant": v, "time_us": t, "graph_us": t, "kept_pairs": k,
                 "native_pairs": 100, "gemm_tiles_128": k // 10, **({"gemm_tiles_64": k // 5} if tiles64 else {})}
                for v, t, k in (("moelab_topk", 100.0, 100), ("moelab_topk_triton", 100.0, 100),
                                ("moelab_adaptive_triton", ada, 60))]
        return {"commit": sha + "0" * 33, "created": created, "rows": rows}

    t = layer_runs([doc("aaaaaaa", "1", 66.0, tiles64=False), doc("bbbbbbb", "2", 64.0)])
    assert len(t) == 2 and t["limit"].notna().all()  # eager and graph, each one row
    row = t.loc[("olmoe", "moelab_adaptive_triton / native layer time_us (kept 0.600, 64-row tiles 0.600)")]
    assert row["aaaaaaa"] == pytest.approx(0.66) and row["bbbbbbb"] == pytest.approx(0.64)


def test_layer_runs_like_picks_the_pairs():
    """like=i keeps the runs that routed docs[i]'s pairs, whichever run is newest; a bad index is named."""
    def doc(sha, ada, kept):
        rows = [{"shape": "olmoe", "T": 4096, "variant": v, "time_us": t, "graph_us": t, "kept_pairs": k,
                 "native_pairs": 100, "gemm_tiles_128": k // 10, "gemm_tiles_64": k // 5}
                for v, t, k in (("moelab_topk", 100.0, 100), ("moelab_adaptive", ada, kept))]
        return {"commit": sha + "0" * 33, "created": sha, "rows": rows}

    docs = [doc("aaaaaaa", 70.0, 60), doc("bbbbbbb", 66.0, 60), doc("ccccccc", 64.0, 58)]
    assert list(layer_runs(docs, like=0).columns) == ["limit", "aaaaaaa", "bbbbbbb"]
    assert list(layer_runs(docs).columns) == ["limit", "ccccccc"]
    assert list(layer_runs(docs, like=None).columns) == ["limit", "aaaaaaa", "bbbbbbb"]  # the most runs
    with pytest.raises(ValueError, match="like=3"):
        layer_runs(docs, like=3)
    # like=None with as many runs on each pairs: the newest group (the later runs in the list)
    tie = [doc("aaaaaaa", 70.0, 60), doc("bbbbbbb", 66.0, 58)]
    assert list(layer_runs(tie, like=None).columns) == ["limit", "bbbbbbb"]
    assert list(layer_runs(tie[::-1], like=None).columns) == ["limit", "aaaaaaa"]


def test_batch_targets_per_input_batch():
    """Batch 0 from the rows (only the variants the further batches time), batches 1.. from doc['batches']:
    each batch's ratio against its own kept pairs; the summary counts the batches that met the bound."""
    def row(var, t, kept, batch=None):
        r = {"shape": "mixtral", "T": 4096, "variant": var, "time_us": t, "graph_us": t, "kept_pairs": kept,
             "native_pairs": 100, "gemm_tiles_128": kept // 10, "gemm_tiles_64": kept // 5}
        return r if batch is None else {**r, "batch": batch}

    doc = {"rows": [row("moelab_topk", 100.0, 100), row("moelab_adaptive", 83.0, 75), row("hf_grouped_mm", 150.0, 100),
                    row("moelab_topk_cutlass", 100.0, 100), row("moelab_adaptive_cutlass", 80.0, 75)],
           "batches": [row("moelab_topk", 100.0, 100, 1), row("moelab_adaptive", 80.0, 75, 1),
                       row("moelab_topk", 100.0, 100, 2), row("moelab_adaptive", 84.0, 76, 2)]}
    t = batch_targets(doc)
    assert sorted(t["batch"].unique()) == [0, 1, 2] and set(t["variant"]) == {"moelab_adaptive"}
    b2 = t[(t["batch"] == 2) & (t["timer"] == "time_us")].iloc[0]
    assert b2["limit"] == pytest.approx(1.1 * 0.76) and not b2["met"]  # 0.84 > 0.836
    s = batch_summary(doc).set_index(["variant", "timer"]).loc[("moelab_adaptive", "time_us")]
    assert (s["met"], s["batches"]) == (1, 3)  # 0.80 <= 0.825; 0.83 and 0.84 above their bounds
    assert s["ratio_min"] == pytest.approx(0.80) and s["ratio_max"] == pytest.approx(0.84)
    assert batch_targets({"rows": doc["rows"]}).empty and batch_summary({"rows": doc["rows"]}).empty


def test_decode_table_compares_decode_sizes_of_batch_zero():
    """Only T in (1, 16, 64) and batch 0; the time ratio beside the shares of pairs kept and experts used."""
    def row(var, T, t, kept, used, batch=0):
        return {"shape": "olmoe", "T": T, "batch": batch, "variant": var, "time_us": t, "graph_us": t / 2,
                "kept_pairs": kept, "native_pairs": 8 * T, "experts_used": used}

    doc = {"rows": [row("moelab_topk", 16, 200.0, 128, 59), row("moelab_adaptive", 16, 160.0, 66, 44),
                    row("hf_grouped_mm", 16, 400.0, 128, 59), row("moelab_topk", 4096, 900.0, 32768, 64),
                    row("moelab_adaptive", 4096, 600.0, 19000, 64), row("moelab_topk", 64, 220.0, 512, 64, batch=1)]}
    t = decode_table(doc)
    assert list(zip(t["shape"], t["T"])) == [("olmoe", 16)]  # T = 4096 is not a decode size; T = 64 has batch 1 only
    r = t.iloc[0]
    assert r["time_ratio_eager"] == pytest.approx(0.8) and r["time_ratio_graph"] == pytest.approx(0.8)
    assert r["native_graph_us"] == 100.0 and r["kept_pairs_ratio"] == pytest.approx(66 / 128)
    assert (r["experts_native"], r["experts_adaptive"]) == (59, 44)
    assert r["experts_used_ratio"] == pytest.approx(44 / 59)


def test_committed_h200_decode_run_saves_only_where_experts_go_unused():
    """The README's decode item on the H200's run of its decode launch: with every expert still used the adaptive
    layer takes the native time (within 1%, though it keeps 74-81% of the pairs); with experts unused it saves."""
    doc = results.read_file(results.REPO / "data/results/archive/moe-layer-20261206-h200-decode.json.xz")
    assert doc["machine"]["device"] == "NVIDIA H200"
    t = decode_table(doc)
    assert len(t) == 6
    full = t[t["experts_used_ratio"] == 1]
    assert len(full) == 3 and (full["time_ratio_graph"] - 1).abs().max() < 0.01
    assert full["kept_pairs_ratio"].max() < 0.82
    part = t[t["experts_used_ratio"] < 1]
    assert (part["time_ratio_graph"] < 0.97).all()


def test_power_trace_summary(tmp_path):
    """Share of nvidia-smi samples at the software power cap (reason bit 0x4), clock and power there; idle
    samples (0x1) count in the share's denominator but not among the 'other' clocks."""
    lines = ["timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active"]
    for mhz, w, reason in ((1980, 300.0, 0), (1500, 700.0, 4), (1700, 690.0, 4), (345, 80.0, 1), (1980, 500.0, 0)):
        lines.append(f"2026/11/30 23:00:00.000, {mhz} MHz, {w} W, 40, 0x{reason:016x}")
    path = tmp_path / "smi.csv"
    path.write_text("\n".join(lines) + "\n")
    p = power_trace(path)
    assert p["samples"] == 5 and p["capped_share"] == pytest.approx(0.4)
    assert p["capped_mhz"] == (1500.0, 1600.0, 1700.0) and p["capped_watts_median"] == pytest.approx(695.0)
    assert p["other_mhz"] == (1980.0, 1980.0, 1980.0)
    committed = sorted((results.REPO / "data" / "results" / "logs").glob("smi-trace-*.csv.xz"))  # as committed
    assert committed and all(0 < power_trace(f)["capped_share"] < 1 for f in committed)


def test_layer_targets_tile_share_follows_the_path_the_run_took():
    """The tile share beside a ratio counts the row tiles of the variant's expert path: 'auto' goes Triton where
    the run's tuned entry beats CUTLASS, and the Triton path's tiles are its tuned gate_up BLOCK_M (64 without a
    table); CUTLASS rows are 128-row tiles."""
    def row(var, kept, D=2048, F=1024):
        return {"shape": "s", "T": 4096, "variant": var, "time_us": float(kept), "graph_us": None, "D": D, "F": F,
                "kept_pairs": kept, "native_pairs": 100, "gemm_tiles_128": kept // 10, "gemm_tiles_64": kept // 4}

    rows = [row(v, 100) for v in ("moelab_topk", "moelab_topk_triton", "moelab_topk_cutlass")]
    rows += [row(v, 60) for v in ("moelab_adaptive", "moelab_adaptive_triton", "moelab_adaptive_cutlass")]

    def tiles(tuned):
        t = layer_targets({"rows": rows, "experts_tuned": tuned}).dropna(subset=["variant"]).set_index("variant")
        return {v: (t.loc[v, "target"].split(", ")[1].rstrip(")"), t.loc[v, "tiles"]) for v in t.index}

    gu = {"gate_up": {"BLOCK_M": 64}, "down": {"BLOCK_M": 64}}
    got = tiles({"(2048, 1024)": [[2**62, {**gu, "beats_cutlass": True}]]})
    assert got["moelab_adaptive"] == ("64-row tiles 0.600", 15 / 25)
    assert got["moelab_adaptive_cutlass"] == ("128-row tiles 0.600", 6 / 10)
    got = tiles({"(2048, 1024)": [[2**62, {"gate_up": {"BLOCK_M": 128}, "down": {}, "beats_cutlass": False}]]})
    assert got["moelab_adaptive"][0].startswith("128") and got["moelab_adaptive_triton"][0].startswith("128")
    # a tuned entry that does not beat CUTLASS: 'auto' stays on CUTLASS (128-row tiles) whatever its BLOCK_M;
    # the pinned Triton path takes the entry's 64-row tiles
    got = tiles({"(2048, 1024)": [[2**62, {**gu, "beats_cutlass": False}]]})
    assert got["moelab_adaptive"] == ("128-row tiles 0.600", 6 / 10)
    assert got["moelab_adaptive_triton"] == ("64-row tiles 0.600", 15 / 25)
    got = tiles(None)
    assert got["moelab_adaptive"][0].startswith("128") and got["moelab_adaptive_triton"][0].startswith("64")


def test_policy_k_and_runs_line_read_what_the_rows_say():
    """A layer row's policy text gives its k values for a legend; several runs give one caption naming every
    machine field's values, the commits and the dates, and bad input is refused naming it."""
    from moelab.kernels.report import policy_k, runs_line

    assert policy_k("EntropyAdaptiveK(k_values=(1, 2), thresholds=(0.5,), renormalize=None)") == "k=(1, 2)"
    assert policy_k("TopK(k=8, renormalize=None)") == "k=8"
    with pytest.raises(ValueError, match="policy='RatioSkip'"):
        policy_k("RatioSkip")
    m = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.17"}
    docs = [{"machine": m, "commit": "abc1234ff", "created": "2026-11-30T10:00"},
            {"machine": m, "commit": "def5678aa", "created": "2026-12-01T09:00"}]
    line = runs_line(docs)
    assert "NVIDIA H200" in line and "2 runs, 2 commits, abc1234 to def5678" in line
    assert "2026-11-30 to 2026-12-01" in line
    line = runs_line(docs[::-1])  # given newest first: the span still runs from the earliest date
    assert "2026-11-30 to 2026-12-01" in line and "2 commits, def5678 to abc1234" in line
    assert runs_line(docs[:1]).endswith("1 runs, abc1234 · 2026-11-30")
    with pytest.raises(ValueError, match="docs=\\[\\]"):
        runs_line([])


def test_layer_targets_of_a_run_without_the_target_size_keep_their_columns():
    """A quick run that leaves out T = 4096 has only the hf comparison rows; the adaptive rows' columns are
    there (empty), so the notebook's selection by variant and timer finds nothing instead of failing."""
    doc = results.load_results("moe-layer")
    quick = dict(doc, rows=[r for r in doc["rows"] if r["T"] != 4096])
    lt = layer_targets(quick)
    assert len(lt) and {"variant", "timer", "kept", "tiles"} <= set(lt.columns) and lt["variant"].isna().all()
    assert lt[(lt["variant"] == "moelab_adaptive") & (lt["timer"] == "time_us")].empty
    assert (layer_targets(doc)["variant"] == "moelab_adaptive").any()


def test_report_tables_refuse_another_topics_document():
    """Each table reads one topic: another topic's document, one without rows, or rows without the table's
    columns raise naming the topic expected and what was given; machine_line names the fields it lacks."""
    routing = {"topic": "routing-kernel", "rows": [{"shape": "s", "T": 1, "method": "m", "E": 8}]}
    for table, topic in ((layer_targets, "moe-layer"), (stage_table, "layer-stages"), (expert_gemms, "experts-tune"),
                         (layout_sweep, "pair-layout-sweep")):
        with pytest.raises(ValueError, match=f"doc of topic 'routing-kernel': needs a results document of topic "
                                             f"'{topic}'"):
            table(routing)
    with pytest.raises(ValueError, match="doc of topic 'moe-layer': needs a results document of topic 'routing-k"):
        routing_targets({**routing, "topic": "moe-layer"})
    with pytest.raises(ValueError, match=r"doc \(keys \[\]\): needs a results document of topic 'routing-kernel', "
                                         "with a 'rows' list"):
        routing_targets({})
    with pytest.raises(ValueError, match=r"its rows lack \['method', 'E'\] \(have \['shape', 'T'\]\): not "
                                         "'routing-kernel' rows"):
        routing_targets({"rows": [{"shape": "s", "T": 1}]})
    with pytest.raises(TypeError, match="doc: a list, needs a results document"):
        layer_targets([])
    with pytest.raises(ValueError, match=r"lacks \['machine', 'commit', 'created'\]"):
        machine_line({})


def test_machine_line_says_when_a_run_borrowed_or_lacked_tuned_launches():
    """The H100 runs with the H200's tables say so (their `tuned_on`); a run on its own tables, or from before the
    field, shows the plain line."""
    h100 = results.read_file(results.results_dir() / "archive" / "routing-kernel-20261205-h100.json.xz")
    assert machine_line(h100) == ("NVIDIA H100 80GB HBM3 · torch 2.11.0+cu130 · triton 3.6.0 · transformers 5.17.0 · "
                                  "commit bb8ca2d · 2026-12-05 · routing launches tuned on NVIDIA H200 · experts "
                                  "launches tuned on NVIDIA H200")
    plain = machine_line({**h100, "tuned_on": {"routing": "NVIDIA H100 80GB HBM3"}})
    assert plain.endswith("commit bb8ca2d · 2026-12-05")
    assert machine_line({k: v for k, v in h100.items() if k != "tuned_on"}) == plain
    assert machine_line({**h100, "tuned_on": {"experts": None}}).endswith("2026-12-05 · experts launches untuned")
