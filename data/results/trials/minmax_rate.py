"""Trial (data/results/trials/README.md): throughput of 32-bit integer min/max (VIMNMX), the packed 16x2 form
(VIMNMX.S16x2, two 16-bit compare-exchanges per instruction) and fp32 FMNMX on this GPU: independent chains of
compare-exchanges. Run: python data/results/trials/minmax_rate.py"""
import torch, triton, triton.language as tl
from triton.testing import do_bench

@triton.jit
def _cx(a, b, OP: tl.constexpr):
    if OP == 0:
        return tl.inline_asm_elementwise("max.s32 $0, $2, $3; min.s32 $1, $2, $3;", "=r,=r,r,r", [a, b],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    elif OP == 1:
        return tl.inline_asm_elementwise("max.s16x2 $0, $2, $3; min.s16x2 $1, $2, $3;", "=r,=r,r,r", [a, b],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("max.f32 $0, $2, $3; min.f32 $1, $2, $3;", "=r,=r,r,r", [a, b],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)

@triton.jit
def _kern(x_ptr, o_ptr, N: tl.constexpr, OP: tl.constexpr):
    i = tl.program_id(0) * 256 + tl.arange(0, 256)
    a0 = tl.load(x_ptr + i)
    a1 = a0 ^ 0x1234; a2 = a0 ^ 0x2345; a3 = a0 ^ 0x3456; a4 = a0 ^ 0x4567; a5 = a0 ^ 0x5678; a6 = a0 ^ 0x6789; a7 = a0 ^ 0x789A
    for _ in range(N):
        a0, a1 = _cx(a0, a1, OP)
        a2, a3 = _cx(a2, a3, OP)
        a4, a5 = _cx(a4, a5, OP)
        a6, a7 = _cx(a6, a7, OP)
        a0, a2 = _cx(a0, a2, OP)
        a1, a3 = _cx(a1, a3, OP)
        a4, a6 = _cx(a4, a6, OP)
        a5, a7 = _cx(a5, a7, OP)
    tl.store(o_ptr + i, a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7)

if __name__ == "__main__":
    nblk = 132 * 32
    x = torch.randint(-2**30, 2**30, (nblk * 256,), device="cuda", dtype=torch.int32)
    o = torch.empty_like(x)
    N = 256
    for op, name in ((0, "VIMNMX s32"), (1, "VIMNMX s16x2"), (2, "FMNMX f32")):
        f = lambda: _kern[(nblk,)](x, o, N=N, OP=op, num_warps=8)
        f()
        ms = do_bench(f, warmup=20, rep=200)
        instr = nblk * 256 * N * 16  # thread-level min/max instructions
        print(f"{name}: {ms * 1e3:.1f} us, {instr / (ms * 1e-3) / 1e12:.2f} T thread-ops/s, "
              f"{instr / (ms * 1e-3) / 132 / 1.98e9:.1f} per SM per clock at 1.98 GHz", flush=True)
