"""CUDA-graph memory pool reuse, measured: four arms with everything else fixed, and adaptive routing in graphs.

Workload per model (the same in every arm): `rounds` times one eager forward of a prompt chunk
(prefill_tokens tokens as sequences of prefill_len, capped at the model's max_position_embeddings) and
`decode_steps` decode steps of random batch sizes in [1, max bucket] (one new token per sequence, no
KV cache: context length 1). Both return only what a server needs: greedy next-token ids of the last
position (--output logits: last-position logits), so output copies stay small; the graphs' static
outputs are rows of one buffer per output, outside the pool (moelab.graphs).
Arms:
  eager          no graphs; decode and prefill eager
  private        decode graphs, one private pool per bucket; prefill eager (ordinary allocator)
  shared         decode graphs in one shared MemPool, captured largest first; prefill eager (ordinary)
  shared+reuse   as shared, and the prefill's memory comes from the graph pool (moelab.graphs); the
                 runner is given the prefill as its eager example and captures with prime='auto' (its
                 default): both layouts are tried and the one with the smaller pool is kept (prime_choice)
  shared+reuse-primed    always primed: one prefill runs in the pool before capture, so the graphs
                 are captured into segments already sized for the eager forward
  shared+reuse-unprimed  never primed: the graphs' segments come first and the prefill adds
                 segments of its own sizes to the pool
Recorded per arm: allocator reserved/allocated peaks over the arm's start, driver-level used memory
(torch.cuda.mem_get_info), bytes per pool, decode tokens/s, and (shared arms) the share of the
prefill's allocated bytes that fell inside the graph pool.
Adaptive (--adaptive): decode (batch sizes drawn from the buckets) with moelab routing + skipping
experts (Triton routing kernel and padded pair layout, fixed worst-case capacity T * k_max) captured
in the graphs; tokens/s graphs vs eager and EntropyAdaptiveK vs the native TopK through the same path.

python benchmarks/graph_pool.py --models tiny-mixtral,tiny-qwen-moe,tiny-olmoe,synthetic --adaptive
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import random
import time

import torch
from tqdm import tqdm

from moelab.graphs import REUSE_PEAK_LIMIT, REUSE_SPEED_FLOOR, GraphRunner, hf_decode_step, make_buckets, pool_bytes
from moelab.results import write_results

log = logging.getLogger("graph_pool")
MiB = float(1 << 20)
ARMS = ("eager", "private", "shared", "shared+reuse", "shared+reuse-primed", "shared+reuse-unprimed")

# a Mixtral-like config, random-initialised, sized so that activations and pools are hundreds of MiB
# (Mixtral-8x7B's layer shapes, 4 layers instead of 32)
SYNTHETIC = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
)


def load_model(name: str, device):
    """(model, how): an embedded checkpoint if trained, else the registry config random-initialised."""
    from moelab import models

    if name == "synthetic":
        from transformers import MixtralConfig, MixtralForCausalLM

        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of 11 GiB
        try:
            with torch.device(device):
                model = MixtralForCausalLM(MixtralConfig(**SYNTHETIC)).eval()
        finally:
            torch.set_default_dtype(old)
        return model, "random-init Mixtral-like " + ",".join(f"{k}={v}" for k, v in SYNTHETIC.items()), None
    try:
        model, tokenizer = models.load(name, device=device)
        return model, "trained checkpoint data/models/" + name, tokenizer
    except FileNotFoundError as e:
        log.warning("%s: %s; using the registry config, random-initialised", name, e)
        return models.build(name).to(device, torch.bfloat16).eval(), "random-init (checkpoint not present)", None


def text_tokens(tokenizer, device) -> torch.Tensor | None:
    """Held-out text (never trained on, not the evaluation set) as one token stream; None without a tokenizer."""
    if tokenizer is None:
        return None
    from moelab.data import heldout_texts

    text = "\n".join(heldout_texts().values())
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long, device=device)


def sample_ids(src, vocab, batch, length, gen) -> torch.Tensor:
    """[batch, length] token ids: contiguous windows of the text stream, or uniform random ids without text."""
    dev = torch.device("cuda")
    if src is None:
        return torch.randint(0, vocab, (batch, length), device=dev, generator=gen)
    starts = torch.randint(0, src.numel() - length, (batch,), device=dev, generator=gen)
    return src[starts[:, None] + torch.arange(length, device=dev)[None, :]]


def prefill_shape(model, tokens: int, length: int) -> tuple[int, int]:
    """(batch, length) of the prompt chunk: sequences of `length` (at most the model's context), `tokens` in all."""
    length = min(length, getattr(model.config, "max_position_embeddings", length))
    if tokens < length:
        raise ValueError(f"prefill_tokens={tokens}: must be >= the sequence length {length}")
    return tokens // length, length


def sync():
    torch.cuda.synchronize()


def clean():
    gc.collect()
    sync()
    torch.cuda.empty_cache()


def pools_of(snapshot) -> dict:
    """Reserved bytes per pool id (default pool = (0, 0))."""
    out: dict = {}
    for s in snapshot:
        pid = tuple(s.get("segment_pool_id", (0, 0)))
        out[pid] = out.get(pid, 0) + s["total_size"]
    return out


def run_arm(arm, step, vocab, buckets, chunk, args, stream, own_pools, src=None, seed=0):
    """One arm of the workload (chunk = prompt (batch, length)); returns its row (memory, throughput, proof).

    own_pools: (weights pool, inputs pool); the workload's token ids go to the inputs pool, so the default
    pool holds nothing at an arm's start and every arm's peak is its own forward's memory."""
    dev = torch.device("cuda")
    rng = random.Random(seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_b = buckets[-1]
    sizes = [rng.randint(1, max_b) for _ in range(args.rounds * args.decode_steps)]
    with torch.cuda.use_mem_pool(own_pools[1]):
        prompts = sample_ids(src, vocab, chunk[0], chunk[1], gen)
        decode_ids = {n: sample_ids(src, vocab, n, 1, gen) for n in set(sizes)}
        pad_ids = {b: torch.zeros(b, 1, dtype=torch.long, device=dev) for b in buckets}
    skip = {(0, 0)} | {p.id for p in own_pools}
    clean()
    torch.cuda.reset_peak_memory_stats()
    base_res, base_alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    base_default = pools_of(torch.cuda.memory_snapshot()).get((0, 0), 0)

    def graph_pools(snapshot) -> dict:
        return {p: v for p, v in pools_of(snapshot).items() if p not in skip}

    free0 = torch.cuda.mem_get_info()[0]
    min_free = free0
    runner = None
    t_capture = 0.0
    if arm != "eager":
        t0 = time.perf_counter()
        runner = GraphRunner(step, lambda b: (decode_ids.get(b, pad_ids[b]),), buckets,
                             pool="private" if arm == "private" else "shared", stream=stream,
                             eager_example=(prompts,) if arm in ("shared+reuse", "shared+reuse-primed") else None)
        runner.capture(prime=True if arm == "shared+reuse-primed" else "auto")
        t_capture = time.perf_counter() - t0
    graph_pool_capture = sum(graph_pools(torch.cuda.memory_snapshot()).values())
    capture_peak = torch.cuda.max_memory_reserved() - base_res
    capture_driver = free0 - torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()  # from here on: the serving loop (warm-up blocks released)

    def prefill():
        with torch.no_grad():
            if arm.startswith("shared+reuse"):
                return runner.eager(prompts, reuse=True)
            if runner is not None:
                return runner.eager(prompts, reuse=False)
            return step(prompts)

    def decode(n):
        with torch.no_grad():
            return runner(decode_ids[n]) if runner is not None else step(decode_ids[n])

    # warm-up round (not timed): lazily created state lands before the measured rounds
    prefill()
    decode(sizes[0])
    sync()
    t_dec = t_pre = 0.0
    tokens = 0
    k = 0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        prefill()
        sync()
        t1 = time.perf_counter()
        min_free = min(min_free, torch.cuda.mem_get_info()[0])
        for _ in range(args.decode_steps):
            decode(sizes[k])
            tokens += sizes[k]
            k += 1
        sync()
        t2 = time.perf_counter()
        t_pre += t1 - t0
        t_dec += t2 - t1
    min_free = min(min_free, torch.cuda.mem_get_info()[0])
    snap = torch.cuda.memory_snapshot()
    by_pool = graph_pools(snap)
    default_end = pools_of(snap).get((0, 0), 0)
    row = {
        "arm": arm,
        "buckets": buckets,
        "prefill_batch": chunk[0],
        "prefill_len": chunk[1],
        "prefill_tokens": chunk[0] * chunk[1],
        "output": args.output,
        "decode_tokens": tokens,
        "decode_tokens_per_s": tokens / t_dec,
        "prefill_ms": 1e3 * t_pre / args.rounds,
        "capture_s": t_capture,
        "capture_reserved_peak_mib": capture_peak / MiB,
        "driver_used_after_capture_mib": capture_driver / MiB,
        "reserved_peak_mib": (torch.cuda.max_memory_reserved() - base_res) / MiB,
        "allocated_peak_mib": (torch.cuda.max_memory_allocated() - base_alloc) / MiB,
        "driver_used_peak_mib": (free0 - min_free) / MiB,
        "graph_pools": len(by_pool),
        "graph_pool_mib_after_capture": graph_pool_capture / MiB,
        "graph_pool_mib_end": sum(by_pool.values()) / MiB,
        "default_pool_mib_end": (default_end - base_default) / MiB,
        "mib_per_pool": {f"{p[0]}:{p[1]}": v / MiB for p, v in by_pool.items()},
        "eager_fallbacks": runner.eager_fallbacks if runner is not None else 0,
        "prime_choice": runner.prime_choice if runner is not None else None,
    }
    if runner is not None and runner.pool is not None:
        proof = runner.scratch_fraction_in_pool(prompts, reuse=arm.startswith("shared+reuse"))
        row.update({
            "scratch_fraction_in_pool": proof["fraction_in_pool"],
            "scratch_fraction_in_captured_segments": proof["fraction_in_captured_segments"],
            "scratch_fraction_on_graph_blocks": proof["fraction_on_graph_blocks"],
            "graph_block_mib": proof["graph_block_bytes"] / MiB,
            "graph_blocks_reused": proof["graph_blocks_reused"],
            "scratch_mib_traced": proof["scratch_bytes"] / MiB,
            "pool_allocated_mib_end": pool_bytes(runner.pool.id)["allocated"] / MiB,
        })
    runner = None
    clean()
    return row


def adaptive_rows(name, model, step, vocab, buckets, args, stream, src=None):
    """Decode tokens/s: graphs vs eager, EntropyAdaptiveK vs native TopK, all through moelab routing."""
    from moelab.hf import moe_layers, patched, record_router
    from moelab.routing import EntropyAdaptiveK, TopK

    dev = torch.device("cuda")
    layers = moe_layers(model)
    native_k = layers[0].native_k
    gen = torch.Generator(device=dev).manual_seed(1)
    calib = sample_ids(src, vocab, 8, 64, gen)
    with torch.no_grad(), record_router(model, logits=False) as rec:
        step(calib)
    ent = torch.cat([rec.entropy(i) for i in rec.layers])
    thr = float(ent.median())
    k_lo = max(1, native_k // 2)
    policies = {"transformers (unpatched)": None, "native TopK": TopK(native_k),
                "EntropyAdaptiveK": EntropyAdaptiveK((k_lo, native_k), (thr,))}
    rng = random.Random(2)
    # bucket-sized batches: eager sees the graphs' shapes (and its Triton kernels compile once, in warm-up)
    sizes = [rng.choice(buckets) for _ in range(args.decode_steps * args.rounds)]
    ids = {n: sample_ids(src, vocab, n, 1, gen) for n in buckets}
    rows = []
    for pname, pol in policies.items():
        # check=False: no host sync in the routing, so the patched step can be captured
        ctx = contextlib.nullcontext() if pol is None else patched(model, pol, check=False)
        with ctx as patch:
            for mode in ("eager", "graphs"):
                runner = None
                if mode == "graphs":
                    runner = GraphRunner(step, lambda b: (ids.get(b, torch.zeros(b, 1, dtype=torch.long,
                                                                                  device=dev)),),
                                         buckets, stream=stream).capture()
                fn = runner if runner is not None else step
                with torch.no_grad():
                    for n in buckets:
                        fn(ids.get(n, torch.zeros(n, 1, dtype=torch.long, device=dev)))
                    sync()
                    t0 = time.perf_counter()
                    for n in sizes:
                        fn(ids[n])
                    sync()
                    dt = time.perf_counter() - t0
                rows.append({"model": name, "arm": f"adaptive:{mode}", "policy": pname, "native_k": native_k,
                             "policy_repr": repr(pol), "decode_tokens": sum(sizes),
                             "decode_tokens_per_s": sum(sizes) / dt})
                runner = fn = None
                clean()
            if patch is None:  # the model's own top-k
                for r in rows[-2:]:
                    r["mean_k"], r["expert_reduction"] = float(native_k), 0.0
                continue
            # mean k of the same decode inputs, eager (kept pairs counted by the patch, read once)
            before = {i: int(v) for i, v in patch.kept_pairs.items()}
            tok_before = dict(patch.tokens)
            with torch.no_grad():
                for n in sorted(ids):
                    step(ids[n])
            kept = sum(int(patch.kept_pairs[i]) - before[i] for i in before)
            toks = sum(patch.tokens[i] - tok_before[i] for i in before)
            for r in rows[-2:]:
                r["mean_k"] = kept / toks
                r["expert_reduction"] = 1 - kept / toks / native_k
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-mixtral,tiny-qwen-moe,tiny-olmoe,synthetic")
    ap.add_argument("--max-batch", type=int, default=256, help="largest decode bucket (buckets: powers of 2 up to it)")
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="prompt chunk of the eager forward, in tokens (synthetic: 4 x 1024; tiny models: 8 x 512)")
    ap.add_argument("--prefill-len", type=int, default=1024,
                    help="sequence length of the chunk, capped at the model's max_position_embeddings")
    ap.add_argument("--output", choices=("ids", "logits"), default="ids",
                    help="what decode and prefill return: greedy next-token ids or last-position logits")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decode-steps", type=int, default=50, help="decode steps per round")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--adaptive", action="store_true", help="also adaptive routing in graphs (moelab.hf)")
    ap.add_argument("--adaptive-models", default="", help="models for --adaptive (default: all of --models)")
    ap.add_argument("--out-dir", default=None, help="results directory (default data/results)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    arms = args.arms.split(",")
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"arm {a!r}: choose from {ARMS}")
    names = args.models.split(",")
    if unknown := [m for m in args.adaptive_models.split(",") if args.adaptive_models and m not in names]:
        ap.error(f"argument --adaptive-models: {unknown}: must be among --models {names}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/graph_pool.py measures CUDA graphs and needs a GPU")
    buckets = make_buckets(args.max_batch)
    rows, errors = [], []
    stream = torch.cuda.Stream()
    for name in tqdm(names, desc="models"):
        # weights in their own pool: the default pool then holds only what the arms allocate
        weights_pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(weights_pool):
            model, how, tokenizer = load_model(name, "cuda")
        inputs_pool = torch.cuda.MemPool()  # token ids of the workload, out of the default pool as well
        with torch.cuda.use_mem_pool(inputs_pool):
            src = text_tokens(tokenizer, "cuda")
        vocab = model.config.vocab_size
        step = hf_decode_step(model, args.output)
        chunk = prefill_shape(model, args.prefill_tokens, args.prefill_len)
        with torch.no_grad():  # cuBLAS workspaces etc. on both streams before any baseline
            for s in (torch.cuda.current_stream(), stream):
                with torch.cuda.stream(s):
                    step(torch.zeros(*chunk, dtype=torch.long, device="cuda"))
                    step(torch.zeros(buckets[-1], 1, dtype=torch.long, device="cuda"))
        sync()
        weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
        for arm in tqdm(arms, desc=name, leave=False):
            try:
                row = run_arm(arm, step, vocab, buckets, chunk, args, stream, (weights_pool, inputs_pool), src)
            except (RuntimeError, ValueError) as e:  # OutOfMemoryError and ScratchLiveError are RuntimeErrors
                log.warning("%s %s failed: %s", name, arm, e)
                errors.append(f"{name} {arm} failed: {type(e).__name__}: {e}")
                clean()
                continue
            rows.append({"model": name, "weights": how, "weights_mib": weights_mib,
                         "tokens": "held-out text" if src is not None else "uniform random ids", **row})
            log.info("%s %s: reserved peak %.1f MiB, %.0f tok/s", name, arm, row["reserved_peak_mib"],
                     row["decode_tokens_per_s"])
        if args.adaptive and (not args.adaptive_models or name in args.adaptive_models.split(",")):
            try:
                rows.extend(adaptive_rows(name, model, step, vocab, buckets, args, stream, src))
            except (RuntimeError, ValueError, ImportError, AttributeError) as e:
                log.warning("%s: adaptive routing in graphs failed: %s", name, e)
                errors.append(f"{name}: adaptive routing in graphs failed: {type(e).__name__}: {e}")
        del model, step, src
        clean()
        del weights_pool, inputs_pool
        write(rows, buckets, errors, args)  # after every model: a cut-short run still leaves its results
    path = write(rows, buckets, errors, args)
    print(path)
    for r in summarise(rows):
        print(r)


def write(rows, buckets, errors, args):
    """The results file (topic graph-pool) with the per-model summaries appended."""
    summary = summarise(rows)
    returned = ("greedy next-token ids of the last position (argmax inside the graph)" if args.output == "ids"
                else "last-position logits")
    notes = (
        "Decode step = one token per sequence without KV cache (context length 1); decode and prefill return "
        f"{returned}; "
        "the graphs' static outputs are rows of one buffer per output allocated outside the pool before capture; "
        f"buckets {buckets}; prefill = eager forward of a prompt chunk of {args.prefill_tokens} tokens (sequences of "
        f"{args.prefill_len}, capped at the model's max_position_embeddings; see prefill_batch/prefill_len per row). "
        "Weights live in a MemPool of their own; memory is counted over each arm's start; *_peak = the serving loop "
        "after capture (capture_reserved_peak_mib: capture incl. warm-up). Target ratio reuse_over_max = shared+reuse "
        "reserved peak / max(graph pool after capture in the shared arm, eager-only reserved peak), "
        f"target <= {REUSE_PEAK_LIMIT:g}; "
        "saved_mib/saved_pct against the shared arm without reuse. shared+reuse: GraphRunner's default capture('auto') "
        "with the prefill as eager example: it captures both layouts (primed: one prefill in the pool before capture, "
        "so the graphs go into eager-sized segments; unprimed: graphs first) and keeps the one with the smaller pool "
        "after a prefill, unprimed on a tie (prime_choice, reuse_layout; capture_s and capture_reserved_peak_mib "
        "include the trial); shared+reuse-primed / -unprimed force one layout (primed_* / unprimed_* columns). "
        "Token ids of the "
        "workload live in a MemPool of their own, so no arm finds cached default-pool memory at its start. "
        "Embedded models: trained checkpoints, prompts and decode tokens from held-out text; synthetic: random ids. "
        "Adaptive rows: EntropyAdaptiveK((native_k//2, native_k)) with its threshold at the median router entropy "
        "of held-out windows, decode batch sizes drawn from the buckets. " + " | ".join(errors)
    )
    return write_results("graph-pool", rows + summary, notes=notes, out_dir=args.out_dir)


def _verified(arm: dict) -> bool:
    """A reuse arm's peak counts only if reuse really happened: no eager forward fell back to the ordinary
    allocator and every traced eager byte landed in the graph pool."""
    return arm.get("eager_fallbacks", 0) == 0 and arm.get("scratch_fraction_in_pool") == 1.0


def summarise(rows) -> list[dict]:
    """Per model: the targets (reuse peak vs max(pool, eager), MiB and % saved, tokens/s with vs without reuse)."""
    out = []
    for m in dict.fromkeys(r["model"] for r in rows):
        by = {r["arm"]: r for r in rows if r["model"] == m}
        if not all(a in by for a in ("eager", "shared", "shared+reuse")):
            continue
        pool = by["shared"]["graph_pool_mib_after_capture"]
        eager_peak = by["eager"]["reserved_peak_mib"]
        reuse = by["shared+reuse"]
        with_reuse = reuse["reserved_peak_mib"]
        without = by["shared"]["reserved_peak_mib"]
        bound = max(pool, eager_peak)
        out.append({
            "model": m, "arm": "summary", "prefill_tokens": by["eager"].get("prefill_tokens"),
            "output": by["eager"].get("output"),
            "graph_pool_mib": pool, "eager_reserved_peak_mib": eager_peak,
            "max_mib": bound, "sum_mib": pool + eager_peak,
            "reuse_reserved_peak_mib": with_reuse, "no_reuse_reserved_peak_mib": without,
            "reuse_over_max": with_reuse / bound if bound else float("nan"),
            "reuse_pool_growth_mib": reuse["graph_pool_mib_end"] - reuse["graph_pool_mib_after_capture"],
            "reuse_default_pool_mib_end": reuse["default_pool_mib_end"],
            "saved_mib": without - with_reuse, "saved_pct": 100 * (without - with_reuse) / without if without else 0.0,
            "tokens_per_s_reuse_over_no_reuse": reuse["decode_tokens_per_s"] / by["shared"]["decode_tokens_per_s"],
            "memory_target_met": with_reuse <= REUSE_PEAK_LIMIT * bound and _verified(reuse),
            "speed_target_met": reuse["decode_tokens_per_s"] >= REUSE_SPEED_FLOOR * by["shared"]["decode_tokens_per_s"],
        })
        out[-1]["reuse_layout"] = ("primed" if (reuse.get("prime_choice") or {}).get("primed") else "unprimed")
        for tag in ("primed", "unprimed"):  # the two layouts forced, for comparison with the automatic choice
            arm = by.get(f"shared+reuse-{tag}")
            if arm is None:
                continue
            peak = arm["reserved_peak_mib"]
            out[-1].update({
                f"{tag}_graph_pool_mib_after_capture": arm["graph_pool_mib_after_capture"],
                f"{tag}_reserved_peak_mib": peak,
                f"{tag}_over_max": peak / bound if bound else float("nan"),
                f"{tag}_saved_mib": without - peak,
                f"{tag}_saved_pct": 100 * (without - peak) / without if without else 0.0,
                f"{tag}_tokens_per_s_over_no_reuse": arm["decode_tokens_per_s"] / by["shared"]["decode_tokens_per_s"],
                f"{tag}_memory_target_met": peak <= REUSE_PEAK_LIMIT * bound and _verified(arm),
            })
    return out


if __name__ == "__main__":
    main()
