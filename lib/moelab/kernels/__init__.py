"""Triton kernels: fused routing (routing.py), pair layout without host sync (layout.py), padded expert row ops
(experts.py), grouped expert GEMMs (grouped.py). They import only `moelab.plan` and this module; the dispatchers
(`moelab.routing`, `moelab.experts`) import them lazily, so the CPU path never needs Triton.

This module holds what they share: the launch helpers (`Launcher`, a kernel's cached direct launch; `launch`,
`on_device_of`, `check_kernel_input`, `interpreting`, `pow2`, `cdiv`) and the tuned launch tables, kept as JSON
per device in `configs/<device name>.json` (as vLLM keeps fused_moe configs):
    {"device": name,
     "routing":  {"BLOCK_E,BLOCK_K": [[T up to, {select, warps, tile, split}], ...]},
     "grouped":  {"D,F": [[N rows up to, {"gate_up": {...}, "down": {...}, "beats_cutlass": bool}], ...]},
     "few_rows": {"D,F": {"gate_up": {...}, "down": {...}}}}
with null for the last bound (any size). A GPU takes its own table, else a same-SM device's (TUNED_ON).
"""

import contextlib
import functools
import json
import logging
import operator
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): triton.next_power_of_2 without its host-side wrapper cost."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0 (triton.cdiv as plain Python, see pow2)."""
    return -(-a // b)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET 1, true, on or yes, as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def check_kernel_input(t: torch.Tensor, what: str) -> None:
    """ValueError when a Triton kernel would get a CPU tensor without the interpreter (Triton's own error, "0 active
    drivers", names neither)."""
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{what} on a {t.device.type} tensor: the Triton kernels need CUDA tensors, or "
                         "TRITON_INTERPRET=1 in the environment before triton is first imported")


# ------------------------------------------------------------------ tuned launch tables

CONFIGS = Path(__file__).with_name("configs")
UNBOUNDED = 2**62  # the last entry's bound: every larger size (null in the JSON files)
TABLES = ("routing", "grouped", "few_rows")


def config_path(device: str, directory: Path = CONFIGS) -> Path:
    return Path(directory) / f"{device.replace(' ', '_')}.json"


def read_config(path: Path) -> dict:
    """One device's file as {"device": name, table: {key tuple: entries}}: bounded lists as [(bound, launch)]."""
    doc = json.loads(Path(path).read_text())
    out = {"device": doc["device"]}
    for table in TABLES:
        out[table] = {tuple(map(int, k.split(","))): [(UNBOUNDED if n is None else n, c) for n, c in v]
                      if isinstance(v, list) else v for k, v in doc.get(table, {}).items()}
    return out


def _dumps(x, indent: str = "", lead: str = "") -> str:
    """JSON with each list or object on one line where that fits in 120 characters, else one item per line."""
    flat = lead + json.dumps(x)
    if len(indent + flat) < 120 or not isinstance(x, (dict, list)) or not x:
        return flat
    inner = indent + " "
    items = ([_dumps(v, inner, f"{json.dumps(k)}: ") for k, v in x.items()] if isinstance(x, dict)
             else [_dumps(v, inner) for v in x])
    ends = "{}" if isinstance(x, dict) else "[]"
    return lead + ends[0] + "\n" + ",\n".join(inner + i for i in items) + "\n" + indent + ends[1]


def write_config(device: str, tables: dict, directory: Path = CONFIGS) -> Path:
    """Write `tables` ({table: {key tuple: entries}}, the form read_config gives) as `device`'s file."""
    doc = {"device": device}
    for table in TABLES:
        doc[table] = {",".join(map(str, k)): [[None if n >= UNBOUNDED else n, c] for n, c in v]
                      if isinstance(v, list) else v for k, v in tables.get(table, {}).items()}
    path = config_path(device, directory)
    path.write_text(_dumps(doc) + "\n")
    return path


@functools.lru_cache(maxsize=1)
def _configs() -> dict:
    """Every device's file, in TUNED_ON's order (a same-SM device without a table looks there first), then by name."""
    found = {c["device"]: c for c in map(read_config, CONFIGS.glob("*.json"))}
    order = list(TUNED_ON)
    return {n: found[n] for n in sorted(found, key=lambda n: (order.index(n) if n in order else len(order), n))}


def load_tables(table: str) -> dict:
    """{device name: its `table` ('routing', 'grouped' or 'few_rows')} from the configs, read once; fresh dicts."""
    return {dev: dict(c[table]) for dev, c in _configs().items() if c[table]}


# A GPU takes its own entry for a shape, else that of a device listed here with the same compute capability and SM
# count: an H100 SXM and the H200 are both GH100 with 132 SMs (they differ in HBM).
TUNED_ON = {"NVIDIA H200": (9, 0, 132),  # device name -> (major, minor, SMs) of the GPU its tables were tuned on
            "NVIDIA H100 80GB HBM3": (9, 0, 132)}


@functools.lru_cache(maxsize=16)
def device_identity(index: int) -> tuple[str, tuple[int, int, int]]:
    """(name, (compute capability major, minor, SM count)) of CUDA device `index`."""
    p = torch.cuda.get_device_properties(index)
    return p.name, (p.major, p.minor, p.multi_processor_count)


def tuned_tables(tables: dict, index: int) -> list[str]:
    """The devices of `tables` whose launches CUDA device `index` takes, in lookup order: its own name, then the
    TUNED_ON devices with its compute capability and SM count; [] for none or a non-CUDA index (-1)."""
    if index < 0:
        return []
    name, arch = device_identity(index)
    return [n for n in tables if n == name] + [n for n in tables if n != name and TUNED_ON.get(n) == arch]


