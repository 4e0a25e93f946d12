"""Trial (data/results/trials/README.md): main's 16-bit row routing kernel (bf16, native top-8) with its logits
read by the Hopper tensor-memory accelerator (TMA): a host tensor descriptor over the row pieces ([T * split,
E / split]), one `desc.load` of an [R, 8] box per chunk. In persistent programs over `tl.range(...,
num_stages=S)` Triton issues those loads as asynchronous bulk copies into shared memory with barriers, one
instruction per box instead of one 16-byte load per thread, so that block b + S - 1 streams in while block
b is ranked. The cp.async trial (routing_pipe.py) paid a copy instruction per thread and lost; session 18 found
warps waiting on loads 28-34% of their cycles. Not used by main.
Run from the repository root: PYTHONPATH=lib python data/results/trials/routing_tma.py time"""
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moelab.kernels import routing as kr
from moelab.kernels.routing import _chunk16, _count, _finish, _keys_tile, _merge16, _unkey16


@triton.jit
def _tma_kernel(
    x_desc, xw_desc, logits_ptr, ids_ptr, w_ptr, k_ptr, ent_ptr, T, NBLK, NPROG,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, CH: tl.constexpr, EC: tl.constexpr,
    SPLIT: tl.constexpr, STAGES: tl.constexpr, READS_ONLY: tl.constexpr,
):
    R: tl.constexpr = BLOCK_T * SPLIT
    CPC: tl.constexpr = EC // (CH * SPLIT)
    CPS: tl.constexpr = CPC * CH
    RB: tl.constexpr = SPLIT * CPS - 1
    pid = tl.program_id(0)
    q = tl.arange(0, R)
    col0 = (q % SPLIT)[:, None] * CPS + tl.arange(0, CH)[None, :]  # [R, CH]: columns, for the tie keys
    for blk in tl.range(pid, NBLK, NPROG, num_stages=STAGES):
        rq = blk * BLOCK_T + q // SPLIT
        rmask = (rq < T)[:, None]
        m = tl.full((R,), float("-inf"), tl.float32)
        s = tl.zeros((R,), tl.float32)
        t = tl.zeros((R,), tl.float32)
        v0 = tl.full((R,), -2147483648, tl.int32)
        v1 = v0
        v2 = v0
        v3 = v0
        v4 = v0
        v5 = v0
        v6 = v0
        v7 = v0
        if READS_ONLY == 2:  # one [R, E / split] box per block and a sum: the stream in wide boxes
            s += tl.sum(xw_desc.load([blk * R, 0]).to(tl.float32), axis=1)
            m = s
            t = s
            v0 = s.to(tl.int32)
        elif READS_ONLY:  # the loads and a sum: the stream without the ranking
            for c in tl.static_range(0, CPC):
                x16 = x_desc.load([blk * R, c * CH])
                s += tl.sum(x16.to(tl.float32), axis=1)
            m = s
            t = s
            v0 = s.to(tl.int32)
        else:
            x16 = x_desc.load([blk * R, 0])
            m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk16(
                x16, rmask, RB - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, K, R, CH, True, False, True, True)
            for c in tl.static_range(1, CPC):
                x16 = x_desc.load([blk * R, c * CH])
                m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = _chunk16(
                    x16, rmask, RB - c * CH - col0, m, s, t, v0, v1, v2, v3, v4, v5, v6, v7, K, R, CH, False, False,
                    True, True)
        if SPLIT > 1:
            m, s, t, v0, v1, v2, v3, v4, v5, v6, v7 = tl.reduce(
                (tl.reshape(m, [BLOCK_T, SPLIT]), tl.reshape(s, [BLOCK_T, SPLIT]), tl.reshape(t, [BLOCK_T, SPLIT]),
                 tl.reshape(v0, [BLOCK_T, SPLIT]), tl.reshape(v1, [BLOCK_T, SPLIT]), tl.reshape(v2, [BLOCK_T, SPLIT]),
                 tl.reshape(v3, [BLOCK_T, SPLIT]), tl.reshape(v4, [BLOCK_T, SPLIT]), tl.reshape(v5, [BLOCK_T, SPLIT]),
                 tl.reshape(v6, [BLOCK_T, SPLIT]), tl.reshape(v7, [BLOCK_T, SPLIT])), 1, _merge16)
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        lse = tl.log(s)
        ent = lse - t / s
        slots = tl.arange(0, BLOCK_K)[None, :]
        keys = _keys_tile(v0, v1, v2, v3, v4, v5, v6, v7, slots, K, BLOCK_T, BLOCK_K)
        x_tile = _unkey16(keys, logits_ptr.dtype.element_ty, True)
        p_tile = tl.exp((x_tile.to(tl.float32) - m[:, None]) - lse[:, None])
        ids_tile = tl.where(slots < K, RB - (keys & 0xFFFF), -1)
        w_tile = tl.where(slots < K, p_tile, 0.0)
        top = tl.max(w_tile, axis=1)
        cnt = _count(w_tile, top, slots, 0.0, 0, K, BLOCK_T)
        _finish(ids_tile, w_tile, cnt, ent, rows, row_ok, slots, blk, ids_ptr, w_ptr, k_ptr, ent_ptr,
                k_ptr, ent_ptr, k_ptr, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, K, 1,
                0, 0, K, BLOCK_T, False, False, 16)


