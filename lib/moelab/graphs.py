"""Decode-step CUDA graphs: batch-size buckets, one shared memory pool, eager forwards that borrow it.

    runner = GraphRunner(step_fn, make_inputs, buckets).capture()   # largest bucket first, one MemPool
    out = runner(*inputs)        # pad to the bucket, copy into the static inputs, replay, copy out n rows
    out = runner.eager(*inputs)  # step_fn without a graph, its memory taken from the same pool

As in torchtitan's cudagraph.py, every graph is captured into ONE `torch.cuda.MemPool` on one capture
stream; the eager forward runs on that stream inside the pool (`moelab.scratch`), so it reuses the blocks
the graphs leave free between replays. A replay while eager memory of the pool is live raises
`ScratchLiveError`; a tensor an eager forward leaves in the pool is caught by comparing the pool's held
blocks before and after it.

Static outputs live OUTSIDE the pool: one [max bucket, ...] buffer per output, each graph ending with a copy
into its first b rows. Were they the graphs' own results, each bucket's output would pin pool blocks that
the eager forward could otherwise reuse.

Proof helpers: `pool_segments` / `pool_bytes` / `pool_blocks` read the allocator snapshot;
`trace_allocations` records a call's alloc events; `fraction_in_segments` and `fraction_on_ranges` say which
share of those bytes lay inside the pool, or on the very addresses the graphs used during capture.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import logging
import numbers
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from moelab.scratch import (
    PoolLock,
    ScratchBuffers,
    ScratchLiveError,
    active_scopes,
    check_device,
    live_scratch_bytes,
    prefer_graph_pool,
    register_capture_stream,
    share_pool_lock,
)

log = logging.getLogger(__name__)

# the pool-reuse targets that benchmarks/graph_pool.py checks and notebook 06 shows
REUSE_PEAK_LIMIT = 1.05  # serving loop's reserved peak with reuse <= this x max(graph pool, eager-only peak)
REUSE_SPEED_FLOOR = 0.98  # decode tokens/s with reuse >= this x the shared pool's without reuse


def make_buckets(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself: 1, 2, 4, ..., max_batch."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be an int >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def check_buckets(buckets: Sequence[int]) -> list[int]:
    """Validated, ascending, distinct bucket sizes (Python ints) from any iterable of ints, numpy's too."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise TypeError(f"buckets={buckets!r}: must be an iterable of batch sizes, e.g. [1, 2, 4, 8]")
    bs = list(buckets)
    if not bs:
        raise ValueError("buckets=[]: need at least one batch size")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
            raise ValueError(f"bucket {b!r} in {bs}: batch sizes must be ints >= 1")
    bs = [int(b) for b in bs]
    if len(set(bs)) != len(bs):
        raise ValueError(f"buckets={bs}: batch sizes must be distinct")
    return sorted(bs)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds a batch of n."""
    bs = check_buckets(buckets)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"batch size n={n!r}: must be an int >= 1")
    for b in bs:
        if b >= n:
            return b
    raise ValueError(f"batch size n={n} exceeds the largest bucket {bs[-1]}: run it eagerly or add a bucket")


def capture_order(buckets: Sequence[int]) -> list[int]:
    """Largest first: the smaller graphs then fit in blocks the largest one freed during its capture."""
    return sorted(check_buckets(buckets), reverse=True)


# families whose forward builds a tensor on the host and copies it over (MiniMax's lightning attention),
# which a CUDA-graph capture refuses
HOST_FACTORY_FAMILIES = frozenset({"minimax"})


def hf_decode_step(model, output: str = "ids", on_device: bool | None = None) -> Callable:
    """step(ids_BL) of a transformers causal LM: last position only, greedy ids [B] or logits [B, V].

    One forward without KV cache, output_router_logits=False (the router aux loss syncs with the host, which
    capture refuses). on_device: run the forward under `torch.device(<the ids' device>)`, so that factory calls
    without a device land there (None: for HOST_FACTORY_FAMILIES only; it costs host time elsewhere).
    """
    if output not in ("ids", "logits"):
        raise ValueError(f"output={output!r}: must be 'ids' (greedy next tokens) or 'logits' (last position)")
    if on_device is None:
        on_device = getattr(model.config.get_text_config(), "model_type", None) in HOST_FACTORY_FAMILIES

    def step(ids_BL):
        with torch.device(ids_BL.device) if on_device else contextlib.nullcontext():
            out = model(input_ids=ids_BL, use_cache=False, logits_to_keep=1, output_router_logits=False)
        logits_BV = out.logits[:, -1]
        return logits_BV.argmax(-1) if output == "ids" else logits_BV

    return step


# ----- allocator snapshots and traces
def _pool_snapshot(pid: tuple[int, int]) -> list:
    """The allocator snapshot of one pool's segments (the whole snapshot where torch cannot narrow it)."""
    params = inspect.signature(torch.cuda.memory_snapshot).parameters
    if "mempool_id" in params:
        kw = {"include_traces": False} if "include_traces" in params else {}
        return torch.cuda.memory_snapshot(mempool_id=tuple(pid), **kw)
    return torch.cuda.memory_snapshot()


