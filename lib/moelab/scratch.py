"""Scratch buffers for the eager forward, borrowed from a CUDA-graph memory pool.

The captured decode graphs own a pool whose blocks sit free between replays; the eager forward can
borrow them instead of growing a second pool. Three rules make that safe and real:
- the pool is a `torch.cuda.MemPool` (a `graph_pool_handle()` tuple cannot route allocations: that is
  the bug that silently disabled the published TensorRT-LLM version);
- allocations run on the stream the graphs were captured on: the caching allocator only hands a free
  block to a request on the block's own stream, so any other stream grows the pool instead of reusing it;
- a scratch buffer lives for one eager forward; a replay while one is live raises (the replay writes
  into the blocks the graph freed during capture).
Only `torch.cuda.OutOfMemoryError` from the pool is caught: it falls back to the ordinary allocator,
logs a warning and counts the fallback.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import logging
import math
import numbers
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "prefer_graph_pool",
    "preferred_pool",
    "pool_id",
    "register_capture_stream",
    "capture_stream",
    "BestFitFreeList",
    "ScratchBuffers",
    "ScratchLiveError",
    "live_scratch_bytes",
    "active_scopes",
    "pool_lock",
    "share_pool_lock",
    "PoolLock",
    "PoolLockTimeout",
    "LOCK_WAIT_S",
    "registered_pools",
    "round_block",
    "check_device",
]

log = logging.getLogger(__name__)

_tls = threading.local()
# Registries keyed by pool id, guarded by _registry_lock. A pool's entries go once its pool object is garbage
# (a MemPool's id is never given out again): its finalizer only queues the id (`_collected`, no lock: it may run
# in any thread, during any allocation, also one made under _registry_lock), and the next registry call drops it.
_capture_streams: dict[tuple[int, int], "torch.cuda.Stream"] = {}
# pool id -> (storage weak reference, bytes) of scratch blocks; not expired = pool memory still in use
_live_blocks: dict[tuple[int, int], list] = {}
# pool id -> number of eager scopes currently open on it (any thread)
_open_scopes: dict[tuple[int, int], int] = {}
# pool id -> the lock its eager scopes hold for their whole forward (a GraphRunner shares its own: see pool_lock)
_pool_locks: dict[tuple[int, int], "PoolLock"] = {}
_watched: set[tuple[int, int]] = set()  # ids whose pool object has a finalizer
_collected: collections.deque = collections.deque()  # ids whose pool object is gone: dropped at the next call
# re-entrant: a collection under it may finalize a forward() scope entered and never left, whose clean-up
# (`_count_scope`) takes it again in the same thread
_registry_lock = threading.RLock()
LOCK_WAIT_S = 60.0  # seconds a thread waits for a pool's lock before PoolLockTimeout (None: forever): the wait of
# the locks pool_lock makes, read when it makes one; PoolLock() and GraphRunner(lock_wait_s=...) default to 60 s


class ScratchLiveError(RuntimeError):
    """A graph replay was requested while eager scratch memory of its pool is still in use."""


class PoolLockTimeout(TimeoutError):
    """A pool's lock stayed taken for the whole wait: most likely two threads waiting on each other."""


def _check_wait(wait_s, name: str) -> float | None:
    """A lock wait as RLock.acquire takes it: float seconds, or None (forever) for None and inf."""
    if wait_s is None:
        return None
    if (isinstance(wait_s, bool) or not isinstance(wait_s, numbers.Real)
            or not (0 <= wait_s < threading.TIMEOUT_MAX or wait_s == math.inf)):
        raise ValueError(f"{name}={wait_s!r}: must be seconds >= 0 (below threading.TIMEOUT_MAX), or None / inf to "
                         "wait forever")
    return None if wait_s == math.inf else float(wait_s)


