"""Train an embedded MoE model: a plain loop with a router load-balancing loss (the model's own, or per layer).

    python tools/train.py --model tiny-olmoe [--seed S] [--out DIR]

trains on `moelab.data.training_texts()` (never WikiText-2 test) with the shipped checkpoint's recipe (the defaults
of `TrainConfig` with `RECIPES[model]` over them; every option can be given), validates on `heldout_texts()` every
`eval_every` steps, keeps the best-validation weights (bf16 safetensors) and `train_log.json` in DIR (default
data/models/<model>), and the latest state (fp32 weights, optimizer, RNG: tensors and plain values that load with
`torch.load(weights_only=True)`) in DIR/.resume, so a killed run resumes where it stopped.
`--card` evaluates a trained checkpoint and writes its README.md; `--tokenizer-only` rebuilds the shared tokenizer.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moelab import models
from moelab.params import check_int, check_real, is_real
from moelab.results import command_line, commit, machine, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer import EOS, encode, unigram_perplexity  # noqa: E402

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainConfig:
    """One training run. The defaults, with `RECIPES[model]` over them, are the shipped checkpoints' recipe."""

    model: str = "tiny-olmoe"  # registry name (its config) or a family for a micro model
    out: str = ""  # output dir (default data/models/<model>)
    tokenizer: str = ""  # tokenizer dir (default data/models/tokenizer)
    overrides: dict = dataclasses.field(default_factory=dict)  # config fields over the registry config
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 700
    time_budget_s: float = 0.0  # stop early after this much training wall time (0: no limit)
    stop_after: int = 0  # stop this invocation after this many steps, resumable (0: run to the end)
    eval_every: int = 35
    eval_tokens: int = 65536  # held-out tokens per validation (an equal share from each held-out text)
    train_tokens: int = 0  # use only the first N training tokens (0: all), e.g. for CPU tests
    seed: int = 0
    balance: str = "model"  # router loss: 'model' (transformers' own: loads pooled over layers) or 'per-layer'
    device: str = ""  # default: cuda if available
    amp: str = "bf16"  # autocast dtype on CUDA: bf16 or none
    log_every: int = 10


# what a shipped checkpoint's run set beyond the defaults (its registry config carries its router loss coefficient)
RECIPES = {"tiny-mixtral": {"seed": 1, "balance": "per-layer"}}
# fields that may differ when a run is resumed (they do not change what is computed)
_RESUMABLE_CHANGES = ("out", "time_budget_s", "stop_after", "device", "log_every")


def _stream(tokenizer, texts: dict[str, str], per_text: int = 0) -> torch.Tensor:
    """All texts encoded and joined with EOS between them, as one int32 stream.

    per_text > 0: only the first per_text tokens of each text (texts are cut to 8 chars/token first, more
    than any text here needs, so that short slices encode fast).
    """
    eos = tokenizer.convert_tokens_to_ids(EOS)
    values = [v[: per_text * 8] for v in texts.values()] if per_text else list(texts.values())
    enc = tokenizer(values, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    out: list[int] = []
    for ids in enc:
        out.extend(ids[:per_text] if per_text else ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.int32)


def _train_ids(tokenizer, texts: dict[str, str], n: int = 0) -> torch.Tensor:
    """The training stream, or its first n tokens (n > 0) without encoding all of it: on into the next texts
    where the first is shorter."""
    return _stream(tokenizer, texts, n)[:n] if n else _stream(tokenizer, texts)


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_frac * lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def validation_loss(model, val_LS: torch.Tensor, batch_size: int, device, amp_dtype) -> float:
    """Mean next-token loss (no router loss) over the fixed held-out chunks."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, val_LS.shape[0], batch_size):
        x = val_LS[i : i + batch_size].to(device).long()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        n += x[:, 1:].numel()
    model.train()
    return total / n


def _save_best(model, out: Path) -> None:
    """The best weights as bf16 safetensors + config (a copy, so the fp32 master weights stay exact)."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)


def _save_resume(model, opt, state: dict, out: Path) -> None:
    """Write the resume state to .resume.tmp (state.json last: it marks the folder complete), then swap it in by
    renames: .resume -> .resume.old, .resume.tmp -> .resume. A kill at any point leaves one complete state that
    `_recover_resume` finds."""
    d, tmp, old = out / ".resume", out / ".resume.tmp", out / ".resume.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    torch.save({"optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / "optim.pt")
    write_json(tmp / "state.json", state)
    shutil.rmtree(old, ignore_errors=True)
    if d.exists():
        d.rename(old)
    tmp.rename(d)
    shutil.rmtree(old, ignore_errors=True)