def _of_pool(snapshot: list, pid: tuple[int, int]) -> list:
    return [s for s in snapshot if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pid)]


def pool_segments(pid: tuple[int, int], snapshot: list | None = None) -> list[tuple[int, int, int]]:
    """(address, total_size, allocated_size) of every allocator segment of pool `pid`."""
    segs = _of_pool(_pool_snapshot(pid) if snapshot is None else snapshot, pid)
    return [(s["address"], s["total_size"], s["allocated_size"]) for s in segs]


def pool_bytes(pid: tuple[int, int], snapshot: list | None = None) -> dict:
    """Reserved and allocated bytes of one pool (from the allocator snapshot)."""
    segs = pool_segments(pid, snapshot)
    return {"reserved": sum(s[1] for s in segs), "allocated": sum(s[2] for s in segs), "segments": len(segs)}


def pool_blocks(pid: tuple[int, int], snapshot: list | None = None) -> frozenset[tuple[int, int]]:
    """(address, size) of every block of pool `pid` that a tensor holds (allocator state 'active_allocated')."""
    held = []
    for seg in _of_pool(_pool_snapshot(pid) if snapshot is None else snapshot, pid):
        addr = seg["address"]  # blocks come in address order; older snapshots give no block address
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                held.append((b.get("address", addr), b["size"]))
            addr += b["size"]
    return frozenset(held)


def _pool_state(pid: tuple[int, int]) -> dict:
    """pool_bytes and pool_blocks of one pool from one snapshot."""
    snap = _pool_snapshot(pid)
    return {**pool_bytes(pid, snap), "blocks": pool_blocks(pid, snap)}


_ANCHOR = 8  # trailing entries of a user's history that mark where the body's events start


def _entry_key(e: dict) -> tuple:
    return (e.get("action"), e.get("addr"), e.get("size"), e.get("stream"), e.get("time_us"))


def _events_after(dev: list, n: int, anchor: tuple) -> list:
    """The entries of one device's history after its first n at the body's start, whose last entries then were
    `anchor`. A full history drops its oldest entries, moving the anchor towards the front: it is found again
    there; if it has gone too, the body's first events have gone with it, and this raises."""
    m = len(anchor)
    if m == 0:
        return dev[n:] if len(dev) >= n else dev
    for i in range(min(n, len(dev)) - m, -1, -1):  # the latest match at or left of the anchor's old place
        if tuple(_entry_key(e) for e in dev[i:i + m]) == anchor:
            return dev[i + m:]
    raise RuntimeError(f"trace_allocations: the memory history being recorded ({len(dev)} entries) dropped the "
                       "entries before the body's first events (it is full), so the body's alloc events cannot be "
                       "told apart; record with a larger max_entries (torch.cuda.memory._record_memory_history) or "
                       "stop recording around the traced call")


