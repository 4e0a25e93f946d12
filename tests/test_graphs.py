"""Graph runner, shared pool and eager scratch: pure logic on any machine, the real thing on CUDA."""

import gc
import logging
import random
import threading
import time

import numpy as np
import pytest
import torch

from moelab.graphs import (
    HOST_FACTORY_FAMILIES,
    GraphRunner,
    bucket_for,
    capture_order,
    check_buckets,
    fraction_in_segments,
    fraction_on_ranges,
    hf_decode_step,
    make_buckets,
    merge_ranges,
    pool_blocks,
    pool_bytes,
    trace_allocations,
)
from moelab.routing import EntropyAdaptiveK, choose_k
from moelab.scratch import (
    BestFitFreeList,
    ScratchBuffers,
    ScratchLiveError,
    active_scopes,
    pool_id,
    prefer_graph_pool,
    preferred_pool,
    round_block,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


class PoolToken:
    """A pool identity for the context logic (anything with an .id of two ints is accepted, like MemPool; the
    registries watch the first live object of an id, so a test keeps one object per id alive while it needs it)."""

    def __init__(self, i):
        self.id = (0, i)


# ----- buckets
def test_make_buckets():
    assert make_buckets(1) == [1]
    assert make_buckets(8) == [1, 2, 4, 8]
    assert make_buckets(12) == [1, 2, 4, 8, 12]
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="max_batch"):
            make_buckets(bad)


def test_bucket_for_is_smallest_holding_bucket():
    bs = [1, 2, 4, 8, 12]
    for n in range(1, 13):
        b = bucket_for(n, bs)
        assert b >= n and all(x < n for x in bs if x < b)
    with pytest.raises(ValueError, match="exceeds the largest bucket 12"):
        bucket_for(13, bs)
    with pytest.raises(ValueError, match="n=0"):
        bucket_for(0, bs)


def test_check_buckets_and_capture_order():
    assert check_buckets([8, 1, 4]) == [1, 4, 8]
    assert capture_order([2, 16, 4, 1]) == [16, 4, 2, 1]
    with pytest.raises(ValueError, match="distinct"):
        check_buckets([1, 2, 2])
    with pytest.raises(ValueError, match="at least one"):
        check_buckets([])
    with pytest.raises(ValueError, match=">= 1"):
        check_buckets([0, 4])
    assert check_buckets(np.array([4, 1, 2])) == [1, 2, 4] and type(check_buckets(np.array([2]))[0]) is int
    assert check_buckets(b for b in (2, 1)) == [1, 2]
    for bad in (4, None):
        with pytest.raises(TypeError, match=f"buckets={bad!r}: must be an iterable of batch sizes"):
            check_buckets(bad)


# ----- best fit
def test_best_fit_takes_smallest_sufficient_block():
    fl = BestFitFreeList()
    for n, name in [(4096, "a"), (1024, "b"), (2048, "c"), (1024, "d")]:
        fl.put(n, name)
    assert fl.take(1000) == "b"  # smallest that fits; ties: freed first
    assert fl.take(1000) == "d"
    assert fl.take(1025) == "c"
    assert fl.take(5000) is None
    assert fl.take(4096) == "a"
    assert len(fl) == 0


def test_best_fit_random_against_brute_force():
    rng = random.Random(0)
    fl, free = BestFitFreeList(), []
    for i in range(2000):
        if free and rng.random() < 0.5:
            want = rng.randrange(1, 10_000)
            got = fl.take(want)
            fits = [(n, j) for n, j in free if n >= want]
            if not fits:
                assert got is None
            else:
                best = min(fits)
                assert got == best[1]
                free.remove(best)
        else:
            n = rng.randrange(1, 10_000)
            fl.put(n, i)
            free.append((n, i))
    assert sorted(fl.sizes()) == sorted(n for n, _ in free)


def test_round_block():
    assert [round_block(n) for n in (0, 1, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]
    with pytest.raises(ValueError, match="nbytes=-1"):
        round_block(-1)


# ----- preferred pool context
def test_prefer_graph_pool_nests_and_restores():
    a, b = PoolToken(1), PoolToken(2)
    assert preferred_pool() is None
    with prefer_graph_pool(a):
        assert preferred_pool() is a
        with prefer_graph_pool(b):
            assert preferred_pool() is b
            with prefer_graph_pool(None):
                assert preferred_pool() is None
            assert preferred_pool() is b
        assert preferred_pool() is a
    assert preferred_pool() is None


def test_prefer_graph_pool_restores_on_error():
    a, b = PoolToken(1), PoolToken(2)
    with prefer_graph_pool(a):
        with pytest.raises(KeyError):
            with prefer_graph_pool(b):
                raise KeyError("boom")
        assert preferred_pool() is a
    assert preferred_pool() is None


def test_prefer_graph_pool_is_thread_local():
    a = PoolToken(1)
    seen = []
    with prefer_graph_pool(a):
        t = threading.Thread(target=lambda: seen.append(preferred_pool()))
        t.start()
        t.join()
        assert preferred_pool() is a
    assert seen == [None]


def test_graph_pool_handle_tuple_is_rejected():
    # the published bug: a graph_pool_handle() tuple passed where a MemPool is needed
    with pytest.raises(ValueError, match="must be a torch.cuda.MemPool"):
        with prefer_graph_pool((1, 0)):
            pass
    with pytest.raises(ValueError, match="must be a torch.cuda.MemPool"):
        pool_id((1, 0))
    assert preferred_pool() is None


# ----- scratch buffers without a pool (CPU)
def test_scratch_best_fit_reuse_within_one_forward():
    sb = ScratchBuffers("cpu")
    with sb.forward(pool=None):
        a = sb.empty((250,), torch.float32)  # 1000 B -> 1024 B block
        b = sb.empty((10, 128), torch.float32)  # 5120 B
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
        sb.release(b)
        sb.release(a)
        c = sb.empty((300,), torch.uint8)  # fits both: best fit is a's block
        assert c.untyped_storage().data_ptr() == pa
        d = sb.empty((1200,), torch.float32)  # 4800 B: only b's block
        assert d.untyped_storage().data_ptr() == pb
        e = sb.empty((3000,), torch.float32)  # nothing free fits: new block
        assert e.shape == (3000,) and e.dtype == torch.float32
    assert (sb.requests, sb.reused, sb.fallbacks) == (5, 2, 0)


def test_scratch_scope_rules():
    sb = ScratchBuffers("cpu")
    with pytest.raises(RuntimeError, match="inside `with scratch.forward"):
        sb.empty((4,), torch.float32)
    with sb.forward(pool=None):
        with pytest.raises(RuntimeError, match="do not nest"):
            with sb.forward(pool=None):
                pass
        with pytest.raises(ValueError, match="not handed out"):
            sb.release(torch.zeros(3))
        with pytest.raises(ValueError, match="shape"):
            sb.empty((-1, 2), torch.float32)
        for bad in ((2.5,), (True, 4), (4, False)):  # a bool is an int to Python, not a size
            with pytest.raises(ValueError, match=r"shape=.*: sizes must be ints"):
                sb.empty(bad, torch.float32)
    with pytest.raises(ValueError, match="pool='default'"):
        with sb.forward(pool="default"):
            pass


def test_scratch_scope_belongs_to_the_thread_that_opened_it():
    """Another thread can neither open a second scope nor take buffers from the open one (which would share
    its free list); the opening thread keeps working, and once it closes, another thread may open a scope."""
    import threading

    sb = ScratchBuffers("cpu")
    errors = {}

    def other(name, fn):
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)

    def open_scope():
        with sb.forward(pool=None):
            pass

    with sb.forward(pool=None):
        mine = sb.empty((8,), torch.float32)
        for name, fn in (("open", open_scope), ("empty", lambda: sb.empty((4,), torch.float32))):
            t = threading.Thread(target=other, args=(name, fn))
            t.start()
            t.join()
        assert "do not nest" in errors["open"] and "open in thread" in errors["open"]
        assert "belongs to thread" in errors["empty"]
        sb.release(mine)
        assert sb.empty((8,), torch.float32).untyped_storage().data_ptr() == mine.untyped_storage().data_ptr()
    errors.clear()
    t = threading.Thread(target=other, args=("after", open_scope))
    t.start()
    t.join()
    assert errors == {}