class PoolLock:
    """The re-entrant lock of one graph pool: every scratch scope on the pool holds it, and so do its runner's
    replays, eager forwards and captures. A wait longer than `wait_s` raises PoolLockTimeout naming the holder
    instead of hanging: a thread that holds a scope and waits for another thread's replay of the same pool
    would otherwise wait forever. The wait cannot tell that from a holder that is only slow (a long capture or
    prefill, or a lock handed to other waiters first: it is not fair), so keep wait_s well above the longest
    hold; None waits forever."""

    def __init__(self, wait_s: float | None = 60.0, *, arg: str = "wait_s"):
        self.wait_s = _check_wait(wait_s, arg)  # arg: the name a bad value is reported under
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None  # (thread name, what it does) of the outermost hold
        self._owner: int | None = None  # thread ident of the holder
        self._depth = 0

    def acquire(self, what: str = "a scratch scope") -> None:
        """Take the lock for `what` (named to a waiter that times out); PoolLockTimeout after wait_s."""
        if not self._lock.acquire(timeout=-1 if self.wait_s is None else self.wait_s):
            name, doing = self._holder or ("?", "?")  # read without the lock: a hint for the message
            raise PoolLockTimeout(
                f"{what} waited {self.wait_s} s for a graph pool's lock, held by thread {name!r} for {doing}. A "
                "thread that holds a scratch scope on a pool must not wait for another thread's replay or eager "
                "forward on it (deadlock); a longer wait: GraphRunner(lock_wait_s=...), None waits forever"
            )
        if self._depth == 0:
            self._owner = threading.get_ident()
            self._holder = (threading.current_thread().name, what)
        self._depth += 1

    def release(self) -> None:
        if self._depth == 0 or self._owner != threading.get_ident():
            raise RuntimeError(f"PoolLock released by thread {threading.current_thread().name!r}, which does not "
                               f"hold it (holder: {self._holder})")
        self._depth -= 1
        if self._depth == 0:
            self._owner = self._holder = None
        self._lock.release()

    @contextlib.contextmanager
    def hold(self, what: str):
        """`with lock.hold("a replay"):` the lock for the body."""
        self.acquire(what)
        try:
            yield self
        finally:
            self.release()

    def holder(self) -> tuple[str, str] | None:
        """(thread name, what it does) of the current holder, None when free."""
        return self._holder


def _registered(pool) -> tuple[int, int]:
    """pool_id(pool), with _registry_lock held: drop the ids of collected pools, and watch this one."""
    pid = pool_id(pool)
    _drop_collected()
    if pid not in _watched:
        weakref.finalize(pool, _collected.append, pid)
        _watched.add(pid)
    return pid


def registered_pools() -> set[tuple[int, int]]:
    """Ids of the pools that have entries (capture stream, lock, open scopes or tracked blocks)."""
    with _registry_lock:
        _drop_collected()
        return set(_capture_streams) | set(_live_blocks) | set(_open_scopes) | set(_pool_locks)


def _drop_collected() -> None:
    while _collected:
        gone = _collected.popleft()
        for reg in (_capture_streams, _live_blocks, _open_scopes, _pool_locks):
            reg.pop(gone, None)
        _watched.discard(gone)


def pool_id(pool) -> tuple[int, int]:
    """The (int, int) id of a MemPool; ValueError for anything that cannot route allocations. The registries
    keep a pool's entries while the first object registered with its id lives (weak-referenceable, one live
    object per id: true of MemPool, whose ids are never reused)."""
    pid = getattr(pool, "id", None)
    if not (isinstance(pid, tuple) and len(pid) == 2 and all(isinstance(i, int) for i in pid)):
        raise ValueError(
            f"pool={pool!r}: must be a torch.cuda.MemPool (with an .id of two ints); a graph_pool_handle() "
            "tuple cannot be passed to torch.cuda.use_mem_pool"
        )
    return pid


def _stack() -> list:
    if not hasattr(_tls, "pools"):
        _tls.pools = []
    return _tls.pools


@contextlib.contextmanager
def prefer_graph_pool(pool):
    """Make `pool` (a MemPool, or None for 'no preference') the preferred pool of this thread.

    Nests; the previous preference comes back on exit, also when the body raises.
    """
    if pool is not None:
        pool_id(pool)
    stack = _stack()
    depth = len(stack)
    stack.append(pool)
    try:
        yield pool
    finally:
        del stack[depth:]


