"""Patching transformers MoE blocks: the model's own rule reproduces it, and the model comes back intact."""

import copy

import numpy as np
import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moelab import models
from moelab.hf import moe_layers, native_policy, patched, record_router
from moelab.routing import EntropyAdaptiveK, RatioSkip, TopK, TopP, route_torch

BASE = dict(vocab_size=101, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)


def tiny(family: str, layers: int = 3):
    """Random-initialised tiny model of each supported class (fp32, eval mode)."""
    torch.manual_seed(0)
    COMMON = dict(BASE, num_hidden_layers=layers)
    if family == "mixtral":
        m = MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8,
                                             num_experts_per_tok=2))
    elif family == "qwen2_moe":  # Qwen1.5-MoE: no renormalisation, shared expert, one dense layer
        m = Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                                               shared_expert_intermediate_size=40, num_experts=12,
                                               num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1]))
    elif family == "qwen3_moe":
        m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                                               num_experts=10, num_experts_per_tok=3, norm_topk_prob=True,
                                               head_dim=8))
    elif family == "olmoe":
        m = OlmoeForCausalLM(OlmoeConfig(**COMMON, intermediate_size=24, num_experts=16, num_experts_per_tok=8,
                                         norm_topk_prob=False, eos_token_id=0))  # its default, 50279, is past vocab
    else:  # the newer families at their real expert counts (moelab.models._RANDOM); hybrids mix linear attention
        m = models.tiny_random(family)
    for layer in moe_layers(m):  # routers some classes initialise to zero: give them real spread
        torch.nn.init.normal_(layer.block.gate.weight, std=0.5)
    return m.eval()


def _have(family: str) -> bool:
    import transformers

    return hasattr(transformers, models.FAMILIES[family][1])


# the four classic families, then the newer ones where the installed transformers has them
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"] + [
    pytest.param(f, marks=pytest.mark.skipif(not _have(f), reason=f"this transformers has no {f}"))
    for f in ("minimax", "qwen3_next", "qwen3_5_moe", "flex_olmo")
]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny(request.param)


