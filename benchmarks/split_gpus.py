"""Same perplexity on one GPU and with the model split over several (device_map, accelerate).

For each embedded model: WikiText-2 test perplexity, unchanged and patched with an adaptive policy,
loaded once on GPU 0 and once with its decoder layers spread over all visible GPUs. Writes
data/results/split-gpus.json. Needs >= 2 GPUs:
    PYTHONPATH=lib python benchmarks/split_gpus.py --max-tokens 65536
"""

from __future__ import annotations

import argparse

import torch

from moelab.data import eval_text
from moelab.evaluate import perplexity
from moelab.hf import patched
from moelab.models import NAMES, load
from moelab.results import write_results
from moelab.routing import EntropyAdaptiveK


def split_map(model, n_gpus: int) -> dict:
    """Embeddings on GPU 0, decoder layers in contiguous runs over the GPUs, the final norm on the last."""
    L = model.config.num_hidden_layers
    head = 0 if getattr(model.config, "tie_word_embeddings", False) else n_gpus - 1  # tied: beside the embedding
    dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": n_gpus - 1, "lm_head": head}
    for i in range(L):
        dm[f"model.layers.{i}"] = min(n_gpus - 1, i * n_gpus // L)
    return dm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(NAMES))
    ap.add_argument("--max-tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(f"visible GPUs = {n}: this check needs at least 2")
    text = eval_text()
    rows = []
    for name in args.models.split(","):
        ref, tok = load(name, device="cuda:0", dtype=torch.float32)
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: args.max_tokens])
        native_k = ref.config.num_experts_per_tok
        policy = EntropyAdaptiveK((max(1, native_k // 2), native_k), (1.0,))
        split, _ = load(name, device_map=split_map(ref, n), dtype=torch.float32)
        devices = sorted({str(p.device) for p in split.parameters()})
        for label, model in (("one-gpu", ref), ("split", split)):
            base = perplexity(model, None, ids, context=512, stride=512, batch_size=32, progress=False)
            with patched(model, policy) as patch:
                ada = perplexity(model, None, ids, context=512, stride=512, batch_size=32, progress=False)
            rows.append({"model": name, "placement": label, "gpus": n if label == "split" else 1,
                         "param_devices": devices if label == "split" else ["cuda:0"],
                         "ppl_unchanged": base["ppl"], "ppl_adaptive": ada["ppl"],
                         "adaptive_mean_k": sum(patch.mean_k().values()) / len(patch.mean_k()),
                         "scored_tokens": base["scored_tokens"]})
            print(rows[-1])
        del ref, split
        torch.cuda.empty_cache()
    write_results("split-gpus", rows, notes=(
        f"WikiText-2 test, first {args.max_tokens} tokens, context 512 stride 512, fp32. 'split': decoder layers "
        "spread over the GPUs with a device_map (moelab.models.load(device_map=...)); 'one-gpu': all on cuda:0. "
        f"Adaptive: EntropyAdaptiveK((native_k//2, native_k), (1.0,)) through moelab.hf.patched."))


if __name__ == "__main__":
    main()
