"""Triton kernels: fused routing (routing.py), pair layout without host sync (layout.py), padded
expert row ops (experts.py), grouped expert GEMMs (grouped.py), the issue-5 target checks (report.py).
Dispatch lives in moelab.routing / moelab.experts, which import these lazily (on CUDA), so the CPU path
never needs Triton. This module holds the launch helpers they share: `Launcher` (a kernel's cached direct
launch), `launch`, `on_device_of`, `check_kernel_input`, `interpreting`, `pow2`, `cdiv`, and `device_table`, which
picks the per-device tuned launches (routing.TUNED, grouped.TUNED) a GPU takes."""

import contextlib
import functools
import logging
import operator
import os

import torch

log = logging.getLogger(__name__)


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): triton.next_power_of_2 as plain Python. Triton's is a
    constexpr_function (callable inside kernels too) and its wrapper costs microseconds per host call."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0: triton.cdiv without its constexpr_function wrapper (see pow2)."""
    return -(-a // b)


_NO_SWITCH = contextlib.nullcontext()


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: TRITON_INTERPRET is 1, true, on or yes in any case
    (the values Triton 3.9 itself takes as true)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def check_kernel_input(t: torch.Tensor, what: str) -> None:
    """ValueError when a Triton kernel would get a CPU tensor without Triton's interpreter (whose own
    error, "0 active drivers", names neither)."""
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{what} on a {t.device.type} tensor: the Triton kernels need CUDA tensors, or "
                         "TRITON_INTERPRET=1 in the environment before triton is first imported")


# The tuned launch tables (routing.TUNED, grouped.TUNED) are keyed by device name. A GPU takes its own entry for a
# shape, else that of a device listed here with the same compute capability and SM count: an H100 SXM and the H200
# are both GH100 with 132 SMs (they differ in HBM), so each takes the other's entries for shapes it was not tuned
# on (the H100 the H200's 256- and 512-expert routers). Untuned, the H100 ran routing at 0.14-0.17 of the HBM bound
# at T = 65536 and OLMoE-like layers on 128-row CUTLASS tiles (moe-layer/routing-kernel runs at 64bc936, logs/).
TUNED_ON = {"NVIDIA H200": (9, 0, 132),  # device name -> (major, minor, SMs) of the GPU its tables were tuned on
            "NVIDIA H100 80GB HBM3": (9, 0, 132)}


@functools.lru_cache(maxsize=16)
def device_identity(index: int) -> tuple[str, tuple[int, int, int]]:
    """(name, (compute capability major, minor, SM count)) of CUDA device `index`."""
    p = torch.cuda.get_device_properties(index)
    return p.name, (p.major, p.minor, p.multi_processor_count)


def tuned_tables(tables: dict, index: int) -> list[str]:
    """The keys of `tables` (a per-device TUNED dict) whose launches CUDA device `index` takes, in the order a
    shape is looked up: its own name, then the TUNED_ON devices with the same compute capability and SM count;
    [] for none (the defaults) or a non-CUDA index."""
    if index < 0:
        return []
    name, arch = device_identity(index)
    return [n for n in tables if n == name] + [n for n in tables if n != name and TUNED_ON.get(n) == arch]


def tuned_for(tables: dict, index: int) -> str | None:
    """The first table device `index` looks a shape up in (tuned_tables): its own, else a same-SM device's,
    else None. Results record it as `tuned_on`."""
    return next(iter(tuned_tables(tables, index)), None)


def own_table(tables: dict, index: int) -> dict:
    """Device `index`'s own entries in `tables`, nothing from another device ({} for none or a non-CUDA index)."""
    return tables.get(device_identity(index)[0], {}) if index >= 0 else {}


def device_table(tables: dict, index: int) -> dict:
    """The per-shape entries device `index` runs with: a same-SM device's, overridden by its own."""
    out: dict = {}
    for n in reversed(tuned_tables(tables, index)):
        out.update(tables[n])
    return out


@functools.lru_cache(maxsize=1)
def _gpus() -> int:
    return torch.cuda.device_count()


def on_device_of(t: torch.Tensor):
    """Context that makes t's GPU current: Triton launches on the current device, not the tensor's,
    which matters once a model is split over several GPUs (device_map). With one GPU: nothing to do."""
    if not t.is_cuda or _gpus() == 1 or t.get_device() == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(t.device)


def _spec(a):
    """What Triton specialises a kernel argument on: dtype and 16-byte alignment of tensors; ints equal
    to 1, divisible by 16, and 32- or 64-bit; floats and None not at all. Plain ints are tested first:
    isinstance(x, torch.Tensor) goes through the tensor metaclass's Python-level instance check. Anything
    else by its type name only: a host tensor descriptor's block shape and dtype must follow from the
    constexprs and the other arguments (kernels/grouped.py), and it goes to the direct call as it is."""
    if type(a) is int:
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    return type(a).__name__


