"""Compile time of the fp32 row routing kernel, on a machine without a GPU.

Compiles `_route_rows_kernel` of a given routing.py for sm_90 with the ptxas that ships in the triton wheel
(no driver needed) at the embedded models' launch shapes, each in a fresh Triton cache, and prints seconds
and PTX lines per kernel. For main's module both chunk-loop forms (UNROLL 0 / 1); for a version before
ceda31b (policy kind a constexpr, loops always unrolled) pass --constexpr-policy; a version between ceda31b and
5e46683 (loops always) compiles as written.
Run: python data/results/trials/compile_time.py PATH [--constexpr-policy] (TRITON_CACHE_DIR is set per kernel)
"""

import argparse
import importlib.util
import inspect
import os
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# (E, k, BLOCK_T, warps): tiny-olmoe and tiny-qwen-moe at small and large T, tiny-mixtral
SHAPES = [(64, 8, 16, 4), (64, 8, 32, 2), (60, 4, 16, 4), (8, 2, 128, 4)]


def compile_once(fn, E, K, block_t, warps, extra):
    names = fn.arg_names
    const = dict(K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(E),
                 RENORM=False, STATS=False, BLOCK_K1=triton.next_power_of_2(K + 1), CH=4, EC=E, SC=E, **extra)
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in ("logits_ptr", "w_ptr", "ent_ptr", "entsum_ptr") else "*i32"
        elif n == "fpar" or n.startswith("th"):
            sig[n] = "fp32"
        else:
            sig[n] = "i64" if n == "kv_packed" else "i32"
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        t = time.perf_counter()
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        return time.perf_counter() - t, len(kernel.asm["ptx"].splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--constexpr-policy", action="store_true", help="POLICY / NTH are constexprs (before ceda31b)")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("moelab.kernels._routing_compile", args.path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = mod._route_rows_kernel
    params = inspect.signature(fn.fn).parameters
    forms = [dict(UNROLL=u) for u in (False, True)] if "UNROLL" in params else [{}]
    print(f"triton {triton.__version__}, {args.path}")
    compile_once(fn, 8, 2, 16, 4, dict(forms[0], **(dict(POLICY=1, NTH=2) if args.constexpr_policy else {})))  # warm-up
    for form in forms:
        extra = dict(form, **(dict(POLICY=1, NTH=2) if args.constexpr_policy else {}))
        for E, K, block_t, warps in SHAPES:
            s, lines = compile_once(fn, E, K, block_t, warps, extra)
            print(f"{form or 'as written'} E={E:3d} k={K} BLOCK_T={block_t:3d} warps={warps}: {s:6.2f} s, "
                  f"{lines} PTX lines", flush=True)


if __name__ == "__main__":
    main()