def test_scratch_scopes_on_one_pool_wait_for_its_lock():
    """A scope on a pool holds pool_lock(pool) for its whole forward (a GraphRunner shares its own lock there,
    so replays wait too): a scope of another thread opens only after the holder lets go."""
    import time

    from moelab.scratch import PoolLock, pool_lock, share_pool_lock

    pool, events = PoolToken(901), []
    assert pool_lock(pool) is pool_lock(PoolToken(901)) and pool_lock(pool) is not pool_lock(PoolToken(902))

    def other():
        with ScratchBuffers("cpu").forward(pool):
            events.append("other's scope")

    mine = PoolLock()
    share_pool_lock(pool, mine)
    with mine.hold("a replay"):  # e.g. the runner in a replay
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.2)
        events.append("holder done")
        with ScratchBuffers("cpu").forward(pool):  # re-entrant: the holder's own scope opens at once
            events.append("holder's scope")
        assert mine.holder() == (threading.current_thread().name, "a replay")  # the outermost hold is named
    t.join()
    assert events == ["holder done", "holder's scope", "other's scope"]
    assert active_scopes(pool) == 0 and pool_lock(pool).holder() is None
    with pytest.raises(TypeError, match="PoolLock"):
        share_pool_lock(pool, threading.RLock())


def test_a_wait_for_a_held_pool_lock_ends_in_an_error_naming_the_holder():
    """A thread that holds a pool's lock and waits on another thread that needs it would hang both; the
    waiter gives up after the lock's wait_s with an error naming the holder, and leaves no scope open."""
    from moelab.scratch import PoolLock, PoolLockTimeout, share_pool_lock

    pool, errors, lock = PoolToken(903), [], PoolLock(wait_s=0.2)
    share_pool_lock(pool, lock)
    sb = ScratchBuffers("cpu")

    def other():
        try:
            with sb.forward(pool):
                errors.append("opened")
        except PoolLockTimeout as e:
            errors.append(str(e))

    with lock.hold("a replay"):
        t = threading.Thread(target=other)
        t.start()
        t.join(30)  # the holder waits on the other thread: without a timeout, neither would ever go on
    assert not t.is_alive() and len(errors) == 1, errors
    assert "a scratch scope waited 0.2 s" in errors[0] and f"thread {threading.current_thread().name!r}" in errors[0]
    assert "for a replay" in errors[0]
    assert active_scopes(pool) == 0
    with sb.forward(pool):  # the failed wait left the ScratchBuffers free for the next scope
        pass
    for bad in (-1, "1", True, float("nan"), threading.TIMEOUT_MAX):
        with pytest.raises(ValueError, match="wait_s="):
            PoolLock(wait_s=bad)
    assert PoolLock(float("inf")).wait_s is None and PoolLock(None).wait_s is None
    from fractions import Fraction

    assert PoolLock(Fraction(1, 4)).wait_s == 0.25  # any real number becomes a float RLock.acquire takes


def test_a_pool_lock_times_its_wait_and_only_its_holder_releases_it():
    from moelab.scratch import PoolLock, PoolLockTimeout

    lock, out = PoolLock(wait_s=0.3), {}

    def other():
        t0 = time.perf_counter()
        try:
            lock.acquire("a replay")
        except PoolLockTimeout:
            out["waited"] = time.perf_counter() - t0
        try:
            lock.release()
        except RuntimeError as e:
            out["release"] = str(e)

    with lock.hold("a scratch scope"):
        t = threading.Thread(target=other, name="decoder")
        t.start()
        t.join(30)
        assert lock.holder() == (threading.current_thread().name, "a scratch scope")  # untouched by the other
    assert 0.25 <= out["waited"] < 10 and "'decoder', which does not hold it" in out["release"]
    assert lock.holder() is None
    zero = PoolLock(wait_s=0)  # one try

    def try_zero():
        try:
            zero.acquire("a replay")
            out["zero"] = "taken"
        except PoolLockTimeout:
            out["zero"] = "refused"

    with zero.hold("a scratch scope"):
        t = threading.Thread(target=try_zero)
        t.start()
        t.join(30)
    assert out["zero"] == "refused"


def test_a_pools_registry_entries_go_with_the_pool_object():
    """Capture stream and lock are kept per pool id; once the pool object is garbage they are dropped
    (a MemPool's id is never given out again), so runners made and dropped in a loop leave nothing behind."""
    from moelab.scratch import capture_stream, pool_lock, register_capture_stream, registered_pools

    pool, stream = PoolToken(904), object()
    register_capture_stream(pool, stream)
    lock = pool_lock(pool)
    assert capture_stream(PoolToken(904)) is stream and pool_lock(PoolToken(904)) is lock
    assert (0, 904) in registered_pools()
    del pool
    gc.collect()
    assert (0, 904) not in registered_pools() and capture_stream(PoolToken(904)) is None