def tuned_for(tables: dict, index: int) -> str | None:
    """The first device whose table device `index` looks a shape up in (results record it as `tuned_on`)."""
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


# ------------------------------------------------------------------ launching

_NO_SWITCH = contextlib.nullcontext()


@functools.lru_cache(maxsize=1)
def _gpus() -> int:
    return torch.cuda.device_count()


def on_device_of(t: torch.Tensor):
    """Context that makes t's GPU current: Triton launches on the current device, not the tensor's, which matters
    once a model is split over several GPUs."""
    if not t.is_cuda or _gpus() == 1 or t.get_device() == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(t.device)


def _spec(a):
    """What Triton specialises an argument on: ints by == 1, % 16 and 32 / 64 bits; tensors by dtype and 16-byte
    alignment; bools by value; floats and None not at all; anything else (a tensor descriptor, whose block shape and
    dtype follow from the constexprs) by its type. Plain ints first: the tensor isinstance check costs host time."""
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
    """Launch a @triton.jit kernel; from the second call of a specialisation on, call the compiled kernel's launcher
    directly and skip Triton's argument binding, which costs more host time than a small kernel's GPU work.
    MOELAB_FAST_LAUNCH=0 always goes through Triton.

    The cache key holds what Triton specialises on (`_spec`), so a cached kernel only runs arguments it was compiled
    for; tensors go to it as their addresses (the caller vouches that they are on the GPU). If the compiled launcher's
    private signature differs (another Triton), the first direct call raises TypeError: the fast path is switched
    off with a warning and `disabled` says why.
    """

    def __init__(self, fn):
        self.fn, self.names, self.cache, self._pick = fn, list(fn.arg_names), {}, {}
        self.disabled = "" if os.environ.get("MOELAB_FAST_LAUNCH", "1") != "0" else "MOELAB_FAST_LAUNCH=0"
        self.interpret = interpreting()  # read once: os.environ costs ~1 us a call
        self.direct_calls = 0

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, varying: tuple | None = None,
                 num_stages: int | None = None):
        """kernel[grid](*args, **constexprs, num_warps=num_warps[, num_stages=num_stages]); returns the cache entry
        of the compiled kernel (None off the direct path), for a caller that keeps it and launches it with `run`.
        varying: the indices of the arguments whose specialisation can change between calls (the caller vouches
        for the others: fresh allocations are always 16-byte aligned); None: all of them."""
        if self.disabled or self.interpret or not args[0].is_cuda:
            self._public(grid, args, constexprs, num_warps, num_stages)
            return None
        if varying is None:
            spec = tuple(map(_spec, args))
        else:
            pick = self._pick.get(varying)
            if pick is None:
                get = operator.itemgetter(*varying)
                pick = self._pick[varying] = get if len(varying) > 1 else (lambda a, g=get: (g(a),))
            spec = tuple(map(_spec, pick(args)))
        key = (args[0].get_device(), num_warps, num_stages, varying, tuple(constexprs.values()), spec)
        hit = self.cache.get(key)
        if hit is None:  # compiles on first use
            kernel = self._public(grid, args, constexprs, num_warps, num_stages)
            tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            hit = self.cache[key] = (kernel, [constexprs[n] for n in self.names[len(args):]], tensors)
        else:
            self.run(hit, grid, args, constexprs, num_warps, num_stages)
        return hit

    def run(self, hit, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int | None = None):
        """Launch a cache entry directly with the tensors' addresses (the caller vouches that `args` specialise as
        those it was compiled for)."""
        if not self.disabled:
            kernel, ordered, tensors = hit
            g = (*grid, 1, 1)
            a = list(args)
            for i in tensors:
                a[i] = a[i].data_ptr()
            try:
                kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(args[0].get_device()),
                           kernel.function, kernel.packed_metadata, None, None, None, *a, *ordered)
                self.direct_calls += 1
                return
            except TypeError as e:  # another Triton's launcher signature: the public path from now on
                self.disabled = f"direct launch failed ({e}); using kernel[grid](...)"
                log.warning("moelab.kernels: %s", self.disabled)
        self._public(grid, args, constexprs, num_warps, num_stages)

    def bind(self, hit, grid: tuple, args: tuple) -> "Direct | None":
        """A cache entry's launch with all but its leading tensor arguments fixed, for a caller that repeats one call
        with fresh tensors only, after `run` has taken the direct path once (so the signature fits). None where the
        direct path is off or a tensor argument follows a scalar one."""
        kernel, ordered, tensors = hit
        if self.disabled or tensors != tuple(range(len(tensors))):
            return None
        return Direct(self, kernel, (*grid, 1, 1)[:3], args[0].get_device(), (*args[len(tensors):], *ordered))

    def _public(self, grid, args, constexprs, num_warps, num_stages):
        if num_stages is None:
            return self.fn[grid](*args, **constexprs, num_warps=num_warps)
        return self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


class Direct:
    """One bound launch (`Launcher.bind`): called with the leading tensor arguments' addresses, it launches the
    compiled kernel on the device's current stream, with no per-call derivation or specialisation check."""

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
    """fn[grid](*args, **constexprs, ...) through one `Launcher` per kernel, every argument's specialisation checked."""
    lau = _LAUNCHERS.get(fn)
    if lau is None:
        lau = _LAUNCHERS[fn] = Launcher(fn)
    return lau(grid, args, constexprs, num_warps, None, num_stages)