def preferred_pool():
    """The pool preferred by the innermost `prefer_graph_pool` of this thread (None outside any)."""
    stack = _stack()
    return stack[-1] if stack else None


def register_capture_stream(pool, stream) -> None:
    """Remember the stream a pool's graphs were captured on: scratch allocations must use it to reuse blocks."""
    with _registry_lock:
        _capture_streams[_registered(pool)] = stream


def capture_stream(pool):
    """The registered capture stream of `pool`, or None."""
    return _capture_streams.get(pool_id(pool))


def pool_lock(pool) -> PoolLock:
    """The lock that every scratch scope on `pool` holds for its whole forward. A GraphRunner registers its
    own lock here (`share_pool_lock`), so a scope of another thread and a replay of its graphs, which would
    overwrite that scope's blocks, never overlap: the replay waits for the scope to end. A pool no runner
    registered gets a PoolLock waiting LOCK_WAIT_S."""
    with _registry_lock:
        pid = _registered(pool)
        lock = _pool_locks.get(pid)
        if lock is None:
            lock = _pool_locks[pid] = PoolLock(LOCK_WAIT_S)
        return lock


def share_pool_lock(pool, lock: PoolLock) -> None:
    """Make `lock` (a PoolLock: re-entrant, so its holder may open scopes) the one scopes on `pool` hold."""
    if not isinstance(lock, PoolLock):
        raise TypeError(f"lock={lock!r}: must be a moelab.scratch.PoolLock")
    with _registry_lock:
        _pool_locks[_registered(pool)] = lock


def round_block(nbytes: int) -> int:
    """Block size the CUDA caching allocator gives a request of nbytes (multiples of 512 bytes)."""
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes}: must be >= 0")
    return max(512, 512 * math.ceil(nbytes / 512))


def _track(pid, block) -> None:
    # a storage weak reference outlives the Python tensor: views handed to the caller keep it unexpired
    with _registry_lock:
        _live_blocks.setdefault(pid, []).append((StorageWeakRef(block.untyped_storage()), block.numel()))


def live_scratch_bytes(pool) -> int:
    """Bytes of scratch blocks from `pool` that something still references after their forward ended."""
    pid = pool_id(pool)
    with _registry_lock:
        refs = [(r, n) for r, n in _live_blocks.get(pid, []) if not r.expired()]
        if pid in _live_blocks:
            _live_blocks[pid] = refs
    return sum(n for _, n in refs)


def _count_scope(pid, n: int) -> None:
    with _registry_lock:
        left = _open_scopes.get(pid, 0) + n
        if left > 0:
            _open_scopes[pid] = left
        else:
            _open_scopes.pop(pid, None)


def active_scopes(pool) -> int:
    """Eager scratch scopes currently open on `pool`."""
    return _open_scopes.get(pool_id(pool), 0)


class BestFitFreeList:
    """Free blocks ordered by size: `take(n)` returns the smallest block of at least n bytes.

    Ties go to the block that was freed first. Pure Python: the policy is testable without a GPU.
    """

    def __init__(self):
        self._keys: list[tuple[int, int]] = []  # (nbytes, seq), sorted
        self._blocks: dict[int, object] = {}
        self._seq = itertools.count()

    def put(self, nbytes: int, block) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        seq = next(self._seq)
        bisect.insort(self._keys, (nbytes, seq))
        self._blocks[seq] = block

    def take(self, nbytes: int):
        """Remove and return the best-fitting block, or None if no free block is large enough."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        i = bisect.bisect_left(self._keys, (nbytes, -1))
        if i == len(self._keys):
            return None
        _, seq = self._keys.pop(i)
        return self._blocks.pop(seq)

    def clear(self) -> None:
        self._keys.clear()
        self._blocks.clear()

    def blocks(self) -> list:
        return [self._blocks[seq] for _, seq in self._keys]

    def sizes(self) -> list[int]:
        return [n for n, _ in self._keys]

    def __len__(self) -> int:
        return len(self._keys)


def check_device(device) -> torch.device:
    """`device` as a torch.device: the CPU (eager forwards only) or a CUDA device this machine has."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: must be 'cpu' or a CUDA device ('cuda', 'cuda:0', ...)")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d.type == "cuda" and (d.index or 0) >= n:
        raise ValueError(f"device={device!r}: this machine has {n} CUDA device(s)")
    return d


