"""Scratch memory for the eager forward, borrowed from a CUDA-graph memory pool.

The captured decode graphs own a pool whose blocks sit free between replays; the eager forward can
borrow them instead of growing a second pool. Three rules make that safe and real:
- the pool is a `torch.cuda.MemPool` (a `graph_pool_handle()` tuple cannot route allocations);
- allocations run on the stream the graphs were captured on: the caching allocator only hands a free
  block to a request on the block's own stream, so any other stream grows the pool instead;
- scratch lives for one eager forward, and a replay while any of it is live raises `ScratchLiveError`
  (the replay writes into the blocks the graph freed during capture). A scope on a pool holds the pool's
  lock (`pool_lock`), which its runner's replays hold too, so another thread's replay waits for it.
An out-of-memory error in the pool falls back to the ordinary allocator, logged and counted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import numbers
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)

# Registries keyed by pool id, guarded by _registry_lock. A pool's entries go once its pool object is garbage
# (a MemPool's id is never given out again): its finalizer only queues the id (`_collected`, no lock: it may run
# in any thread, during any allocation, also one made under _registry_lock), and the next registry call drops it.
_capture_streams: dict[tuple[int, int], "torch.cuda.Stream"] = {}
_live_blocks: dict[tuple[int, int], list] = {}  # pool id -> [(storage weak ref, bytes)] of scratch tensors
_open_scopes: dict[tuple[int, int], int] = {}  # pool id -> scratch scopes open on it (any thread)
_pool_locks: dict[tuple[int, int], "PoolLock"] = {}
_watched: set[tuple[int, int]] = set()  # ids whose pool object has a finalizer
_collected: collections.deque = collections.deque()
# re-entrant: a collection under it may finalize a forward() scope entered and never left, whose clean-up
# (`_count_scope`) takes it again in the same thread
_registry_lock = threading.RLock()
LOCK_WAIT_S = 60.0  # the wait of the locks `pool_lock` makes for pools no runner registered


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
    """The re-entrant lock of one graph pool, held by every scratch scope on it and by its runner's replays,
    eager forwards and captures. A wait longer than `wait_s` raises PoolLockTimeout naming the holder instead
    of hanging (a thread holding a scope that waits for another thread's replay would wait forever); a slow
    holder looks the same, so keep wait_s well above the longest hold. None waits forever."""

    def __init__(self, wait_s: float | None = 60.0, *, arg: str = "wait_s"):
        self.wait_s = _check_wait(wait_s, arg)  # arg: the name a bad value is reported under
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None  # (thread name, what it does) of the outermost hold
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, what: str = "a scratch scope") -> None:
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
        self.acquire(what)
        try:
            yield self
        finally:
            self.release()

    def holder(self) -> tuple[str, str] | None:
        """(thread name, what it does) of the current holder, None when free."""
        return self._holder


def pool_id(pool) -> tuple[int, int]:
    """The (int, int) id of a MemPool; ValueError for anything that cannot route allocations."""
    pid = getattr(pool, "id", None)
    if not (isinstance(pid, tuple) and len(pid) == 2 and all(isinstance(i, int) for i in pid)):
        raise ValueError(
            f"pool={pool!r}: must be a torch.cuda.MemPool (with an .id of two ints); a graph_pool_handle() "
            "tuple cannot be passed to torch.cuda.use_mem_pool"
        )
    return pid


def _registered(pool) -> tuple[int, int]:
    """pool_id(pool), with _registry_lock held: drop the ids of collected pools, and watch this one."""
    pid = pool_id(pool)
    _drop_collected()
    if pid not in _watched:
        weakref.finalize(pool, _collected.append, pid)
        _watched.add(pid)
    return pid


def _drop_collected() -> None:
    while _collected:
        gone = _collected.popleft()
        for reg in (_capture_streams, _live_blocks, _open_scopes, _pool_locks):
            reg.pop(gone, None)
        _watched.discard(gone)


def registered_pools() -> set[tuple[int, int]]:
    """Ids of the pools that have entries (capture stream, lock, open scopes or tracked scratch)."""
    with _registry_lock:
        _drop_collected()
        return set(_capture_streams) | set(_live_blocks) | set(_open_scopes) | set(_pool_locks)


def register_capture_stream(pool, stream) -> None:
    """Remember the stream a pool's graphs were captured on: scratch allocations must use it to reuse blocks."""
    with _registry_lock:
        _capture_streams[_registered(pool)] = stream


def capture_stream(pool):
    """The registered capture stream of `pool`, or None."""
    return _capture_streams.get(pool_id(pool))


def pool_lock(pool) -> PoolLock:
    """The lock every scratch scope on `pool` holds for its whole forward: a GraphRunner's own (`share_pool_lock`),
    so that a replay never overlaps another thread's scope; else a PoolLock waiting LOCK_WAIT_S."""
    with _registry_lock:
        pid = _registered(pool)
        if pid not in _pool_locks:
            _pool_locks[pid] = PoolLock(LOCK_WAIT_S)
        return _pool_locks[pid]


def share_pool_lock(pool, lock: PoolLock) -> None:
    """Make `lock` (re-entrant, so its holder may open scopes) the one scopes on `pool` hold."""
    if not isinstance(lock, PoolLock):
        raise TypeError(f"lock={lock!r}: must be a moelab.scratch.PoolLock")
    with _registry_lock:
        _pool_locks[_registered(pool)] = lock


def live_scratch_bytes(pool) -> int:
    """Bytes of `pool`'s scratch tensors (`ScratchBuffers.empty`) that something still references."""
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


_tls = threading.local()  # .pools: the prefer_graph_pool stack; .pids: pools this thread is routed to


def _stack(name: str) -> list:
    if not hasattr(_tls, name):
        setattr(_tls, name, [])
    return getattr(_tls, name)


@contextlib.contextmanager
def prefer_graph_pool(pool):
    """Make `pool` (a MemPool, or None for 'no preference') this thread's preferred pool for scratch scopes.
    Nests; the previous preference comes back on exit, also when the body raises."""
    if pool is not None:
        pool_id(pool)
    stack = _stack("pools")
    depth = len(stack)
    stack.append(pool)
    try:
        yield pool
    finally:
        del stack[depth:]


def preferred_pool():
    """The pool of this thread's innermost `prefer_graph_pool` (None outside any)."""
    stack = _stack("pools")
    return stack[-1] if stack else None


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
    """Scopes of one eager forward whose scratch comes from a graph pool.

    with scratch.forward(pool):           # pool: a MemPool, None (ordinary allocator) or the preferred one
        buf = scratch.empty((T, F), torch.bfloat16)
    route_all=True routes every allocation of the body into the pool (the whole eager forward), on the pool's
    capture stream. The scope holds `pool_lock(pool)` throughout, and is used by the thread that opened it:
    another thread gets an error (give each thread its own ScratchBuffers).
    """

    def __init__(self, device=None):
        self.device = check_device(device) if device is not None else None
        self.pool_bytes = 0  # bytes `empty` took from the pool
        self.fallbacks = 0  # requests the pool could not serve (out of memory) and the ordinary allocator did
        self.fallback_bytes = 0
        self._scope = None
        self._owner = None  # the thread that opened the scope
        self._lock = threading.Lock()  # makes "is a scope open? then open one" one step

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
        scope = _Scope(pool, pid)
        with self._lock:
            if self._scope is not None:
                where = "" if self._owner == threading.get_ident() else f" (open in thread {self._owner})"
                raise RuntimeError(f"ScratchBuffers.forward() scopes do not nest: one eager forward at a time{where}")
            self._scope, self._owner = scope, threading.get_ident()
        try:
            with contextlib.ExitStack() as es:  # callbacks run last registered first: the lock goes last
                if pid is not None:
                    lock = pool_lock(pool)
                    lock.acquire("a scratch scope")  # waits for a replay of the pool's graphs (or another scope)
                    es.callback(lock.release)
                    _count_scope(pid, 1)
                    es.callback(_count_scope, pid, -1)
                if stream is not None:  # the body runs on `stream`, ordered after and before the caller's
                    cur = torch.cuda.current_stream(stream.device)
                    stream.wait_stream(cur)
                    es.callback(cur.wait_stream, stream)
                    es.enter_context(torch.cuda.stream(stream))
                if pool is not None and route_all:
                    scope.begin_routing()
                    es.callback(scope.end_routing)
                yield self
        finally:
            with self._lock:
                self._scope, self._owner = None, None

    def _need_scope(self):
        scope, owner = self._scope, self._owner
        if scope is None:
            raise RuntimeError("scratch buffers live inside `with scratch.forward():` (one eager forward)")
        if owner != threading.get_ident():
            raise RuntimeError(f"this ScratchBuffers' forward scope belongs to thread {owner}; a scope serves the "
                               "thread that opened it (give each thread its own ScratchBuffers)")
        return scope

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor from the scope's pool; tracked, so that no replay runs while it lives."""
        scope = self._need_scope()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in shape):
            raise ValueError(f"shape={shape!r}: sizes must be ints")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape={shape}: sizes must be >= 0")
        if scope.pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device or "cpu")
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        try:
            with scope.routed():
                t = torch.empty(shape, dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError as e:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.fallbacks += 1
            self.fallback_bytes += nbytes
            log.warning("scratch: graph pool %s out of memory for %d bytes (%s); using the ordinary allocator "
                        "(fallback %d)", scope.pid, nbytes, str(e).splitlines()[0], self.fallbacks)
            with scope.unrouted():
                return torch.empty(shape, dtype=dtype, device=device)
        self.pool_bytes += t.untyped_storage().nbytes()
        with _registry_lock:  # a storage weak reference outlives the tensor: views handed on keep it unexpired
            _live_blocks.setdefault(scope.pid, []).append((StorageWeakRef(t.untyped_storage()),
                                                           t.untyped_storage().nbytes()))
        return t

    @contextlib.contextmanager
    def unrouted(self):
        """Inside a route_all scope: allocate with the ordinary allocator (e.g. outputs that outlive the forward)."""
        with self._need_scope().unrouted():
            yield


class _Scope:
    """Pool routing of one eager forward (torch.cuda.use_mem_pool), on and off."""

    def __init__(self, pool, pid):
        self.pool, self.pid = pool, pid
        self._cm = None
        self._routing = False

    def begin_routing(self):
        # a scope inside another that already routes this thread to the pool (e.g. a step_fn's own
        # ScratchBuffers inside GraphRunner.eager) rides on it: use_mem_pool cannot be entered twice
        self._routing = True
        pids = _stack("pids")
        if self.pid not in pids:
            self._cm = torch.cuda.use_mem_pool(self.pool)
            self._cm.__enter__()
        pids.append(self.pid)

    def end_routing(self):
        if self._routing:
            self._routing = False
            _stack("pids").remove(self.pid)
            if self._cm is not None:
                cm, self._cm = self._cm, None
                cm.__exit__(None, None, None)

    @contextlib.contextmanager
    def routed(self):
        """Allocations in the body go to the pool (already so when this thread is routed to it)."""
        if self.pid in _stack("pids"):
            yield
            return
        self.begin_routing()
        try:
            yield
        finally:
            self.end_routing()

    @contextlib.contextmanager
    def unrouted(self):
        """Allocations in the body go to the ordinary allocator; routing resumes after. (A scope riding on an
        outer scope's routing cannot suspend it: its allocations stay in the pool, and an OOM there reaches
        GraphRunner.eager, which re-runs the forward on the ordinary allocator.)"""
        was = self._cm is not None
        if was:
            self.end_routing()
        try:
            yield
        finally:
            if was:
                self.begin_routing()