def route_tma(x, K=8, rows=32, split=2, stages=3, per_sm=4, warps=None, reads_only=False, programs=None):
    """(ids, weights, k, entropy) of TopK(K) on bf16 logits x [T, E] (E a multiple of 8 * split); programs=0:
    one program per block of rows (no loop). Returns the compiled kernel too."""
    T, E = x.shape
    ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
    w = torch.empty(T, K, dtype=torch.float32, device=x.device)
    k = torch.empty(T, dtype=torch.int32, device=x.device)
    ent = torch.empty(T, dtype=torch.float32, device=x.device)
    nblk = triton.cdiv(T, rows)
    nsm = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = nblk if programs == 0 else max(1, min(nblk, programs or nsm * per_sm))
    desc = TensorDescriptor.from_tensor(x.view(T * split, E // split), [rows * split, 8])
    wide = TensorDescriptor.from_tensor(x.view(T * split, E // split), [rows * split, E // split])
    ck = _tma_kernel[(grid,)](desc, wide, x, ids, w, k, ent, T, nblk, grid, K=K, BLOCK_K=K, BLOCK_T=rows, CH=8, EC=E,
                              SPLIT=split, STAGES=stages, READS_ONLY=reads_only,
                              num_warps=warps or max(1, rows * split // 32))
    return (ids, w, k, ent), ck


def ir_counts(ck):
    ir = ck.asm["ttgir"]
    return {"tma_copy": ir.count("async_tma_copy_global_to_local"), "wait_barrier": ir.count("wait_barrier"),
            "local_load": ir.count("local_load"), "shared_B": ck.metadata.shared, "regs": getattr(ck, "n_regs", None)}


def part_time():
    sys.path.insert(0, "benchmarks")
    from moe_kernels import copy_bandwidth_gbs, graph_us, memory_floor

    from moelab.routing import TopK
    bw = copy_bandwidth_gbs()
    print("bw", bw, torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    res = []
    K, T = 8, 65536
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for E in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(E)
        n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * 2))))
        inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
        inputs[0][::3] = inputs[0][::3].round()
        calls = max(20, n_in)
        ref = kr.route_triton(inputs[0], TopK(K), False)
        bound = (T * E * 2 + T * K * 8 + T * 8) / (bw * 1e9) * 1e6
        out = {"main": graph_us(lambda x: kr.route_triton(x, TopK(K), False), inputs, calls),
               "memory_floor": graph_us(lambda x: memory_floor(x, K), inputs, calls)}
        print(f"E={E} bound {bound:.2f} us (50%: {2 * bound:.2f}); main {out['main']:.2f}, "
              f"floor {out['memory_floor']:.2f}", flush=True)
        variants = []
        for split in ((1, 2, 4) if E == 64 else (2, 4)):
            for rows in (16, 32, 64):
                if not 32 <= rows * split <= 256:
                    continue
                variants.append((f"s{split} r{rows} grid", dict(rows=rows, split=split, stages=1, programs=0)))
                for stages in (2, 3):
                    for per_sm in (2, 4, 8):
                        variants.append((f"s{split} r{rows} st{stages} x{per_sm}",
                                         dict(rows=rows, split=split, stages=stages, per_sm=per_sm)))
        best, shown = {}, set()
        for name, kw in variants:
            try:
                fn = lambda x, kw=kw: route_tma(x, K, **kw)[0]
                (ids, w, k, ent), ck = route_tma(inputs[0], K, **kw)
                same = bool(torch.equal(ids, ref.expert_ids) and float((w - ref.weights).abs().max()) <= 1e-6
                            and float((ent - ref.entropy).abs().max()) <= 1e-5)
                us = graph_us(fn, inputs, calls)
            except Exception as e:  # noqa: BLE001 (a launch that does not fit: say so, go on)
                print(f"  E={E} {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tag = (kw["split"], kw["stages"])
            if tag not in shown:
                shown.add(tag)
                print(f"  E={E} {name}: TTGIR {ir_counts(ck)}", flush=True)
            out[name] = us
            best[name] = us
            print(f"  E={E} {name}: {us:.2f} us, {bound / us:.3f} of the bound (plan as main: {same})", flush=True)
        top = sorted(best, key=best.get)[:3]
        for name in top:  # the best three again, and their stream alone
            kw = dict(variants)[name]
            out[name + " again"] = graph_us(lambda x, kw=kw: route_tma(x, K, **kw)[0], inputs, calls)
            ro = graph_us(lambda x, kw=kw: route_tma(x, K, reads_only=True, **kw)[0], inputs, calls)
            out[name + " reads only"] = ro
            print(f"  E={E} {name}: again {out[name + ' again']:.2f}, reads only {ro:.2f}", flush=True)
        out["main again"] = graph_us(lambda x: kr.route_triton(x, TopK(K), False), inputs, calls)
        print(f"E={E}: main again {out['main again']:.2f}", flush=True)
        res.append(dict(E=E, T=T, bound=bound, **out))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "routing_tma.json"), "w") as f:
        json.dump(res, f, indent=1)


def part_wide():
    """The stream alone with one wide box per block ([R, E / split], 64-256-byte box rows) against the 16-byte
    boxes of part_time: would wide boxes read at the memory floor?"""
    sys.path.insert(0, "benchmarks")
    from moe_kernels import graph_us, memory_floor
    K, T = 8, 65536
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for E in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(E)
        n_in = max(1, min(16, math.ceil(3 * l2 / (T * E * 2))))
        inputs = [torch.randn(T, E, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_in)]
        calls = max(20, n_in)
        print(f"E={E}: floor {graph_us(lambda x: memory_floor(x, K), inputs, calls):.2f} us", flush=True)
        for split in (1, 2):
            for rows in (16, 32, 64):
                for stages, per_sm in ((1, 0), (2, 4), (2, 8), (3, 4), (3, 8)):
                    if not 32 <= rows * split <= 256:
                        continue
                    kw = dict(rows=rows, split=split, stages=stages, per_sm=per_sm, programs=0 if not per_sm else None)
                    try:
                        w = graph_us(lambda x, kw=kw: route_tma(x, K, reads_only=2, **kw)[0], inputs, calls)
                        n = graph_us(lambda x, kw=kw: route_tma(x, K, reads_only=1, **kw)[0], inputs, calls)
                    except Exception as e:  # noqa: BLE001
                        print(f"  E={E} {kw}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    print(f"  E={E} s{split} r{rows} st{stages} x{per_sm or 'grid'}: wide boxes {w:.2f} us, "
                          f"16-byte boxes {n:.2f}", flush=True)


if __name__ == "__main__":
    {"time": part_time, "wide": part_wide}[sys.argv[1]]()