def test_a_scope_never_left_and_collected_under_the_registry_lock_cleans_up(monkeypatch):
    """A forward() scope entered and never left is closed when the collector frees it, possibly in a thread
    that holds the registry's lock: its clean-up takes that lock again and must not hang; it releases the
    pool's lock and its open-scope count."""
    from moelab import scratch

    # a fresh lock of the module's own kind: should the clean-up hang, the stuck thread holds only this one
    monkeypatch.setattr(scratch, "_registry_lock", type(scratch._registry_lock)())
    pool, sb, out = PoolToken(906), ScratchBuffers("cpu"), {}

    def abandon_then_collect():
        cm = sb.forward(pool)
        cm.__enter__()  # never __exit__: a scope left open by mistake
        out["open"] = active_scopes(pool)
        with scratch._registry_lock:
            del cm
            gc.collect()
        out["after"] = active_scopes(pool)

    t = threading.Thread(target=abandon_then_collect, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the abandoned scope's clean-up hung on the registry lock"
    assert out == {"open": 1, "after": 0}
    assert scratch.pool_lock(pool).holder() is None
    with sb.forward(pool):  # the ScratchBuffers is free again
        pass


def test_a_pool_collected_while_the_registry_is_busy_does_not_hang(monkeypatch):
    """A pool's finalizer may run in any thread during any allocation, also one made while the registry's own
    lock is held (a collection of a pool in a reference cycle): it must not take that lock."""
    from moelab import scratch

    # a lock of this test's own: should the finalizer take it, the stuck thread holds only this one
    monkeypatch.setattr(scratch, "_registry_lock", threading.Lock())
    gc.disable()  # the cycle is freed by the collection below, under the lock, not earlier
    try:
        pool = PoolToken(905)
        pool.cycle = pool  # only the cycle collector frees it
        scratch.pool_lock(pool)
        del pool
        seen = {}

        def collect_under_the_registry_lock():
            with scratch._registry_lock:
                gc.collect()
                seen["queued"] = (0, 905) in scratch._collected  # the finalizer ran, and only queued the id

        t = threading.Thread(target=collect_under_the_registry_lock, daemon=True)
        t.start()
        t.join(30)
    finally:
        gc.enable()
    assert not t.is_alive(), "the finalizer took the registry lock its own thread held"
    assert seen == {"queued": True}
    assert (0, 905) not in scratch.registered_pools()


def test_runner_validates_arguments():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=None means the current CUDA device, and this machine has none"):
            GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2])
    with pytest.raises(ValueError, match="pool='global'"):
        GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2], pool="global", device="cpu")
    with pytest.raises(ValueError, match="warmup=0"):
        GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2], warmup=0, device="cpu")
    with pytest.raises(ValueError, match="eager_example primes the shared pool"):
        GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2], pool="private", device="cpu",
                    eager_example=(torch.zeros(4),))
    with pytest.raises(ValueError, match="dim 0"):
        GraphRunner(lambda x, y: x, lambda b: (torch.zeros(b),), [1, 2], device="cpu",
                    eager_example=(torch.zeros(4), torch.zeros(3)))
    # one tensor is one input, not a tuple of its rows
    r = GraphRunner(lambda x: x, lambda b: (torch.zeros(b, 8),), [1, 2], device="cpu", eager_example=torch.zeros(4, 8))
    assert len(r.eager_example) == 1 and r.eager_example[0].shape == (4, 8)
    # no silent fallback: reuse=True needs a shared pool (none before capture, none with private pools)
    with pytest.raises(ValueError, match="reuse=True: this runner has no shared pool"):
        r.eager(torch.zeros(2, 8), reuse=True)
    with pytest.raises(ValueError, match="reuse='yes'"):
        r.eager(torch.zeros(2, 8), reuse="yes")
    with pytest.raises(ValueError, match="reuse=1: must be None, True or False"):
        r.eager(torch.zeros(2, 8), reuse=1)
    with pytest.raises(ValueError, match="a 0-d tensor has none"):
        GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2], device="cpu", eager_example=torch.tensor(1.0))
    with pytest.raises(ValueError, match="no shared pool yet: capture"):
        r.scratch_fraction_in_pool(torch.zeros(2, 8))
    assert r.pool_bytes() == {}  # no graphs: no pools, and no CUDA allocator to ask on a CPU runner
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    for bad, match in (("gpu", "device='gpu': must be 'cpu' or a CUDA device"),
                       ("meta", "device='meta': must be 'cpu' or a CUDA device"),
                       (missing, f"device='{missing}': this machine has {torch.cuda.device_count()} CUDA device")):
        with pytest.raises(ValueError, match=match):
            GraphRunner(lambda x: x, lambda b: (torch.zeros(b),), [1, 2], device=bad)
        with pytest.raises(ValueError, match=match):
            ScratchBuffers(bad)
    # a CPU runner is one for eager forwards: it runs step_fn as it is, without grad
    w = torch.ones(8, requires_grad=True)
    out = GraphRunner(lambda x: x * w, lambda b: (torch.zeros(b, 8),), [1, 2], device="cpu").eager(torch.ones(2, 8))
    assert torch.equal(out, torch.ones(2, 8)) and not out.requires_grad


def test_fraction_in_segments():
    segs = [(1000, 100, 0), (5000, 1000, 0)]
    assert fraction_in_segments([(1000, 50), (5100, 50)], segs) == 1.0
    assert fraction_in_segments([(1000, 50), (2000, 150)], segs) == 0.25
    assert fraction_in_segments([(1090, 20)], segs) == 0.0  # crosses the segment's end
    assert fraction_in_segments([(1050, 50), (5000, 1000)], segs) == 1.0  # ending exactly at a segment's end
    assert fraction_in_segments([(1050, 51)], segs) == 0.0  # one byte past it


def test_pool_segments_and_blocks_read_one_pool_of_a_snapshot():
    """From an allocator snapshot (torch.cuda.memory_snapshot's form): the segments and held blocks of the pool
    asked for only (a segment without a pool id is the default pool (0, 0)); blocks without an address of their
    own (older torch) lie one after another from their segment's address."""
    snap = [
        {"address": 0x10000, "total_size": 4096, "allocated_size": 768, "segment_pool_id": (1, 2),
         "blocks": [{"size": 512, "state": "inactive"}, {"size": 256, "state": "active_allocated"},
                    {"size": 2816, "state": "inactive"}, {"size": 512, "state": "active_allocated"}]},
        {"address": 0x20000, "total_size": 2048, "allocated_size": 2048, "segment_pool_id": [0, 0],
         "blocks": [{"size": 2048, "state": "active_allocated"}]},
        {"address": 0x30000, "total_size": 1024, "allocated_size": 128,
         "blocks": [{"size": 128, "state": "active_allocated", "address": 0x30000},
                    {"size": 896, "state": "active_pending_free", "address": 0x30080}]},
        {"address": 0x40000, "total_size": 8192, "allocated_size": 0, "segment_pool_id": (1, 2),
         "blocks": [{"size": 8192, "state": "inactive"}]},
    ]
    from moelab.graphs import pool_segments

    assert pool_segments((1, 2), snap) == [(0x10000, 4096, 768), (0x40000, 8192, 0)]
    assert pool_segments((0, 0), snap) == [(0x20000, 2048, 2048), (0x30000, 1024, 128)]
    assert pool_bytes((1, 2), snap) == {"reserved": 4096 + 8192, "allocated": 768, "segments": 2}
    assert pool_blocks((1, 2), snap) == frozenset({(0x10000 + 512, 256), (0x10000 + 512 + 256 + 2816, 512)})
    assert pool_blocks((0, 0), snap) == frozenset({(0x20000, 2048), (0x30000, 128)})
    assert pool_blocks((3, 4), snap) == frozenset() and pool_segments((3, 4), snap) == []