class Launcher:
    """Launch a @triton.jit kernel; from the second call of a specialisation on, call the compiled
    kernel's launcher directly and skip Triton's argument binding (data/results/routing-host-*.json: on
    the H200 machine's host the routing call takes about twice the host time through the public path).
    Set MOELAB_FAST_LAUNCH=0 to always go through Triton.

    The cache key holds everything Triton specialises on (see `_spec`), so a cached kernel only runs
    arguments it was compiled for. Tensors go to the direct call as their addresses (for a tensor,
    Triton's launcher calls data_ptr() and asks the driver about the address: cuPointerGetAttribute);
    the caller vouches that they are on the GPU. If the launcher's private signature ever differs
    (another Triton), the first direct call raises TypeError: the fast path is switched off with a
    warning and `disabled` says why.
    """

    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        self.cache: dict = {}
        self.disabled = "" if os.environ.get("MOELAB_FAST_LAUNCH", "1") != "0" else "MOELAB_FAST_LAUNCH=0"
        self.interpret = interpreting()  # read once: os.environ costs ~1 us a call
        self.direct_calls = 0
        self._pick: dict = {}  # varying indices -> itemgetter

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, varying: tuple | None = None,
                 num_stages: int | None = None):
        """kernel[grid](*args, **constexprs, num_warps=num_warps[, num_stages=num_stages]).

        varying: the indices of the arguments whose specialisation can change from call to call (the
        caller vouches that the others keep theirs: fresh allocations are always 16-byte aligned); None:
        all of them. Fewer indices, less host time per call."""
        if self.disabled or self.interpret or not args[0].is_cuda:
            return self._public(grid, args, constexprs, num_warps, num_stages)
        key = self._key(args, constexprs, num_warps, num_stages, varying)
        hit = self.cache.get(key)
        if hit is None:
            kernel = self._public(grid, args, constexprs, num_warps, num_stages)  # compiles on first use
            tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self.cache[key] = (kernel, [constexprs[n] for n in self.names[len(args):]], tensors)
            return kernel
        return self._direct(hit, grid, args, constexprs, num_warps, num_stages)

    def entry(self, args: tuple, constexprs: dict, num_warps: int, varying: tuple | None = None,
              num_stages: int | None = None):
        """The cached compiled kernel for these arguments once a call has compiled it; None where the
        direct path is off. For a caller that keeps it under its own key (route_triton) and launches it
        with `run`, with no specialisation check per call."""
        if self.disabled or self.interpret or not args[0].is_cuda:
            return None
        return self.cache.get(self._key(args, constexprs, num_warps, num_stages, varying))

    def run(self, entry, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int | None = None):
        """Launch an `entry` directly; the caller vouches that `args` specialise as those it was found for."""
        if self.disabled:
            return self._public(grid, args, constexprs, num_warps, num_stages)
        return self._direct(entry, grid, args, constexprs, num_warps, num_stages)

    def bind(self, entry, grid: tuple, args: tuple) -> "Direct | None":
        """`entry`'s launch with everything but its leading tensor arguments fixed (those after them, the
        constexprs, the grid, the device), for a caller that repeats one call with fresh tensors only
        (route_triton, from its third call of a key on: after `run` has taken the direct path once, so
        the launcher's signature is known to fit). None where the direct path is off or a tensor
        argument follows a scalar one."""
        kernel, ordered, tensors = entry
        if self.disabled or tensors != tuple(range(len(tensors))):
            return None
        g = tuple(grid) + (1, 1)
        return Direct(self, kernel, g[:3], args[0].get_device(), (*args[len(tensors):], *ordered))

    def _key(self, args, constexprs, num_warps, num_stages, varying):
        if varying is None:
            spec = tuple(map(_spec, args))
        else:
            pick = self._pick.get(varying)
            if pick is None:
                get = operator.itemgetter(*varying)
                pick = self._pick[varying] = get if len(varying) > 1 else (lambda a, g=get: (g(a),))
            spec = tuple(map(_spec, pick(args)))
        return (args[0].get_device(), num_warps, num_stages, varying, tuple(constexprs.values()), spec)

    def _direct(self, hit, grid, args, constexprs, num_warps, num_stages):
        """The compiled kernel's launcher called with the tensors' addresses."""
        kernel, ordered, tensors = hit
        g = tuple(grid) + (1, 1)
        a = list(args)
        for i in tensors:
            a[i] = a[i].data_ptr()
        try:
            kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(args[0].get_device()), kernel.function,
                       kernel.packed_metadata, None, None, None, *a, *ordered)
        except TypeError as e:  # another Triton's launcher signature: use the public path from now on
            self.disabled = f"direct launch failed ({e}); using kernel[grid](...)"
            log.warning("moelab.kernels: %s", self.disabled)
            return self._public(grid, args, constexprs, num_warps, num_stages)
        self.direct_calls += 1
        return kernel

    def _public(self, grid, args, constexprs, num_warps, num_stages):
        if num_stages is None:
            return self.fn[grid](*args, **constexprs, num_warps=num_warps)
        return self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


class Direct:
    """One bound launch (`Launcher.bind`): called with the leading tensor arguments' addresses, it launches
    the compiled kernel on the device's current stream, with no per-call derivation or specialisation check."""

    __slots__ = ("launcher", "run", "function", "meta", "grid", "device", "rest")

    def __init__(self, launcher: Launcher, kernel, grid: tuple, device: int, rest: tuple):
        self.launcher, self.run, self.function = launcher, kernel.run, kernel.function
        self.meta, self.grid, self.device, self.rest = kernel.packed_metadata, grid, device, rest

    def __call__(self, *pointers: int) -> None:
        gx, gy, gz = self.grid
        self.run(gx, gy, gz, torch._C._cuda_getCurrentRawStream(self.device), self.function, self.meta, None, None,
                 None, *pointers, *self.rest)
        self.launcher.direct_calls += 1


_LAUNCHERS: dict = {}


def launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, num_stages: int | None = None):
    """fn[grid](*args, **constexprs, num_warps=..., num_stages=...) through one `Launcher` per kernel, every
    argument's specialisation checked (for the layout, row and GEMM kernels: the decode path launches
    five of them per MoE layer, where Triton's public launch path costs more host time than the GPU work)."""
    lau = _LAUNCHERS.get(fn)
    if lau is None:
        lau = _LAUNCHERS[fn] = Launcher(fn)
    return lau(grid, args, constexprs, num_warps, None, num_stages)