def _recover_resume(out: Path) -> None:
    """After a kill inside `_save_resume`: put the newest complete state back at .resume (the finished
    .resume.tmp, else .resume.old) and drop the rest."""
    d, tmp, old = out / ".resume", out / ".resume.tmp", out / ".resume.old"
    if not d.exists():
        for cand in (tmp, old):
            if (cand / "state.json").exists():
                cand.rename(d)
                log.warning("%s: a save was cut short; resuming from the last complete state (%s)", out, cand.name)
                break
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)


def balance_loss(router_logits, num_experts: int, k: int) -> torch.Tensor:
    """Switch-style load-balancing loss taken per layer and averaged: mean over layers of E * sum_e f_e * P_e
    (f: share of the top-k selections, times k; P: mean router probability); k when every layer is balanced.

    transformers' `load_balancing_loss_func` pools f and P over all layers before the product, so one layer's
    overused expert e can be offset by another layer's underused expert e (different experts, same index):
    its minimum does not make each layer balanced. This one does.
    """
    layers = [r for r in router_logits if r is not None]
    if not layers:
        raise ValueError("no router logits: the model must return them (output_router_logits=True)")
    total = 0.0
    for logits in layers:
        p_TE = torch.softmax(logits.float().reshape(-1, num_experts), dim=-1)
        top_TK = p_TE.topk(k, dim=-1).indices
        f_E = torch.zeros(num_experts, device=p_TE.device).scatter_add_(
            0, top_TK.flatten(), torch.ones(top_TK.numel(), device=p_TE.device)) / p_TE.shape[0]
        total = total + num_experts * (f_E * p_TE.mean(0)).sum()
    return total / len(layers)