def test_merge_ranges_and_fraction_on_ranges():
    r = merge_ranges([(120, 50), (100, 50), (300, 10), (400, 0), (170, 5)])
    assert r == [(100, 175), (300, 310)]  # overlapping and touching blocks merge; empty ones vanish
    assert fraction_on_ranges([(100, 75)], r) == 1.0
    assert fraction_on_ranges([(150, 100)], r) == 0.25  # 150-175 on, 175-250 off
    assert fraction_on_ranges([(160, 200), (500, 40)], r) == (15 + 10) / 240
    rng = random.Random(0)
    for _ in range(200):  # byte by byte against a set of addresses
        blocks = [(rng.randrange(0, 400), rng.randrange(0, 60)) for _ in range(rng.randrange(0, 6))]
        allocs = [(rng.randrange(0, 400), rng.randrange(1, 60)) for _ in range(rng.randrange(1, 5))]
        covered = {a for b, n in blocks for a in range(b, b + n)}
        want = sum(a in covered for b, n in allocs for a in range(b, b + n)) / sum(n for _, n in allocs)
        assert fraction_on_ranges(allocs, merge_ranges(blocks)) == pytest.approx(want)


def test_hf_decode_step_returns_greedy_ids_of_the_last_position():
    from moelab.models import tiny_random

    # a trained config keeps output_router_logits on; the step turns it off (its aux loss syncs with the host)
    model = tiny_random("mixtral", output_router_logits=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False, output_router_logits=False).logits[:, -1]
        got_ids = hf_decode_step(model)(ids)
        got_logits = hf_decode_step(model, "logits")(ids)
    assert got_ids.shape == (3,) and got_ids.dtype == torch.long
    assert torch.equal(got_ids, full.argmax(-1))
    torch.testing.assert_close(got_logits, full)
    with pytest.raises(ValueError, match="output='probs'"):
        hf_decode_step(model, "probs")
    # under torch.device(ids' device): the same logits (MiniMax's step takes it by default: its lightning
    # attention builds a state with torch.zeros on the host, which a capture refuses to copy)
    with torch.no_grad():
        torch.testing.assert_close(hf_decode_step(model, "logits", on_device=True)(ids), full)
    assert HOST_FACTORY_FAMILIES == {"minimax"}


def test_entropy_adaptive_choose_k_is_the_table_lookup_without_a_k_tensor():
    # choose_k builds k from Python scalars (graph-capturable: no host-to-device copy); same as k_values[idx]
    pol = EntropyAdaptiveK((1, 2, 4, 8), (0.5, 1.0, 2.0))
    ent = torch.cat([torch.rand(500) * 3, torch.tensor([0.5, 1.0, 2.0, 0.0, float("nan")])])
    idx = sum((ent >= t).long() for t in pol.thresholds)
    want = torch.tensor(pol.k_values, dtype=torch.int32)[idx]
    got = choose_k(pol, torch.empty(ent.shape[0], 8), ent)
    assert got.dtype == torch.int32 and torch.equal(got, want)


