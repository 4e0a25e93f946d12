"""The embedded MoE models (data/models/<name>, trained by `tools/train.py` with the routing geometry of
Mixtral-8x7B, Qwen1.5-MoE-A2.7B and OLMoE-1B-7B), loading of those or any local transformers MoE checkpoint, and
what moelab needs to know about an MoE model."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import reprlib
from pathlib import Path

import numpy as np
import torch

from moelab.data import check_file, data_dir, normalised_entropy
from moelab.params import check_int, is_int
from moelab.routing import quantile

log = logging.getLogger(__name__)

# family (config.model_type, of the text model) -> (config class, causal-LM class), names from transformers 5
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM"),
}
# families `hf.patched` has an adapter for: those above and Qwen3-VL-MoE's text model
ADAPTED = frozenset(FAMILIES) | {"qwen3_vl_moe"}
# families that always renormalise the top-k weights; the others follow config.norm_topk_prob
ALWAYS_RENORMALIZE = frozenset({"mixtral", "minimax", "qwen3_5_moe", "qwen3_vl_moe"})

_SHARED = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,  # every embedded model
               max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1)

# name -> (family, config kwargs): about 9.5M parameters each
TINY = {
    "tiny-mixtral": ("mixtral", dict(_SHARED, num_key_value_heads=2, intermediate_size=256, num_local_experts=8,
                                     num_experts_per_tok=2, router_aux_loss_coef=0.05)),
    "tiny-qwen-moe": ("qwen2_moe", dict(_SHARED, num_key_value_heads=4, num_experts=60, num_experts_per_tok=4,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=128,
                                        intermediate_size=128, norm_topk_prob=False, decoder_sparse_step=1,
                                        mlp_only_layers=[], router_aux_loss_coef=0.1)),
    "tiny-olmoe": ("olmoe", dict(_SHARED, num_key_value_heads=4, intermediate_size=32, num_experts=64,
                                 num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01)),
}
NAMES = tuple(TINY)
# config fields that are sizes: an override must be an int >= 1 (the optional ones may be None: derived)
_SIZES = frozenset({"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts",
                    "max_position_embeddings"})
_OPTIONAL_SIZES = frozenset({"num_key_value_heads", "head_dim"})
# keys every transformers config takes beyond its class's fields
_CONFIG_KWARGS = frozenset({"attn_implementation", "experts_implementation", "output_attentions", "rope_theta",
                            "rope_scaling"})

# family -> the real model's expert count, k and convention, scaled down for `tiny_random`
_RANDOM = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, intermediate_size=32, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, intermediate_size=32,
                      norm_topk_prob=True, head_dim=16),
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, intermediate_size=16, norm_topk_prob=False),
    # MiniMax-Text-01 with linear attention in every other layer
    "minimax": dict(num_local_experts=32, num_experts_per_tok=2, intermediate_size=16, head_dim=16,
                    layer_types=["linear_attention", "full_attention"]),
    # Qwen3-Next-80B-A3B: 512 experts (above the fused Triton experts' 256), gated DeltaNet layers
    "qwen3_next": dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=16, intermediate_size=32,
                       shared_expert_intermediate_size=32, norm_topk_prob=True, head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"]),
    "flex_olmo": dict(num_experts=7, num_experts_per_tok=5, intermediate_size=16, norm_topk_prob=False),
}


def _classes(family: str):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: not a supported MoE family; choose one of {sorted(FAMILIES)}")
    cfg_name, model_name = FAMILIES[family]
    if not hasattr(transformers, model_name):
        raise ValueError(f"family={family!r}: this transformers ({transformers.__version__}) has no {model_name}")
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def models_dir() -> Path:
    return data_dir() / "models"


def model_dir(name: str) -> Path:
    """data/models/<name> for a registry name, its weights unpacked from the shipped model.safetensors.xz (checked
    against data/SHA256SUMS) the first time."""
    if name not in TINY:
        raise ValueError(f"model {name!r}: not an embedded model; choose one of {list(NAMES)}")
    path = models_dir() / name
    if not (path / "model.safetensors").exists() and (path / "model.safetensors.xz").exists():
        check_file(f"models/{name}/model.safetensors")
    return path


def tokenizer_dir() -> Path:
    """The shared tokenizer of the embedded models (a copy also sits in each model's folder)."""
    return models_dir() / "tokenizer"


def build_config(name_or_family: str, **overrides):
    """The config `build` makes a model from (checked: override names and sizes, k in [1, E]); no weights."""
    if name_or_family in TINY:
        family, kwargs = TINY[name_or_family]
        kwargs = dict(kwargs)
    else:
        family = name_or_family
        kwargs = dict(_SHARED, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, **_RANDOM.get(family, {}))
    cfg_cls, _ = _classes(family)
    kwargs.update(_check_overrides(cfg_cls, kwargs, overrides))
    cfg = cfg_cls(**kwargs)
    moe_info(cfg)  # k in [1, E]
    if getattr(cfg, "head_dim", None) is None:  # derived: hidden_size / heads, rotated in pairs
        d, h = cfg.hidden_size, cfg.num_attention_heads
        if d % h or (d // h) % 2:
            raise ValueError(f"hidden_size={d}: must be a multiple of 2 * num_attention_heads={h} (head_dim = "
                             f"hidden_size / num_attention_heads, an even number for the rotary embedding; "
                             f"{cfg_cls.__name__} has no head_dim of its own)")
    return cfg


def build(name_or_family: str, seed: int = 0, **overrides):
    """A freshly initialised model: a registry name's config, or a family's tiny config + overrides."""
    cfg = build_config(name_or_family, **overrides)
    if getattr(cfg, "_experts_implementation", None) in (None, "grouped_mm"):  # transformers' default on torch 2.9+
        ffn = "moe_intermediate_size" if hasattr(cfg, "moe_intermediate_size") else "intermediate_size"
        for key in ("hidden_size", ffn):
            if getattr(cfg, key) % 4:
                raise ValueError(f"{key}={getattr(cfg, key)}: must be a multiple of 4 for transformers' grouped_mm "
                                 "experts (torch's grouped GEMM takes rows of a multiple of 16 bytes: 4 fp32 values, "
                                 "8 in bf16); pass experts_implementation='eager' for other sizes")
    _, model_cls = _classes(TINY[name_or_family][0] if name_or_family in TINY else name_or_family)
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def _check_overrides(cfg_cls, base: dict, overrides: dict) -> dict:
    """overrides with sizes as ints, once every key is a field of cfg_cls (or of `base`) and every size an int >= 1."""
    valid = {n for n, p in inspect.signature(cfg_cls.__init__).parameters.items()
             if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | set(base) | _CONFIG_KWARGS
    out, default = {}, None
    for key, v in overrides.items():
        if key not in valid and default is None:  # an attribute of a default config: older configs take **kwargs
            default = cfg_cls()
        if key not in valid and not hasattr(default, key):
            raise TypeError(f"{key}={v!r}: not a {cfg_cls.__name__} field; valid overrides: {sorted(valid)}")
        if key in _SIZES and not (is_int(v) and v >= 1 or v is None and key in _OPTIONAL_SIZES):
            raise ValueError(f"{key}={v!r}: must be an int >= 1")
        out[key] = int(v) if is_int(v) else v  # numpy ints too
    return out


def tiny_random(family: str, seed: int = 0, **overrides):
    """A tiny random model of a family with the real model's expert count, k and renormalisation (qwen3_moe: 16
    experts), width 64, 2 layers, vocab 256, for tests; any config field overridden."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: not a supported MoE family; choose one of {sorted(FAMILIES)}")
    return build(family, seed=seed, **overrides)


def moe_info(model_or_config) -> dict:
    """num_experts, native_k, renormalize (the model's top-k convention) and family of an MoE model."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    family = getattr(cfg, "model_type", None)
    if isinstance(family, str) and family.endswith("_text"):  # a multimodal model's text part: its family's
        family = family[: -len("_text")]
    E = next((n for key in ("num_local_experts", "num_experts", "n_routed_experts")
              if isinstance(n := getattr(cfg, key, None), int) and n > 0), None)
    k = getattr(cfg, "num_experts_per_tok", None)
    if E is None or not isinstance(k, int):
        raise ValueError(f"model_type={family!r}: not an MoE model (no num_experts/num_local_experts and "
                         "num_experts_per_tok in its config)")
    renorm = family in ALWAYS_RENORMALIZE or bool(getattr(cfg, "norm_topk_prob", False))
    if not 1 <= k <= E:
        raise ValueError(f"num_experts_per_tok={k}: must be in [1, num_experts={E}]")
    info = {"num_experts": E, "native_k": k, "renormalize": renorm, "family": family}
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        info["shared_expert"] = True
    return info


def resolve(name_or_path: str | Path) -> Path:
    """A registry name -> data/models/<name>; a path (a Path, or a str with a separator) -> itself. Raises if there
    is no checkpoint, or for a bare registry name that is also a folder here (ambiguous)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path={name_or_path!r}: must be a str or a path")
    s = str(name_or_path)
    if not s:
        raise ValueError(f"name_or_path={s!r}: empty; pass one of {list(NAMES)} or a checkpoint directory")
    as_path = isinstance(name_or_path, Path) or os.sep in s or (os.altsep and os.altsep in s) or s.startswith(".")
    if s in TINY and not as_path and Path(s).exists():
        raise ValueError(f"{s!r} is both an embedded model and a folder here: pass './{s}' for the folder "
                         f"or moelab.models.model_dir({s!r}) for the embedded model")
    if s in TINY and not as_path:
        path = model_dir(s)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: embedded model {s!r} has no checkpoint (no config.json); train it "
                                    f"with `python tools/train.py --model {s}` or restore data/models from git")
        return path
    path = Path(s).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the working folder {Path.cwd()}: {path.absolute()})"
        raise FileNotFoundError(f"{path}: no such directory{where}; pass one of {list(NAMES)} or a local "
                                "transformers checkpoint directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json in it, so it is not a transformers checkpoint directory")
    return path


def fingerprint(name_or_path: str | Path, edge_bytes: int = 16 << 20) -> str:
    """Which weights a result came from: sha256 over each weight file's (*.safetensors, else *.bin/*.pt/*.pth) name,
    size and first and last `edge_bytes`."""
    h = hashlib.sha256()
    path = resolve(name_or_path)
    files = sorted(path.glob("*.safetensors")) or sorted(f for x in ("*.bin", "*.pt", "*.pth") for f in path.glob(x))
    if not files:
        raise FileNotFoundError(f"{path}: no weight files to fingerprint (*.safetensors, *.bin, *.pt or *.pth)")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(edge_bytes))
            if size > 2 * edge_bytes:
                fh.seek(size - edge_bytes)
                h.update(fh.read())
            elif size > edge_bytes:
                h.update(fh.read())
    return h.hexdigest()[:16]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device=None) -> torch.device:
    """None -> CPU; 'auto' -> CUDA when this machine has it, else CPU; else `torch.device(device)`."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this machine has no CUDA device (use 'auto' or 'cpu')")
    return dev


def pick_dtype(dtype, device: torch.device) -> torch.dtype:
    """None or 'auto' -> bfloat16 on CUDA, float32 on CPU; a name in DTYPES or a torch dtype."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r}: must be 'auto' or one of {sorted(DTYPES)}")


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "model.safetensors.index.json")


def load(name_or_path: str | Path, device=None, dtype=None, device_map=None):
    """(model, tokenizer) in eval mode from a registry name or a local checkpoint dir, checked first (embedded
    files against data/SHA256SUMS, JSON, tokenizer, weight headers) and after (finite weights); failures name the
    file. device and dtype as `pick_device` and `pick_dtype`; device_map goes to `from_pretrained` (then device is
    ignored). A family without an adapter loads with a warning."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in TINY and path == model_dir(name_or_path):
        for f in MODEL_FILES:
            check_file(f"models/{name_or_path}/{f}")
    for f in (path / n for n in _JSON_FILES if (path / n).exists()):  # every JSON file transformers reads
        try:
            json.loads(f.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not valid JSON ({e}); a truncated or corrupt file?") from None
    cfg = AutoConfig.from_pretrained(path)
    try:
        info = moe_info(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if info["family"] not in ADAPTED:
        log.warning("%s: family %r is not one moelab has an adapter for (%s)", path, info["family"], sorted(ADAPTED))
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config.json) beside the model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exceptions)
        raise ValueError(f"{path}: its tokenizer does not load ({type(e).__name__}: {e})") from None
    for f in sorted(path.glob("*.safetensors")):  # headers only: a truncated file named here
        try:
            with safe_open(f, "pt"):
                pass
        except SafetensorError as e:
            raise ValueError(f"{f}: {e} (a truncated or corrupt weights file?)") from None
    device = map_device(device_map) if device_map is not None else pick_device(device)
    dtype = pick_dtype(dtype, device)
    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    bad = [n for n, p in model.named_parameters()
           if p.is_floating_point() and p.device.type != "meta" and not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"{path}: non-finite values in {len(bad)} weight tensor(s): {', '.join(bad[:8])}"
                         f"{' ...' if len(bad) > 8 else ''} (a corrupt checkpoint?)")
    return model, tokenizer


def reference_experts(model) -> str | None:
    """Make unpatched blocks run transformers' reference expert loop ('eager', whose sum order the paper baselines
    use; grouped_mm differs in bf16) where the model can; returns the implementation in use."""
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except ValueError as e:
            log.warning("keeping experts implementation %r (%s)",
                        getattr(model.config, "_experts_implementation", None), e)
    return getattr(model.config, "_experts_implementation", None)


MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's: CUDA when there is one


def map_device(device_map) -> torch.device:
    """CUDA if any device_map target is a GPU (a strategy name counts where there is CUDA), else CPU."""
    targets = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    on_cuda = False
    for t in targets:
        if isinstance(t, str) and t in MAP_STRATEGIES:
            on_cuda |= torch.cuda.is_available()
        elif not (isinstance(t, str) and t in ("cpu", "disk", "meta")):
            dev = f"cuda:{t}" if isinstance(t, int) and not isinstance(t, bool) else t
            try:
                on_cuda |= pick_device(dev).type == "cuda"
            except ValueError as e:
                raise ValueError(f"device_map={device_map!r}: {e}") from None
    return torch.device("cuda" if on_cuda else "cpu")


def model_context(model) -> int | None:
    """The model's maximum context (max_position_embeddings of its text config), or None if it has none."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def input_device(model) -> torch.device:
    """Where input ids go: the embedding's device (also right for device_map='auto' models)."""
    if hasattr(model, "get_input_embeddings") and model.get_input_embeddings() is not None:
        return model.get_input_embeddings().weight.device
    return next(model.parameters()).device


def as_ids(ids, name: str = "ids", what: str = "token ids") -> torch.Tensor:
    """ids (a tensor, array or sequence of ints) as a tensor; a TypeError naming `name` for anything else."""
    if not isinstance(ids, (str, bytes)):
        try:
            return torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{name}={reprlib.repr(ids)}: must be {what} (a list, array or tensor of ints)")


def check_ids(model, ids: torch.Tensor) -> torch.Tensor:
    """ids unchanged, once every id is inside the model's vocabulary (not a device-side assert later)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids={reprlib.repr(ids)}: must be a torch.Tensor of token ids (torch.as_tensor(ids))")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"token ids of dtype {ids.dtype}: must be an integer tensor (torch.long)")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
    if vocab is None or ids.numel() == 0:
        return ids
    bad = ((ids < 0) | (ids >= vocab)).flatten().nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"token id {int(ids.flatten()[i])} at position {i}: must be in [0, vocab_size={vocab}) "
                         f"({len(bad)} ids outside; was the text tokenized for another model?)")
    return ids


def n_params(model) -> int:
    """Distinct parameters (a tied tensor counts once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def router_stats(model, ids, seq_len: int | None = None, max_tokens: int = 16384, batch_size: int = 8) -> dict:
    """Per-layer router statistics on a token stream in chunks of seq_len (default and cap: min(512, context)):
    load_entropy (normalised entropy of the top-k expert load, 1 = balanced) and token_entropy_q (quantiles of
    per-token router entropy / log E)."""
    info = moe_info(model)
    E, k = info["num_experts"], info["native_k"]
    seq_len = None if seq_len is None else check_int("seq_len", seq_len, 1, " or None")
    max_tokens, batch_size = check_int("max_tokens", max_tokens), check_int("batch_size", batch_size)
    ids = check_ids(model, as_ids(ids).long().flatten()[:max_tokens])
    limit = model_context(model) or 512
    seq_len = min(seq_len, limit) if seq_len else min(512, limit)
    n = ids.numel() // seq_len
    if n < 1:
        raise ValueError(f"{ids.numel()} tokens: need at least seq_len={seq_len} for router statistics")
    x_NL = ids[: n * seq_len].view(n, seq_len)
    device = next(model.parameters()).device
    loads, ents = None, None
    for i in range(0, n, batch_size):
        out = model(input_ids=x_NL[i : i + batch_size].to(device), output_router_logits=True, use_cache=False)
        layers = [r for r in out.router_logits if r is not None]
        if loads is None:
            loads = [torch.zeros(E, dtype=torch.float64) for _ in layers]
            ents = [[] for _ in layers]
        for l, logits_TE in enumerate(layers):
            logits_TE = logits_TE.float().reshape(-1, E)
            top_TK = logits_TE.topk(k, dim=-1).indices
            loads[l] += torch.bincount(top_TK.flatten().cpu(), minlength=E).double()
            logp_TE = torch.log_softmax(logits_TE, dim=-1)
            ents[l].append((-(logp_TE.exp() * logp_TE).sum(-1) / np.log(E)).cpu())
    qs = (0.05, 0.25, 0.5, 0.75, 0.95)
    return {"tokens": n * seq_len, "load_entropy": [normalised_entropy(ld.numpy()) for ld in loads],
            "token_entropy_quantiles": qs,
            "token_entropy_q": [quantile(torch.cat(e), torch.tensor(qs)).tolist() for e in ents],
            "load": [ld.tolist() for ld in loads]}
