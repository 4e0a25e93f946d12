"""benchmarks/serving.py on the CPU: the static KV cache decodes exactly as the full forward, and the per-layer
thresholds keep the asked share of the native pairs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving  # noqa: E402

from moelab.hf import moe_layers, patched  # noqa: E402
from moelab.models import tiny_random  # noqa: E402


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "mixtral"])
def test_kv_cache_decode_matches_the_full_forward(family):
    model = tiny_random(family)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = serving.StaticKV(model, 4, 32)
        step = serving.kv_step(model, cache, output="logits")
        b = 3  # fewer sequences than the cache holds, as a smaller decode bucket
        got = [step(ids[:b, :8], torch.zeros(b, dtype=torch.long))]
        want = [full[:b, 7]]
        for t in range(8, 12):
            got.append(step(ids[:b, t:t + 1], torch.full((b,), t)))
            want.append(full[:b, t])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-4)


def test_arm_policies_keep_the_asked_share_of_native_pairs():
    model = tiny_random("olmoe")
    for layer in moe_layers(model):
        torch.nn.init.normal_(layer.block.gate.weight, std=0.5)
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, model.config.vocab_size, (4, 64), generator=g)
    arms = serving.arm_policies(model, calib)
    assert arms["hf"] is None and len(arms["native"]) == len(moe_layers(model))
    for keep in serving.KEEP:
        for kind in ("eak", "ratio"):
            with torch.no_grad(), patched(model, arms[f"{kind}-{round(100 * keep)}"]) as patch:
                model(input_ids=calib)
                assert serving.kept_fraction(patch) == pytest.approx(keep, abs=0.05)


def test_layer_bytes_of_the_full_shapes():
    import transformers

    family, kw = serving.FULL["mixtral-8x7b"]
    cfg = transformers.MixtralConfig(**kw)
    assert serving.layer_bytes(cfg) / 2**30 == pytest.approx(2.71, abs=0.02)  # 46.7B params over 32 layers, bf16
    assert serving.kv_bytes(cfg, 64, 2048) == 2 * 2 * 64 * 8 * 2048 * 128
