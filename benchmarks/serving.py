"""Whole-model speed at full layer shapes: prefill, decode with a KV cache in CUDA graphs, adaptive k end to end,
and the graph pool with a real cache.

Models are random-initialised in bf16 with the layer shapes of OLMoE-1B-7B (16 layers), Qwen1.5-MoE-A2.7B (24
layers, shared expert) and Mixtral-8x7B (32 layers, or as many as fit the GPU: the row says how many). Router
weights are redrawn so that router logits have standard deviation `--router-std`: token entropies then spread,
instead of every token sitting near log E as with the default initialisation.

Arms (prefill and decode):
  hf          transformers as shipped (its default experts implementation, recorded in `experts_impl`)
  hf-graph    decode only: the same model, static KV cache, each decode step captured in a CUDA graph
  native      moelab routing with the model's own top-k (`moelab.hf.patched`)
  eak-<p>     EntropyAdaptiveK((k_lo, k), (t,)) per layer, t at the entropy quantile that keeps p% of the native
              pairs on a calibration batch (k_lo = max(1, k // 2))
  ratio-<p>   RatioSkip(beta, k) per layer, beta bisected on the calibration batch to keep p% of the native pairs
Prefill: batch x length 1x2048, 8x1024, 4x4096 (no cache, last-position logits). Decode: one token per sequence
per step into a static cache of 2048 positions (attended, masked, whatever they hold), batch 1, 16, 64, every arm
in a CUDA graph of moelab.graphs.GraphRunner; `hf` decode runs eager.
Amdahl: the share s of the native prefill spent in the routed experts (CUDA events around every experts module)
predicts t(f) = t_native * (1 - s * (1 - f)) at a measured kept fraction f.
Pool (--parts pool): notebook 06's arms on this KV-cache decode (buckets 1, 16, 64 on one cache): eager, private
pools, one shared pool, shared pool with the eager prefill borrowing it; peaks, the share of eager scratch bytes in
the pool, decode tokens/s, and a stress of interleaved prefills and replays checked against the plain forward.

    python benchmarks/serving.py --models olmoe-1b-7b,qwen1.5-moe-a2.7b --parts prefill,decode,pool
    python benchmarks/serving.py --models mixtral-8x7b --parts prefill,decode
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import logging
import math
import statistics
import time

import torch

log = logging.getLogger("serving")
GiB = float(1 << 30)
MiB = float(1 << 20)

# name -> (family, transformers config kwargs): the published models' layer shapes
FULL = {
    "olmoe-1b-7b": ("olmoe", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096)),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, max_position_embeddings=8192,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6)),
}
CLASSES = {"olmoe": ("OlmoeConfig", "OlmoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM")}
PREFILL = ((1, 2048), (8, 1024), (4, 4096))
DECODE = (1, 16, 64)
KEEP = (0.9, 0.75, 0.6)
CACHE_LEN = 2048
DECODE_START = 1024


# ----------------------------------------------------------------------------------------------- models
def layer_bytes(cfg) -> int:
    """bf16 bytes of one decoder layer (attention + routed experts + shared expert + router)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // h
    kv = getattr(cfg, "num_key_value_heads", None) or h
    attn = d * hd * (2 * h + 2 * kv)
    e = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    f = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    shared = 3 * d * getattr(cfg, "shared_expert_intermediate_size", 0)
    return 2 * (attn + 3 * e * d * f + shared + e * d)


def kv_bytes(cfg, batch: int, length: int) -> int:
    """bf16 bytes of one layer's static KV cache."""
    h = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * 2 * batch * h * length * hd


