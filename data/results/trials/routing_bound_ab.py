"""route_triton host time per eager call, for the lib on sys.path (A/B of two commits; probe, not a benchmark)."""
import os, sys, time, torch
cpu = int(sys.argv[1]); tag = sys.argv[2]
os.sched_setaffinity(0, {cpu})
from moelab.routing import EntropyAdaptiveK, TopK
from moelab.kernels import routing as kr
import moelab
assert tag in moelab.__file__ or True
print(tag, moelab.__file__)
def tm(f, n=20000):
    f(); torch.cuda.synchronize()
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    ts.sort()
    return ts[0], ts[4]
for T, E, pol in ((1, 8, EntropyAdaptiveK((1, 2), (1.76,))), (64, 64, EntropyAdaptiveK((2, 4, 8), (3.0, 3.6))),
                  (4096, 128, EntropyAdaptiveK((2, 4, 8), (3.0, 3.6)))):
    x = torch.randn(T, E, device="cuda").to(torch.bfloat16)
    for _ in range(50):
        kr.route_triton(x, pol, True)
    a = tm(lambda: kr.route_triton(x, pol, True))
    b = tm(lambda: kr._plan_buffers(T, pol.k_max, x.device))
    print(f"{tag} T={T:5d} E={E:3d} route_triton min {a[0]:6.2f} med {a[1]:6.2f} us | plan_buffers min {b[0]:6.2f} med {b[1]:6.2f}", flush=True)