@contextlib.contextmanager
def trace_allocations():
    """Record the allocator's alloc events of the body; yields a list filled with (address, size) on exit, also
    when the body raises. Where someone already records memory history, their settings and history are left as
    they are and the body's events are read from it (found after the entries that ended it at the start)."""
    events: list[tuple[int, int]] = []
    torch.cuda.synchronize()
    if getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)():
        torch.empty(1, device="cuda")  # a probe's alloc and free (3 entries): the last entries now mark the start
        start = [(len(dev), tuple(_entry_key(e) for e in dev[-_ANCHOR:]))
                 for dev in torch.cuda.memory._snapshot()["device_traces"]]
        if (kept := start[torch.cuda.current_device()][0]) < 3:
            raise RuntimeError(f"trace_allocations: the memory history being recorded keeps {kept} entries after "
                               "an alloc and a free (a history of the state alone, enabled='state', keeps one): too "
                               "few to read the body's allocations from; record with enabled='all' or stop "
                               "recording around the traced call")
        try:
            yield events
        finally:
            torch.cuda.synchronize()
            for dev, (n, anchor) in zip(torch.cuda.memory._snapshot()["device_traces"], start):
                events.extend((e["addr"], e["size"]) for e in _events_after(dev, n, anchor) if e["action"] == "alloc")
        return
    record = torch.cuda.memory._record_memory_history
    kw = {"clear_history": True} if "clear_history" in inspect.signature(record).parameters else {}
    record(enabled="all", context=None, stacks="python", max_entries=1_000_000, **kw)
    try:
        yield events
    finally:
        try:
            torch.cuda.synchronize()
            for dev in torch.cuda.memory._snapshot()["device_traces"]:
                events.extend((e["addr"], e["size"]) for e in dev if e["action"] == "alloc")
        finally:
            record(enabled=None)


def fraction_in_segments(allocs: Sequence[tuple[int, int]], segments: Sequence[tuple[int, int, int]]) -> float:
    """Share of the allocated bytes whose block lies inside one of the segments (address ranges)."""
    total = sum(n for _, n in allocs)
    if total == 0:
        return float("nan")
    inside = sum(n for addr, n in allocs if any(base <= addr and addr + n <= base + size for base, size, _ in segments))
    return inside / total


def merge_ranges(allocs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, size) blocks -> sorted, disjoint [start, end) address ranges covering them."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((a, a + n) for a, n in allocs if n > 0):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def fraction_on_ranges(allocs: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]]) -> float:
    """Share of the allocated bytes lying on the [start, end) ranges (`merge_ranges`' output), byte by byte."""
    total = sum(n for _, n in allocs)
    if total == 0:
        return float("nan")
    starts = [r[0] for r in ranges]
    on = 0
    for addr, n in allocs:
        i = max(bisect.bisect_right(starts, addr) - 1, 0)
        while i < len(ranges) and ranges[i][0] < addr + n:
            on += max(0, min(ranges[i][1], addr + n) - max(ranges[i][0], addr))
            i += 1
    return on / total


# ----- the runner
@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple  # static input tensors, batch = bucket
    outputs: tuple  # the first `bucket` rows of the runner's output buffers (outside the pool)
    pool: object  # the shared MemPool, or the graph's own pool handle (private)


def _input_tuple(x, name: str) -> tuple:
    """Inputs as a tuple of tensors: one tensor is one input (never its rows)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    x = tuple(x)
    if not x or not all(isinstance(t, torch.Tensor) for t in x):
        raise ValueError(f"{name}: must be a tensor or a non-empty tuple of tensors")
    return x


def _as_tuple(out) -> tuple:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise ValueError(f"step_fn returned {type(out).__name__}: must return a tensor or a non-empty tuple of tensors")


def _copy_rows(statics: tuple, outs: tuple) -> None:
    """Copy each result into its static buffer. A function, so that no reference to a result outlives it: the
    results' blocks go back to the pool within the capture."""
    for buf, o in zip(statics, outs, strict=True):
        buf.copy_(o)