def _logits_and_router_logits(model, x):
    """(next-token logits, per-layer router logits) of one forward, without the model's pooled router loss.

    Runs the decoder and the output head; a model whose causal-LM forward changes the head's output
    (logit scaling or soft-capping) runs whole instead, and its pooled loss is computed and dropped."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    plain = (head is not None and model.base_model is not model
             and getattr(cfg, "logits_scaling", 1) == 1 and not getattr(cfg, "final_logit_softcapping", None))
    if not plain:
        outp = model(input_ids=x, use_cache=False, output_router_logits=True)
        return outp.logits, outp.router_logits
    outp = model.base_model(input_ids=x, use_cache=False, output_router_logits=True)
    return head(outp.last_hidden_state), outp.router_logits


def _forward_backward(model, x, amp_dtype, device, balance: str = "model"):
    """One forward and backward; returns (loss, router loss) with loss = next-token loss + coef * router loss."""
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        if balance == "model":  # the model adds router_aux_loss_coef * its pooled loss to its own loss
            outp = model(input_ids=x, labels=x, use_cache=False)
            loss, aux = outp.loss, outp.aux_loss
        else:  # the decoder and the head alone: the causal-LM forward would also pool a router loss we drop
            logits, router_logits = _logits_and_router_logits(model, x)
            lm = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                   x[:, 1:].reshape(-1))
            info = models.moe_info(model)
            aux = balance_loss(router_logits, info["num_experts"], info["native_k"])
            loss = lm + float(model.config.router_aux_loss_coef) * aux
    loss.backward()
    return loss, aux


def _first_step(model, x, amp_dtype, device, balance: str = "model"):
    """The first step, falling back to the eager experts loop if this torch's grouped_mm cannot run here
    (fp32 expert weights under bf16 autocast are not supported by every torch/GPU pair)."""
    impl = getattr(model.config, "_experts_implementation", None)
    if impl in (None, "eager"):
        return _forward_backward(model, x, amp_dtype, device, balance)
    try:
        return _forward_backward(model, x, amp_dtype, device, balance)
    except (RuntimeError, NotImplementedError) as e:
        log.warning("experts implementation %r failed on %s (%s); falling back to 'eager'", impl, device, e)
        model.zero_grad(set_to_none=True)
        model.config._experts_implementation = "eager"
        return _forward_backward(model, x, amp_dtype, device, balance)


def recipe(model: str, **given) -> TrainConfig:
    """The shipped recipe for `model`, with the options given over it."""
    return TrainConfig(model=model, **{**RECIPES.get(model, {}), **given})


def _check(cfg: TrainConfig) -> None:
    """Every option, before the output folder, the data or the model is made."""
    check_int("seq_len", cfg.seq_len, 8)
    for name in ("batch_size", "max_steps", "eval_every", "log_every", "eval_tokens"):
        check_int(name, getattr(cfg, name), 1)
    check_int("warmup_steps", cfg.warmup_steps, 0)
    check_int("train_tokens", cfg.train_tokens, 0, " (0: all)")
    check_int("stop_after", cfg.stop_after, 0, " (0: run to the end)")
    check_int("seed", cfg.seed, 0)
    check_real("time_budget_s", cfg.time_budget_s, 0.0)
    check_real("min_lr_frac", cfg.min_lr_frac, 0.0, 1.0)
    if not (is_real(cfg.lr) and 0 < cfg.lr < math.inf):
        raise ValueError(f"lr={cfg.lr!r}: must be a number > 0 and finite")
    if not (is_real(cfg.grad_clip) and cfg.grad_clip > 0):
        raise ValueError(f"grad_clip={cfg.grad_clip!r}: must be a number > 0 (inf: no clipping)")
    if cfg.amp not in ("bf16", "none"):
        raise ValueError(f"amp={cfg.amp!r}: must be 'bf16' or 'none'")
    if cfg.balance not in ("model", "per-layer"):
        raise ValueError(f"balance={cfg.balance!r}: must be 'model' or 'per-layer'")
    if cfg.model not in models.TINY and cfg.model not in models.FAMILIES:
        raise ValueError(f"model={cfg.model!r}: not an embedded model {list(models.NAMES)} "
                         f"or a family {sorted(models.FAMILIES)}")
    if not isinstance(cfg.overrides, dict):
        raise ValueError(f"overrides={cfg.overrides!r}: must be a dict (a JSON object) of config fields")
    models.build_config(cfg.model, **cfg.overrides)  # names and sizes


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) one model; returns the train log (also written to out/train_log.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelab.data import heldout_texts, training_texts

    _check(cfg)
    device = models.pick_device(cfg.device or "auto")
    out = Path(cfg.out or models.models_dir() / cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    amp_dtype = torch.bfloat16 if (device.type == "cuda" and cfg.amp == "bf16") else None

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or models.tokenizer_dir())
    tokenizer.save_pretrained(out)
    t0 = time.perf_counter()
    texts = training_texts()
    train_ids = _train_ids(tokenizer, texts, cfg.train_tokens)
    held = heldout_texts()
    val_ids = _stream(tokenizer, held, max(1, cfg.eval_tokens // len(held)))
    L = cfg.seq_len
    n_chunks = train_ids.numel() // L
    if n_chunks < cfg.batch_size:
        raise ValueError(f"{train_ids.numel()} training tokens: fewer than one batch of {cfg.batch_size}x{L}")
    train_NL = train_ids[: n_chunks * L].view(n_chunks, L)
    val_LS = val_ids[: (val_ids.numel() // L) * L].view(-1, L)
    if val_LS.numel() == 0:  # checked before any step: validation would divide by zero rows
        raise ValueError(f"eval_tokens={cfg.eval_tokens} gives {val_ids.numel()} held-out tokens, fewer than one "
                         f"window of seq_len={L}: raise eval_tokens to at least {L * len(held)}")
    log.info("data: %d training tokens (%d chunks), %d validation tokens, encoded in %.1fs",
             train_ids.numel(), n_chunks, val_LS.numel(), time.perf_counter() - t0)

    _recover_resume(out)
    resume = out / ".resume" / "state.json"
    if resume.exists():
        state = json.loads(resume.read_text())
        changed = {k: (v, state["config"].get(k)) for k, v in dataclasses.asdict(cfg).items()
                   if state["config"].get(k) != v and k not in _RESUMABLE_CHANGES}
        if changed:
            raise ValueError(f"{resume}: resuming with a different config {changed} (new, old); "
                             f"delete {resume.parent} to start over")
        model = AutoModelForCausalLM.from_pretrained(out / ".resume", dtype=torch.float32).to(device)
        log.info("resuming %s at step %d", out, state["step"])
    else:
        state = {"config": dataclasses.asdict(cfg), "step": 0, "tokens_seen": 0, "train_wall_s": 0.0,
                 "loss_curve": [], "val_curve": [], "best_val": None, "best_step": None}
        overrides = dict(cfg.overrides)
        if cfg.model not in models.TINY:  # a family's micro config: its vocabulary is the tokenizer's
            overrides.setdefault("vocab_size", len(tokenizer))
        model = models.build(cfg.model, seed=cfg.seed, **overrides).to(device)
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size={model.config.vocab_size} < the tokenizer's {len(tokenizer)} tokens: "
                         "set overrides={'vocab_size': ...} or use the tokenizer the model was built for")
    model.train()
    model.config.output_router_logits = True  # the model adds router_aux_loss_coef * its balancing loss
    coef = float(model.config.router_aux_loss_coef)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    if resume.exists():
        try:  # tensors and plain values only: a planted pickle is refused, not run
            extra = torch.load(out / ".resume" / "optim.pt", weights_only=True)
        except Exception as e:
            raise ValueError(f"{out / '.resume' / 'optim.pt'}: not a resume state of tensors and plain values ({e}); "
                             f"delete {out / '.resume'} to start over") from None
        opt.load_state_dict(extra["optimizer"])
        torch.set_rng_state(extra["torch_rng"])
        if extra["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["cuda_rng"])

    def order(epoch: int) -> torch.Tensor:  # the data order of an epoch depends only on seed and epoch
        g = torch.Generator().manual_seed(cfg.seed * 100003 + epoch)
        return torch.randperm(n_chunks, generator=g)

    per_epoch = n_chunks // cfg.batch_size
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=f"train {cfg.model}", unit="step")
    t_start = time.perf_counter() - state["train_wall_s"]
    stop_reason = "max_steps"
    start_step = state["step"]
    while state["step"] < cfg.max_steps:
        step = state["step"]
        epoch, pos = divmod(step, per_epoch)
        idx = order(epoch)[pos * cfg.batch_size : (pos + 1) * cfg.batch_size]
        x = train_NL[idx].to(device).long()
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        opt.zero_grad(set_to_none=True)
        if state["step"] == start_step:  # first step of this invocation: check the experts kernel works here
            loss, aux_t = _first_step(model, x, amp_dtype, device, cfg.balance)
        else:
            loss, aux_t = _forward_backward(model, x, amp_dtype, device, cfg.balance)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        state["step"] = step + 1
        state["tokens_seen"] += x.numel()
        bar.update(1)
        if state["step"] % cfg.log_every == 0 or state["step"] == 1:
            aux = float(aux_t.detach()) if aux_t is not None else 0.0
            lm = loss.item() - coef * aux
            state["loss_curve"].append({"step": state["step"], "tokens": state["tokens_seen"], "loss": lm,
                                        "aux_loss": aux, "lr": _lr(cfg, step), "grad_norm": float(gnorm),
                                        "epoch": state["tokens_seen"] / train_ids.numel()})
            bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}")
        last = state["step"] == cfg.max_steps
        over_time = bool(cfg.time_budget_s) and time.perf_counter() - t_start > cfg.time_budget_s
        stop_now = bool(cfg.stop_after) and state["step"] - start_step >= cfg.stop_after
        if state["step"] % cfg.eval_every == 0 or last or over_time or stop_now:
            val = validation_loss(model, val_LS, cfg.batch_size, device, amp_dtype)
            state["val_curve"].append({"step": state["step"], "tokens": state["tokens_seen"], "val_loss": val,
                                       "epoch": state["tokens_seen"] / train_ids.numel()})
            tqdm.write(f"{cfg.model} step {state['step']}: val loss {val:.4f} (ppl {math.exp(val):.1f})")
            if state["best_val"] is None or val < state["best_val"]:
                state["best_val"], state["best_step"] = val, state["step"]
                _save_best(model, out)
            state["train_wall_s"] = time.perf_counter() - t_start
            _save_resume(model, opt, state, out)
        if over_time or stop_now:
            stop_reason = f"time_budget_s={cfg.time_budget_s}" if over_time else f"stop_after={cfg.stop_after}"
            break
    bar.close()
    state["train_wall_s"] = time.perf_counter() - t_start
    train_log = {
        "model": cfg.model,
        "config": dataclasses.asdict(cfg),
        "model_config": model.config.to_diff_dict(),
        "moe": models.moe_info(model),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "params": models.n_params(model),
        "steps": state["step"],
        "stop_reason": stop_reason,
        "tokens_seen": state["tokens_seen"],
        "train_tokens": int(train_ids.numel()),
        "epochs": state["tokens_seen"] / train_ids.numel(),
        "validation_tokens": int(val_LS.numel()),
        "validation_texts": list(held),
        "best_val_loss": state["best_val"],
        "best_step": state["best_step"],
        "loss_curve": state["loss_curve"],
        "val_curve": state["val_curve"],
        "wall_time_s": state["train_wall_s"],
        "device": str(device),
        "machine": machine(),
        "commit": commit(),
        "command": command_line(),
        "data": "moelab.data.training_texts() (tinyshakespeare, five OLMoE domain texts, WikiText-2 valid, "
                "each minus its last 5% held out); validation: first eval_tokens of heldout_texts()",
    }
    write_json(out / "train_log.json", train_log)
    return train_log


# ---- model card ---------------------------------------------------------------------------------------

def evaluate_checkpoint(name_or_path, eval_tokens: int | None = None, stats_tokens: int = 32768,
                        context: int = 2048, stride: int = 512) -> dict:
    """WikiText-2 test perplexity vs a unigram model (same tokenizer, fitted on the tokens the run trained on),
    and router statistics on held-out text."""
    from moelab.data import eval_text, heldout_texts, training_texts
    from moelab.evaluate import perplexity

    model, tok = models.load(name_or_path)
    held = heldout_texts()  # the held-out slices none of whose text was trained on
    L = min(512, model.config.max_position_embeddings)  # the training length of the embedded models
    check_int("stats_tokens", stats_tokens, L * len(held),
              f" (one window of {L} tokens from each of the {len(held)} held-out slices)")
    per_text = stats_tokens // len(held)
    slices = {name: _stream(tok, {name: text}, per_text) for name, text in held.items()}  # each ends with EOS
    short = {name: ids.numel() for name, ids in slices.items() if ids.numel() < L}
    if short:
        raise ValueError(f"held-out slices {short} (tokens) are shorter than one window of {L}")
    test_ids = encode(tok, eval_text())
    test_router_ids = test_ids[:stats_tokens]
    test_total = len(test_ids)
    if eval_tokens:
        test_ids = test_ids[:eval_tokens]
    ppl = perplexity(model, tok, test_ids, context=context, stride=stride, batch_size=8)
    ppl.update(test_tokens=len(test_ids), test_tokens_total=test_total)
    tlog = models.resolve(name_or_path) / "train_log.json"
    n_train = json.loads(tlog.read_text())["config"].get("train_tokens", 0) if tlog.exists() else 0
    uni = unigram_perplexity(tok, _train_ids(tok, training_texts(), n_train).tolist(), test_ids)
    stats = models.router_stats(model, torch.cat(list(slices.values())), max_tokens=stats_tokens)
    # the same on the evaluation text (never trained on, never used to pick a checkpoint): does the balance hold?
    test_stats = models.router_stats(model, torch.as_tensor(test_router_ids), max_tokens=stats_tokens)
    stats["text"] = f"up to the first {per_text} tokens of each of heldout_texts() {list(held)}"
    stats["texts"] = list(held)
    stats["tokens_each"] = {name: ids.numel() - 1 for name, ids in slices.items()}
    heldout, scored = {}, {}  # next-token loss on each held-out slice, in windows of L
    for name, ids in slices.items():
        val_LS = ids[: (ids.numel() // L) * L].view(-1, L)
        with torch.no_grad():
            heldout[name] = validation_loss(model, val_LS, 8, model.device, None)
        scored[name] = val_LS.shape[0] * (L - 1)  # a window's first token has no prediction
    model.eval()
    return {"wikitext2_test": ppl, "unigram": uni, "router": stats, "router_test": test_stats, "heldout_loss": heldout,
            "heldout_scored_tokens": scored, "heldout_window": L, "heldout_tokens_each": per_text,
            "params": models.n_params(model), "moe": models.moe_info(model), "machine": machine(),
            "commit": commit(), "command": command_line()}


def _full_test_line(name: str, path: Path, test_total: int) -> str:
    """The unchanged model's WikiText-2 test perplexity from the committed paper-tables run, where that run
    used these weights: the embedded model's own folder, and the same fingerprint where the run recorded one."""
    from moelab.results import load_optional

    if name not in models.NAMES or Path(path).resolve() != models.model_dir(name).resolve():
        return ""  # a checkpoint elsewhere: the committed runs are of the embedded models
    doc = load_optional("paper-tables")
    base = [r for r in (doc or {}).get("rows", []) if r.get("model") == name and r.get("section") == "baseline"]
    if not base:
        return ""
    recorded = doc.get("weights", {}).get(name)
    if recorded is not None and recorded != models.fingerprint(path):
        return ""  # the run was of other weights (retrained since)
    r, m = base[0], doc["machine"]
    for part in doc.get("resumed_from", []):  # rows kept from an earlier part ran on that part's machine
        if name in part.get("models_done", []):
            m = part["machine"]
            break
    protocol = doc.get("protocol") or {}
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(protocol.get("dtype"), protocol.get("dtype"))
    tokens = r.get("routed_tokens")
    if protocol.get("line_ends") != "LF":  # a run from before eval_text(): the shipped copy, CRLF line ends
        which = "WikiText-2 test copy as shipped with its CRLF line ends, before `eval_text()`"
    elif tokens == test_total:
        which = "whole WikiText-2 test set with LF line ends, as `eval_text()` gives it"
    else:
        which = f"first {tokens:,} tokens of WikiText-2 test with LF line ends, as `eval_text()` gives it"
    return (f"\nOn the {which} ({r['scored_tokens']:,} scored tokens, context {r['context']}, "
            f"stride {r['stride']}{', ' + dtype if dtype else ''}) the unchanged model scores **{r['ppl']:.1f}** on "
            f"{m['device']} (torch {m['torch']}, transformers {m['transformers']}, commit {doc['commit'][:7]}): "
            f"`data/results/{doc['topic']}.json`, section `baseline`, "
            "from `benchmarks/paper_tables.py`.\n")


