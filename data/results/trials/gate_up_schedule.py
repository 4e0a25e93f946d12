"""Trial (data/results/trials/README.md): OLMoE-like layer, T = 4096, batches 0-4, native and terciles policy, with
gate_up launch variants (config overrides of grouped.TUNED) timed in CUDA graphs in turn (and eager for two of them),
the cost of a gate_up grid whose groups are all empty, and per-kernel profiles of the whole layer in a graph.
Ran at 9866a00 (DYNAMIC) as it stands; at 5869eee (TILES) and 774b68a (BY_EXPERT) with the variants their logs name.
Run from the repository root: PYTHONPATH=lib python data/results/trials/gate_up_schedule.py"""
import copy, functools, json, os, sys, time
import torch
sys.path.insert(0, "benchmarks")  # moe_kernels
from moe_kernels import LAYERS, hf_block, moelab_layer, layer_policies, layer_input, captured, interleaved_events_us, gemm_tiles
from moelab.kernels import grouped
from triton.testing import do_bench

OUT = os.environ.get("OUT", "/tmp")
res = {}
name = "olmoe"
D, Fd, E, k, renorm, shared = LAYERS[name]
block, cfg = hf_block(name, D, Fd, E, k, shared, "cuda")
ours = moelab_layer(block, renorm, shared)
pols = layer_policies(block, k, renorm, D)
dev = torch.device("cuda")
base_entry = copy.deepcopy(grouped.TUNED["NVIDIA H200"][(2048, 1024)])

# 3. gate_up variants inside the whole layer, graphs timed interleaved, batches 0..4
variants = {"cur": {}, "dyn": {"DYNAMIC": True}, "dyn_both": {"DYNAMIC": True}, "dyn_gm8": {"DYNAMIC": True, "GROUP_M": 8}}
entries = {}
for v, extra in variants.items():
    e = copy.deepcopy(base_entry); e[0][1]["gate_up"].update(extra); entries[v] = e
    if v == "dyn_both":
        e[0][1]["down"].update({"DYNAMIC": True, "FLATTEN": False})
def use(v):
    grouped.TUNED["NVIDIA H200"][(2048, 1024)] = entries[v]
    grouped._launch_config.cache_clear()
def eager(v, x, pol):
    use(v)
    return ours(x, pol)
xs = {b: layer_input(4096, D, b) for b in range(5)}
graphs, timers, ys, kept = {}, {}, {}, {}
for v, extra in variants.items():
    use(v)
    for b in range(5):
        x = xs[b]
        for p in ("native", "adaptive"):
            try:
                y, plan = ours(x, pols[p])
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print("variant", v, "failed", type(e).__name__, str(e)[:300], flush=True)
                break
            ys[v, b, p] = y
            kept[b, p] = (int(plan.k.sum()), gemm_tiles(plan, 64))
            g = captured(functools.partial(ours, pol=pols[p]), [x], 1)
            graphs[v, b, p] = g
            timers[f"{v}|{b}|{p}"] = g.replay
            if v in ("cur", "dyn") and b < 2:
                timers[f"{v}|{b}|{p}|eager"] = functools.partial(eager, v, x, pols[p])
use("cur")
for key, y in ys.items():
    ref = ys["cur", key[1], key[2]]
    if key[0] != "cur":
        print("diff", key, float((y.float() - ref.float()).abs().max()), flush=True)
t0 = time.time()
times = interleaved_events_us(timers, 9, rep_ms=40)
# empty-grid cost per variant
x0 = xs[0]
offs0 = torch.zeros(E, dtype=torch.int32, device=dev); tok0 = torch.zeros(32768, dtype=torch.int64, device=dev)
for v in variants:
    use(v); c = grouped.launch_config(32768, E, D, Fd, dev)
    fn = lambda c=c: grouped.gate_up_swiglu(x0, tok0, offs0, block.experts.gate_up_proj, c["gate_up"])
    fn(); g = captured(lambda _x: fn(), [None], 10)
    print("empty grid", v, do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e3 / 10, flush=True)
use("cur")
print("timing took", time.time() - t0, flush=True)
import statistics as st
summ = {}
for v in variants:
    for b in range(5):
        if f"{v}|{b}|native" not in times:
            continue
        n = st.median(times[f"{v}|{b}|native"]); a = st.median(times[f"{v}|{b}|adaptive"])
        kp, tl_ = kept[b, "adaptive"]; kn, tn = kept[b, "native"]
        summ[f"{v}|{b}"] = dict(native=n, adaptive=a, ratio=a / n, limit=1.1 * kp / kn, tiles=tl_ / tn)
        print(f"{v:10s} b{b} native {n:7.1f} adaptive {a:7.1f} ratio {a / n:.3f} limit {1.1 * kp / kn:.3f} tiles {tl_ / tn:.3f}", flush=True)
        if f"{v}|{b}|native|eager" in times:
            n = st.median(times[f"{v}|{b}|native|eager"]); a = st.median(times[f"{v}|{b}|adaptive|eager"])
            summ[f"{v}|{b}|eager"] = dict(native=n, adaptive=a, ratio=a / n)
            print(f"{v:10s} b{b} eager  native {n:7.1f} adaptive {a:7.1f} ratio {a / n:.3f}", flush=True)
res["layer_variants"] = summ
res["times"] = times
json.dump(res, open(os.path.join(OUT, "diag_layer.json"), "w"), indent=1)

def kernels_of(g, reps=20):
    import statistics as st
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    evs = sorted([e for e in prof.events() if e.device_type.name == "CUDA"], key=lambda e: e.time_range.start)
    n = len(evs) // reps
    per = [[(e.name[:40], e.time_range.start, e.time_range.end) for e in evs[r * n:(r + 1) * n]] for r in range(reps)]
    return [(per[0][i][0], st.median(p[i][2] - p[i][1] for p in per)) for i in range(n)], st.median(p[-1][2] - p[0][1] for p in per)

from torch.profiler import profile, ProfilerActivity  # noqa: E402
for v in ("cur", "dyn", "dyn_both"):
    for b in (0, 1):
        for p in ("native", "adaptive"):
            if (v, b, p) in graphs:
                ks, span = kernels_of(graphs[v, b, p])
                print("profile", v, b, p, f"span {span:.1f}", " ".join(f"{d:.1f}" for _n, d in ks), flush=True)