class GraphRunner:
    """CUDA graphs of `step_fn` for a set of batch-size buckets, sharing one pool (or one pool each).

    step_fn(*inputs) -> tensor or tuple of tensors, every input and output batched along dim 0 with rows
    independent of one another (a decode step). make_inputs(b) builds example inputs of batch b (used for
    warm-up; padding rows are zero at replay).
    pool: 'shared' (one MemPool for all buckets) or 'private' (one pool each, for comparison).
    stream: the capture stream (a new one if None); eager forwards that borrow the pool run on it.
    eager_example: inputs of the largest eager forward (e.g. a prefill chunk), with which `capture` may prime
    the pool. device='cpu' builds a runner for eager forwards only.
    lock_wait_s: how long a replay, eager forward or scratch scope on the shared pool waits for another
    thread's before PoolLockTimeout (None: forever); see `moelab.scratch.PoolLock`.
    """

    def __init__(
        self,
        step_fn: Callable,
        make_inputs: Callable[[int], tuple],
        buckets: Sequence[int],
        *,
        pool: str = "shared",
        warmup: int = 2,
        device=None,
        stream=None,
        eager_example: tuple | None = None,
        lock_wait_s: float | None = 60.0,
    ):
        if pool not in ("shared", "private"):
            raise ValueError(f"pool={pool!r}: must be 'shared' or 'private'")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup={warmup!r}: must be an int >= 1 (cuBLAS and lazy state before capture)")
        if device is None and not torch.cuda.is_available():
            raise ValueError("device=None means the current CUDA device, and this machine has none "
                             "(device='cpu' builds a runner for eager forwards only; capture needs CUDA)")
        self.step_fn = step_fn
        self.make_inputs = make_inputs
        self.buckets = check_buckets(buckets)
        self.pool_mode = pool
        self.warmup = warmup
        self.device = check_device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.graphs: dict[int, _Graph] = {}
        self.out_buffers: tuple = ()  # one [max bucket, ...] buffer per output, ordinary allocator
        self.pool = None  # the shared MemPool
        self.stream = stream
        if eager_example is not None:
            if pool != "shared":
                raise ValueError("eager_example primes the shared pool: it needs pool='shared'")
            eager_example = _input_tuple(eager_example, "eager_example")
            self._check_inputs(eager_example)
        self.eager_example = eager_example
        self.scratch = ScratchBuffers(self.device)
        self.eager_growth_bytes = 0  # segment bytes eager forwards added to the shared pool
        self._growth_hinted = False
        self.prime_choice: dict | None = None  # capture('auto'): pool bytes of both layouts, which one was kept
        self.eager_fallbacks = 0  # eager forwards that hit OOM in the pool and re-ran on the ordinary allocator
        self._captured_segments: list = []  # the shared pool's segments right after capture
        self._graph_ranges: list = []  # address ranges the graphs' own allocations used during capture
        self._leak: tuple[frozenset, str] | None = None  # (the pool's held blocks before the leaking forward, message)
        # one capture, eager forward or replay at a time (a replay must not land between another thread's safety
        # check and its eager kernels); after capture also the pool's `pool_lock`, held by any scratch scope on it
        self._lock = PoolLock(lock_wait_s, arg="lock_wait_s")

    # ----- capture
    def capture(self, release_cache: bool = True, prime: tuple | bool | str = "auto") -> "GraphRunner":
        """Warm up and capture every bucket, largest first. release_cache: empty_cache() after (warm-up blocks).

        prime: whether one eager forward runs inside the shared pool before the captures, leaving free segments
        sized for it; the graphs are captured into them, and later eager forwards find them free.
          'auto' (default): with an `eager_example`, capture both ways and keep the layout whose pool is smaller
              after one eager forward, the unprimed one on a tie (`prime_choice` records both). Without one: no.
          True: prime with `eager_example`; a tuple: prime with those inputs; False: never.
        A capture that fails leaves no graphs and no pool: capture() can be called again.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("GraphRunner.capture needs CUDA")
        if self.graphs:
            raise RuntimeError("already captured")
        auto = False
        if isinstance(prime, str):
            if prime != "auto":
                raise ValueError(f"prime={prime!r}: must be 'auto', True, False or a tuple of inputs")
            auto, prime = self.eager_example is not None and self.pool_mode == "shared", None
        elif prime is True:
            if self.eager_example is None:
                raise ValueError("prime=True primes with eager_example, and this runner has none: pass "
                                 "GraphRunner(..., eager_example=inputs) or prime=(inputs,)")
            prime = self.eager_example
        elif prime is False:
            prime = None
        else:
            prime = _input_tuple(prime, "prime")
            self._check_inputs(prime)
        if prime is not None and self.pool_mode != "shared":
            raise ValueError("prime needs pool='shared': a private pool per bucket has nothing to share")
        with self._lock.hold("a capture"):
            try:
                return self._capture_auto(release_cache) if auto else self._capture_once(release_cache, prime)
            except BaseException:
                self._release()
                raise

    def _capture_auto(self, release_cache: bool) -> "GraphRunner":
        """Both layouts, each followed by one eager forward of eager_example; keep the smaller pool."""
        sizes = {}
        for primed in (False, True):
            self._capture_once(release_cache, self.eager_example if primed else None)
            self.eager(*self.eager_example)
            sizes[primed] = pool_bytes(self.pool.id)["reserved"]
            if primed and sizes[True] < sizes[False]:
                break
            self._release()
        else:  # the unprimed layout is no larger: capture it again (the trial was released)
            self._capture_once(release_cache, None)
            self.eager(*self.eager_example)
        self.prime_choice = {"unprimed_pool_bytes": sizes[False], "primed_pool_bytes": sizes[True],
                             "primed": sizes[True] < sizes[False]}
        self.eager_growth_bytes = 0
        self._growth_hinted = False
        return self

    def _release(self) -> None:
        """Drop the graphs and their pool (a failed capture, or a trial layout of capture('auto'))."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.out_buffers = ()
        self.pool = None  # the MemPool's segments go back once no graph holds it
        self._captured_segments = []
        self._graph_ranges = []
        self._leak = None
        torch.cuda.empty_cache()

    def _capture_once(self, release_cache: bool, prime: tuple | None) -> "GraphRunner":
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        if self.pool_mode == "shared":
            self.pool = torch.cuda.MemPool()
            register_capture_stream(self.pool, self.stream)
            share_pool_lock(self.pool, self._lock)  # scratch scopes of other threads on the pool wait for replays
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        if prime is not None:
            with torch.no_grad(), torch.cuda.stream(self.stream):
                _as_tuple(self.step_fn(*prime))  # lazy state (cuBLAS workspace) outside the pool first
            # give its cached activations back before the same forward runs in the graph pool, or the process
            # briefly holds two eager peaks
            self.stream.synchronize()
            torch.cuda.empty_cache()
            self._eager_in(self.pool, self.stream, tuple(prime), _pool_state(self.pool.id))
            self._raise_leak()
        # the allocator's own records of the captures: which addresses the graphs really use
        with torch.no_grad(), (trace_allocations() if self.pool is not None else contextlib.nullcontext([])) as allocs:
            for b in capture_order(self.buckets):
                made = _input_tuple(self.make_inputs(b), f"make_inputs({b})")
                self._check_inputs(made, b)
                self.stream.wait_stream(cur)  # the warm-up reads inputs made on the current stream
                with torch.cuda.stream(self.stream):  # the runner's own static inputs (a replay would overwrite
                    inputs = tuple(t.clone() for t in made)  # a caller's tensor), in its stream's segment
                del made
                with torch.cuda.stream(self.stream):  # warm-up on the capture stream, ordinary allocator
                    for _ in range(self.warmup):
                        warm = _as_tuple(self.step_fn(*inputs))
                    self._check_outputs(warm, b)
                    if not self.out_buffers:  # largest bucket first: its rows hold every bucket's output
                        self.out_buffers = tuple(
                            torch.empty((b, *o.shape[1:]), dtype=o.dtype, device=o.device) for o in warm
                        )
                    del warm
                g = torch.cuda.CUDAGraph()
                statics = tuple(buf[:b] for buf in self.out_buffers)
                with torch.cuda.graph(g, pool=self.pool.id if self.pool is not None else None, stream=self.stream):
                    _copy_rows(statics, _as_tuple(self.step_fn(*inputs)))
                self.graphs[b] = _Graph(g, inputs, statics, self.pool if self.pool is not None else g.pool())
        cur.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        if release_cache:
            torch.cuda.empty_cache()
        if self.pool is not None:
            self._captured_segments = pool_segments(self.pool.id)
            # warm-ups and static inputs use the ordinary allocator: the pool's blocks are the graphs'
            ranges = merge_ranges((base, size) for base, size, _ in self._captured_segments)
            self._graph_ranges = merge_ranges([(a, n) for a, n in allocs if fraction_on_ranges([(a, n)], ranges) == 1])
        return self

    def _check_outputs(self, outs: tuple, b: int) -> None:
        if self.out_buffers and len(outs) != len(self.out_buffers):
            raise ValueError(
                f"step_fn returned {len(outs)} outputs for batch {b}, {len(self.out_buffers)} for the largest bucket"
            )
        for i, o in enumerate(outs):
            if o.dim() == 0 or o.shape[0] != b:
                raise ValueError(f"step_fn output of shape {tuple(o.shape)}: dim 0 must be the batch {b}")
            if self.out_buffers:
                buf = self.out_buffers[i]
                if o.shape[1:] != buf.shape[1:] or o.dtype != buf.dtype:
                    raise ValueError(
                        f"step_fn output {i} of shape {tuple(o.shape)} {o.dtype}: every bucket must give the same "
                        f"outputs as the largest ({len(self.out_buffers)} outputs, "
                        f"{[(tuple(t.shape[1:]), t.dtype) for t in self.out_buffers]} per row)"
                    )

    def _check_inputs(self, inputs: tuple, b: int | None = None) -> None:
        """Tensors batched along dim 0, all of batch b (default: the first one's)."""
        if any(t.dim() == 0 for t in inputs):
            raise ValueError(f"inputs of shapes {[tuple(t.shape) for t in inputs]}: each needs a batch dimension "
                             "(dim 0), a 0-d tensor has none")
        b = inputs[0].shape[0] if b is None else b
        for t in inputs:
            if t.shape[0] != b:
                raise ValueError(f"input of shape {tuple(t.shape)}: dim 0 must be the batch size {b}")

    def pool_ids(self) -> dict[int, tuple[int, int]]:
        """Pool id of each bucket's graph (all the same when shared)."""
        return {b: (g.pool.id if hasattr(g.pool, "id") else tuple(g.pool)) for b, g in self.graphs.items()}

    def pool_bytes(self) -> dict[tuple[int, int], dict]:
        """Reserved/allocated bytes of each distinct pool the graphs own (none before capture, or on the CPU)."""
        if not self.graphs:
            return {}
        snap = torch.cuda.memory_snapshot()
        return {pid: pool_bytes(pid, snap) for pid in dict.fromkeys(self.pool_ids().values())}

    # ----- replay
    def __call__(self, *inputs):
        """Replay the bucket graph for a batch of n <= max bucket; returns fresh tensors of n rows."""
        with self._lock.hold("a replay"):
            return self._replay(inputs)

    def _check_replay_safe(self) -> None:
        """Raise ScratchLiveError while eager memory of the shared pool is live: a forward still running (another
        thread's replay waits for the pool lock instead), or a tensor an eager forward left in the pool."""
        if self.pool is None:
            return
        self._raise_leak("replay refused: ")
        if active_scopes(self.pool):
            raise ScratchLiveError(
                f"replay refused: an eager forward holding scratch in graph pool {self.pool.id} is still running; "
                "finish it (leave its scratch scope) before replaying"
            )
        live = live_scratch_bytes(self.pool)
        if live:
            raise ScratchLiveError(
                f"replay refused: {live} bytes of eager scratch buffers from graph pool {self.pool.id} are still "
                "referenced after their forward ended; a replay would overwrite them. Drop those tensors first"
            )

    def _replay(self, inputs: tuple):
        if not self.graphs:
            raise RuntimeError("capture() first")
        self._check_replay_safe()
        if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in inputs):
            raise ValueError("inputs must be tensors batched along dim 0 (at least one dimension)")
        n = inputs[0].shape[0]
        b = bucket_for(n, self.buckets)
        g = self.graphs[b]
        if len(inputs) != len(g.inputs):
            raise ValueError(f"got {len(inputs)} inputs, the graphs were captured with {len(g.inputs)}")
        for static, x in zip(g.inputs, inputs):
            if x.shape[0] != n or x.shape[1:] != static.shape[1:] or x.dtype != static.dtype:
                raise ValueError(
                    f"input {tuple(x.shape)} {x.dtype}: need ({n}, *{tuple(static.shape[1:])}) {static.dtype}"
                )
        cur = torch.cuda.current_stream(self.device)
        # the static inputs are written on the caller's stream: first let it wait for the capture stream,
        # where the last replay (maybe queued from another thread's stream) may still be reading them
        cur.wait_stream(self.stream)
        for static, x in zip(g.inputs, inputs):
            static[:n].copy_(x)
            if n < b:
                static[n:].zero_()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            g.graph.replay()
            # copied out on the capture stream, so the runner's small allocations share its segments; safe for
            # the caller's stream, which every runner call first waits for
            outs = tuple(o[:n].clone() for o in g.outputs)
        cur.wait_stream(self.stream)
        return outs[0] if len(outs) == 1 else outs

    # ----- eager
    def eager(self, *inputs, reuse: bool | None = None, stream=None):
        """step_fn without a graph, on the capture stream; with reuse, all its memory comes from the shared pool.

        reuse: None (default) borrows the shared pool where there is one; True insists on it; False uses the
        ordinary allocator. stream: another stream (it cannot reuse the pool's free blocks: the pool grows).
        Outputs are copied out of the pool before the forward ends. An OOM in the pool re-runs the forward on
        the ordinary allocator (logged, `eager_fallbacks`; side effects of the failed attempt stay applied). A
        tensor the forward leaves in the pool raises ScratchLiveError, and replays refuse until it is gone; a
        forward that raises has its frames' locals cleared (they hold pool memory a replay would overwrite).
        """
        if not (reuse is None or reuse is True or reuse is False):
            raise ValueError(f"reuse={reuse!r}: must be None, True or False")
        if reuse is True and self.pool is None:
            why = ("pool=private" if self.pool_mode == "private" else "capture() first" if self.device.type == "cuda"
                   else f"a runner on {self.device} runs eager forwards only")
            raise ValueError(f"reuse=True: this runner has no shared pool to borrow ({why})")
        with self._lock.hold("an eager forward"):
            return self._eager(inputs, reuse is not False, stream)

    def _eager(self, inputs: tuple, reuse: bool, stream):
        if self.device.type != "cuda":  # a runner for eager forwards only: no streams, no pool
            with torch.no_grad():
                outs = _as_tuple(self.step_fn(*inputs))
            return outs[0] if len(outs) == 1 else outs
        pool = self.pool if (reuse and self.pool is not None) else None
        stream = stream or self.stream or torch.cuda.current_stream(self.device)
        cur = torch.cuda.current_stream(self.device)
        stream.wait_stream(cur)
        before = _pool_state(pool.id) if pool is not None else None
        oom = None
        try:
            try:
                outs, after = self._eager_in(pool, stream, inputs, before)
            except BaseException as e:
                if pool is None:
                    raise
                # the failed forward's frames hold tensors inside the pool: drop their locals (the traceback keeps
                # its lines), and let replays check that nothing else it made there is still allocated
                traceback.clear_frames(e.__traceback__)
                if self._leak is None:
                    self._leak = (before["blocks"], "an eager forward that raised left tensors in the pool")
                if not isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                oom = str(e).splitlines()[0]
            if oom is not None:  # out of the except clause: the failed attempt's frames are gone
                self.eager_fallbacks += 1
                log.warning("eager forward: graph pool %s out of memory (%s); re-running on the ordinary allocator "
                            "(fallback %d)", pool.id, oom, self.eager_fallbacks)
                outs, _ = self._eager_in(None, stream, inputs, None)
                after = pool_bytes(pool.id)
        finally:
            cur.wait_stream(stream)  # also after a failure: the caller's stream follows what was queued
        if pool is not None and (grown := after["reserved"] - before["reserved"]) > 0:
            self.eager_growth_bytes += grown
            if not self._growth_hinted:
                self._growth_hinted = True
                log.info("eager forward in graph pool %s added %.1f MiB of segments%s", pool.id, grown / 2**20,
                         "" if self.eager_example is not None else
                         ": pass eager_example= (the largest eager inputs) so capture() primes the pool with "
                         "eager-sized segments and the graphs are captured into them")
        self._raise_leak()
        return outs[0] if len(outs) == 1 else outs

    def _eager_in(self, pool, stream, inputs, before: dict | None) -> tuple[tuple, dict | None]:
        """One forward -> (outputs copied out, the pool's `_pool_state` after it). With a pool, a block held after
        it that was not held before is recorded as a leak (`_leak`)."""
        # a block held at the start could be freed by the forward and taken again by a tensor it keeps: then
        # (address, size) alone would not tell the two apart, so trace the forward's allocations and count a
        # held block as new wherever one was allocated at its address (usually no block is held)
        traced = pool is not None and bool(before["blocks"])
        try:
            with (trace_allocations() if traced else contextlib.nullcontext([])) as allocs, torch.no_grad(), \
                    prefer_graph_pool(pool), self.scratch.forward(pool, stream, route_all=pool is not None):
                outs = _as_tuple(self.step_fn(*inputs))
                with self.scratch.unrouted():
                    kept = tuple(o.clone() for o in outs)  # results leave the pool before the scope ends
                del outs
        finally:
            if traced:  # also when the forward raised: the caller records the leak from `before`
                taken = {a for a, _ in allocs}
                before["blocks"] = frozenset(b for b in before["blocks"] if b[0] not in taken)
        if pool is None:
            return kept, None
        after = _pool_state(pool.id)
        if after["blocks"] - before["blocks"] and self._leak is None:
            self._leak = (before["blocks"], "an eager forward left tensors in the pool")
        return kept, after

    def _raise_leak(self, prefix: str = "") -> None:
        """Raise while a block of the pool that a tensor holds was not held before the leaking forward; forget
        the leak once every such block is free."""
        if self._leak is None:
            return
        before, what = self._leak
        left = pool_blocks(self.pool.id) - before if self.pool is not None else frozenset()
        if not left:
            self._leak = None
            return
        raise ScratchLiveError(f"{prefix}{what}: {len(left)} blocks, {sum(n for _, n in left)} bytes of graph pool "
                               f"{self.pool.id} are still allocated (a tensor made inside it outlived the forward); "
                               "replays would overwrite them. Drop those tensors first")

    def scratch_fraction_in_pool(self, *inputs, reuse: bool = True, stream=None) -> dict:
        """Proof that reuse is on: where one eager forward's allocated bytes lay (the copied-out results excluded).

        fraction_in_pool: inside the shared pool's segments; fraction_in_captured_segments: inside those it had
        right after capture; fraction_on_graph_blocks: on the addresses the graphs' own allocations used during
        capture (memory really shared); graph_blocks_reused: the share of those addresses (graph_block_bytes)
        that the eager forward's allocations covered.
        """
        if self.pool is None:
            raise ValueError("pool='private' has no shared pool to borrow from" if self.pool_mode == "private"
                             else "no shared pool yet: capture() first")
        with trace_allocations() as allocs:
            outs = _as_tuple(self.eager(*inputs, reuse=reuse, stream=stream))
            result_ptrs = {t.untyped_storage().data_ptr() for t in outs}
        scratch = [(a, n) for a, n in allocs if a not in result_ptrs]
        return {
            "scratch_bytes": sum(n for _, n in scratch),
            "allocations": len(scratch),
            "fraction_in_pool": fraction_in_segments(scratch, pool_segments(self.pool.id)),
            "fraction_in_captured_segments": fraction_in_segments(scratch, self._captured_segments),
            "fraction_on_graph_blocks": fraction_on_ranges(scratch, self._graph_ranges),
            "graph_block_bytes": sum(b - a for a, b in self._graph_ranges),
            "graph_blocks_reused": fraction_on_ranges([(a, b - a) for a, b in self._graph_ranges],
                                                      merge_ranges(scratch)),
        }