def _card(name: str, path: Path, ev: dict, tlog: dict) -> str:
    from moelab.data import heldout_texts

    moe = ev["moe"]
    mc = tlog["model_config"]
    d = mc.get("hidden_size")
    q = ev["router"]["token_entropy_q"]
    loads = ev["router"].get("load") or [[] for _ in q]  # selections per expert, per layer

    def least(load) -> str:  # experts with under a tenth of the uniform share of the layer's selections
        if not load or not sum(load):
            return "-"
        rare = sum(1 for n in load if n < 0.1 * sum(load) / len(load))
        return f"{rare} of {len(load)} (least {100 * min(load) / sum(load):.2f}%)"

    rows = "\n".join(
        f"| {l} | {ev['router']['load_entropy'][l]:.3f} | {least(loads[l])} | "
        + " | ".join(f"{v:.3f}" for v in q[l]) + " |"
        for l in range(len(q))
    )
    rt = ev.get("router_test")
    test_line = (f"\nOn the first {rt['tokens']:,} tokens of WikiText-2 test (the evaluation text, never trained on "
                 "and never used to pick a checkpoint) the load entropy per layer is "
                 + " / ".join(f"{x:.3f}" for x in rt["load_entropy"])
                 + (f"; under 0.8 in {sum(x < 0.8 for x in rt['load_entropy'])} of {len(rt['load_entropy'])} layers"
                    if min(rt["load_entropy"]) < 0.8 else "") + ".\n") if rt else ""
    size_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
    shipped = " (shipped xz-compressed, unpacked on first load)" if (path / "model.safetensors.xz").exists() else ""
    val = tlog["val_curve"]
    vt = tlog.get("validation_texts")
    val_texts = f"the last 5% of {', '.join(vt)}" if vt else f"`heldout_texts()` of commit {tlog['commit'][:7]}"
    seen = [t for t in vt or [] if t not in heldout_texts()]
    last = " (the last step)" if tlog["best_step"] == tlog["steps"] else ""
    scored = ev.get("heldout_scored_tokens", {})
    held_rows = "\n".join(f"| {t} | {scored.get(t, 0):,} | {loss:.3f} | {math.exp(loss):.1f} |"
                          for t, loss in ev.get("heldout_loss", {}).items())
    held_block = (f"""
Next-token loss on held-out text no model trained on (`moelab.data.heldout_texts()`): up to the first
{ev['heldout_tokens_each']:,} tokens of each slice, in windows of {ev.get('heldout_window', 512)} (a window's first
token is not scored):

| held-out slice | scored tokens | loss | perplexity |
|---|---|---|---|
{held_rows}
""" if held_rows else "")
    if seen:  # slices found later to repeat text the model trained on
        val_texts += (f" ({len(seen)} of which repeat training text, `moelab.data.heldout_repeats`, so these losses"
                      " are not held-out numbers" + (": the held-out table under Evaluation is)" if held_rows else ")"))
    wt, uni = ev["wikitext2_test"], ev["unigram"]
    renorm = "renormalised" if moe["renormalize"] else "not renormalised"
    shared = ", plus a shared expert with its gate" if moe.get("shared_expert") else ""
    # the training run's options that differ from today's defaults (the registry config is that commit's)
    defaults = dataclasses.asdict(TrainConfig())
    changed = {k: v for k, v in tlog["config"].items()
               if k in defaults and k not in ("model", "out", "device") and v != defaults[k]}
    train_cmd = f"python tools/train.py --model {tlog['config']['model']}" + "".join(
        f" --{k.replace('_', '-')} " + shlex.quote(json.dumps(v) if isinstance(v, dict) else str(v))
        for k, v in changed.items())
    balance = ("taken per layer (`balance_loss` in `tools/train.py`)" if tlog["config"].get("balance") == "per-layer"
               else "transformers' own (expert loads pooled over the layers)")
    cpu = ev["machine"].get("cpu_model") or ev["machine"].get("host_cpu")
    cmd = f"python tools/train.py --model {name} --card" + (
        f" --card-tokens {wt['test_tokens']}" if wt["test_tokens"] < wt["test_tokens_total"] else "")
    part = (f": its first {wt['test_tokens']:,} of {wt['test_tokens_total']:,} tokens"
            if wt["test_tokens"] < wt["test_tokens_total"] else "")
    return f"""# {name}

A small {moe['family']} mixture-of-experts language model trained by `tools/train.py`, so that moelab's
notebooks have a *trained* router to study on a machine without a model hub. Its routing geometry
mirrors the real model: {moe['num_experts']} experts, top-{moe['native_k']}, top-k weights
{renorm}{shared}.

**Good for**: studying routing policies (adaptive k, top-p, ratio skipping) end to end on a CPU in seconds:
real learned routers, real perplexity changes. **Not** a useful language model: it is tiny and trained on
~3M tokens, so absolute perplexities are high; compare policies against this model's own top-k.

## Size
- {ev['params']:,} parameters (tied input/output embeddings), hidden {d}, {mc.get('num_hidden_layers')} layers,
  vocabulary {mc.get('vocab_size')}, context {mc.get('max_position_embeddings')} tokens
- weights stored in bf16 safetensors: {size_mb:.1f} MB{shipped}; `moelab.models.load('{name}')` loads fp32 on the CPU

## Data and training
- Tokenizer: byte-level BPE, {mc.get('vocab_size')} tokens, trained with `tokenizers` on the training texts
  (shared by the three embedded models; `tools/tokenizer.py`).
- Training text: `moelab.data.training_texts()`: tinyshakespeare, the five OLMoE domain texts
  (arXiv, books, C4, GitHub, Wikipedia) and WikiText-2 valid, each minus its last 5% (held out):
  {tlog['train_tokens']:,} tokens. WikiText-2 test is never trained on.
- {tlog['steps']} steps of {tlog['config']['batch_size']} x {tlog['config']['seq_len']} tokens
  ({tlog['tokens_seen']:,} tokens, {tlog['epochs']:.2f} epochs), AdamW lr {tlog['config']['lr']}, cosine,
  router load-balancing loss coefficient {mc.get('router_aux_loss_coef')}, {balance};
  {tlog['wall_time_s']:.0f} s on {tlog['machine']['device']}: `{train_cmd}` at commit {tlog['commit'][:12]}.
- Checkpoint = best validation loss on {val_texts}: step {tlog['best_step']}{last},
  val loss {tlog['best_val_loss']:.3f} (ppl {math.exp(tlog['best_val_loss']):.1f}); first/last validation:
  {val[0]['val_loss']:.3f} / {val[-1]['val_loss']:.3f}. Full curves in `train_log.json`.

## Evaluation
`{cmd}` on the CPU in fp32 ({cpu}, torch {ev['machine']['torch']}), commit {ev['commit'][:12]}:

| | perplexity | scored tokens |
|---|---|---|
| this model, WikiText-2 test (raw, LF line ends: `eval_text()`){part}, context {wt['context']}, \
stride {wt['stride']} | **{wt['ppl']:.1f}** | {wt['scored_tokens']:,} |
| unigram model (add-one, fitted on the training tokens), same tokenizer | {uni['ppl']:.1f} | {uni['scored_tokens']:,} |
{_full_test_line(name, path, wt['test_tokens_total'])}{held_block}
Router statistics on {ev['router']['tokens']:,} held-out tokens ({ev['router']['text']}; `moelab.models.router_stats`):
load entropy = normalised entropy of the expert load (top-{moe['native_k']} selections), 1 = balanced;
rarely used = experts given under a tenth of the uniform share ({100 / moe['num_experts']:.2f}%) of the selections,
and the least-used expert's share;
per-token router entropy / log({moe['num_experts']}) at quantiles 5/25/50/75/95%.

| layer | load entropy | rarely used | q05 | q25 | q50 | q75 | q95 |
|---|---|---|---|---|---|---|---|
{rows}
{test_line}"""