def ids(n=40, seed=0):
    return torch.randint(0, 101, (2, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_native_topk_reproduces_logits(model):
    x = ids()
    ref = model(input_ids=x).logits
    layers = moe_layers(model)
    with patched(model, [native_policy(layer) for layer in layers]) as p:
        out = model(input_ids=x).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # every token kept exactly the native k in every layer
    assert p.mean_k() == {layer.index: float(layer.native_k) for layer in layers}
    assert all(p.tokens[i] == x.numel() for i in p.tokens)
    # without the finiteness check (no host sync, for graph capture) the same forward gives the same logits
    with patched(model, [native_policy(layer) for layer in layers], check=False):
        torch.testing.assert_close(model(input_ids=x).logits, out, rtol=0, atol=0)


def test_conventions():
    from moelab.hf import SUPPORTED_BLOCKS

    assert set(SUPPORTED_BLOCKS.values()) == models.ADAPTED  # models.load warns for exactly the others
    classic = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
    conv = {f: [(layer.native_k, layer.renormalize) for layer in moe_layers(tiny(f))] for f in classic}
    assert conv["mixtral"] == [(2, True)] * 3
    assert conv["qwen2_moe"] == [(4, False)] * 2  # layer 1 is dense (mlp_only_layers)
    assert conv["qwen3_moe"] == [(3, True)] * 3
    assert conv["olmoe"] == [(8, False)] * 3
    # the newer ones: (E, k, renormalise) as their real checkpoints have them; the config and the blocks agree
    want = {"minimax": (32, 2, True), "qwen3_next": (512, 10, True), "qwen3_5_moe": (256, 8, True),
            "flex_olmo": (7, 5, False)}
    for f, (E, k, renorm) in want.items():
        if not _have(f):
            continue
        m = tiny(f)
        assert [(lay.num_experts, lay.native_k, lay.renormalize) for lay in moe_layers(m)] == [(E, k, renorm)] * 2
        info = models.moe_info(m)
        assert (info["num_experts"], info["native_k"], info["renormalize"], info["family"]) == (E, k, renorm, f)


@pytest.mark.skipif(not hasattr(__import__("transformers"), "Qwen3VLMoeTextModel"), reason="no Qwen3-VL-MoE here")
@torch.no_grad()
def test_qwen3_vl_moe_text_model_reproduces_itself():
    """Qwen3-VL-MoE's text model (its router always renormalises; the config has no switch): the family is read
    from the text config, and its own top-k through moelab gives the same hidden states."""
    import transformers

    cfg = transformers.Qwen3VLMoeTextConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, moe_intermediate_size=16, intermediate_size=32,
                                            num_experts=128, num_experts_per_tok=8, head_dim=8)
    torch.manual_seed(0)
    m = transformers.Qwen3VLMoeTextModel(cfg).eval()
    layers = moe_layers(m)
    for layer in layers:
        torch.nn.init.normal_(layer.block.gate.weight, std=0.5)
    assert [(lay.family, lay.native_k, lay.renormalize) for lay in layers] == [("qwen3_vl_moe", 8, True)] * 2
    assert models.moe_info(m)["family"] == "qwen3_vl_moe"
    x = ids()
    ref = m(input_ids=x).last_hidden_state
    with patched(m, [native_policy(layer) for layer in layers]) as p:
        out = m(input_ids=x).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert p.mean_k() == {0: 8.0, 1: 8.0}


@torch.no_grad()
def test_restores_exactly_also_on_error(model):
    x = ids(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(input_ids=x).logits
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    with patched(model, TopK(1)):
        pass
    with pytest.raises(KeyError):
        with patched(model, TopK(1)):
            raise KeyError("boom")
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model(input_ids=x).logits, ref)


@torch.no_grad()
def test_patched_runs_inside_accelerate_hooks_of_an_offloaded_model(tmp_path):
    """A model loaded with a device_map that offloads a layer to disk has accelerate hooks as its modules' own
    forwards (they load the offloaded weights): patched routes inside them, so the offloaded layer computes
    with its real weights, and the hooks are back on exit."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    tiny("mixtral").save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                             offload_folder=str(tmp_path / "off")).eval()
    gate = m.model.layers[1].mlp.gate
    assert gate.weight.device.type == "meta" and "forward" in gate.__dict__  # offloaded, behind its hook
    hooked = {n: mod.__dict__["forward"] for n, mod in m.named_modules() if "forward" in mod.__dict__}
    x = ids()
    ref = m(input_ids=x).logits
    with patched(m, [native_policy(layer) for layer in moe_layers(m)]) as p:
        out = m(input_ids=x).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert p.mean_k() == {i: 2.0 for i in range(3)}
    with patched(m, TopK(1)):
        assert not torch.allclose(m(input_ids=x).logits, ref, atol=1e-3)  # the routing did change
    assert {n: mod.__dict__["forward"] for n, mod in m.named_modules() if "forward" in mod.__dict__} == hooked
    assert torch.equal(m(input_ids=x).logits, ref)


@torch.no_grad()
def test_adaptive_changes_logits_and_recorded_k_matches_policy(model):
    x = ids(seed=2)
    ref = model(input_ids=x).logits
    layer0 = moe_layers(model)[0]
    with record_router(model) as rec0:
        model(input_ids=x)
    med = float(rec0.entropy(0).median())
    pol = EntropyAdaptiveK((1, 2, layer0.native_k + 1), (med - 0.05, med + 0.05))
    with patched(model, pol, record="logits") as p:
        out = model(input_ids=x).logits
    assert not torch.allclose(out, ref, atol=1e-4)
    rec = p.record
    for i in rec.layers:
        ent, k = rec.entropy(i), rec.k(i)
        want = torch.where(ent < med - 0.05, 1, torch.where(ent < med + 0.05, 2, layer0.native_k + 1))
        assert torch.equal(k, want.int())
        assert p.kept_pairs[i] == int(k.sum())
        # recorded entropy is the full-softmax entropy of the recorded logits
        logp = torch.log_softmax(rec.router_logits(i), -1)
        torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))
    # layer 0 sees the same input patched or not: same logits, same entropy
    torch.testing.assert_close(rec.router_logits(0), rec0.router_logits(0))


@torch.no_grad()
def test_per_layer_policies_and_other_policies(model):
    x = ids(seed=3)
    n = len(moe_layers(model))
    with patched(model, {0: TopK(1)}) as p:  # only layer 0 patched
        model(input_ids=x)
    assert list(p.mean_k()) == [0] and p.mean_k()[0] == 1.0
    # a list maps to the MoE layers in order: a different policy in every layer, each layer's recorded k is its own
    # policy's k on the logits its router produced (route_torch, the reference), and another layer's policy would
    # have chosen other k on them (so a list applied out of order shows here)
    pols = [TopP(0.5, k_max=4), RatioSkip(0.3, k_max=4)] + [TopK(i) for i in range(1, n - 1)]
    layers = moe_layers(model)
    with patched(model, pols, record="logits") as p:
        model(input_ids=x)
    assert p.record.layers == list(range(n))
    for i, layer in enumerate(layers):
        k, logits_TE = p.record.k(i), p.record.router_logits(i)
        assert k.numel() == x.numel() and pols[i].k_min <= int(k.min()) and int(k.max()) <= pols[i].k_max
        assert torch.equal(k, route_torch(logits_TE, pols[i], layer.renormalize).k)
        assert p.kept_pairs[i] == int(k.sum())
        for j, other in enumerate(pols):
            if j != i:
                assert not torch.equal(k, route_torch(logits_TE, other, layer.renormalize).k), (i, j)


def test_bad_policies_raise(model):
    n = len(moe_layers(model))
    with pytest.raises(ValueError, match="one per MoE layer"):
        with patched(model, [TopK(1)] * (n + 1)):
            pass
    too_many = moe_layers(model)[0].num_experts + 1
    with pytest.raises(ValueError, match=f"k_max={too_many} exceeds its num_experts={too_many - 1}"):
        with patched(model, TopK(too_many)):
            pass
    with pytest.raises(ValueError, match="record="):
        with patched(model, TopK(1), record="yes"):
            pass
    with pytest.raises(ValueError, match=r"policy keys \[True\]: must be MoE layer ordinals \(ints, not bools\)"):
        with patched(model, {True: TopK(1)}):  # bool is an int subclass: it would have patched layer 1
            pass
    with pytest.raises(ValueError, match=r"policy=\{\}: a dict needs at least one \{moe layer: policy\}"):
        with patched(model, {}):  # nothing patched, nothing counted: evaluate's summary would have no policy
            pass
    with patched(model, {np.int64(0): TopK(1)}, record=True) as p:  # numpy ints from a sweep's table
        model(input_ids=ids(n=6))
    assert list(p.mean_k()) == [0] and p.mean_k()[0] == 1.0
    with pytest.raises(ValueError, match="already patched"):
        with patched(model, TopK(1)):
            with patched(model, TopK(1)):
                pass
    assert not any("forward" in m.__dict__ for m in model.modules())
    with patched(model, TopK(1)) as outer:  # a refused nesting leaves the outer context's marks in place
        for _ in range(2):
            with pytest.raises(ValueError, match="already patched"):
                with patched(model, TopK(2)):
                    pass
        model(input_ids=ids(n=6))
    assert outer.mean_k() == {layer.index: 1.0 for layer in moe_layers(model)}
    assert not any("forward" in m.__dict__ or "_moelab_patched" in m.__dict__ for m in model.modules())


def test_float64_model_refused_on_entry(model):
    """A float64 model is refused when patched() is entered, not inside its first forward."""
    m64 = copy.deepcopy(model).double()
    with pytest.raises(ValueError, match=r"router weight dtype=torch.float64: patched routing takes float32"):
        with patched(m64, TopK(1)):
            raise AssertionError("entered")
    assert not any("forward" in mod.__dict__ for mod in m64.modules())


def test_non_moe_model_raises():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2))
    with pytest.raises(ValueError, match="no supported MoE block"):
        moe_layers(m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_native_topk_reproduces_logits_cuda(family):
    """On CUDA (Triton routing, padded layout), fp32: the model's own rule reproduces it.

    (bf16 is left out: near-ties in bf16 router logits may rank experts differently from transformers.)
    """
    m = tiny(family).to("cuda", torch.float32)
    x = ids(seed=4).cuda()
    ref = m(input_ids=x).logits.float()
    with patched(m, [native_policy(layer) for layer in moe_layers(m)]) as p:
        out = m(input_ids=x).logits.float()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert p.mean_k() == {layer.index: float(layer.native_k) for layer in moe_layers(m)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_patched_bf16_takes_the_fused_experts_cuda(family, monkeypatch):
    """bf16 on CUDA at a decode-like size: the patched block hands over transformers' SiLU module
    (experts.act_fn), which runs the fused Triton experts and matches the unfused path on the same plan."""
    import moelab.experts as ex
    import moelab.kernels.grouped as gk

    m = tiny(family).to("cuda", torch.bfloat16)
    x = ids(n=16, seed=5).cuda()  # 32 tokens: at most 32 padded rows per expert, so 'auto' fuses
    calls = []
    real = gk.fused_experts
    monkeypatch.setattr(gk, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    # above 256 experts (Qwen3-Next's 512) the fused Triton experts do not apply: CUTLASS or the loop computes
    fusing = [layer for layer in moe_layers(m) if layer.num_experts <= gk.MAX_EXPERTS]
    with patched(m, [native_policy(layer) for layer in moe_layers(m)]):
        fused = m(input_ids=x).logits.float()
        assert len(calls) == len(fusing)
        ex.set_gemm("loop")
        try:
            unfused = m(input_ids=x).logits.float()
        finally:
            ex.set_gemm("auto")
    assert len(calls) == len(fusing)
    torch.testing.assert_close(fused, unfused, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreted CPU run; on CUDA the *_cuda tests run it")
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
@torch.no_grad()
def test_native_topk_through_the_triton_path_on_cpu(family, monkeypatch):
    """The whole Triton path of a patched block, interpreted on the CPU (TRITON_INTERPRET=1, set by conftest.py):
    route_triton, pair_layout_padded and the fused experts with transformers' own SiLU module (experts.act_fn)
    reproduce the model's logits with its own top-k, renormalised (Mixtral) or not (OLMoE, Qwen1.5-MoE with its
    shared expert and a dense layer), and every token keeps the native k."""
    import os

    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on a CPU"
    import moelab.experts as ex
    import moelab.kernels.grouped as gk
    import moelab.kernels.layout as lk
    import moelab.kernels.routing as kr
    from moelab.routing import set_backend

    calls = {"route_triton": 0, "pair_layout_padded": 0, "fused_experts": 0}

    def counted(name, real):  # the real kernel, counted (moelab imports these three at call time)
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for mod, name in ((kr, "route_triton"), (lk, "pair_layout_padded"), (gk, "fused_experts")):
        monkeypatch.setattr(mod, name, counted(name, getattr(mod, name)))
    m = tiny(family, layers=2 if family == "qwen2_moe" else 1)  # the interpreter is slow: one MoE layer
    layers = moe_layers(m)
    x = ids(n=8, seed=6)
    ref = m(input_ids=x).logits
    set_backend("triton")
    ex.set_layout("padded")
    ex.set_gemm("triton")
    try:
        with patched(m, [native_policy(layer) for layer in layers]) as p:
            out = m(input_ids=x).logits
    finally:
        set_backend("auto")
        ex.set_layout("auto")
        ex.set_gemm("auto")
    # each MoE layer routed, laid out and computed its experts through the kernels, once
    assert calls == {"route_triton": len(layers), "pair_layout_padded": len(layers), "fused_experts": len(layers)}
    # fp32 throughout, the same experts and weights: the tiled Triton GEMMs and the per-token combine only add the
    # same products in another order than transformers' per-expert matmuls, i.e. fp32 rounding. These logits reach
    # about 0.4, where an fp32 ulp is 3e-8: the two paths differ by a few ulp (at most 1.5e-7 seen, the torch path
    # likewise); 1e-6 leaves room for other BLAS summation orders, while a wrong kernel (a SiLU off by 10% in its
    # exponent) moves them by 1e-4
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert p.mean_k() == {layer.index: float(layer.native_k) for layer in layers}
    assert all(p.tokens[i] == x.numel() for i in p.tokens)


@torch.no_grad()
def test_router_logits_reads_every_layer_in_causal_chunks(model):
    """router_logits gives [T, E] per MoE layer; read in chunks, a chunk's first tokens see what one whole
    forward shows them (causal attention), and bad input is refused naming it."""
    from moelab.hf import router_logits

    x = ids(40)[0]
    whole = router_logits(model, x, context=40)
    chunked = router_logits(model, x, context=16)
    layers = moe_layers(model)
    assert sorted(whole) == sorted(chunked) == [layer.index for layer in layers]
    for i, logits_TE in chunked.items():
        assert logits_TE.shape == (40, layers[0].num_experts)
        torch.testing.assert_close(logits_TE[:16], whole[i][:16])
        assert not torch.allclose(logits_TE[16:32], whole[i][16:32])  # the second chunk starts afresh
    with pytest.raises(ValueError, match="context=0"):
        router_logits(model, x, context=0)
    for i, logits_TE in router_logits(model, x, context=np.int64(16)).items():  # numpy ints are ints
        torch.testing.assert_close(logits_TE, chunked[i])
    with pytest.raises(ValueError, match=r"ids of shape \(2, 40\)"):
        router_logits(model, ids(40), context=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_patched_decode_step_in_cuda_graphs(family):
    """Every family's decode step (`hf_decode_step`, bf16) with adaptive routing captures in CUDA graphs, the
    hybrids' linear-attention layers included, and its replays give the eager step's logits at each batch
    bucket; the adaptive plan changes them from the model's own routing."""
    from moelab.graphs import HOST_FACTORY_FAMILIES, GraphRunner, hf_decode_step

    m = tiny(family).to("cuda", torch.bfloat16)
    layers = moe_layers(m)
    vocab = m.config.get_text_config().vocab_size
    step = hf_decode_step(m, "logits")
    make = lambda b: (torch.randint(0, vocab, (b, 3), device="cuda"),)  # noqa: E731
    x = {b: torch.randint(0, vocab, (b, 3), generator=torch.Generator().manual_seed(b)).cuda() for b in (1, 4)}
    own = {b: step(x[b]) for b in x}
    with record_router(m) as rec:  # each layer's median entropy: half the tokens keep k // 2 experts
        step(torch.cat([x[1], x[4]]))
    pols = [EntropyAdaptiveK((layer.native_k // 2, layer.native_k), (float(rec.entropy(i).float().median()),))
            for i, layer in enumerate(layers)]
    with patched(m, pols, check=False) as p:
        runner = GraphRunner(step, make, [1, 4], warmup=2).capture()
        assert p.uncounted and p.uncounted % len(layers) == 0  # captured forwards of every layer: not counted
        for b in x:
            ref = step(x[b])
            torch.testing.assert_close(runner(x[b]), ref)
            assert not torch.equal(ref, own[b])
        k = p.mean_k()
    assert all(min(pol.k_values) <= k[i] <= max(pol.k_values) for i, pol in enumerate(pols))
    if family in HOST_FACTORY_FAMILIES:  # why its step runs under torch.device: without, the capture fails
        with pytest.raises(RuntimeError, match="during CUDA graph capture"):
            GraphRunner(hf_decode_step(m, "logits", on_device=False), make, [1], warmup=1).capture()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@torch.no_grad()
def test_captured_patched_forwards_are_not_counted_and_record_refuses_capture():
    """Replays route as patched but write nothing into the Patch (its counters are freed while graphs live on):
    warm-ups count, captures and replays do not; a recording patch cannot be captured."""
    from moelab.graphs import GraphRunner, hf_decode_step

    m = tiny("mixtral").to("cuda", torch.bfloat16)  # bf16: the fused Triton experts, no host sync (capturable)
    step = hf_decode_step(m, "logits")
    x = ids(n=1, seed=3).repeat(2, 1).cuda()  # [4, 1]: four sequences, one token each
    make = lambda b: (torch.randint(0, 101, (b, 1), device="cuda"),)  # noqa: E731
    pol = EntropyAdaptiveK((1, 2), (1.0,))
    with patched(m, pol, check=False) as p:
        runner = GraphRunner(step, make, [4], warmup=2).capture()
        layers = len(moe_layers(m))
        uncounted, tokens = p.uncounted, dict(p.tokens)
        ref = step(x)  # eager: counted, into the same tensors (in place)
        counters = dict(p.kept_pairs)  # the warm-ups' device tensors: a captured count would add into them
        assert all(isinstance(v, torch.Tensor) and v.is_cuda for v in counters.values())
        counted = {i: int(v) for i, v in counters.items()}
        p.reset_counts()
        for _ in range(3):
            torch.testing.assert_close(runner(x), ref)
        torch.cuda.synchronize()
        assert {i: int(v) for i, v in counters.items()} == counted  # no replay wrote into them
        assert uncounted == layers  # one captured forward of each layer
        assert tokens == {i: 2 * 4 for i in range(layers)}  # the two warm-ups
    assert all(1 * 12 <= v <= 2 * 12 for v in counted.values())  # two warm-ups and one eager forward
    torch.testing.assert_close(runner(x), ref)  # the graphs outlive the patch: they keep its routing
    with patched(m, pol, record=True, check=False) as p:
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            GraphRunner(step, make, [4]).capture()
        step(x)  # the refused capture left no routing plan behind: eager forwards go on, and are recorded
        assert p.tokens == {i: 3 * 4 for i in range(layers)}  # two warm-ups and this one
        assert all(p.record.k(i).numel() == 3 * 4 for i in range(layers))