def build(name: str, layers: int | None, router_std: float, reserve_gib: float):
    """(model, layers built): the random-initialised bf16 model on the current GPU, with as many of its layers as
    fit beside `reserve_gib` of working memory and the KV cache of the largest decode batch."""
    import transformers

    family, kw = FULL[name]
    cfg_name, model_name = CLASSES[family]
    cfg = getattr(transformers, cfg_name)(**kw)
    full = cfg.num_hidden_layers
    free = torch.cuda.mem_get_info()[0]
    per_layer = layer_bytes(cfg) + kv_bytes(cfg, max(DECODE), CACHE_LEN)
    embed = 2 * 2 * cfg.vocab_size * cfg.hidden_size
    fit = int((free - reserve_gib * GiB - embed) // per_layer)
    n = min(full, fit) if layers is None else layers
    if n < 1:
        raise RuntimeError(f"{name}: not one layer fits ({free / GiB:.1f} GiB free, {per_layer / GiB:.2f} GiB a layer)")
    cfg.num_hidden_layers = n
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = getattr(transformers, model_name)(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    from moelab.hf import moe_layers

    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            w = layer.block.gate.weight
            w.copy_(torch.randn(w.shape, generator=g, device=w.device) * (router_std / math.sqrt(w.shape[1])))
    return model, n, full


# --------------------------------------------------------------------------------------------- KV cache
def _cache_classes():
    from transformers.cache_utils import Cache, StaticLayer

    return Cache, StaticLayer


class StaticKV:
    """A static KV cache [B_max, H, L, D] per layer for transformers models: a forward of b <= B_max sequences
    writes its keys and values at positions `pos` into the first b rows and attends over all L positions (the
    causal mask hides those past the query). One cache serves every decode bucket."""

    def __new__(cls, model, batch: int, length: int):
        Cache, StaticLayer = _cache_classes()

        class _KV(Cache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                b = key_states.shape[0]
                k, v = self.k[layer_idx][:b], self.v[layer_idx][:b]
                k.index_copy_(2, self.pos, key_states)
                v.index_copy_(2, self.pos, value_states)
                return k, v

        cfg = model.config.get_text_config()
        p = next(model.parameters())
        h = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (batch, h, length, d)
        ks = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        vs = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        layers = []
        for k, v in zip(ks, vs):
            lay = StaticLayer(max_cache_len=length)
            lay.keys, lay.values, lay.is_initialized = k, v, True
            lay.device, lay.dtype = p.device, p.dtype
            lay.max_batch_size = lay.batch_size = batch
            lay.num_heads, lay.head_dim, lay.k_head_dim, lay.v_head_dim = h, d, d, d
            layers.append(lay)
        cache = _KV(layers=layers)
        cache.k, cache.v = ks, vs
        cache.pos = None  # set by each forward (kv_step)
        cache.idle = torch.zeros((), dtype=torch.long, device=p.device)
        return cache


def kv_step(model, cache, output: str = "ids"):
    """step(ids_BL, pos_B) -> greedy ids [B] (or last-position logits): the L new tokens of every sequence at
    positions pos_B[0] .. pos_B[0] + L - 1 (all sequences of a step at one position), through the cache.
    Capturable: positions stay on the device."""
    params = inspect.signature(model.model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    takes_cache_position = "cache_position" in params

    def step(ids_BL, pos_B):
        B, L = ids_BL.shape
        pos_L = pos_B[:1] + torch.arange(L, device=ids_BL.device)
        cache.pos = pos_L
        start = pos_B[0]
        for lay in cache.layers:  # newer transformers offset the causal mask by the layers' length
            lay.cumulative_length = start
        kw = {cache_kw: cache, "position_ids": pos_L[None].expand(B, L)}
        if takes_cache_position:
            kw["cache_position"] = pos_L
        try:
            out = model(input_ids=ids_BL, use_cache=True, logits_to_keep=1, output_router_logits=False, **kw)
        finally:  # no tensor of this forward outlives it (an eager forward borrowing a graph pool must leave none)
            cache.pos = None
            for lay in cache.layers:
                lay.cumulative_length = cache.idle
        logits = out.logits[:, -1]
        return logits.argmax(-1) if output == "ids" else logits

    return step


# --------------------------------------------------------------------------------------------- policies
def arm_policies(model, calib_ids) -> dict:
    """{arm: per-layer policy list (None: unpatched)} with thresholds set per layer on the calibration batch."""
    from moelab.hf import moe_layers, native_policy, record_router
    from moelab.routing import EntropyAdaptiveK, RatioSkip, route_torch

    layers = moe_layers(model)
    with torch.no_grad(), record_router(model, logits=True) as rec:
        model(input_ids=calib_ids, use_cache=False, logits_to_keep=1)
    arms = {"hf": None, "native": [native_policy(layer) for layer in layers]}
    for keep in KEEP:
        eak, ratio = [], []
        for layer in layers:
            k, renorm = layer.native_k, layer.renormalize
            logits = rec.router_logits(layer.index).float()
            ent = rec.entropy(layer.index).float()
            k_lo = max(1, k // 2)
            share_hi = (keep * k - k_lo) / (k - k_lo)  # tokens at k, the rest at k_lo
            t = float(torch.quantile(ent, min(max(1 - share_hi, 0.0), 1.0)))
            eak.append(EntropyAdaptiveK((k_lo, k), (t,), renormalize=renorm))
            lo, hi = 0.0, 1.0
            for _ in range(30):  # larger beta keeps fewer
                mid = (lo + hi) / 2
                kept = route_torch(logits, RatioSkip(mid, k), renorm).k.float().mean().item() / k
                lo, hi = (mid, hi) if kept > keep else (lo, mid)
            ratio.append(RatioSkip((lo + hi) / 2, k, renormalize=renorm))
        arms[f"eak-{round(100 * keep)}"] = eak
        arms[f"ratio-{round(100 * keep)}"] = ratio
    return arms


@contextlib.contextmanager
def arm_context(model, policies):
    """The model routed by moelab with these policies (check=False: no host sync, capturable), or unchanged."""
    if policies is None:
        yield None
        return
    from moelab.hf import patched

    with patched(model, policies, check=False) as patch:
        yield patch


def kept_fraction(patch) -> float | None:
    """Kept pairs over native pairs of the eager forwards counted so far."""
    if patch is None:
        return None
    kept = sum(int(v) for v in patch.kept_pairs.values())
    native = sum(patch.tokens[i] * patch.layers[i].native_k for i in patch.tokens)
    return kept / native if native else None


# ----------------------------------------------------------------------------------------------- timing
def cuda_ms(fn, reps: int, warmup: int = 1) -> list[float]:
    """Milliseconds of each of `reps` calls, after `warmup` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


@contextlib.contextmanager
def expert_timer(model):
    """Collect CUDA events around every experts module's forward; yields a function giving their total ms."""
    from moelab.hf import moe_layers

    pairs: list = []
    handles = []

    def pre(mod, args, kwargs=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        pairs.append([e])

    def post(mod, args, out):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        pairs[-1].append(e)

    for layer in moe_layers(model):
        handles.append(layer.block.experts.register_forward_pre_hook(pre))
        handles.append(layer.block.experts.register_forward_hook(post))
    try:
        yield lambda: (torch.cuda.synchronize(), sum(a.elapsed_time(b) for a, b in pairs))[1]
    finally:
        for h in handles:
            h.remove()


def clean():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- prefill
def prefill_rows(name, model, arms, args, meta) -> list[dict]:
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for B, L in PREFILL:
        ids = torch.randint(0, vocab, (B, L), device="cuda", generator=g)
        fwd = functools.partial(model, input_ids=ids, use_cache=False, logits_to_keep=1)
        base = {"model": name, "part": "prefill", "batch": B, "length": L, "tokens": B * L, **meta}
        native_ms = share = None
        for arm, pols in arms.items():
            try:
                with torch.no_grad(), arm_context(model, pols) as patch:
                    ms = cuda_ms(fwd, args.reps)
                    kept = kept_fraction(patch)
                    if arm == "native":
                        with expert_timer(model) as expert_ms:
                            total = cuda_ms(fwd, 1, warmup=0)[0]
                            share = expert_ms() / total
            except torch.cuda.OutOfMemoryError as e:
                rows.append({**base, "arm": arm, "error": f"OutOfMemoryError: {str(e)[:200]}"})
                clean()
                continue
            med = statistics.median(ms)
            row = {**base, "arm": arm, "ms": med, "ms_min": min(ms), "ms_max": max(ms), "reps": len(ms),
                   "tokens_per_s": B * L / med * 1e3, "kept_fraction": kept}
            if arm == "native":
                native_ms = med
                row["expert_share"] = share
            elif native_ms is not None and kept is not None:
                row["amdahl_ms"] = native_ms * (1 - share * (1 - kept))
                row["vs_amdahl"] = med / row["amdahl_ms"] - 1
                row["saving_vs_native"] = 1 - med / native_ms
                row["amdahl_saving"] = share * (1 - kept)
            rows.append(row)
            log.info("%s prefill %dx%d %s: %.2f ms (kept %s)", name, B, L, arm, med, kept)
        hf = next((r for r in rows[-len(arms):] if r["arm"] == "hf" and "ms" in r), None)
        for r in rows[-len(arms):]:
            if hf is not None and "ms" in r:
                r["speedup_vs_hf"] = hf["ms"] / r["ms"]
        ids = fwd = None
        clean()
    return rows


# ----------------------------------------------------------------------------------------------- decode
def decode_rows(name, model, arms, args, meta, stream) -> list[dict]:
    from moelab.graphs import GraphRunner

    vocab = model.config.vocab_size
    cache = StaticKV(model, max(DECODE), CACHE_LEN)
    step = kv_step(model, cache)
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for B in DECODE:
        ids = [torch.randint(0, vocab, (B, 1), device="cuda", generator=g) for _ in range(args.steps)]
        pos = [torch.full((B,), DECODE_START + i, dtype=torch.long, device="cuda") for i in range(args.steps)]
        base = {"model": name, "part": "decode", "batch": B, "cache_len": CACHE_LEN, "steps": args.steps, **meta}
        variants = [("hf", None, False), ("hf-graph", None, True)]
        variants += [(a, p, True) for a, p in arms.items() if p is not None]
        for arm, pols, graphs in variants:
            runner = None
            try:
                with torch.no_grad(), arm_context(model, pols) as patch:
                    if graphs:
                        runner = GraphRunner(step, functools.partial(first_rows, (ids[0], pos[0])), [B],
                                             stream=stream).capture()
                    loop = functools.partial(run_steps, runner if runner is not None else step, ids, pos)

                    ms = [m / len(pos) for m in cuda_ms(loop, args.reps)]
                    kept = None
                    if patch is not None:  # the same inputs eagerly, counted (replays are not)
                        patch.reset_counts()
                        run_steps(step, ids, pos)
                        kept = kept_fraction(patch)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # OOM, or a forward that cannot be captured
                rows.append({**base, "arm": arm, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                log.warning("%s decode b=%d %s: %s", name, B, arm, rows[-1]["error"])
                runner = None
                clean()
                continue
            med = statistics.median(ms)
            rows.append({**base, "arm": arm, "graphs": graphs, "ms_per_step": med, "ms_min": min(ms),
                         "ms_max": max(ms), "reps": len(ms), "tokens_per_s": B / med * 1e3, "kept_fraction": kept})
            log.info("%s decode b=%d %s: %.3f ms/step", name, B, arm, med)
            runner = loop = None
            clean()
        by = {r["arm"]: r for r in rows if r.get("batch") == B and "ms_per_step" in r}
        for r in by.values():
            for ref in ("hf-graph", "native"):
                if ref in by:
                    r[f"speedup_vs_{ref.replace('-', '_')}"] = by[ref]["ms_per_step"] / r["ms_per_step"]
    cache = step = None
    clean()
    return rows


def first_rows(inputs: tuple, b: int) -> tuple:
    return tuple(t[:b] for t in inputs)


def run_steps(fn, ids, positions) -> None:
    for x, p in zip(ids, positions):
        fn(x, p)


# ------------------------------------------------------------------------------------------------- pool
def pools_of(snapshot) -> dict:
    out: dict = {}
    for s in snapshot:
        pid = tuple(s.get("segment_pool_id", (0, 0)))
        out[pid] = out.get(pid, 0) + s["total_size"]
    return out


def pool_rows(name, model, args, meta, stream) -> list[dict]:
    """Notebook 06's arms on the KV-cache decode: memory, proof of where eager scratch lands, speed, stress."""
    from moelab.graphs import GraphRunner

    vocab = model.config.vocab_size
    buckets = list(DECODE)
    cache = StaticKV(model, max(buckets), CACHE_LEN)
    step = kv_step(model, cache)
    g = torch.Generator(device="cuda").manual_seed(4)
    pb, pl = args.pool_prefill
    prompt = (torch.randint(0, vocab, (pb, pl), device="cuda", generator=g), torch.zeros(pb, dtype=torch.long,
                                                                                          device="cuda"))
    dec = {b: (torch.randint(0, vocab, (b, 1), device="cuda", generator=g),
               torch.full((b,), DECODE_START, dtype=torch.long, device="cuda")) for b in buckets}
    sizes = [buckets[i % len(buckets)] for i in range(args.steps * len(buckets))]
    rows = []
    for arm in ("eager", "private", "shared", "shared+reuse"):
        clean()
        torch.cuda.reset_peak_memory_stats()
        base_res = torch.cuda.memory_reserved()
        runner = None
        t0 = time.perf_counter()
        with torch.no_grad():
            if arm != "eager":
                runner = GraphRunner(step, lambda b: dec[b], buckets, stream=stream,
                                     pool="private" if arm == "private" else "shared",
                                     eager_example=prompt if arm == "shared+reuse" else None)
                runner.capture()
            capture_s = time.perf_counter() - t0
            snap = torch.cuda.memory_snapshot()
            graph_pool = sum(v for p, v in pools_of(snap).items() if p != (0, 0))
            torch.cuda.reset_peak_memory_stats()
            base_serving = torch.cuda.memory_reserved()

            if runner is None:
                prefill = functools.partial(step, *prompt)
                decode = lambda b, f=step: f(*dec[b])  # noqa: E731
            else:
                prefill = functools.partial(runner.eager, *prompt, reuse=arm == "shared+reuse")
                decode = lambda b, f=runner: f(*dec[b])  # noqa: E731

            prefill()
            decode(buckets[0])
            torch.cuda.synchronize()
            t_pre = t_dec = 0.0
            for _ in range(args.rounds):
                t1 = time.perf_counter()
                prefill()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                for b in sizes:
                    decode(b)
                torch.cuda.synchronize()
                t_pre += t2 - t1
                t_dec += time.perf_counter() - t2
            row = {"model": name, "part": "pool", "arm": arm, "buckets": buckets, "cache_len": CACHE_LEN,
                   "prefill_batch": pb, "prefill_len": pl, "capture_s": capture_s,
                   "graph_pool_mib": graph_pool / MiB,
                   "reserved_peak_mib": (torch.cuda.max_memory_reserved() - base_res) / MiB,
                   "serving_reserved_peak_mib": (torch.cuda.max_memory_reserved() - base_res) / MiB,
                   "serving_start_mib": (base_serving - base_res) / MiB,
                   "steady_reserved_mib": (torch.cuda.memory_reserved() - base_res) / MiB,
                   "decode_tokens_per_s": args.rounds * sum(sizes) / t_dec,
                   "prefill_ms": 1e3 * t_pre / args.rounds, **meta}
            if runner is not None and runner.pool is not None:
                proof = runner.scratch_fraction_in_pool(*prompt, reuse=arm == "shared+reuse")
                row.update({"scratch_fraction_in_pool": proof["fraction_in_pool"],
                            "scratch_mib": proof["scratch_bytes"] / MiB,
                            "scratch_fraction_on_graph_blocks": proof["fraction_on_graph_blocks"],
                            "eager_fallbacks": runner.eager_fallbacks})
            if arm == "shared+reuse":
                short = (prompt[0][:1, :256], prompt[1][:1])
                row.update(stress(runner, step, short, dec, buckets, args.stress))
        rows.append(row)
        log.info("%s pool %s: peak %.0f MiB, %.0f tok/s", name, arm, row["reserved_peak_mib"],
                 row["decode_tokens_per_s"])
        runner = None
    by = {r["arm"]: r for r in rows}
    bound = max(by["shared"]["graph_pool_mib"], by["eager"]["reserved_peak_mib"])
    reuse, shared = by["shared+reuse"], by["shared"]
    rows.append({"model": name, "part": "pool", "arm": "summary", "graph_pool_mib": shared["graph_pool_mib"],
                 "eager_reserved_peak_mib": by["eager"]["reserved_peak_mib"], "max_mib": bound,
                 "reuse_reserved_peak_mib": reuse["reserved_peak_mib"],
                 "no_reuse_reserved_peak_mib": shared["reserved_peak_mib"],
                 "private_reserved_peak_mib": by["private"]["reserved_peak_mib"],
                 "reuse_over_max": reuse["reserved_peak_mib"] / bound,
                 "saved_mib": shared["reserved_peak_mib"] - reuse["reserved_peak_mib"],
                 "saved_pct": 100 * (1 - reuse["reserved_peak_mib"] / shared["reserved_peak_mib"]),
                 "tokens_per_s_reuse_over_no_reuse": reuse["decode_tokens_per_s"] / shared["decode_tokens_per_s"],
                 "stress_mismatches": reuse.get("stress_mismatches"), **meta})
    cache = step = None
    clean()
    return rows


def stress(runner, step, prompt, dec, buckets, n: int) -> dict:
    """n rounds of: eager prefill borrowing the pool, and one replay of a bucket; each output against the plain
    forward of the same inputs (ordinary allocator, no graph). Equal greedy ids expected everywhere."""
    mism = checks = 0
    for i in range(n):
        b = buckets[i % len(buckets)]
        got_p = runner.eager(*prompt, reuse=True)
        want_p = step(*prompt)
        got_d = runner(*dec[b]).clone()
        want_d = step(*dec[b])
        mism += int((got_p != want_p).sum()) + int((got_d != want_d).sum())
        checks += got_p.numel() + got_d.numel()
    torch.cuda.synchronize()
    return {"stress_rounds": n, "stress_checks": checks, "stress_mismatches": mism}


# ------------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="olmoe-1b-7b,qwen1.5-moe-a2.7b,mixtral-8x7b")
    ap.add_argument("--parts", default="prefill,decode,pool", help="any of prefill, decode, pool")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's, as many as fit)")
    ap.add_argument("--router-std", type=float, default=2.0, help="standard deviation of the router logits")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of each measurement")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed repetition")
    ap.add_argument("--rounds", type=int, default=3, help="pool: serving rounds (a prefill, then decode steps)")
    ap.add_argument("--stress", type=int, default=1000, help="pool: interleaved prefill/replay rounds checked")
    ap.add_argument("--pool-prefill", default="4x1024", help="pool: the eager prefill, BATCHxLENGTH")
    ap.add_argument("--pool-models", default="olmoe-1b-7b,qwen1.5-moe-a2.7b")
    ap.add_argument("--reserve-gib", type=float, default=14.0, help="working memory left free when fitting layers")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop before a part that starts after this many seconds (0: no limit); the file says so")
    ap.add_argument("--topic", default="serving")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    names = args.models.split(",")
    parts = set(args.parts.split(","))
    if bad := [m for m in names if m not in FULL]:
        ap.error(f"--models {bad}: choose from {sorted(FULL)}")
    if bad := parts - {"prefill", "decode", "pool"}:
        ap.error(f"--parts {sorted(bad)}: choose from prefill, decode, pool")
    try:
        pb, pl = (int(x) for x in args.pool_prefill.split("x"))
    except ValueError:
        ap.error(f"--pool-prefill={args.pool_prefill!r}: must be BATCHxLENGTH, e.g. 4x1024")
    args.pool_prefill = (pb, pl)
    for flag in ("reps", "steps", "rounds", "stress"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/serving.py measures CUDA graphs and needs a GPU")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from moelab.results import write_results

    rows, errors = [], []
    stream = torch.cuda.Stream()
    t_start = time.perf_counter()

    def write():
        notes = ("Random-initialised bf16 models at full layer shapes; router logits std "
                 f"{args.router_std}; thresholds per layer from a calibration batch of 4 x 512 random tokens. "
                 "Prefill: CUDA-event time of one forward (no cache, last-position logits), median of reps. "
                 f"Decode: {args.steps} steps from position {DECODE_START} into a static cache of {CACHE_LEN} "
                 "positions; ms_per_step is the median over reps. Amdahl: amdahl_ms = native ms * (1 - expert_share "
                 "* (1 - kept_fraction)). Pool: buckets share one cache outside the pool; peaks over each arm's "
                 "start. " + " | ".join(errors))
        return write_results(args.topic, rows, notes=notes, out_dir=args.out_dir)

    for name in names:
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            errors.append(f"{name}: not run (past --budget-s {args.budget_s:g})")
            continue
        try:
            model, n, full = build(name, args.layers, args.router_std, args.reserve_gib)
        except (RuntimeError, ValueError) as e:
            errors.append(f"{name}: {type(e).__name__}: {e}")
            log.warning("%s", errors[-1])
            continue
        cfg = model.config
        meta = {"layers": n, "layers_full": full, "experts_impl": getattr(cfg, "_experts_implementation", None),
                "attn_impl": getattr(cfg, "_attn_implementation", None)}
        log.info("%s: %d of %d layers, %.1f GiB of weights", name, n, full,
                 sum(p.numel() * p.element_size() for p in model.parameters()) / GiB)
        g = torch.Generator(device="cuda").manual_seed(5)
        calib = torch.randint(0, model.config.vocab_size, (4, 512), device="cuda", generator=g)
        arms = arm_policies(model, calib)
        rows.extend({"model": name, "part": "calibration", "arm": a, "policies": [repr(p) for p in pols], **meta}
                    for a, pols in arms.items() if pols)
        for part in ("prefill", "decode", "pool"):
            if part not in parts or (part == "pool" and name not in args.pool_models.split(",")):
                continue
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                errors.append(f"{name} {part}: not run (past --budget-s {args.budget_s:g})")
                continue
            t0 = time.perf_counter()
            try:
                if part == "prefill":
                    rows.extend(prefill_rows(name, model, arms, args, meta))
                elif part == "decode":
                    rows.extend(decode_rows(name, model, arms, args, meta, stream))
                else:
                    rows.extend(pool_rows(name, model, args, meta, stream))
            except (RuntimeError, ValueError) as e:
                errors.append(f"{name} {part}: {type(e).__name__}: {str(e)[:300]}")
                log.exception("%s %s failed", name, part)
                clean()
            log.info("%s %s took %.0f s", name, part, time.perf_counter() - t0)
            write()
        model = arms = None
        clean()
    print(write())


if __name__ == "__main__":
    main()