# ----- CUDA
def _mlp_step(D=256, H=1024, seed=0):
    """A small MoE-free decode-like step: two GEMMs and a softmax, rows independent."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(D, H, device="cuda", generator=g, dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(H, D, device="cuda", generator=g, dtype=torch.bfloat16) / H**0.5

    def step(x_BD):
        h = torch.nn.functional.gelu(x_BD @ w1)
        y = h @ w2
        return torch.softmax(y.float(), -1)

    return step, (lambda b: (torch.randn(b, D, device="cuda", dtype=torch.bfloat16),))


def _hf_step():
    """Decode step of a tiny random Mixtral (transformers, grouped_mm experts), one token per sequence."""
    from moelab.models import tiny_random

    model = tiny_random("mixtral", hidden_size=128, intermediate_size=256, vocab_size=512).to("cuda", torch.bfloat16)

    def step(ids_B1):
        out = model(input_ids=ids_B1, use_cache=False, logits_to_keep=1, output_router_logits=False)
        return out.logits[:, -1].float()

    return step, (lambda b: (torch.randint(0, 512, (b, 1), device="cuda"),))


def _hf_ids_step():
    """Greedy-ids decode step of a tiny random Mixtral whose config keeps output_router_logits on (as trained)."""
    from moelab.models import tiny_random

    model = tiny_random("mixtral", hidden_size=128, intermediate_size=256, vocab_size=512,
                        output_router_logits=True).to("cuda", torch.bfloat16)
    return hf_decode_step(model, "ids"), (lambda b: (torch.randint(0, 512, (b, 1), device="cuda"),))


STEPS = {"mlp": _mlp_step, "hf-mixtral": _hf_step, "hf-mixtral-ids": _hf_ids_step}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(STEPS))
def test_stress_interleaved_eager_and_replays_match_no_graph_run(kind):
    step, make = STEPS[kind]()
    buckets = [1, 2, 4, 8, 16, 32]
    runner = GraphRunner(step, make, buckets).capture()
    rng = random.Random(0)
    cases = []
    with torch.no_grad():
        for _ in range(48):
            n = rng.randint(1, 32)
            (x,) = make(n)
            b = bucket_for(n, buckets)
            pad = torch.zeros((b, *x.shape[1:]), dtype=x.dtype, device=x.device)
            pad[:n] = x
            cases.append((x, step(pad)[:n].clone(), step(x).clone()))  # no graph, no pool
    torch.cuda.synchronize()
    mismatches, replays, eagers, results = 0, 0, 0, []
    for _ in range(1200):
        x, ref_graph, ref_eager = cases[rng.randrange(len(cases))]
        if rng.random() < 0.5:
            out, ref = runner(x), ref_graph
            replays += 1
        else:
            out, ref = runner.eager(x), ref_eager
            eagers += 1
        mismatches += not torch.equal(out, ref)
        results.append((out, ref))
    assert replays > 400 and eagers > 400
    assert mismatches == 0
    # and still right after every later call: no result lives where a later replay or eager forward writes
    assert sum(not torch.equal(out, ref) for out, ref in results) == 0
    assert runner.eager_fallbacks == 0


@gpu
@pytest.mark.gpu
def test_shared_pool_graphs_reuse_one_pool_and_private_pools_do_not():
    step, make = _mlp_step(D=512, H=4096)
    shared = GraphRunner(step, make, [8, 64, 256]).capture()
    assert len(set(shared.pool_ids().values())) == 1
    private = GraphRunner(step, make, [8, 64, 256], pool="private").capture()
    assert len(set(private.pool_ids().values())) == 3
    shared_res = sum(p["reserved"] for p in shared.pool_bytes().values())
    private_res = sum(p["reserved"] for p in private.pool_bytes().values())
    assert shared_res < private_res


@gpu
@pytest.mark.gpu
def test_proof_scratch_lands_in_graph_pool_only_when_on():
    step, make = _mlp_step(D=512, H=4096)
    runner = GraphRunner(step, make, [16, 64]).capture()
    (x,) = make(64)
    on = runner.scratch_fraction_in_pool(x, reuse=True)
    off = runner.scratch_fraction_in_pool(x, reuse=False)
    assert on["scratch_bytes"] > 0 and off["scratch_bytes"] > 0, (on, off)
    assert on["fraction_in_pool"] == 1.0, on
    assert on["fraction_in_captured_segments"] > 0.5, on  # blocks the graphs own, not new segments
    assert on["fraction_on_graph_blocks"] > 0.5, on  # the very bytes the graphs' allocations used
    assert on["graph_block_bytes"] > 0 and on["graph_blocks_reused"] > 0.5, on  # most of them, as large as it is
    assert off["fraction_in_pool"] == 0.0 and off["fraction_on_graph_blocks"] == 0.0, off
    assert off["graph_blocks_reused"] == 0.0, off
    # another stream cannot take the capture stream's free blocks: the pool grows instead
    other_stream = torch.cuda.Stream()
    with torch.cuda.stream(other_stream), torch.no_grad():
        step(x)  # its cuBLAS workspace outside the pool (else it would stay live in the pool: refused)
    other_stream.synchronize()
    other = runner.scratch_fraction_in_pool(x, reuse=True, stream=other_stream)
    assert other["fraction_in_pool"] == 1.0, other
    assert other["fraction_in_captured_segments"] == 0.0 and other["fraction_on_graph_blocks"] == 0.0, other


@gpu
@pytest.mark.gpu
def test_forward_leaving_memory_in_the_pool_is_refused():
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    kept = []

    def leaky(x):  # keeps an intermediate made inside the pool beyond the forward
        y = step(x)
        kept.append(torch.empty(1 << 20, device="cuda"))
        return y

    runner.step_fn = leaky
    (x,) = make(4)
    with pytest.raises(ScratchLiveError, match="outlived the forward"):
        runner.eager(x)


@gpu
@pytest.mark.gpu
def test_a_leak_refuses_replays_until_freed_whatever_the_pool_held_at_capture():
    step, make = _mlp_step()
    held, leak, mode = [], [], {"hold": True, "leak": False}

    def fn(x):
        y = step(x)
        if mode["hold"]:  # tensors made during capture and kept: the pool's allocated bytes after capture
            held.append(torch.empty(1 << 22, device="cuda"))
        if mode["leak"]:
            leak.append(torch.empty(1 << 16, device="cuda"))
        return y

    runner = GraphRunner(fn, make, [4, 8]).capture()
    mode["hold"] = False
    held.clear()  # the pool now holds less than right after capture: a capture-time baseline would miss a leak
    (x,) = make(4)
    runner.eager(x)  # no leak: fine
    mode["leak"] = True
    with pytest.raises(ScratchLiveError, match="outlived the forward"):
        runner.eager(x)
    mode["leak"] = False
    with pytest.raises(ScratchLiveError, match="replay refused"):  # remembered, not only raised once
        runner(x)
    leak.clear()
    torch.testing.assert_close(runner(x), step(x))  # freed: replays go ahead


def _runner_keeping_capture_tensors():
    """A runner whose step kept a 256 KiB tensor per captured bucket: (step, make, runner, held, indices of the
    held tensors that lie in the pool)."""
    step, make = _mlp_step()
    held, mode = [], {"hold": True}

    def fn(x):
        y = step(x)
        if mode["hold"]:
            held.append(torch.ones(1 << 16, device="cuda"))  # the capture's land in the pool
        return y

    runner = GraphRunner(fn, make, [4, 8]).capture()
    mode["hold"] = False
    segs = _pool_segs(runner)
    pooled = [i for i, t in enumerate(held) if fraction_in_segments([(t.data_ptr(), t.nbytes)], segs) == 1.0]
    assert pooled, "no tensor of the capture was kept in the pool"
    return step, make, runner, held, pooled


@gpu
@pytest.mark.gpu
def test_a_leak_is_told_by_blocks_not_bytes():
    """A forward that frees a tensor the pool held from capture and keeps a new one of the same size on another
    block leaves the pool's allocated bytes as they were; the new block is still caught."""
    step, make, runner, held, pooled = _runner_keeping_capture_tensors()
    kept = []

    def swap(x):
        y = step(x)
        new = torch.ones(1 << 16, device="cuda")  # taken while the old one holds its block: another block
        del held[pooled.pop()]
        kept.append(new)
        return y

    runner.step_fn = swap
    (x,) = make(4)
    before = pool_bytes(runner.pool.id)["allocated"]
    with pytest.raises(ScratchLiveError, match="1 blocks, 262144 bytes .* outlived the forward"):
        runner.eager(x)
    assert pool_bytes(runner.pool.id)["allocated"] == before  # a count of bytes would have let it pass
    with pytest.raises(ScratchLiveError, match="replay refused"):
        runner(x)
    kept.clear()
    torch.testing.assert_close(runner(x), step(x))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("raises", [False, True])
def test_a_leak_on_the_very_block_it_freed_is_caught(raises):
    """A forward that frees a tensor the pool held from capture and keeps a new one of the same size on exactly
    that block leaves the pool's held (address, size) blocks as they were; the allocations traced during the
    forward still tell the new tensor from the old, also when the forward raises afterwards."""
    step, make, runner, held, pooled = _runner_keeping_capture_tensors()
    kept, same_block = [], []

    def swap(x):
        old = held.pop(pooled.pop())
        ptr = old.data_ptr()
        del old  # its block is free now, on the capture stream: the next request of its size takes it
        new = torch.ones(1 << 16, device="cuda")
        same_block.append(new.data_ptr() == ptr)
        kept.append(new)
        if raises:
            raise KeyError("after keeping it")
        return step(x)

    runner.step_fn = swap
    (x,) = make(4)
    blocks = pool_blocks(runner.pool.id)
    with pytest.raises(KeyError if raises else ScratchLiveError, match="after keeping it" if raises else
                       "1 blocks, 262144 bytes .* outlived the forward"):
        runner.eager(x)
    assert same_block == [True], "the kept tensor did not take the freed block: the case is not exercised"
    assert pool_blocks(runner.pool.id) == blocks  # the same (address, size) blocks held as before the forward
    with pytest.raises(ScratchLiveError, match="replay refused"):
        runner(x)
    kept.clear()
    runner.step_fn = step
    torch.testing.assert_close(runner(x), step(x))


@gpu
@pytest.mark.gpu
def test_trace_allocations_fills_its_list_when_the_body_raises():
    with pytest.raises(KeyError):
        with trace_allocations() as allocs:
            t = torch.empty(1 << 20, device="cuda")
            raise KeyError(t.data_ptr())
    assert t.data_ptr() in {a for a, _ in allocs}, allocs