def write_card(name_or_path: str, eval_tokens: int | None = None, reuse: bool = False, **eval_kw) -> Path:
    """Evaluate a trained model (registry name or checkpoint dir with train_log.json); write README.md, eval.json.

    reuse: rebuild README.md from the existing eval.json without evaluating again. eval_kw: `evaluate_checkpoint`'s.
    """
    path = models.resolve(name_or_path)
    tlog = json.loads((path / "train_log.json").read_text())
    if reuse:
        ev = json.loads((path / "eval.json").read_text())
    else:
        ev = evaluate_checkpoint(path, eval_tokens=eval_tokens, **eval_kw)
        write_json(path / "eval.json", ev)
    name = name_or_path if str(name_or_path) in models.NAMES else path.name
    (path / "README.md").write_text(_card(name, path, ev, tlog))
    return path / "README.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/train.py", description=__doc__.split("\n")[0])
    for f in dataclasses.fields(TrainConfig):  # unset options take the model's recipe
        kind = json.loads if f.name == "overrides" else type(f.default)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS,
                       help="JSON dict of config fields over the registry config" if f.name == "overrides"
                       else f"default: {f.default!r}, or the model's recipe")
    p.add_argument("--card", action="store_true",
                   help="evaluate the trained model (--out dir, else --model's) and write its README.md")
    p.add_argument("--card-tokens", type=int, default=0, help="with --card: score only this many test tokens")
    p.add_argument("--card-reuse", action="store_true", help="with --card: rebuild README.md from eval.json")
    p.add_argument("--tokenizer-only", action="store_true", help="train the shared tokenizer and exit")
    a = vars(p.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    card, card_tokens, card_reuse = a.pop("card"), a.pop("card_tokens"), a.pop("card_reuse")
    if a.pop("tokenizer_only"):
        from tokenizer import save_tokenizer, train_tokenizer

        print(save_tokenizer(train_tokenizer(), models.tokenizer_dir()))
        return 0
    model = a.pop("model", TrainConfig.model)
    if card:
        print(write_card(Path(a["out"]) if a.get("out") else model, eval_tokens=card_tokens or None, reuse=card_reuse))
        return 0
    tlog = train(recipe(model, **a))
    print(json.dumps({k: tlog[k] for k in ("model", "steps", "tokens_seen", "epochs", "best_val_loss",
                                            "best_step", "wall_time_s", "params")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
