"""When the graph runner's exact leak check traces an eager forward, and what the trace costs.

`GraphRunner.eager` compares the pool's held (address, size) blocks before and after each forward; when the
pool starts a forward with blocks held, it also traces the forward's allocations (the allocator's memory
history), so a kept tensor on the very block the forward freed is caught (`moelab.graphs`). Per model, as the
graph-pool benchmark's shared+reuse arm builds it (decode buckets 1..256 in one shared MemPool, the prompt
chunk as eager example): the blocks the pool holds after capture and before each prefill, then the prefill's
median time on the usual path, with one small tensor held in the pool (every forward traced: checked inside
the forward, where the allocator's history must be on), and on the usual path again.

    PYTHONPATH=lib python benchmarks/leak_check.py [--models tiny-mixtral,tiny-qwen-moe,tiny-olmoe,synthetic]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from moelab.graphs import GraphRunner, hf_decode_step, make_buckets, pool_blocks
from moelab.results import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_pool import clean, load_model, prefill_shape  # noqa: E402


def history_on() -> bool:
    return bool(getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)())


def measure(name: str, args) -> dict:
    dev = torch.device("cuda")
    model, how, _ = load_model(name, dev)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, length = prefill_shape(model, args.prefill_tokens, args.prefill_len)
    prompts = torch.randint(0, vocab, (batch, length), device=dev, generator=gen)
    buckets = make_buckets(args.max_batch)
    ids = {b: torch.randint(0, vocab, (b, 1), device=dev, generator=gen) for b in buckets}
    step = hf_decode_step(model)
    traced = []  # per forward: was the allocator's history on inside it

    def fn(x):
        traced.append(history_on())
        return step(x)

    runner = GraphRunner(fn, lambda b: (ids[b],), buckets, eager_example=(prompts,)).capture()
    row = {"model": name, "weights": how, "prefill_batch": batch, "prefill_len": length,
           "blocks_held_after_capture": len(pool_blocks(runner.pool.id)), "prime_choice": runner.prime_choice}

    def timed(runner) -> tuple[float, int, int]:
        """(median ms of a prefill, forwards traced, most blocks held at a prefill's start)"""
        runner.eager(prompts)  # warm-up
        torch.cuda.synchronize()
        del traced[:]
        ts, held_at_start = [], []
        for _ in range(args.forwards):
            held_at_start.append(len(pool_blocks(runner.pool.id)))
            t0 = time.perf_counter()
            runner.eager(prompts)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), sum(traced), max(held_at_start)

    row["eager_ms"], row["traced_forwards"], row["blocks_held_at_prefill_start"] = timed(runner)
    with torch.cuda.use_mem_pool(runner.pool), torch.cuda.stream(runner.stream):
        held = torch.empty(1024, device=dev)  # one 4 KiB block held: every forward now starts with a block held
    row["eager_ms_block_held"], row["traced_forwards_block_held"], _ = timed(runner)
    del held
    torch.cuda.synchronize()
    row["eager_ms_again"], row["traced_forwards_again"], _ = timed(runner)
    row["forwards"] = args.forwards
    row["trace_overhead_ms"] = row["eager_ms_block_held"] - (row["eager_ms"] + row["eager_ms_again"]) / 2
    del runner, model
    clean()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-mixtral,tiny-qwen-moe,tiny-olmoe,synthetic")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--forwards", type=int, default=15, help="timed prefills per path (median)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/leak_check.py measures CUDA graph pools and needs a GPU")
    if args.forwards < 1:
        raise SystemExit(f"--forwards={args.forwards}: must be >= 1")
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name, args))
        print(rows[-1], flush=True)
    notes = ("eager_ms*: median wall time of one prefill (GraphRunner.eager with reuse, synchronized); "
             "traced_forwards*: forwards during which the allocator's memory history was on (the exact leak check's "
             "trace); *_block_held: one 4 KiB tensor allocated in the pool on the capture stream and kept, so every "
             "forward starts with a block held; trace_overhead_ms = block-held time - mean of the usual path's two.")
    print("wrote", write_results("leak-check", rows, notes=notes, out_dir=args.out_dir))


if __name__ == "__main__":
    main()