@gpu
@pytest.mark.gpu
def test_another_threads_scratch_scope_on_the_pool_makes_replays_wait():
    """A replay from one thread while another thread's scratch scope on the graphs' pool is open would write
    into that scope's blocks: it waits for the scope to end (the runner shares its lock with the pool's scopes)."""
    import time

    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    (x,) = make(8)
    ref = step(x)
    entered, events = threading.Event(), []

    def other():
        sb = ScratchBuffers()
        with sb.forward(runner.pool):
            buf = sb.empty((1 << 20,), torch.float32)
            buf.fill_(7.0)
            entered.set()
            time.sleep(0.5)  # a replay now would run on the blocks this scope holds
            events.append(("intact", bool((buf == 7.0).all())))
            del buf
            events.append("left")

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    out = runner(x)
    events.append("replayed")
    t.join()
    assert events == [("intact", True), "left", "replayed"]
    torch.testing.assert_close(out, ref)


@gpu
@pytest.mark.gpu
def test_a_scope_holder_waiting_on_a_replaying_thread_gets_an_error_not_a_hang():
    """The replay that must wait for a scope, while the scope's thread waits for the replay, gives up after
    the runner's lock_wait_s with an error naming the holder; runner and pool work on afterwards."""
    from moelab.scratch import PoolLockTimeout

    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8], lock_wait_s=0.5).capture()
    (x,) = make(8)
    ref = step(x)
    errors = []

    def replay():
        try:
            runner(x)
        except PoolLockTimeout as e:
            errors.append(str(e))

    sb = ScratchBuffers()
    with sb.forward(runner.pool):
        buf = sb.empty((1 << 20,), torch.float32)
        buf.fill_(7.0)
        t = threading.Thread(target=replay)
        t.start()
        t.join(30)  # waits on the replaying thread while holding the scope
        assert bool((buf == 7.0).all())
        del buf
    assert not t.is_alive() and len(errors) == 1, errors
    assert "a replay waited 0.5 s" in errors[0] and "for a scratch scope" in errors[0]
    assert f"thread {threading.current_thread().name!r}" in errors[0]
    torch.testing.assert_close(runner(x), ref)


@gpu
@pytest.mark.gpu
def test_a_dropped_runner_leaves_no_pool_registry_entries():
    """Capture stream, lock and tracked blocks are kept per pool; capture('auto') makes trial pools too. Once
    a runner is dropped, none of its pools' entries are left (runners made in a loop do not pile them up)."""
    from moelab.scratch import registered_pools

    before = registered_pools()
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8], eager_example=make(8)).capture()  # 'auto': two or three pools
    pid = runner.pool.id
    (x,) = make(8)
    runner.eager(x)
    torch.testing.assert_close(runner(x), step(x))
    assert pid in registered_pools()
    del runner
    gc.collect()
    assert registered_pools() - before == set()


@gpu
@pytest.mark.gpu
def test_a_forward_that_raises_leaves_nothing_a_replay_could_overwrite():
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    stash, mode = [], {"stash": False}

    def failing(x):
        y = step(x)  # noqa: F841 (a local in the pool, held by the traceback's frame)
        big = torch.ones(1 << 20, device="cuda")  # noqa: F841
        if mode["stash"]:
            stash.append(torch.empty(1 << 16, device="cuda"))
        raise RuntimeError("boom")

    (x,) = make(4)
    runner.step_fn = failing
    with pytest.raises(RuntimeError, match="boom") as info:
        runner.eager(x)
    assert info.value.__traceback__ is not None  # the traceback is still held, its frames' pool tensors not
    t = torch.empty(1 << 20, device="cuda")  # routing into the pool ended with the failed forward
    assert fraction_in_segments([(t.data_ptr(), t.nbytes)], _pool_segs(runner)) == 0.0
    torch.testing.assert_close(runner(x), step(x))  # nothing of the failed forward is left in the pool
    mode["stash"] = True
    with pytest.raises(RuntimeError, match="boom"):
        runner.eager(x)
    with pytest.raises(ScratchLiveError, match="replay refused: an eager forward that raised"):
        runner(x)
    stash.clear()
    torch.testing.assert_close(runner(x), step(x))
    runner.step_fn = step
    torch.testing.assert_close(runner.eager(x), step(x))


@gpu
@pytest.mark.gpu
def test_capture_and_proof_leave_someone_elses_memory_history_alone():
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=100_000)
    try:
        mine = torch.empty(1 << 20, device="cuda")  # an event of the user's own recording
        step, make = _mlp_step()
        runner = GraphRunner(step, make, [4, 8]).capture()
        (x,) = make(8)
        proof = runner.scratch_fraction_in_pool(x)
        assert torch._C._cuda_isHistoryEnabled()  # still recording, history kept
        traces = torch.cuda.memory._snapshot()["device_traces"]
        assert any(e["action"] == "alloc" and e["addr"] == mine.data_ptr() for dev in traces for e in dev)
        assert proof["fraction_in_pool"] == 1.0 and proof["fraction_on_graph_blocks"] > 0.5, proof
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_events_after_finds_the_body_start_when_the_history_made_way():
    """A full history drops its oldest entries: the body's events are found after the entries that ended it at
    the start, wherever those moved; once they are gone too, the start cannot be found and it raises."""
    from moelab.graphs import _ANCHOR, _entry_key, _events_after

    def entries(lo, hi):
        return [{"action": "alloc", "addr": 4096 * i, "size": 512, "stream": 0, "time_us": i} for i in range(lo, hi)]

    before = entries(0, 64)
    anchor = tuple(_entry_key(e) for e in before[-_ANCHOR:])
    body = entries(64, 90)
    assert _events_after(before + body, 64, anchor) == body  # not full: the same positions
    assert _events_after((before + body)[-64:], 64, anchor) == body  # full at 64: 26 oldest made way
    for kept in (body[-20:], (before + body)[-30:]):  # the body's first events made way, or part of the anchor
        with pytest.raises(RuntimeError, match="max_entries"):
            _events_after(kept, 64, anchor)
    assert _events_after(body, 0, ()) == body  # empty at the start
    # the body repeating the anchor's entries (no time stamps) is not mistaken for it: the latest match at or
    # left of the anchor's old place wins
    flat = [dict(e, time_us=None) for e in before[-_ANCHOR:]]
    key = tuple(_entry_key(e) for e in flat)
    assert _events_after(flat + flat, _ANCHOR, key) == flat