class ScratchBuffers:
    """Per-forward scratch tensors, best-fit reused, allocated from the preferred graph pool.

    with scratch.forward():               # one eager forward; pool = preferred_pool()
        buf = scratch.empty((T, F), torch.bfloat16)
        ...
        scratch.release(buf)              # its block can serve a later request of this forward
    At the end of the scope every block goes back to the caching allocator (inside the pool).
    route_all=True also routes every other allocation of the body into the pool (the whole eager forward).
    One scope at a time, used by the thread that opened it: another thread gets an error, not a shared
    free list (give each thread its own ScratchBuffers). A scope on a pool holds `pool_lock(pool)` throughout:
    scopes of other threads on the same pool, and replays of a GraphRunner's graphs in it, wait for it.
    """

    def __init__(self, device=None):
        self.device = check_device(device) if device is not None else None
        self.fallbacks = 0  # requests the pool could not serve (out of memory) and the ordinary allocator did
        self.fallback_bytes = 0
        self.pool_bytes = 0  # bytes of new blocks taken from the pool
        self.reused = 0  # requests served by a block freed earlier in the same forward
        self.requests = 0
        self._scope = None
        self._owner = None  # the thread that opened the scope
        self._lock = threading.Lock()  # makes "is a scope open? then open one" one step

    # ----- scope
    @contextlib.contextmanager
    def forward(self, pool="preferred", stream=None, route_all: bool = False):
        """One eager forward. pool: a MemPool, None (ordinary allocator) or 'preferred'."""
        if isinstance(pool, str):
            if pool != "preferred":
                raise ValueError(f"pool={pool!r}: must be a MemPool, None or 'preferred'")
            pool = preferred_pool()
        pid = pool_id(pool) if pool is not None else None
        if pid is not None and stream is None:
            stream = capture_stream(pool)
        scope = _Scope(pool, pid, stream, route_all)
        with self._lock:
            if self._scope is not None:
                where = "" if self._owner == threading.get_ident() else f" (open in thread {self._owner})"
                raise RuntimeError(f"ScratchBuffers.forward() scopes do not nest: one eager forward at a time{where}")
            self._scope, self._owner = scope, threading.get_ident()
        lock = pool_lock(pool) if pid is not None else None
        try:
            with contextlib.ExitStack() as es:  # callbacks run last registered first: the lock goes last
                if lock is not None:
                    lock.acquire("a scratch scope")  # waits for a replay of the pool's graphs (or another scope)
                    es.callback(lock.release)
                    _count_scope(pid, 1)
                    es.callback(_count_scope, pid, -1)
                es.callback(self._end_scope, scope)  # blocks tracked before the lock lets a replay check them
                if stream is not None:  # the body runs on `stream`, ordered after and before the caller's
                    cur = torch.cuda.current_stream(stream.device)
                    stream.wait_stream(cur)
                    es.callback(cur.wait_stream, stream)  # runs after the stream context below is left
                    es.enter_context(torch.cuda.stream(stream))
                if pool is not None and route_all:
                    scope.begin_routing()
                    es.callback(scope.end_routing)
                yield self
        finally:
            with self._lock:
                self._scope, self._owner = None, None

    def _end_scope(self, scope) -> None:
        """Every block of the scope goes back to the allocator; those of a pool are tracked (live_scratch_bytes)."""
        blocks = scope.handed + scope.free.blocks()
        scope.free.clear()
        scope.handed.clear()
        if scope.pid is not None:
            for b in blocks:
                _track(scope.pid, b)

    def _need_scope(self):
        scope, owner = self._scope, self._owner
        if scope is None:
            raise RuntimeError("scratch buffers live inside `with scratch.forward():` (one eager forward)")
        if owner != threading.get_ident():
            raise RuntimeError(f"this ScratchBuffers' forward scope belongs to thread {owner}; a scope serves the "
                               "thread that opened it (give each thread its own ScratchBuffers)")
        return scope

    # ----- buffers
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` whose memory is a scratch block."""
        scope = self._need_scope()
        if isinstance(shape, int):
            shape = (shape,)
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in shape):
            raise ValueError(f"shape={tuple(shape)!r}: sizes must be ints")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape={shape}: sizes must be >= 0")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = round_block(math.prod(shape) * itemsize)
        self.requests += 1
        block = scope.free.take(nbytes)
        if block is not None:
            self.reused += 1
        else:
            block = self._new_block(scope, nbytes)
        scope.handed.append(block)
        n = math.prod(shape) * itemsize
        return block[:n].view(dtype).view(shape)

    def release(self, t: torch.Tensor) -> None:
        """Give a buffer's block back for best-fit reuse later in this forward (t must not be used after)."""
        scope = self._need_scope()
        ptr = t.untyped_storage().data_ptr()
        for i, b in enumerate(scope.handed):
            if b.data_ptr() == ptr:
                scope.handed.pop(i)
                scope.free.put(b.numel(), b)
                return
        raise ValueError(f"tensor at {ptr:#x} was not handed out by this scratch scope")

    def _new_block(self, scope, nbytes: int) -> torch.Tensor:
        device = self.device or (torch.device("cuda", torch.cuda.current_device()) if scope.pool is not None else "cpu")
        if scope.pool is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            with scope.routed():
                block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.pool_bytes += nbytes
            return block
        except torch.cuda.OutOfMemoryError as e:
            self.fallbacks += 1
            self.fallback_bytes += nbytes
            log.warning(
                "scratch: graph pool %s out of memory for %d bytes (%s); using the ordinary allocator "
                "(fallback %d)", scope.pid, nbytes, str(e).splitlines()[0], self.fallbacks,
            )
            with scope.unrouted():
                return torch.empty(nbytes, dtype=torch.uint8, device=device)

    @contextlib.contextmanager
    def unrouted(self):
        """Inside a route_all scope: allocate with the ordinary allocator (e.g. outputs that outlive the forward)."""
        with self._need_scope().unrouted():
            yield


_routing = threading.local()  # .pids: pool ids this thread's allocations are being routed to (use_mem_pool)


def _routing_now() -> list:
    if not hasattr(_routing, "pids"):
        _routing.pids = []
    return _routing.pids


class _Scope:
    """State of one eager forward: free list, handed-out blocks, pool routing on/off."""

    def __init__(self, pool, pid, stream, route_all):
        self.pool, self.pid, self.stream, self.route_all = pool, pid, stream, route_all
        self.free = BestFitFreeList()
        self.handed: list[torch.Tensor] = []
        self._cm = None
        self._routing = False

    def begin_routing(self):
        # a scope inside another that already routes this thread to the pool (e.g. a step_fn's own
        # ScratchBuffers inside GraphRunner.eager) rides on it: use_mem_pool cannot be entered twice
        self._routing = True
        pids = _routing_now()
        if self.pid not in pids:
            self._cm = torch.cuda.use_mem_pool(self.pool)
            self._cm.__enter__()
        pids.append(self.pid)

    def end_routing(self):
        if self._routing:
            self._routing = False
            _routing_now().remove(self.pid)
            if self._cm is not None:
                cm, self._cm = self._cm, None
                cm.__exit__(None, None, None)

    @contextlib.contextmanager
    def routed(self):
        """Allocations in the body go to the pool (already so when this thread is routed to it)."""
        if self.pid in _routing_now():
            yield
            return
        self.begin_routing()
        try:
            yield
        finally:
            self.end_routing()

    @contextlib.contextmanager
    def unrouted(self):
        """Allocations in the body go to the ordinary allocator; routing resumes after. (A scope riding on
        an outer scope's routing cannot suspend it: its allocations stay in the pool, and an OOM there
        reaches GraphRunner.eager, which re-runs the forward on the ordinary allocator.)"""
        was = self._cm is not None
        if was:
            self.end_routing()
        try:
            yield
        finally:
            if was:
                self.begin_routing()
