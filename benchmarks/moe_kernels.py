"""GPU benchmark: the fused routing kernel and the MoE layer against their baselines.

Routing (topic `routing-kernel`), bf16 logits [T, E]: moelab's Triton kernel (native top-k, entropy
adaptive-k, adaptive-k with device statistics), moelab's torch reference, a faithful torch
re-implementation of the proposed TensorRT-LLM AdaptiveKMoeRoutingMethod (with and without its
host-syncing statistics) and plain softmax + top-k. Eager time (host loop, Python launch included)
and GPU time per call inside a CUDA graph (inputs rotated past the L2 so large T reads HBM). Host
(topic `routing-host`): where the eager call's host time goes. `memory_floor`: a kernel that only reads
the logits and writes a plan of the same size, a reference for what moving those bytes costs. Topic
`routing-wide`: the same for 256- and 512-expert routers (Qwen3.5, Qwen3-Next), at the untuned launch.

MoE layer (topic `moe-layer`), bf16, Mixtral-like / OLMoE-like / Qwen1.5-MoE-like: moelab's layer
(router GEMM, Triton routing, padded layout, expert GEMMs as 'auto' picks them; `_triton` / `_cutlass`:
pinned to moelab's Triton grouped GEMMs / torch._grouped_mm) with native top-k and with entropy
adaptive-k, against the transformers 5 sparse MoE blocks with experts implementation 'eager' and
'grouped_mm', on the same weights. Times are medians of CUDA-event timings (triton.testing.do_bench);
ours also inside a CUDA graph. CUTLASS tiles (topic `cutlass-tiles`): torch._grouped_mm's expert GEMMs
with its 128 x 256 tiles against its 64 x 128 ones, which it only picks at <= 128 rows per group (forced
here by empty groups between the experts).

    PYTHONPATH=lib python benchmarks/moe_kernels.py [--quick]
        [--parts tune,routing,routing-wide,host,tune-gemm,tune-few,layer,cutlass-tiles]
        [--tokens ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moelab import kernels
from moelab.experts import get_gemm, run_experts, set_gemm
from moelab.kernels import device_table, own_table, tuned_for
from moelab.kernels.layout import pair_layout_padded
from moelab.kernels.routing import RoutingStats, route_triton
from moelab.results import write_results
from moelab.routing import EntropyAdaptiveK, TopK, route_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
from kernel_report import GEMM_KEYS, batch_targets, layer_targets, least_regret  # noqa: E402

TOKENS = [1, 16, 64, 512, 4096, 65536]
# name: (hidden D, expert ffn F, experts E, native k, renormalize, shared expert ffn)
LAYERS = {
    "mixtral": (4096, 14336, 8, 2, True, 0),
    "olmoe": (2048, 1024, 64, 8, False, 0),
    "qwen15": (2048, 1408, 60, 4, False, 5632),
}
ROUTING_SHAPES = [("mixtral", 8, 2, True), ("qwen15", 60, 4, False), ("olmoe", 64, 8, False), ("e128", 128, 8, False)]
# wider routers (--parts routing-wide, its own results topic): Qwen3.5-35B-A3B (256 experts, top-8) and
# Qwen3-Next-80B-A3B / Qwen3.5-397B-A17B (512 experts, top-10), both renormalising; no tuned launch there: DEFAULT
WIDE_ROUTING_SHAPES = [("qwen35", 256, 8, True), ("qwen3next", 512, 10, True)]


# ------------------------------------------------------------------ baselines (torch, not in lib)


def trtllm_adaptive(logits, k_values, thresholds, k_max, stats=None):
    """The proposed TensorRT-LLM AdaptiveKMoeRoutingMethod.apply, step for step, in plain torch."""
    probs = F.softmax(logits.to(torch.float32), dim=-1)
    entropy = -torch.sum(probs * torch.log(probs + 1e-9), dim=-1)
    k = torch.full_like(entropy, k_values[-1], dtype=torch.int32)
    for i in range(len(thresholds) - 1, -1, -1):  # highest threshold first, as proposed
        k = torch.where(entropy < thresholds[i], k_values[i], k)
    top_v, top_i = torch.topk(probs, k=k_max, dim=-1)
    valid = torch.arange(k_max, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
    masked = torch.where(valid, top_v, torch.zeros_like(top_v))
    weights = masked / (masked.sum(dim=-1, keepdim=True) + 1e-9)
    if stats is not None:  # its running statistics: one .item() (host sync) per k value and for entropy
        for kv in k_values:
            stats["k"][kv] += (k == kv).sum().item()
        stats["tokens"] += k.numel()
        stats["entropy"] += entropy.sum().item()
    return top_i.to(torch.int32), weights


def softmax_topk(logits, k, renorm):
    """Plain torch routing as the transformers blocks do it."""
    probs = F.softmax(logits.float(), dim=-1)
    v, i = torch.topk(probs, k, dim=-1)
    if renorm:
        v = v / v.sum(-1, keepdim=True)
    return i, v


@triton.jit
def _memory_floor_kernel(x_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr, T, E: tl.constexpr,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Read a [BLOCK_T, E] tile of logits once, write ids / weights [BLOCK_T, K] and k / entropy [BLOCK_T]
    of trivial values (row max and sum): a routing call's memory traffic without its work."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ok = rows < T
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=ok[:, None] & (cols < E)[None, :],
                other=0.0).to(tl.float32)
    mx = tl.max(x, axis=1)
    sm = tl.sum(x, axis=1)
    kk = tl.arange(0, BLOCK_K)
    out = rows[:, None] * K + kk[None, :]
    mask = ok[:, None] & (kk < K)[None, :]
    tl.store(ids_ptr + out, mx.to(tl.int32)[:, None] + kk[None, :], mask=mask)
    tl.store(w_ptr + out, sm[:, None] + kk[None, :].to(tl.float32), mask=mask)
    tl.store(k_ptr + rows, mx.to(tl.int32), mask=ok)
    tl.store(ent_ptr + rows, sm, mask=ok)


def memory_floor(logits, K):
    """Plan-sized outputs from one read of the logits (contiguous [T, E]; E a constant, so rows load in the
    widest vectors their alignment allows): no softmax, no selection. About 1024 logits and at least 16 rows
    per program, 2 warps up to E = 64 and 4 above."""
    T, E = logits.shape
    ids, w = torch.empty(T, K, dtype=torch.int32, device=logits.device), torch.empty(T, K, device=logits.device)
    k, ent = torch.empty(T, dtype=torch.int32, device=logits.device), torch.empty(T, device=logits.device)
    if T:
        block_e = triton.next_power_of_2(E)
        block_t = max(16, 1024 // block_e)
        _memory_floor_kernel[(triton.cdiv(T, block_t),)](
            logits, ids, w, k, ent, T, E=E, K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_T=block_t,
            BLOCK_E=block_e, num_warps=2 if block_e <= 64 else 4)
    return ids, w, k, ent


# ------------------------------------------------------------------ timing


def eager_us(fn, min_s=0.005, repeats=3):
    """Per-call wall time of a host loop (Python launch included), synchronised at the end; median of
    `repeats` loops of n calls, n grown until a loop takes min_s."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= min_s or n >= 4096:
            break
        n *= 2
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(times)[repeats // 2]


def interleaved_eager_us(fns: dict, rounds=5, warmup_s=0.25) -> dict:
    """eager_us of every method, measured in turn for several rounds (median per method): a slow spell
    of the shared host falls on all methods alike instead of on whichever was being timed. Untimed
    rounds of all methods for `warmup_s` first, so that none is timed while the host warms up; the
    warm-up clock starts after each method's first call, which may compile (seconds). The garbage
    collector is off while timing, as in `timeit`."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warmup_s:
            for fn in fns.values():
                eager_us(fn, repeats=1)
        times = {m: [] for m in fns}
        for _ in range(rounds):
            for m, fn in fns.items():
                times[m].append(eager_us(fn, repeats=1))
    finally:
        if was_enabled:
            gc.enable()
    return {m: sorted(v)[len(v) // 2] for m, v in times.items()}


def captured(make_call, inputs, calls):
    """One CUDA graph of `calls` calls cycling over `inputs` (after two warm-up calls on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            make_call(inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            make_call(inputs[i % len(inputs)])
    return g


def graph_us(make_call, inputs, calls):
    """GPU time per call inside one CUDA graph of `calls` calls cycling over `inputs`."""
    from triton.testing import do_bench

    g = captured(make_call, inputs, calls)
    ms = do_bench(g.replay, warmup=10, rep=40, return_mode="median")
    del g
    return ms * 1e3 / calls


def events_us(fn, rep_ms=50):
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def interleaved_events_us(fns: dict, rounds: int, rep_ms: int) -> dict:
    """events_us of every function, measured in turn for `rounds` rounds: {name: [us per round]}. A slow
    spell of the GPU or host falls on all of them alike, so ratios of medians are steadier than ratios
    of times taken minutes apart. Each round takes the functions in another (seeded) order: a function's place
    in a round biases its time, which a median cannot remove."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(events_us(fns[name], rep_ms=rep_ms))
    return times


def _host_probe_us(n=200, device="cuda"):
    """Host time of four small allocations (the plan buffers of a routing call), best of 5 loops."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            (torch.empty(64, 8, dtype=torch.int32, device=device), torch.empty(64, 8, device=device),
             torch.empty(64, dtype=torch.int32, device=device), torch.empty(64, device=device))
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


REPIN = {"on": False}  # set when the process is pinned: the routing part pins again before each (shape, T)


def pin_fastest_cpu(verbose: bool = True) -> dict:
    """Pin this process to the allowed CPU whose host probe (`_host_probe_us`: on the GPU, or on the CPU without
    one) is fastest; {"pinned", "probe_us"} for the results file. On a virtual machine some vCPUs can run host
    code much slower than others, and an unpinned eager timing takes either speed."""
    if not hasattr(os, "sched_setaffinity"):
        return {"pinned": None, "probe_us": {}}
    allowed = sorted(os.sched_getaffinity(0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = {}
    for cpu in allowed:
        os.sched_setaffinity(0, {cpu})
        probe[cpu] = _host_probe_us(device=device)
    best = min(probe, key=probe.get)
    os.sched_setaffinity(0, {best})
    if verbose:
        print(f"host: pinned to CPU {best} ({probe[best]:.1f} us per probe; slowest CPU {max(probe.values()):.1f} us)",
              flush=True)
    return {"pinned": best, "probe_us": probe}


def copy_bandwidth_gbs():
    """Device-to-device copy, bytes read + written per second (the HBM ceiling used below)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    us = events_us(lambda: b.copy_(a))
    return 2 * a.numel() / (us * 1e-6) / 1e9


# ------------------------------------------------------------------ routing


def adaptive_policy(entropy, k):
    """k levels (k/4, k/2, k) at the batch's entropy terciles (Mixtral k=2: (1, 2) at the median)."""
    ks = sorted({max(1, k // 4), max(1, k // 2), k})
    q = torch.quantile(entropy.float(), torch.linspace(0, 1, len(ks) + 1, device=entropy.device)[1:-1])
    th = [float(v) for v in q]
    return EntropyAdaptiveK(tuple(ks), tuple(th))


def routing_methods(k, renorm, ada, stats, trt_stats):
    """name -> (call on logits, slots K in the output)."""
    return {
        "triton_topk": (lambda x: route_triton(x, TopK(k), renorm), k),
        "triton_adaptive": (lambda x: route_triton(x, ada, renorm), ada.k_max),
        "triton_adaptive_stats": (lambda x: route_triton(x, ada, renorm, stats), ada.k_max),
        "torch_reference_adaptive": (lambda x: route_torch(x, ada, renorm), ada.k_max),
        "trtllm_adaptive": (lambda x: trtllm_adaptive(x, ada.k_values, ada.thresholds, ada.k_max), ada.k_max),
        "trtllm_adaptive_stats": (
            lambda x: trtllm_adaptive(x, ada.k_values, ada.thresholds, ada.k_max, trt_stats),
            ada.k_max,
        ),
        "torch_softmax_topk": (lambda x: softmax_topk(x, k, renorm), k),
        "memory_floor": (lambda x: memory_floor(x, k), k),  # reference: the traffic of a top-k plan, no work
    }


# not captured: .item() syncs the host
NOT_CAPTURABLE = {
    "trtllm_adaptive_stats": "host sync: .item() per statistic",
}


def bench_routing_one(name, E, k, renorm, tokens, bw_gbs, l2_bytes):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(E)
    calib = torch.randn(4096, E, device="cuda", generator=g)
    ada = adaptive_policy(route_torch(calib, TopK(k), renorm).entropy, k)
    for T in tokens:
        per = T * E * 2
        n_in = max(1, min(16, math.ceil(3 * l2_bytes / max(per, 1))))
        inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
        calls = max(20, n_in)
        stats = RoutingStats.zeros(ada.k_max, "cuda")
        trt_stats = {"k": {kv: 0 for kv in ada.k_values}, "tokens": 0, "entropy": 0.0}
        methods = routing_methods(k, renorm, ada, stats, trt_stats)
        # the vCPUs' speeds drift during a run: each point's eager timings on the one fastest now
        host = pin_fastest_cpu(verbose=False) if REPIN["on"] else None
        eager = interleaved_eager_us({m: functools.partial(fn, inputs[0]) for m, (fn, _) in methods.items()})
        for method, (fn, K) in methods.items():
            row = {"shape": name, "E": E, "native_k": k, "k_max": K, "T": T, "method": method, "dtype": "bf16",
                   "policy": repr(ada) if "adaptive" in method else f"TopK({k})"}
            row["eager_us"] = eager[method]
            if host:
                row["host_cpu"], row["host_probe_us"] = host["pinned"], host["probe_us"][host["pinned"]]
            row["graph_note"] = NOT_CAPTURABLE.get(method, "")
            row["graph_us"] = None if row["graph_note"] else graph_us(fn, inputs, calls)
            # fewest bytes: read the logits once, write ids + weights [T, K] and k + entropy [T]
            row["min_bytes"] = T * E * 2 + T * K * 8 + T * 8
            row["hbm_bound_us"] = row["min_bytes"] / (bw_gbs * 1e9) * 1e6
            row["frac_of_hbm_bound"] = row["hbm_bound_us"] / row["graph_us"] if row["graph_us"] else None
            rows.append(row)
            print(f"routing {name:8s} T={T:6d} {method:26s} eager {row['eager_us']:9.1f} us  "
                  f"graph {row['graph_us'] or float('nan'):8.2f} us", flush=True)
    return rows


def _routed_experts(x, logits, k, renorm, gu, dn):
    return run_experts(x, route_triton(logits, TopK(k), renorm), gu, dn)


def bench_host(tokens=(16, 4096), rounds=7):
    """Host time per eager call (wall time of a host loop, synchronised at the end) of moelab's adaptive
    routing call and its parts: the direct launch (`Launcher`, the default), the same call through
    Triton's public launch path, the four plan allocations alone, and the torch TensorRT-LLM version.
    Also the routed experts of each layer shape at decode sizes (routing, padded layout, fused Triton
    experts: seven launches), direct against public launch."""
    from moelab import kernels
    from moelab.kernels import routing as kr

    def public(fn):
        launchers = (kr._launch, kr._launch_rows, kr._launch_rows16, *kernels._LAUNCHERS.values())
        for lau in launchers:
            lau.disabled = "benchmark: public launch path"
        try:
            return fn()
        finally:
            for lau in launchers:
                lau.disabled = ""

    rows = []
    for name, E, k, renorm in ROUTING_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(E)
        ada = adaptive_policy(route_torch(torch.randn(4096, E, device="cuda", generator=g), TopK(k), renorm).entropy, k)
        for T in tokens:
            x = torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16)
            call = functools.partial(route_triton, x, ada, renorm)
            fns = {
                "route_triton": call,
                "route_triton_public_launch": functools.partial(public, call),
                "plan_buffers": functools.partial(kr._plan_buffers, T, ada.k_max, x.device),
                "trtllm_adaptive": functools.partial(trtllm_adaptive, x, ada.k_values, ada.thresholds, ada.k_max),
            }
            us = interleaved_eager_us(fns, rounds)
            for method, t in us.items():
                rows.append({"shape": name, "E": E, "T": T, "method": method, "eager_us": t, "policy": repr(ada)})
            print(f"host {name:8s} T={T:5d} " + "  ".join(f"{m} {t:6.1f} us" for m, t in us.items()), flush=True)
    for name, (D, Fd, E, k, renorm, _) in LAYERS.items():
        g = torch.Generator(device="cuda").manual_seed(D + E)
        gu = (torch.randn(E, 2 * Fd, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)
        dn = (torch.randn(E, D, Fd, device="cuda", generator=g) * Fd**-0.5).to(torch.bfloat16)
        for T in (1, 16):
            x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
            logits = torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16)
            call = functools.partial(_routed_experts, x, logits, k, renorm, gu, dn)
            fns = {"experts": call, "experts_public_launch": functools.partial(public, call)}
            us = interleaved_eager_us(fns, rounds)
            gpu = events_us(call)
            for method, t in us.items():
                rows.append({"shape": name, "E": E, "T": T, "method": method, "eager_us": t, "gpu_us": gpu,
                             "policy": f"TopK({k})"})
            print(f"host {name:8s} T={T:5d} experts " + "  ".join(f"{m} {t:6.1f} us" for m, t in us.items())
                  + f"  (events {gpu:.1f} us)", flush=True)
        del gu, dn
    return rows


def bench_routing(tokens, bw_gbs, l2_bytes, quick, save, shapes=ROUTING_SHAPES):
    rows = []
    for name, E, k, renorm in shapes[2:] if quick and len(shapes) > 2 else shapes:
        rows += bench_routing_one(name, E, k, renorm, tokens, bw_gbs, l2_bytes)
        save(rows)  # after every shape: a run cut short keeps what it measured
    return rows


# ------------------------------------------------------------------ MoE layer


def hf_block(name, D, Fd, E, k, shared, dev, seed=0):
    """The transformers 5 sparse MoE block of the family, built on the device in bf16, weights N(0, 1/fan_in)
    from `seed` (the same weights, router included, in every run)."""
    if name == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = MixtralConfig(hidden_size=D, intermediate_size=Fd, num_local_experts=E, num_experts_per_tok=k)
    elif name == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block

        cfg = OlmoeConfig(hidden_size=D, intermediate_size=Fd, num_experts=E, num_experts_per_tok=k,
                          norm_topk_prob=False)
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=Fd, num_experts=E, num_experts_per_tok=k,
                             shared_expert_intermediate_size=shared, norm_topk_prob=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev), torch.no_grad():
            block = Block(cfg)
            g = torch.Generator(device=dev).manual_seed(seed)
            for p in block.parameters():
                p.normal_(0, p.shape[-1] ** -0.5, generator=g)
    finally:
        torch.set_default_dtype(old)
    return block.eval(), cfg


def moelab_layer(block, renorm, shared, gemm=None):
    """Our layer on the block's own weights: router GEMM, Triton routing, padded layout, grouped GEMMs.
    gemm: the expert GEMM mode (moelab.experts.set_gemm) while a call runs, restored after it; None: the
    current one ('auto': the Triton grouped GEMMs on CUDA; 'grouped': torch._grouped_mm / CUTLASS)."""
    gu, dn, wr = block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight

    def ours(x, pol):
        prev = get_gemm()
        if gemm is not None:
            set_gemm(gemm)
        try:
            logits = F.linear(x, wr)
            plan = route_triton(logits, pol, renorm)
            y = run_experts(x, plan, gu, dn, layout=pair_layout_padded(plan))
        finally:
            set_gemm(prev)
        if shared:
            y = y + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return y, plan

    return ours


def hf_call(block, cfg, impl, x):
    cfg._experts_implementation = impl
    return block(x[None])[0]


def gemm_tiles(plan, rows_per_tile):
    """Row tiles the grouped GEMM runs: sum over experts of ceil(pairs / rows_per_tile)."""
    ids = plan.expert_ids
    counts = torch.bincount(ids[ids >= 0].long(), minlength=plan.num_experts)
    return int(((counts + rows_per_tile - 1) // rows_per_tile).sum())


def experts_used(plan):
    ids = plan.expert_ids
    return int(torch.unique(ids[ids >= 0]).numel())


def layer_input(T, D, batch=0):
    """The layer benchmarks' input: [T, D] bf16 N(0, 1), seeded by (T, batch) alone, so that a batch is the same
    whatever other sizes a run times."""
    g = torch.Generator(device="cuda").manual_seed(T + (batch << 32))
    return torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)


def layer_policies(block, k, renorm, D):
    """The layer benchmarks' policies: native top-k; 'adaptive', (k/4, k/2, k) at the entropy
    terciles of a seeded 4096-token calibration batch through the block's router; and the milder 'adaptive_q25' /
    'adaptive_q50', (k/2, k) at the 25% / 50% entropy quantile (about 87% / 75% of the native pairs kept,
    the terciles policy about 58%). The inputs come from `layer_input`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    xc = torch.randn(4096, D, device="cuda", generator=g).to(torch.bfloat16)
    ent = route_torch(F.linear(xc, block.gate.weight), TopK(k), renorm).entropy
    pols = {"native": TopK(k), "adaptive": adaptive_policy(ent, k)}
    for q in (0.25, 0.5):
        pols[f"adaptive_q{int(q * 100)}"] = quantile_policy(ent, k, q)
    return pols


def quantile_policy(entropy, k, q):
    """(k/2, k) with the threshold at the q-quantile of the batch's entropy: about 1 - q / 2 of the pairs kept."""
    return EntropyAdaptiveK((max(1, k // 2), k), (float(entropy.float().quantile(q)),))


ROUNDS = 5  # layer benchmark: interleaved timing rounds per variant (median reported, every round kept)
# at the wall-clock target's T (4096) more and longer rounds: a Mixtral-like layer call takes about 5 ms, so a
# 20 ms round would time only about four calls
TARGET_T, TARGET_ROUNDS, TARGET_REP_MS = 4096, 9, 50
# at TARGET_T the target's layers (ours, 'auto' path) are also timed on further input batches: with 128-row
# tiles the same share of kept pairs makes another share of row tiles on another batch (Mixtral-like median
# policy: 0.761 or 0.779 of the native tiles at 0.751 of the pairs), so one batch can sit on either side of a bound
BATCHES = 5


@torch.no_grad()
def bench_layer_one(name, tokens):
    rows = []
    D, Fd, E, k, renorm, shared = LAYERS[name]
    block, cfg = hf_block(name, D, Fd, E, k, shared, "cuda")
    ours = moelab_layer(block, renorm, shared)
    cutlass = moelab_layer(block, renorm, shared, gemm="grouped")  # each expert-GEMM path pinned, same run
    triton_ = moelab_layer(block, renorm, shared, gemm="triton")
    pols = layer_policies(block, k, renorm, D)
    native, ada = pols["native"], pols["adaptive"]
    milder = {f"moelab_{p}": pols[p] for p in ("adaptive_q25", "adaptive_q50")}
    routed = moelab_layer(block, renorm, 0) if shared else None  # without the shared expert (qwen15)
    for T in tokens:
        x = layer_input(T, D)
        y_nat, plan_nat = ours(x, native)
        _, plan_ada = ours(x, ada)
        y_cut, _ = cutlass(x, native)
        y_tri, _ = triton_(x, native)
        y_hf = hf_call(block, cfg, "grouped_mm", x)
        hf_norm = y_hf.float().norm().clamp_min(1e-12)
        rel = {"moelab_topk": float((y_nat.float() - y_hf.float()).norm() / hf_norm),
               "moelab_topk_cutlass": float((y_cut.float() - y_hf.float()).norm() / hf_norm),
               "moelab_topk_triton": float((y_tri.float() - y_hf.float()).norm() / hf_norm)}
        variants = {
            "moelab_topk": (functools.partial(ours, x, native), native, plan_nat),
            "moelab_adaptive": (functools.partial(ours, x, ada), ada, plan_ada),
            "moelab_topk_cutlass": (functools.partial(cutlass, x, native), native, plan_nat),
            "moelab_adaptive_cutlass": (functools.partial(cutlass, x, ada), ada, plan_ada),
            "moelab_topk_triton": (functools.partial(triton_, x, native), native, plan_nat),
            "moelab_adaptive_triton": (functools.partial(triton_, x, ada), ada, plan_ada),
            "hf_eager": (functools.partial(hf_call, block, cfg, "eager", x), native, plan_nat),
            "hf_grouped_mm": (functools.partial(hf_call, block, cfg, "grouped_mm", x), native, plan_nat),
        }
        if T == TARGET_T:  # the wall-clock target's size
            for var, pol in milder.items():
                variants[var] = (functools.partial(ours, x, pol), pol, ours(x, pol)[1])
            if routed is not None:  # the shared expert's time does not shrink with k: the target on the rest
                variants["moelab_topk_routed_only"] = (functools.partial(routed, x, native), native, plan_nat)
                variants["moelab_adaptive_routed_only"] = (functools.partial(routed, x, ada), ada, plan_ada)
        timers, graphs = {}, []
        for var, (fn, pol, _plan) in variants.items():
            timers[var, "time_us"] = fn
            if var.startswith("moelab") and T <= 4096:
                layer = next((f for suffix, f in (("routed_only", routed), ("cutlass", cutlass), ("triton", triton_))
                              if var.endswith(suffix)), ours)
                graphs.append(captured(functools.partial(layer, pol=pol), [x], 1))
                timers[var, "graph_us"] = graphs[-1].replay
        # every variant (eager and graph) timed in turn, ROUNDS rounds: the target's ratios come from one window
        if T == TARGET_T:
            times = interleaved_events_us(timers, TARGET_ROUNDS, rep_ms=TARGET_REP_MS)
        else:
            times = interleaved_events_us(timers, ROUNDS, rep_ms=10 if T >= 65536 else 20)
        del graphs
        for var, (_fn, pol, plan) in variants.items():
            rows.append(_layer_row(name, T, 0, var, pol, plan, times, rel.get(var)))
    return rows


def _layer_row(name, T, batch, var, pol, plan, times, rel_err=None):
    """One results row of the layer benchmark: medians and every round of the variant's timers, and its plan's
    pairs, experts and row tiles."""
    D, Fd, E, k, _renorm, shared = LAYERS[name]
    row = {"shape": name, "D": D, "F": Fd, "E": E, "native_k": k, "shared_ffn": shared, "T": T, "batch": batch,
           "variant": var, "dtype": "bf16", "policy": repr(pol)}
    for col in ("time_us", "graph_us"):
        us = times.get((var, col))
        row[col] = None if us is None else sorted(us)[len(us) // 2]
        row[col.replace("_us", "_rounds_us")] = us
    row["kept_pairs"] = int(plan.k.sum())
    row["native_pairs"] = T * k
    row["mean_k"] = row["kept_pairs"] / T
    row["experts_used"] = experts_used(plan)
    row["gemm_tiles_128"] = gemm_tiles(plan, 128)
    row["gemm_tiles_64"] = gemm_tiles(plan, 64)  # the Triton path's row tiles (BLOCK_M 64 by default)
    row["rel_err_vs_hf"] = rel_err
    print(f"layer {name:8s} T={T:6d} b{batch} {var:24s} {row['time_us']:10.1f} us  graph "
          f"{row['graph_us'] or float('nan'):10.1f}  kept {row['kept_pairs']}/{T * k} "
          f"experts {row['experts_used']}/{E}", flush=True)
    return row


@torch.no_grad()
def bench_layer_batches(name, batches=BATCHES, T=TARGET_T):
    """The target's layers (ours as 'auto' picks its GEMMs: native, and every adaptive policy; qwen15 also
    without its shared expert) on input batches 1 .. batches-1 (batch 0 is bench_layer_one's), each batch's
    variants timed in turn, eager and in a graph, as bench_layer_one times them at T."""
    rows = []
    D, Fd, E, k, renorm, shared = LAYERS[name]
    block, _cfg = hf_block(name, D, Fd, E, k, shared, "cuda")
    ours = moelab_layer(block, renorm, shared)
    routed = moelab_layer(block, renorm, 0) if shared else None
    pols = layer_policies(block, k, renorm, D)
    names = {"native": "moelab_topk", "adaptive": "moelab_adaptive", "adaptive_q25": "moelab_adaptive_q25",
             "adaptive_q50": "moelab_adaptive_q50"}
    for b in range(1, batches):
        x = layer_input(T, D, b)
        variants = {var: (ours, pols[p]) for p, var in names.items()}
        if routed is not None:
            variants["moelab_topk_routed_only"] = (routed, pols["native"])
            variants["moelab_adaptive_routed_only"] = (routed, pols["adaptive"])
        timers, graphs, plans = {}, [], {}
        for var, (layer, pol) in variants.items():
            plans[var] = layer(x, pol)[1]
            timers[var, "time_us"] = functools.partial(layer, x, pol)
            graphs.append(captured(functools.partial(layer, pol=pol), [x], 1))
            timers[var, "graph_us"] = graphs[-1].replay
        times = interleaved_events_us(timers, TARGET_ROUNDS, rep_ms=TARGET_REP_MS)
        del graphs
        rows += [_layer_row(name, T, b, var, pol, plans[var], times) for var, (_layer, pol) in variants.items()]
    return rows


def bench_layer(tokens, quick, save, batches=BATCHES):
    """(rows, batch rows): every shape at every T, and at TARGET_T (when timed) the target's layers on
    `batches` - 1 further input batches."""
    rows, extra = [], []
    for name in ["olmoe"] if quick else list(LAYERS):
        rows += bench_layer_one(name, tokens)
        torch.cuda.empty_cache()
        save(rows, extra)
    for name in ["olmoe"] if quick else list(LAYERS):
        if TARGET_T in tokens and batches > 1:
            extra += bench_layer_batches(name, batches)
            torch.cuda.empty_cache()
            save(rows, extra)
    return rows, extra


def small_tile_operands(w_ENK, offsets_E, rows):
    """torch._grouped_mm operands that make its dispatch (aten GroupMM.cu: 64 x 128 tiles when rows / groups
    <= 128, else 128 x 256) take the small tiles on the same work: S - 1 empty groups after each expert but
    the last, their weights a view that steps S times per expert (never read: no rows)."""
    E, N, K = w_ENK.shape
    S = 1
    while rows // (S * (E - 1) + 1) > 128:
        S *= 2
    G = S * (E - 1) + 1
    if (N * K) % (8 * S) or G > 1024:  # 16-byte aligned group bases; aten prepares groups in one block
        return None
    b = w_ENK.transpose(1, 2).as_strided((G, K, N), (N * K // S, 1, K))
    return b, offsets_E.repeat_interleave(S)[:G], G


@torch.no_grad()
def bench_cutlass_tiles(tokens=(4096, 16384)):
    """Expert GEMMs of each layer shape through torch._grouped_mm with its large and its small tiles, on the
    padded layouts of native top-k and adaptive plans (same rows, same weights; outputs compared)."""
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        raise SystemExit(f"cutlass-tiles: compute capability {major}.{minor}; torch._grouped_mm's CUTLASS kernels "
                         "need 9.0 or above")
    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (D, Fd, E, k, renorm, _) in LAYERS.items():
        gu = (torch.randn(E, 2 * Fd, D, device="cuda", generator=g) * D**-0.5).bfloat16()
        dn = (torch.randn(E, D, Fd, device="cuda", generator=g) * Fd**-0.5).bfloat16()
        wr = (torch.randn(E, D, device="cuda", generator=g) * D**-0.5).bfloat16()
        for T in tokens:
            logits = F.linear(torch.randn(T, D, device="cuda", generator=g).bfloat16(), wr)
            ada = adaptive_policy(route_triton(logits, TopK(k), renorm).entropy, k)
            for pol in (TopK(k), ada):
                lay = pair_layout_padded(route_triton(logits, pol, renorm))
                rows, kept = lay.num_pairs, int(lay.offsets[-1])
                for gemm, w, width in (("gate_up", gu, D), ("down", dn, Fd)):
                    a = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
                    ops = small_tile_operands(w, lay.offsets, rows)
                    if ops is None:  # e.g. OLMoE-like T = 16384: <= 128 rows per group needs > 1024 groups
                        print(f"cutlass {name} T={T} {gemm}: no small-tile operands for {rows} rows", flush=True)
                        continue
                    b, offs, groups = ops
                    large = functools.partial(torch._grouped_mm, a, w.transpose(1, 2), offs=lay.offsets)
                    small = functools.partial(torch._grouped_mm, a, b, offs=offs)
                    same = torch.equal(small()[:kept], large()[:kept])
                    row = {"shape": name, "T": T, "policy": repr(pol), "gemm": gemm, "E": E, "kept_pairs": kept,
                           "rows": rows, "groups_small": groups, "rows_per_group_small": rows // groups,
                           "same_output": same,
                           "large_tiles_us": events_us(large), "small_tiles_us": events_us(small)}
                    rows_out.append(row)
                    print(f"cutlass {name:8s} T={T:6d} {gemm:8s} kept {kept:6d}/{rows}: 128x256 "
                          f"{row['large_tiles_us']:8.1f} us, 64x128 {row['small_tiles_us']:8.1f} us  same={same}",
                          flush=True)
    return rows_out


TUNE_TOKENS = (16, 512, 4096, 65536)
TUNE_SHAPES = {8: 2, 60: 4, 64: 8, 128: 8}  # E: native k of the routing shapes


def tune_configs(E, k, T, selects="all"):
    """(select, tile, warps, split) worth timing at this shape. The tile kernel ('rounds') over tiles and
    warps ('all'); the row kernel (bf16: 32-bit keys, any E; keys inserted one by one or, 'rowsort',
    sorted in chunks of eight and merged) with a row cut into `split` pieces, tile = rows per program x
    BLOCK_E; selects='rowwise': only the row kernel (timed beside the table's current pick)."""
    from moelab.kernels import routing as kr

    out = []
    if selects == "all":
        out = [("rounds", tile, warps, 1) for tile in ((512, 1024, 2048) if T >= 4096 else (1024,))
               for warps in (4, 8)]
    be = triton.next_power_of_2(E)
    # 'rowsort' differs from 'rowwise' only for 5 <= k <= 8, and alone takes 8 < k <= 16
    sels = [sel for sel in ("rowwise", "rowsort") if kr._rows_select(k, sel, be, 2) and (sel == "rowwise" or k >= 5)]
    for sel in sels:
        for split in (1, 2, 4, 8, 16) if be >= 512 else (1, 2, 4, 8):
            for warps in (2, 4):
                rows = 32 * warps // split  # one row piece per thread
                if split <= be // 8 or split == 1:
                    out.append((sel, rows * be, warps, split))
    return out


def tune_routing(bw_gbs, selects="all", shapes=None, save=None):
    """GPU time in a graph of the native top-k kernel per launch configuration (select, warps, tile, split);
    with selects='rowwise' also the table's current pick (the row says which configuration that was).
    shapes: {E: k} to tune (default TUNE_SHAPES). save(rows) after each (E, T): a run cut short keeps what it
    measured."""
    from moelab.kernels import routing as kr

    rows = []
    keep = dict(kr.LAUNCH)
    for E, k in (shapes or TUNE_SHAPES).items():
        for T in TUNE_TOKENS:
            inputs = [torch.randn(T, E, device="cuda").to(torch.bfloat16) for _ in range(8)]
            configs = tune_configs(E, k, T, selects)
            if selects != "all":
                kr.LAUNCH.update(select=None, tile=None, warps=None, split=None)
                cur = kr.launch_config(T, E, torch.device("cuda"), k)
                configs = [(cur["select"], cur["tile"], cur["warps"], cur["split"])] + configs
            for select, tile, warps, split in dict.fromkeys(configs):
                kr.LAUNCH.update(select=select, tile=tile, warps=warps, split=split)
                us = graph_us(lambda x, k=k: route_triton(x, TopK(k), False), inputs, 16)
                bound = (T * E * 2 + T * k * 8 + T * 8) / (bw_gbs * 1e9) * 1e6
                rows.append({"E": E, "k": k, "T": T, "select": select, "tile": tile, "warps": warps, "split": split,
                             "graph_us": us, "hbm_bound_us": bound})
                print(f"tune E={E:4d} T={T:6d} {select:8s} tile={tile:5d} warps={warps} split={split} {us:8.2f} us "
                      f"(bound {bound:.2f})", flush=True)
            if save is not None:
                save(rows)
    kr.LAUNCH.update(keep)
    return rows


def tuned_table(rows) -> dict:
    """{(BLOCK_E, BLOCK_K): [(T up to, {select, warps, tile, split}), ...]}, a device's routing table
    (kernels/configs): per key and tuned T, the configuration whose worst slowdown against the fastest, over the E
    that share the key, is smallest. The selection's cost grows with k_max, so k is part of the key."""
    def key(r):
        return triton.next_power_of_2(r["E"]), triton.next_power_of_2(r.get("k") or TUNE_SHAPES[r["E"]])

    table: dict = {}
    rows = [r for r in rows if not (r.get("pre") and r["select"] != "rounds")]  # a row-kernel variant since removed
    for kk in sorted({key(r) for r in rows}):
        group = [r for r in rows if key(r) == kk]
        t_all = sorted({r["T"] for r in group})
        entries = []
        for i, T in enumerate(t_all):
            at = [r for r in group if r["T"] == T]
            best = {E: min(r["graph_us"] for r in at if r["E"] == E) for E in {r["E"] for r in at}}
            regret: dict = {}
            for r in at:
                cfg = (r["select"], r["warps"], r["tile"], r.get("split", 1))
                regret[cfg] = max(regret.get(cfg, 0.0), r["graph_us"] / best[r["E"]])
            sel, warps, tile, split = min(regret, key=regret.get)
            entries.append((T if i < len(t_all) - 1 else kernels.UNBOUNDED,
                            {"select": sel, "warps": warps, "tile": tile, "split": split}))
        table[kk] = entries
    return table


GEMM_CONFIGS = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M); gate_up's BLOCK_N counts gate and up each
    "gate_up": [(64, 64, 64, 4, 3, 16), (64, 128, 64, 8, 3, 16), (128, 64, 64, 8, 3, 16), (64, 64, 64, 4, 4, 32),
                (64, 128, 64, 4, 3, 16), (64, 64, 128, 4, 3, 16), (64, 128, 64, 4, 4, 16), (128, 128, 64, 8, 3, 16),
                (128, 128, 64, 8, 4, 16), (64, 128, 64, 4, 5, 16), (64, 64, 64, 4, 6, 16)],
    "down": [(64, 128, 64, 4, 3, 16), (64, 256, 64, 8, 3, 16), (128, 128, 64, 8, 3, 16), (64, 128, 64, 4, 4, 32),
             (128, 256, 64, 8, 3, 16), (64, 128, 128, 4, 3, 16), (64, 256, 64, 4, 4, 16), (128, 128, 64, 4, 3, 16),
             (128, 256, 64, 8, 4, 16), (64, 256, 64, 4, 5, 16)],
}
# the last gate_up / down entries: deeper pipelines, 5-6 stages of weight tiles in flight (about 200 KB of shared
# memory), as the expert weights stream from HBM once per GEMM


# (TMA, PERSISTENT, FLATTEN) per configuration: pointer loads, TMA loads, TMA loads in persistent programs (one
# per SM); for down also with the tile and K loops flattened
LOADS = {"gate_up": ((False, False, False), (True, False, False), (True, True, False)),
         "down": ((False, False, False), (True, False, False), (True, True, False), (True, True, True))}
TUNE_ROUNDS = 3  # tune-gemm: interleaved timing rounds per configuration (median kept, every round recorded)


# the few-row class (grouped.FEW_ROWS[0]: up to 64 padded rows per expert, decode sizes) for --parts tune-few: the
# FEW_ROWS[0] launch first (gate_up 16 x 32 x 128, down 16 x 64 x 128, 4 warps, 3 stages), then wider / deeper
# tiles: at T = 64 the Mixtral-like layer reads 2.8 GB of weights for about 16 rows per expert
FEW_CONFIGS = {
    "gate_up": [(16, 32, 128, 4, 3, 1), (16, 64, 128, 4, 3, 1), (16, 32, 256, 4, 3, 1), (16, 64, 64, 4, 4, 1),
                (16, 32, 128, 4, 5, 1), (16, 64, 128, 8, 4, 1), (16, 128, 64, 4, 4, 1), (16, 32, 64, 4, 6, 1),
                (16, 32, 128, 4, 3, 8), (16, 64, 128, 4, 3, 8), (32, 32, 128, 4, 3, 8), (32, 64, 128, 8, 3, 1)],
    "down": [(16, 64, 128, 4, 3, 1), (16, 128, 128, 4, 3, 1), (16, 32, 256, 4, 3, 1), (16, 64, 256, 4, 4, 1),
             (16, 128, 64, 4, 5, 1), (16, 64, 128, 4, 5, 1), (16, 256, 64, 8, 4, 1), (16, 128, 128, 8, 4, 1),
             (16, 128, 128, 8, 4, 8), (16, 64, 128, 4, 3, 8), (32, 128, 128, 8, 4, 1), (32, 64, 128, 4, 3, 1)],
}
# the last four of each: at T = 64 an expert of the Mixtral-like layer gets more than 16 rows, so 16-row tiles
# read its weights twice or more; GROUP_M 8 walks an expert's row tiles column by column (the second read from
# L2), 32-row tiles read them once
FEW_TOKENS = (64, 16)  # T = 64 first (a run cut short keeps it)


@torch.no_grad()
def tune_experts(tokens=4096, save=None, shapes=None, configs=None):
    """GPU time of each Triton expert GEMM (gate_up + SwiGLU, down) per launch configuration (`configs`,
    default GEMM_CONFIGS), with pointer and with tensor-descriptor (TMA) loads, the latter also in persistent
    programs, on the native top-k plan and the entropy-adaptive plans (`tune_policies`) of each layer shape at
    T = `tokens`, beside torch._grouped_mm (CUTLASS; gather and SwiGLU passes included)."""
    from moelab.experts import grouped_gemm
    from moelab.kernels import grouped as gk

    rows = []
    for name, (D, Fd, E, k, renorm, _shared) in LAYERS.items():
        if shapes is not None and name not in shapes:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
        gu = (torch.randn(E, 2 * Fd, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
        dn = (torch.randn(E, D, Fd, device="cuda", generator=g) * Fd ** -0.5).bfloat16()
        logits = torch.randn(tokens, E, device="cuda", generator=g).bfloat16()
        native = route_triton(logits, TopK(k), renorm)
        plans = {name: route_triton(logits, pol, renorm) for name, pol in tune_policies(native.entropy, k).items()}
        for plan_name, plan in plans.items():
            lay = pair_layout_padded(plan)
            offs = lay.offsets
            kept = int(offs[-1])
            a = gk.gate_up_swiglu(x, lay.token_idx, offs, gu, gk.DEFAULT["gate_up"])
            base = {"shape": name, "T": tokens, "plan": plan_name, "kept_pairs": kept}
            fns, cfgs = {}, {}
            for kernel, cands in (configs or GEMM_CONFIGS).items():
                for (bm, bn, bk, warps, stages, group), (tma, persistent, flatten) in itertools.product(
                        cands, LOADS[kernel]):
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
                           "GROUP_M": group, "TMA": tma, "PERSISTENT": persistent, "FLATTEN": flatten}
                    if kernel == "gate_up":
                        fn = functools.partial(gk.gate_up_swiglu, x, lay.token_idx, offs, gu, cfg)
                    else:
                        fn = functools.partial(gk.down_proj, a, offs, dn, cfg)
                    try:
                        fn()  # compiles
                    except Exception as e:  # e.g. out of shared memory for this tile: record and go on
                        print(f"gemm {name} {kernel} {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    fns[kernel, len(fns)] = fn
                    cfgs[kernel, len(cfgs)] = cfg
            fns["gate_up", "cutlass"] = functools.partial(_cutlass_gate_up, x, lay.token_idx, offs, gu)
            fns["down", "cutlass"] = functools.partial(grouped_gemm, a, dn, offs)
            # all configurations (and CUTLASS) timed in turn, TUNE_ROUNDS rounds: a slow spell of the GPU
            # falls on all of them, so the pick does not follow it
            times = interleaved_events_us(fns, TUNE_ROUNDS, rep_ms=20)
            for (kernel, i), us in times.items():
                med = sorted(us)[len(us) // 2]
                cfg = {"cutlass": True} if i == "cutlass" else cfgs[kernel, i]
                rows.append({**base, "kernel": kernel, **cfg, "time_us": med, "rounds_us": us})
                label = "cutlass" if i == "cutlass" else " ".join(f"{key}={val}" for key, val in cfg.items())
                print(f"gemm {name:8s} T={tokens:5d} {plan_name:8s} {kernel:8s} {label} {med:9.1f} us", flush=True)
        if save is not None:  # after each shape: a run cut short keeps what it measured
            save(rows)
    return rows


def tuned_few_table(rows) -> dict:
    """{(D, F): {"gate_up": cfg, "down": cfg}}: per shape and kernel the few-row configuration whose worst
    slowdown over the (plan, T) cases timed is smallest (least_regret), beside the current FEW_ROWS[0]
    launch's worst slowdown (`current_regret`) and the pick's (`regret`)."""
    from moelab.kernels import grouped as gk

    table = {}
    for name, (D, Fd, *_rest) in LAYERS.items():
        entry = {}
        for kernel in ("gate_up", "down"):
            cand = [{**r, "case": (r["plan"], r["T"])} for r in rows
                    if r["shape"] == name and r["kernel"] == kernel and not r.get("cutlass")]
            if not cand:
                continue
            pick = least_regret(cand, over="case")
            best = {c: min(r["time_us"] for r in cand if r["case"] == c) for c in {r["case"] for r in cand}}
            cur = tuple({"GROUP_M": 1, "TMA": False, "PERSISTENT": False, "FLATTEN": False,
                         **gk.FEW_ROWS[0][1][kernel]}.get(k, False) for k in GEMM_KEYS)

            def regret(cfg, cand=cand, best=best):
                ts = [r["time_us"] / best[r["case"]] for r in cand if tuple(r.get(k, False) for k in GEMM_KEYS) == cfg]
                return max(ts) if ts else None
            entry[kernel] = {**dict(zip(GEMM_KEYS, pick)), "regret": regret(pick), "current_regret": regret(cur)}
        if entry:
            table[(D, Fd)] = entry
    return table


def few_entries(table: dict) -> dict:
    """tuned_few_table's picks as a device's few_rows entries: {(D, F): {kernel: launch}}, the launch keys only,
    those at their defaults (GROUP_M 1, flags off) left out."""
    off = {"GROUP_M": 1, "TMA": False, "PERSISTENT": False, "FLATTEN": False}
    return {shape: {kernel: {k: cfg[k] for k in GEMM_KEYS if k in cfg and off.get(k, None) != cfg[k]}
                    for kernel, cfg in entry.items()}
            for shape, entry in table.items()}


def _cutlass_gate_up(x, tok, offs, gu):
    """gather, torch._grouped_mm, SwiGLU: the steps the Triton gate_up GEMM fuses."""
    from moelab.experts import grouped_gemm
    from moelab.kernels.experts import gather_rows, swiglu_rows

    return swiglu_rows(grouped_gemm(gather_rows(x, tok, offs), gu, offs), offs)


def tune_policies(entropy, k) -> dict:
    """The plans tune-gemm times the expert GEMMs on: native top-k, the terciles policy ('adaptive', about 58% of
    the pairs kept) and the median policy ('adaptive_q50', (k/2, k) at the median entropy, about 75%) where it
    differs from the terciles one (not for k = 2). One configuration has to serve them all."""
    pols = {"native": TopK(k), "adaptive": adaptive_policy(entropy, k)}
    q50 = quantile_policy(entropy, k, 0.5)
    if q50 != pols["adaptive"]:
        pols["adaptive_q50"] = q50
    return pols


def tuned_experts_table(rows) -> dict:
    """{(D, F): [(UNBOUNDED, {"gate_up": cfg, "down": cfg, "beats_cutlass": bool})]}, a device's grouped table
    (kernels/configs): per shape and kernel the configuration whose worst slowdown against the fastest, over the
    plans timed (tune_policies), is smallest (least_regret); beats_cutlass: those two GEMMs take less time than
    CUTLASS's (gather, GEMM + SwiGLU, GEMM) on every plan, so set_gemm('auto') runs them at many rows per expert."""
    table = {}
    for name, (D, Fd, *_rest) in LAYERS.items():
        entry, ours, theirs = {}, {}, {}
        for kernel in ("gate_up", "down"):
            mine = [r for r in rows if r["shape"] == name and r["kernel"] == kernel]
            cand = [r for r in mine if not r.get("cutlass")]
            if not cand:
                continue
            pick = least_regret(cand)
            entry[kernel] = dict(zip(GEMM_KEYS, pick))
            for r in mine:
                if r.get("cutlass"):
                    theirs[r.get("plan")] = theirs.get(r.get("plan"), 0.0) + r["time_us"]
                elif tuple(r.get(k, False) for k in GEMM_KEYS) == pick:
                    ours[r.get("plan")] = ours.get(r.get("plan"), 0.0) + r["time_us"]
        if entry:
            entry["beats_cutlass"] = bool(theirs) and all(ours.get(p, float("inf")) < t for p, t in theirs.items())
            table[(D, Fd)] = [(kernels.UNBOUNDED, entry)]
    return table


PARTS = ("tune", "routing", "routing-wide", "host", "tune-gemm", "tune-few", "layer", "cutlass-tiles")


def among(allowed):
    """An argparse type: a comma list whose every item is in `allowed`."""
    def parse(s: str) -> list[str]:
        items = s.split(",")
        if unknown := [x for x in items if x not in allowed]:
            raise argparse.ArgumentTypeError(f"{unknown}: must be among {list(allowed)}")
        return items
    return parse


def ints_at_least(lo: int):
    """An argparse type: a comma list of ints >= lo."""
    def parse(s: str) -> list[int]:
        try:
            out = [int(t) for t in s.split(",")]
        except ValueError:
            out = [lo - 1]
        if min(out) < lo:
            raise argparse.ArgumentTypeError(f"{s!r}: must be a comma list of ints >= {lo}")
        return out
    return parse


def routing_shapes(s: str) -> dict[int, int]:
    """--tune-routing-shapes: a comma list of E:k (ints, 1 <= k <= E); empty for the default shapes."""
    try:
        shapes = {int(e): int(k) for e, k in (p.split(":") for p in s.split(",") if p)}
    except ValueError:
        shapes = {0: 0}
    if any(not 1 <= k <= e for e, k in shapes.items()):
        raise argparse.ArgumentTypeError(f"{s!r}: must be a comma list of E:k with ints 1 <= k <= E")
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=among(PARTS), default="routing,layer",
                    help=f"comma list of: {', '.join(PARTS)}")
    ap.add_argument("--tokens", type=ints_at_least(1), default=",".join(map(str, TOKENS)), help="comma list of T")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a first check)")
    ap.add_argument("--tune-shapes", type=among(LAYERS), default=",".join(LAYERS),
                    help=f"tune-gemm: comma list of layer shapes to tune ({', '.join(LAYERS)}); the others keep their "
                         "entry in grouped.TUNED")
    ap.add_argument("--tune-routing-shapes", type=routing_shapes, default="",
                    help="tune: comma list of E:k to tune (default the routing shapes' "
                         f"{','.join(f'{e}:{k}' for e, k in TUNE_SHAPES.items())}); other shapes write topic "
                         "routing-tune-wide, e.g. 256:8,512:10 for the routing-wide shapes")
    ap.add_argument("--tune-selects", default="all", choices=("all", "rowwise"),
                    help="tune: every selection, or the row kernel against the table's current pick")
    ap.add_argument("--batches", type=int, default=BATCHES,
                    help="layer: input batches at T=4096 the target's layers are timed on (1: the main batch only)")
    ap.add_argument("--no-pin", action="store_true", help="leave the process unpinned (default: pinned to the "
                    "allowed CPU with the fastest host probe, see pin_fastest_cpu)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this benchmark times GPU kernels (the notebook plots committed results on a CPU)")
    tokens, parts = args.tokens, args.parts
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
    host = {"pinned": None, "probe_us": {}} if args.no_pin else pin_fastest_cpu()
    REPIN["on"] = not args.no_pin
    common = {"copy_bandwidth_gbs": bw, "l2_bytes": l2, "host": host, "tuned_on": tuned_on()}
    if "tune" in parts:
        tune_shapes = args.tune_routing_shapes
        notes = ("native top-k Triton routing, GPU time per call in a CUDA graph (inputs rotated over 8 "
                 "tensors), per launch configuration: select (top-k method), tile (logits per program), "
                 "warps, split (threads per row). tuned_table: per (BLOCK_E, BLOCK_K) and T the "
                 "configuration with the least worst slowdown, the device's routing table (kernels/configs).")

        def save_routing_tune(rows):  # keys of tuned_table "(BLOCK_E, BLOCK_K)"
            extra = {**common, "tuned_table": {str(k): v for k, v in tuned_table(rows).items()}}
            return write_results("routing-tune-wide" if tune_shapes else "routing-tune", rows, extra=extra,
                                 notes=notes)

        rows = tune_routing(bw, args.tune_selects, tune_shapes or None, save_routing_tune)
        print("wrote", save_routing_tune(rows))
        print("wrote", install_tuned("routing", tuned_table(rows)))
        common["tuned_on"] = tuned_on()
    if "routing" in parts:
        notes = ("bf16 router logits, random normal. eager_us: host loop per call, Python launch included, "
                 "all methods timed in turn over 5 rounds (median), after 0.25 s of untimed rounds that "
                 "start after every method's first (compiling) call; the garbage collector is off while "
                 "timing. graph_us: GPU time per call inside one CUDA graph of >= 20 calls, inputs rotated "
                 "over up to 16 copies (3x L2 where 16 suffice; at T <= 4096 they stay in L2, as a router "
                 "GEMM's output does in a layer) (do_bench median of replays). hbm_bound_us: (logits read + "
                 "plan written) / measured copy bandwidth. Adaptive thresholds at the entropy terciles of a "
                 "4096-token calibration batch. graph_us None: the method cannot be captured (graph_note "
                 "says why). host: the process runs pinned to the allowed CPU with the fastest host probe "
                 "(pin_fastest_cpu; probe_us per CPU), pinned again before each (shape, T): host_cpu and its "
                 "host_probe_us per row.")
        save = functools.partial(_save, "routing-kernel", notes, common)
        print("wrote", save(bench_routing(tokens, bw, l2, args.quick, save)))
    if "routing-wide" in parts:  # the same timing for 256- and 512-expert routers (untuned launch)
        notes = ("as routing-kernel, for WIDE_ROUTING_SHAPES (E = 256 top-8, E = 512 top-10, renormalised): the "
                 "routing kernel with the device's DEFAULT launch (no tuned entry at these E), beside the same "
                 "baselines. bf16 router logits, random normal; eager_us and graph_us as there.")
        save = functools.partial(_save, "routing-wide", notes, common)
        print("wrote", save(bench_routing(tokens, bw, l2, args.quick, save, WIDE_ROUTING_SHAPES)))
    if "host" in parts:
        notes = ("host time per eager call (host loop, synchronised at the end; methods timed in turn over 7 "
                 "rounds, median, after 0.25 s of untimed rounds that start after every method's first call; "
                 "the garbage collector off while timing) of route_triton with the entropy-adaptive policy "
                 "on bf16 logits: direct launch (default), Triton's public launch path (moelab Launcher "
                 "disabled), the four plan allocations alone, and the torch TensorRT-LLM version without "
                 "statistics. experts / experts_public_launch: routing (native top-k) + padded layout + "
                 "fused Triton experts of each layer shape at T = 1 and 16, random bf16 weights; gpu_us: the "
                 "same call timed with CUDA events (do_bench median). host: pinned to the allowed CPU with "
                 "the fastest host probe (pin_fastest_cpu).")
        print("wrote", write_results("routing-host", bench_host(), notes=notes, extra=common))
    if "tune-gemm" in parts:
        notes = ("Triton expert GEMMs (moelab.kernels.grouped) per launch configuration (TMA: weight tiles, "
                 "and the down GEMM's rows, through tensor descriptors; PERSISTENT: one program per SM "
                 "looping over the tiles that exist, else one program per tile of the worst-case grid; "
                 "FLATTEN: the tile and K loops pipelined as one), GPU time (CUDA events, L2 flushed; the "
                 "median of 3 rounds of 20 ms in which every configuration of a (shape, plan) and CUTLASS "
                 "are timed in turn, in a seeded shuffled order per round; rounds_us) on the plans of "
                 "tune_policies (native top-k, terciles, and the median policy 'adaptive_q50' where it "
                 "differs) of each layer shape at T=4096, bf16, random weights; cutlass rows: "
                 "torch._grouped_mm on the same rows (gate_up: + gather and SwiGLU passes, which the Triton "
                 "gate_up fuses). tuned_table: per (D, F) and kernel the configuration with the smallest "
                 "worst slowdown over the plans, the device's grouped table (kernels/configs).")

        def save_tune(rows):
            table = tuned_experts_table(rows)
            return write_results("experts-tune", rows, extra={"tuned_table": {str(k): v for k, v in table.items()}},
                                 notes=notes)

        rows = tune_experts(save=save_tune, shapes=args.tune_shapes)
        print("wrote", save_tune(rows))
        print("wrote", install_tuned("grouped", tuned_experts_table(rows)))
        common["tuned_on"] = tuned_on()
    if "tune-few" in parts:  # the few-row launch per device (few_rows in its config)
        notes = ("Triton expert GEMMs at decode sizes (T in FEW_TOKENS, up to 64 padded rows per expert: the "
                 "grouped.FEW_ROWS[0] class) per launch configuration of FEW_CONFIGS (16- and 32-row tiles; "
                 "the first of each kernel is the FEW_ROWS[0] launch), pointer / TMA / persistent loads as "
                 "tune-gemm, on the plans of tune_policies, beside CUTLASS; timing as tune-gemm (interleaved "
                 "rounds, L2 flushed). few_table: per (D, F) and kernel the least-regret configuration over "
                 "(plan, T), its worst slowdown (regret) and the FEW_ROWS[0] launch's (current_regret).")
        few_rows: list = []

        def save_few(rows):
            table = tuned_few_table(few_rows + rows)
            return write_results("experts-tune-few", few_rows + rows, notes=notes,
                                 extra={**common, "few_table": {str(k): v for k, v in table.items()}})

        for t in FEW_TOKENS:
            few_rows += tune_experts(t, save=save_few, shapes=args.tune_shapes, configs=FEW_CONFIGS)
        print("wrote", save_few([]))
        print("wrote", install_tuned("few_rows", few_entries(tuned_few_table(few_rows))))
    if "cutlass-tiles" in parts:
        notes = ("torch._grouped_mm expert GEMMs (bf16, random weights N(0, 1/fan_in), random rows) on the padded "
                 "layout of native top-k and entropy-adaptive plans (terciles policy, as in the layer part) at "
                 "T = 4096 and 16384. large_tiles_us: as called by moelab (aten picks CUTLASS 128 x 256 tiles at "
                 "> 128 rows per group); small_tiles_us: the same GEMM with empty groups between the experts so "
                 "that rows / groups <= 128 and aten picks its 64 x 128 tiles. CUDA-event medians (do_bench). "
                 "same_output: the kept rows are bit-identical.")
        print("wrote", write_results("cutlass-tiles", bench_cutlass_tiles(), notes=notes, extra=common))
    if "layer" in parts:
        notes = ("bf16 MoE layer on random weights N(0, 1/fan_in) (seed 0) and random inputs; same weights "
                 "for all variants. time_us: do_bench median (CUDA events, L2 flushed between calls), eager "
                 "launch; every variant of a (shape, T), eager and graph, is timed in turn in 5 rounds (20 "
                 "ms each, 10 at T=65536; at T=4096 9 rounds of 50 ms), each round in a seeded shuffled "
                 "order: time_us / graph_us are the medians, *_rounds_us every round. gemm_tiles_128: sum "
                 "over experts of ceil(pairs / 128), the row tiles of a grouped GEMM with 128-row tiles; "
                 "gemm_tiles_64: the same with 64-row tiles. graph_us: ours captured in a CUDA graph (T <= "
                 "4096). moelab_*: router GEMM + Triton routing + padded layout + expert GEMMs as "
                 "set_gemm('auto') picks them (Triton grouped GEMMs up to 32 padded rows per expert, and "
                 "above where the device's tuned entry says they beat CUTLASS, else torch._grouped_mm) + "
                 "combine (+ shared expert for qwen15); moelab_*_triton: pinned to the Triton grouped GEMMs "
                 "(gather + gate_up + SwiGLU fused, down; at many rows per expert the device's tuned "
                 "configuration, else 64-row tiles); moelab_*_cutlass: pinned to Triton gather/SwiGLU + "
                 "torch._grouped_mm experts (set_gemm('grouped')). hf_*: transformers sparse MoE block with "
                 "experts implementation eager / grouped_mm. Adaptive: k levels (k/4, k/2, k) at the entropy "
                 "terciles of a 4096-token batch; _q25 / _q50 (T=4096): (k/2, k) at the 25% / 50% entropy "
                 "quantile; _routed_only (qwen15, T=4096): without the shared expert, whose time does not "
                 "shrink with k. rel_err_vs_hf: ||ours - hf_grouped_mm|| / ||hf|| (both bf16). "
                 "layer_targets: at T=4096, adaptive time / native time of the same expert path against 1.1 "
                 "x kept / native pairs. Inputs seeded by (T, batch) alone (layer_input; rows are batch 0); "
                 "batches: ours (native, every adaptive policy; qwen15 also routed only) at T=4096 on input "
                 "batches 1..4, each batch timed as the rows are; batch_targets: layer_targets per batch.")
        save = functools.partial(_save_layer, notes, common)
        print("wrote", save(*bench_layer(tokens, args.quick, save, args.batches)))


def install_tuned(table: str, entries: dict) -> Path:
    """Merge a tuning part's picks over this GPU's own entries of `table` ('routing', 'grouped' or 'few_rows'): in
    the tables this process runs with (the parts after it use them) and in kernels/configs/<device>.json (commit it
    to keep them). Shapes the GPU has no entry for still take a same-SM device's (kernels.device_table)."""
    from moelab.kernels import grouped as gk
    from moelab.kernels import routing as kr

    dev = torch.cuda.get_device_name(0)
    live = {"routing": kr.TUNED, "grouped": gk.TUNED, "few_rows": gk.FEW_TUNED}
    live[table][dev] = {**live[table].get(dev, {}), **entries}
    kr.clear_launch_caches()
    gk._launch_config.cache_clear()
    path = kernels.config_path(dev)
    tables = kernels.read_config(path) if path.exists() else {}
    return kernels.write_config(dev, {**tables, table: live[table][dev]})


def tuned_on() -> dict:
    """Whose tuned launch tables this GPU runs with (kernels.tuned_for): its own name, a same-SM device's, or
    None (the defaults), for the routing kernel and the grouped expert GEMMs."""
    from moelab.kernels import grouped as gk
    from moelab.kernels import routing as kr

    return {"routing": tuned_for(kr.TUNED, 0), "experts": tuned_for(gk.TUNED, 0)}


def _save(topic, notes, common, rows):
    return write_results(topic, rows, notes=notes, extra=common)


def _save_layer(notes, common, rows, batches=()):
    from moelab.kernels import grouped as gk

    # the expert GEMM configurations the run used (a tune-gemm / tune-few part before it in the same run replaces them)
    tuned = {str(k): v for k, v in device_table(gk.TUNED, 0).items()}
    few = {str(k): v for k, v in own_table(gk.FEW_TUNED, 0).items()}  # decode sizes: the device's own entries
    # with the tuned tiles, so that the stored labels' tile shares are the report's (layer_targets)
    targets = layer_targets({"rows": rows, "experts_tuned": tuned}).to_dict("records") if rows else []
    per_batch = (batch_targets({"rows": rows, "batches": list(batches), "experts_tuned": tuned}).to_dict("records")
                 if batches else [])
    return write_results("moe-layer", rows, notes=notes,
                         extra={**common, "layer_targets": targets, "batches": list(batches),
                                "batch_targets": per_batch, "experts_tuned": tuned, "experts_few_tuned": few})


if __name__ == "__main__":
    main()