@gpu
@pytest.mark.gpu
def test_trace_allocations_in_someone_elses_full_history():
    """With a user's small history full before and during the body, every alloc of the body is still found;
    a body with more events than the history holds raises instead of returning a part."""
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=64)
    try:
        junk = [torch.empty(256 * (i + 1), device="cuda") for i in range(100)]  # fill it past its size
        del junk
        with trace_allocations() as allocs:
            mine = [torch.empty(1024 * (i + 1), device="cuda") for i in range(5)]
        assert {t.data_ptr() for t in mine} <= {a for a, _ in allocs}, allocs
        with pytest.raises(RuntimeError, match="max_entries"):
            with trace_allocations():
                many = [torch.empty(512 * (i + 1), device="cuda") for i in range(100)]
        del many
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@gpu
@pytest.mark.gpu
def test_trace_allocations_refuses_a_history_of_the_state_alone():
    """A user's history recording only the allocator's state (enabled='state') keeps its last entry alone, so the
    body's allocations cannot be read from it: refused before the body runs (an empty list would read as 'the
    body allocated nothing'). The setting is left as it was."""
    torch.cuda.memory._record_memory_history(enabled="state")
    try:
        ran = []
        with pytest.raises(RuntimeError, match="enabled='state'"):
            with trace_allocations():
                ran.append(torch.empty(1 << 20, device="cuda"))
        assert ran == [] and torch._C._cuda_isHistoryEnabled()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@gpu
@pytest.mark.gpu
def test_replays_from_two_threads_on_their_own_streams():
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    xs = [make(8)[0] for _ in range(8)]
    refs = [step(x) for x in xs]
    bad = []

    def work(seed):
        rng = random.Random(seed)
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(200):
                i = rng.randrange(len(xs))
                out = runner(xs[i])
                bad.append(not torch.equal(out, refs[i]))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bad) == 400 and not any(bad)


@gpu
@pytest.mark.gpu
def test_scratch_scope_on_another_stream_is_ordered_with_the_callers():
    pool, s = torch.cuda.MemPool(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # the caller's stream is busy for a while ...
    x.fill_(1.0)  # ... before it writes x
    sb = ScratchBuffers()
    with sb.forward(pool, stream=s):
        y = x * 2  # on s: must see the caller's write
        torch.cuda._sleep(50_000_000)
        y.add_(1.0)  # the caller's stream must see this after the scope
    got = y.sum().item()  # on the caller's stream
    assert got == 3.0 * x.numel()


@gpu
@pytest.mark.gpu
def test_step_with_its_own_scratch_buffers_inside_eager():
    """A step_fn using ScratchBuffers of its own inside runner.eager (which already routes the forward to
    the pool) takes its blocks from the pool instead of failing to route twice."""
    step, make = _mlp_step()
    sb = ScratchBuffers("cuda")

    def fn(x):
        with sb.forward():
            buf = sb.empty((x.shape[0], 64), torch.float32)
            buf.fill_(1.0)
            y = step(x) + 0.0 * buf.sum()
        return y

    runner = GraphRunner(fn, make, [4, 8]).capture()
    (x,) = make(8)
    before = sb.pool_bytes
    torch.testing.assert_close(runner.eager(x), step(x))
    assert sb.pool_bytes > before and runner.eager_fallbacks == 0


@gpu
@pytest.mark.gpu
def test_capture_owns_its_static_inputs_and_a_failed_capture_leaves_nothing():
    step, make = _mlp_step()
    fixed = {b: make(b)[0] for b in (4, 8)}
    orig = {b: t.clone() for b, t in fixed.items()}
    runner = GraphRunner(step, lambda b: (fixed[b],), [4, 8]).capture()
    (x,) = make(5)
    torch.testing.assert_close(runner(x), step(x))
    assert all(torch.equal(fixed[b], orig[b]) for b in fixed)  # the caller's tensors were not overwritten

    def bad(b):
        if b == 4:
            raise RuntimeError("no inputs for 4")
        return make(b)

    r2 = GraphRunner(step, bad, [4, 8])
    with pytest.raises(RuntimeError, match="no inputs for 4"):
        r2.capture()
    assert not r2.graphs and r2.pool is None
    r2.make_inputs = make
    r2.capture()  # can be captured again
    assert sorted(r2.graphs) == [4, 8]
    with pytest.raises(ValueError, match="prime=True primes with eager_example"):
        GraphRunner(step, make, [4]).capture(prime=True)


@gpu
@pytest.mark.gpu
def test_captured_segments_are_those_right_after_capture():
    """An eager forward larger than the graphs grows the pool: its scratch is all in the pool, but not all in
    the segments the pool had right after capture."""
    step, make = _mlp_step(D=512, H=4096)
    runner = GraphRunner(step, make, [4]).capture(prime=False)
    (big,) = make(2048)
    first = runner.scratch_fraction_in_pool(big)
    assert first["fraction_in_pool"] == 1.0 and first["fraction_in_captured_segments"] < 1.0, first
    again = runner.scratch_fraction_in_pool(big)  # the grown segments are still not the captured ones
    assert again["fraction_in_captured_segments"] < 1.0, again


@gpu
@pytest.mark.gpu
def test_replay_refused_while_scratch_is_live():
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    (x,) = make(3)
    with runner.scratch.forward(runner.pool):  # stream: the pool's capture stream
        buf = runner.scratch.empty((1024,), torch.float32)
        with pytest.raises(ScratchLiveError, match="still running"):
            runner(x)
    view = buf[:10]
    del buf
    with pytest.raises(ScratchLiveError, match="still\\s+referenced"):
        runner(x)
    del view
    runner(x)  # fine once the scratch is gone


@gpu
@pytest.mark.gpu
def test_preferred_pool_routes_scratch_into_graph_pool():
    step, make = _mlp_step()
    runner = GraphRunner(step, make, [4, 8]).capture()
    sb = ScratchBuffers()
    with prefer_graph_pool(runner.pool), sb.forward():
        t = sb.empty((4096,), torch.float32)
        ptr, n = t.data_ptr(), t.untyped_storage().nbytes()
        del t
    segs = [(s["address"], s["total_size"], 0) for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) == runner.pool.id]
    assert fraction_in_segments([(ptr, n)], segs) == 1.0
    assert sb.pool_bytes > 0 and sb.fallbacks == 0


@gpu
@pytest.mark.gpu
def test_pool_oom_falls_back_to_ordinary_allocator(caplog):
    MiB = 1 << 20
    pool = torch.cuda.MemPool()
    stream = torch.cuda.current_stream()
    gc.collect()  # graphs of earlier tests: their pools must not be freed by the OOM path below
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del big  # a cached 64 MiB segment of the ordinary pool ...
    pin = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")  # ... pinned by a live block: 62 MiB free in it
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + MiB) / total)
    sb = ScratchBuffers()
    try:
        with caplog.at_level(logging.WARNING, logger="moelab.scratch"):
            with sb.forward(pool, stream=stream):
                t = sb.empty((32 * MiB,), torch.uint8)  # the pool needs a new segment: out of memory
                t.fill_(7)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert bool((t == 7).all())
    assert sb.fallbacks == 1 and sb.fallback_bytes == 32 * MiB
    assert any("out of memory" in r.getMessage() for r in caplog.records)
    del pin


