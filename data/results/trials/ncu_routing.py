"""Trial (data/results/trials/README.md): the routing kernel at T = 65536 (bf16, E = 64 and 128, native top-8) a few times, for ncu."""
import torch
from moelab.kernels.routing import route_triton
from moelab.routing import TopK
for E in (64, 128):
    g = torch.Generator(device="cuda").manual_seed(E)
    x = torch.randn(65536, E, device="cuda", generator=g).to(torch.bfloat16)
    for _ in range(3):
        route_triton(x, TopK(8), False)
torch.cuda.synchronize()
print("done")
