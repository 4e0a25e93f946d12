"""notebooks/kernel_report.py: the target checks and the kernel tables, on small documents built here (rows as the
benchmarks write them) and on the current committed results; and the tuning rules of benchmarks/moe_kernels.py
against the committed tuning runs and the tuned tables in lib/moelab/kernels/configs."""

import sys

import pytest

from moelab import results

sys.path.insert(0, str(results.REPO / "notebooks"))
sys.path.insert(0, str(results.REPO / "benchmarks"))
import moe_kernels as mk  # noqa: E402
from kernel_report import (  # noqa: E402
    GEMM_KEYS,
    STAGES,
    batch_summary,
    batch_targets,
    decode_table,
    expert_gemms,
    gemm_scaling,
    layer_targets,
    layout_sweep,
    least_regret,
    machine_line,
    routing_targets,
    stage_paths,
    stage_table,
    stage_time,
)

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def committed(topic: str) -> dict:
    """The current results of `topic` (results.load_results); skipped where this checkout has none."""
    try:
        return results.load_results(topic)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def launches(entries: list, tokens) -> list:
    """The launch a tuned table's entries [(T up to, launch)] give at each T."""
    return [next(c for n, c in entries if T <= n) for T in tokens]


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




def _gemm(plan, us, bm=64, tma=False, kernel="gate_up", persistent=None, flatten=None):
    row = {"shape": "olmoe", "T": 4096, "plan": plan, "kernel": kernel, "BLOCK_M": bm, "BLOCK_N": 64,
           "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 16, "TMA": tma, "time_us": us}
    if persistent is not None:  # runs before the persistent programs have no PERSISTENT key
        row["PERSISTENT"] = persistent
    if flatten is not None:
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
    assert t["triton_persistent"].isna().all() and t["triton_flatten"].isna().all()  # not timed in this run

    rows += [_gemm("native", 104.0, tma=True, persistent=True), _gemm("adaptive", 62.0, tma=True, persistent=True)]
    t = expert_gemms({"rows": rows}).set_index("plan")
    assert t.loc["adaptive", "triton_tma"] == 66.0 and t.loc["adaptive", "triton_persistent"] == 62.0
    assert t.loc["native", "tuned"] == 104.0 and t.loc["native", "tuned_config"] == "64x64x64 w4 s3 tma persistent"

    rows += [_gemm("native", 103.0, tma=True, persistent=True, flatten=True),
             _gemm("adaptive", 63.0, tma=True, persistent=True, flatten=True)]
    t = expert_gemms({"rows": rows}).set_index("plan")
    assert t.loc["adaptive", "triton_persistent"] == 62.0 and t.loc["adaptive", "triton_flatten"] == 63.0
    assert t.loc["native", "tuned_config"] == "64x64x64 w4 s3 tma persistent flatten"  # worst 1.03x, persistent 1.04x




def test_tuned_few_table_weighs_every_plan_and_token_count():
    """tuned_few_table picks, per shape and kernel, the configuration with the smallest worst slowdown over every
    (plan, T) case, and reports the current FEW_ROWS[0] launch's worst slowdown beside it; CUTLASS rows are not
    candidates."""
    from moelab.kernels import grouped as gk

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

    doc = committed("pair-layout-sweep")
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




def test_layer_targets_of_a_run_without_the_target_size_keep_their_columns():
    """A quick run that leaves out T = 4096 has only the hf comparison rows; the adaptive rows' columns are
    there (empty), so the notebook's selection by variant and timer finds nothing instead of failing."""
    doc = committed("moe-layer")
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
    """A run with another device's tables, or none, says so (its `tuned_on`); a run on its own tables, or one
    without the field, shows the plain line; a document without machine, commit or date is refused."""
    m = {"device": H100, "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
    doc = {"machine": m, "commit": "0123456789abcdef", "created": "2026-12-05T10:00:00+00:00",
           "tuned_on": {"routing": H200, "experts": H200}}
    plain = f"{H100} · torch 2.11.0 · triton 3.6.0 · transformers 5.17.0 · commit 0123456 · 2026-12-05"
    assert machine_line(doc) == plain + f" · routing launches tuned on {H200} · experts launches tuned on {H200}"
    assert machine_line({**doc, "tuned_on": {"routing": H100}}) == plain
    assert machine_line({k: v for k, v in doc.items() if k != "tuned_on"}) == plain
    assert machine_line({**doc, "tuned_on": {"experts": None}}) == plain + " · experts launches untuned"


# ---------------------------------------------------------------- the current committed results


def test_committed_layer_stages():
    doc = committed("layer-stages")
    g = gemm_scaling(doc)
    assert len(g) and g[["grouped", "dense"]].gt(0).all().all()
    assert g["kept pairs"].between(0, 1).all()  # adaptive plans keep at most the native pairs
    t = stage_table(doc)
    assert t["layer"].notna().all() and (t.index.get_level_values("plan") == "native").sum() == len(g["shape"].unique())


def test_committed_experts_tune_picks_what_the_grouped_table_holds():
    """The tuned picks of the committed experts-tune run are the H200's grouped table (per GEMM shape), its
    beats_cutlass flags are the rule's, and the report has a row per shape, plan and kernel."""
    from moelab.kernels import grouped as gk

    doc = committed("experts-tune")
    t = expert_gemms(doc)
    plans = {(r["shape"], r["plan"]) for r in doc["rows"]}  # native, terciles and (k > 2) median policy
    assert len(t) == 2 * len(plans)
    assert t[["cutlass", "triton_pointer", "triton_tma", "tuned"]].notna().all().all()
    shapes = {name: (D, F) for name, (D, F, *_rest) in mk.LAYERS.items()}
    for (shape, kernel), g in t.groupby(["shape", "kernel"]):
        cfg = gk.TUNED[H200][shapes[shape]][0][1][kernel]
        want = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
        want += (" tma" if cfg["TMA"] else "") + (" persistent" if cfg.get("PERSISTENT") else "")
        want += " flatten" if cfg.get("FLATTEN") else ""
        assert set(g["tuned_config"]) == {want}


def _same_gemm_table(got: dict, want: dict) -> None:
    """tuned_experts_table's picks against a device's grouped table: every shape, each GEMM's launch keys (a key
    the table leaves out is off) and beats_cutlass."""
    def norm(table):
        return {shape: [(n, {**{g: {k: e[g].get(k, False) for k in GEMM_KEYS} for g in ("gate_up", "down")},
                             "beats_cutlass": e["beats_cutlass"]}) for n, e in entries]
                for shape, entries in table.items()}

    assert norm(got) == norm(want)


@pytest.mark.parametrize("device,topic", [(H200, "experts-tune"), (H100, "experts-tune-h100")])
def test_grouped_tables_are_the_tuning_rule_applied_to_the_committed_runs(device, topic):
    """tuned_experts_table on a device's committed tune-gemm run gives its grouped table, which decides among
    other things whether set_gemm('auto') takes the Triton GEMMs at many rows per expert."""
    from moelab.kernels import grouped as gk

    doc = committed(topic)
    assert doc["machine"]["device"] == device
    _same_gemm_table(mk.tuned_experts_table(doc["rows"]), gk.TUNED[device])


@pytest.mark.parametrize("device,topics", [(H200, ("routing-tune", "routing-tune-wide")),
                                           (H100, ("routing-tune-h100",))])
def test_routing_tables_are_the_tuning_rule_applied_to_the_committed_runs(device, topics):
    """tuned_table on a device's committed routing tuning runs gives the launch its routing table holds at every
    T tuned and above (for the wide routers, one E per key, the fastest launch)."""
    from moelab.kernels import routing as kr

    for topic in topics:
        doc = committed(topic)
        assert doc["machine"]["device"] == device
        tokens = sorted({r["T"] for r in doc["rows"]}) + [10**9]
        for key, entries in mk.tuned_table(doc["rows"]).items():
            assert launches(entries, tokens) == launches(kr.TUNED[device][key], tokens), (topic, key)


@pytest.mark.parametrize("device,topics", [(H200, ("experts-tune-few",)),
                                           (H100, ("experts-tune-few-h100", "experts-tune-few-h100-mixtral"))])
def test_few_row_launches_are_the_tuning_rule_applied_to_the_committed_runs(device, topics):
    """A device's few_rows table is few_entries(tuned_few_table) of its tune-few runs (a later run's shapes over
    an earlier one's); each pick's worst slowdown is at most the FEW_ROWS[0] launch's, and the Mixtral-like shape,
    where an expert gets more than 16 rows at T = 64, takes 32-row tiles."""
    from moelab.kernels import grouped as gk

    got = {}
    for topic in topics:
        doc = committed(topic)
        assert doc["machine"]["device"] == device and {r["T"] for r in doc["rows"]} == {16, 64}
        got.update(mk.tuned_few_table(doc["rows"]))
    assert mk.few_entries(got) == gk.FEW_TUNED[device]
    for shape, entry in got.items():
        for g in ("gate_up", "down"):
            assert entry[g]["regret"] <= entry[g]["current_regret"]
            if shape == (4096, 14336):
                assert entry[g]["current_regret"] > 1.3 and entry[g]["BLOCK_M"] == 32


def test_committed_decode_run_saves_only_where_experts_go_unused():
    """At decode sizes the expert weights are read whatever the rows: with every expert still used the adaptive
    layer takes the native time (within 1%, though it keeps under 82% of the pairs); with experts unused it saves."""
    t = decode_table(committed("moe-layer-decode"))
    full = t[t["experts_used_ratio"] == 1]
    assert len(full) and (full["time_ratio_graph"] - 1).abs().max() < 0.01
    assert full["kept_pairs_ratio"].max() < 0.82
    part = t[t["experts_used_ratio"] < 1]
    assert len(part) and (part["time_ratio_graph"] < 0.97).all()