@gpu
@pytest.mark.gpu
def test_graph_pool_handle_tuple_cannot_route_allocations():
    # what the published TensorRT-LLM change passed to use_mem_pool; it raised, and `except Exception` hid it
    handle = torch.cuda.graph_pool_handle()
    with pytest.raises(AttributeError):
        with torch.cuda.use_mem_pool(handle):
            pass
    with pytest.raises(ValueError, match="graph_pool_handle"):
        with prefer_graph_pool(handle):
            pass


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("how", ["eager_example", "prime"])
def test_primed_capture_puts_graphs_into_eager_sized_segments(how):
    step, make = _mlp_step(D=512, H=4096)
    (prompt,) = make(64)
    with pytest.raises(ValueError, match="prime needs pool='shared'"):
        GraphRunner(step, make, [16, 32], pool="private").capture(prime=(prompt,))
    if how == "eager_example":  # prime=True primes with the runner's eager example
        runner = GraphRunner(step, make, [16, 32], eager_example=(prompt,)).capture(prime=True)
    else:
        runner = GraphRunner(step, make, [16, 32]).capture(prime=(prompt,))
    before = runner.pool_bytes()[runner.pool.id]["reserved"]
    proof = runner.scratch_fraction_in_pool(prompt)
    assert proof["fraction_in_pool"] == 1.0, proof
    assert proof["fraction_in_captured_segments"] == 1.0, proof
    assert proof["fraction_on_graph_blocks"] > 0.0, proof  # the priming forward's segments hold the graphs too
    assert runner.pool_bytes()[runner.pool.id]["reserved"] == before  # the eager forward did not grow the pool
    assert runner.eager_growth_bytes == 0
    (x,) = make(20)
    assert torch.equal(runner(x), runner(x))


@gpu
@pytest.mark.gpu
def test_priming_does_not_hold_two_eager_peaks_at_once():
    """The priming forward first runs outside the pool (lazy state); its cached activations are given back
    before the same forward runs in the pool, so capture's reserved peak stays near one eager peak, not two."""
    step, make = _mlp_step(D=512, H=4096)
    (prompt,) = make(8192)  # activations of 128 MiB: far above the decode graphs'
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    with torch.no_grad():
        step(prompt)
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_reserved() - base
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    runner = GraphRunner(step, make, [16, 32]).capture(prime=(prompt,))
    capture_peak = torch.cuda.max_memory_reserved() - base
    assert capture_peak < 1.5 * eager_peak, (capture_peak, eager_peak)
    assert runner.pool_bytes()[runner.pool.id]["reserved"] >= 0.5 * eager_peak  # the primed pool holds the forward


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prompt_rows", [64, 4096])
def test_auto_prime_keeps_the_smaller_pool(prompt_rows):
    """capture('auto') tries both layouts and keeps the one whose pool is smaller after an eager forward."""
    step, make = _mlp_step(D=512, H=4096)
    (prompt,) = make(prompt_rows)
    runner = GraphRunner(step, make, [16, 32, 64], eager_example=(prompt,)).capture()
    choice = runner.prime_choice
    assert choice["unprimed_pool_bytes"] > 0 and choice["primed_pool_bytes"] > 0
    assert choice["primed"] == (choice["primed_pool_bytes"] < choice["unprimed_pool_bytes"])
    smaller = min(choice["primed_pool_bytes"], choice["unprimed_pool_bytes"])
    assert pool_bytes(runner.pool.id)["reserved"] <= 1.05 * smaller  # (the kept layout was captured anew)
    before = pool_bytes(runner.pool.id)["reserved"]
    runner.eager(prompt)  # the kept layout already holds the eager forward
    assert pool_bytes(runner.pool.id)["reserved"] == before and runner.eager_growth_bytes == 0
    (x,) = make(40)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), step(x), atol=1e-2, rtol=1e-2)


@gpu
@pytest.mark.gpu
def test_unprimed_pool_growth_is_counted():
    """Without priming, an eager forward larger than the graphs adds segments: the runner counts them."""
    step, make = _mlp_step(D=512, H=4096)
    (prompt,) = make(1024)
    runner = GraphRunner(step, make, [16, 32]).capture()
    before = runner.pool_bytes()[runner.pool.id]["reserved"]
    runner.eager(prompt)
    grown = runner.pool_bytes()[runner.pool.id]["reserved"] - before
    assert grown > 0 and runner.eager_growth_bytes == grown  # the pool's own segments, nothing else


@gpu
@pytest.mark.gpu
def test_static_outputs_live_outside_the_pool_and_leave_it_free_for_eager():
    step, make = _mlp_step(D=512, H=4096)
    buckets = [16, 64, 256]
    runner = GraphRunner(step, make, buckets).capture()
    (buf,) = runner.out_buffers
    assert buf.shape == (256, 512) and buf.dtype == torch.float32
    for b in buckets:  # every bucket's static output is the first b rows of the one buffer
        assert runner.graphs[b].outputs[0].data_ptr() == buf.data_ptr()
    ptr = buf.data_ptr()
    assert fraction_in_segments([(ptr, buf.untyped_storage().nbytes())], _pool_segs(runner)) == 0.0
    before = pool_bytes(runner.pool.id)
    assert before["allocated"] == 0, before  # nothing of the graphs stays allocated inside the pool
    (x,) = make(256)
    proof = runner.scratch_fraction_in_pool(x)
    assert proof["fraction_in_captured_segments"] == 1.0, proof  # the largest graph's blocks fit the same forward
    assert pool_bytes(runner.pool.id)["reserved"] == before["reserved"]  # the eager forward did not grow the pool
    with torch.no_grad():
        for n in (3, 16, 200):
            (xn,) = make(n)
            b = bucket_for(n, buckets)
            pad = torch.zeros((b, *xn.shape[1:]), dtype=xn.dtype, device=xn.device)
            pad[:n] = xn
            assert torch.equal(runner(xn), step(pad)[:n])


def _pool_segs(runner):
    return [(s["address"], s["total_size"], 0) for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) == runner.pool.id]


@gpu
@pytest.mark.gpu
def test_torch_routing_path_of_entropy_adaptive_k_captures_in_a_graph():
    # choose_k once copied a host k_values tensor to the GPU, which capture refuses
    from moelab.routing import route_torch

    pol = EntropyAdaptiveK((1, 2, 4), (1.0, 2.0))
    g = torch.Generator(device="cuda").manual_seed(0)
    static = torch.randn(64, 8, device="cuda", generator=g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route_torch(static, pol, True)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = route_torch(static, pol, True)
    for scale in (0.3, 3.0):  # different k per token through the same graph
        static.copy_(torch.randn(64, 8, device="cuda", generator=g) * scale)
        graph.replay()
        ref = route_torch(static, pol, True)
        assert torch.equal(plan.k, ref.k) and torch.equal(plan.expert_ids, ref.expert_ids)
