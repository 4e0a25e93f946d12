"""Corpora and real routing counts shipped in data/, each checked against data/SHA256SUMS.

WikiText-2 test (`eval_text`) is for evaluation only; training corpora split into a training part and a held-out
last 5% (`split_heldout`, `heldout_texts`); `unseen_texts` are other domains no model trained on.
"""

from __future__ import annotations

import collections
import hashlib
import io
import lzma
import os
import pickle
from functools import lru_cache
from pathlib import Path

import numpy as np

EVAL_TEXT = "wikitext2_test.raw"
TRAIN_TEXTS = ("tinyshakespeare", "olmoe_arxiv", "olmoe_b3g", "olmoe_c4", "olmoe_github_oss_with_stack",
               "olmoe_wikipedia", "wikitext2_valid.tokens")
DOMAINS = {"arxiv": "olmoe_arxiv", "book": "olmoe_b3g", "c4": "olmoe_c4",  # AllenAI's routing-count domain ->
           "github": "olmoe_github_oss_with_stack", "wikipedia": "olmoe_wikipedia"}  # the text that was routed
HELDOUT_FRACTION = 0.05
UNSEEN_TEXTS = ("war_and_peace", "poe_works", "requests_src.py")  # other domains no model trained on: evaluation only


def data_dir() -> Path:
    """The project's data/ folder (override with MOELAB_DATA)."""
    env = os.environ.get("MOELAB_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data"


def _hashes() -> dict[str, str]:
    """{path under data/: sha256} from data_dir()'s SHA256SUMS (cached per folder)."""
    return _hashes_in(data_dir())


@lru_cache(maxsize=4)
def _hashes_in(d: Path) -> dict[str, str]:
    sums = d / "SHA256SUMS"
    out = {}
    for i, line in enumerate(sums.read_text().splitlines(), 1):
        if line.strip():
            parts = line.split(maxsplit=1)
            if len(parts) != 2 or len(parts[0]) != 64:
                raise ValueError(f"{sums}, line {i}: {line!r} is not '<sha256> <path>'")
            out[parts[1].strip()] = parts[0]
    return out


@lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a changed file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, computed once per process for each (path, size, mtime)."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _listed(rel: str) -> str:
    if rel not in _hashes():
        raise ValueError(f"{rel}: not listed in {data_dir() / 'SHA256SUMS'}")
    return _hashes()[rel]


def _mismatch(path: Path, got: str, want: str, hint: str = "") -> ValueError:
    return ValueError(f"{path}: sha256 {got} does not match SHA256SUMS {want}; the file is altered or damaged: "
                      f"restore it from the repository (a retrained model: `moelab.data.record_hashes`){hint}")


def check_file(rel: str) -> Path:
    """data_dir() / rel, once its sha256 matches data/SHA256SUMS; an error naming the file otherwise. A file shipped
    only as `rel.xz` (the embedded models' weights) is unpacked beside it first, once, hash-checked."""
    want, path = _listed(rel), data_dir() / rel
    xz = path.with_name(path.name + ".xz")
    if not path.exists() and xz.exists():
        _write_atomic(path, _read_checked(rel))
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; restore it from the repository")
    if (got := file_sha256(path)) != want:
        hint = f"; an unpacked copy of {xz.name} (older weights?): delete it to unpack it again" if xz.exists() else ""
        raise _mismatch(path, got, want, hint)
    return path


def _write_atomic(path: Path, raw: bytes) -> None:
    """path's content set to raw through a temporary file beside it, so that no other process sees it partial."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.part")
    try:
        with open(tmp, "xb") as f:
            f.write(raw)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def record_hashes(rels) -> None:
    """Write the current sha256 of each data_dir() / rel into SHA256SUMS (e.g. after retraining a model); where
    `rel.xz` exists beside rel (the embedded models' weights), rewrite it from rel (xz preset 6) too."""
    sums = data_dir() / "SHA256SUMS"
    new = {rel: file_sha256(data_dir() / rel) for rel in rels}
    for rel in new:
        if (xz := data_dir() / f"{rel}.xz").exists():
            _write_atomic(xz, lzma.compress((data_dir() / rel).read_bytes(), preset=6))
    lines = [f"{new.pop(rel, digest)}  {rel}" for rel, digest in _hashes().items()]
    lines += [f"{digest}  {rel}" for rel, digest in new.items()]
    sums.write_text("\n".join(lines) + "\n")
    _hashes_in.cache_clear()


def _read_checked(rel: str) -> bytes:
    """The bytes of a listed file, from `rel` or its xz-compressed copy `rel.xz` (the hash is the original's)."""
    want, path = _listed(rel), data_dir() / rel
    xz = path.with_name(path.name + ".xz")
    if path.exists():
        raw = path.read_bytes()
    elif xz.exists():
        try:
            raw = lzma.decompress(xz.read_bytes())
        except lzma.LZMAError as e:
            raise ValueError(f"{xz}: damaged xz file ({e}); restore it from the repository") from None
        path = xz
    else:
        raise FileNotFoundError(f"{path}: missing (nor {xz.name}); restore it from the repository (see data/NOTICE.md)")
    if (got := hashlib.sha256(raw).hexdigest()) != want:
        raise _mismatch(path, got, want)
    return raw


def text_names() -> list[str]:
    return sorted(rel[len("text/") : -len(".txt")] for rel in _hashes() if rel.startswith("text/"))


def load_text(name: str) -> str:
    """A corpus by name (e.g. 'wikitext2_test.raw', 'tinyshakespeare'), hash-checked."""
    return _load_text(data_dir(), name)


@lru_cache(maxsize=16)
def _load_text(d: Path, name: str) -> str:  # d: the folder it was read from, so that the cache follows MOELAB_DATA
    if name not in text_names():
        raise ValueError(f"text {name!r}: unknown; choose one of {text_names()}")
    return _read_checked(f"text/{name}.txt").decode("utf-8")


def eval_text() -> str:
    """WikiText-2 test, the evaluation text, with LF line ends (the shipped copy has its source's CRLF)."""
    return load_text(EVAL_TEXT).replace("\r\n", "\n")


def split_heldout(text: str, fraction: float = HELDOUT_FRACTION) -> tuple[str, str]:
    """(train, heldout): the last `fraction` held out, cut after a line break within another `fraction` if any."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction}: must be in (0, 1)")
    cut = int(len(text) * (1 - fraction))
    nl = text.rfind("\n", max(0, cut - int(len(text) * fraction)), cut)
    cut = nl + 1 if nl >= 0 else cut
    return text[:cut], text[cut:]


def training_texts() -> dict[str, str]:
    """Training part of every training corpus (never WikiText-2 test)."""
    return {n: split_heldout(load_text(n))[0] for n in TRAIN_TEXTS}


REPEAT_BLOCK = 200  # characters: a held-out slice repeats its training part if any such block of it occurs there


def heldout_repeats(name: str) -> float:
    """Share of the held-out slice's REPEAT_BLOCK-character blocks found verbatim in its training part."""
    return _heldout_repeats(data_dir(), name)


@lru_cache(maxsize=16)
def _heldout_repeats(d: Path, name: str) -> float:  # d: cached per data folder, as `_load_text`
    train, held = split_heldout(load_text(name))
    return block_repeats(held, train)


def block_repeats(text: str, corpus: str, block: int = REPEAT_BLOCK) -> float:
    """Share of the text's `block`-character blocks found verbatim in corpus (only blocks holding one of the
    corpus's aligned half-block pieces, as any match must, are searched for)."""
    half = block // 2
    pieces = {corpus[q : q + half] for q in range(0, len(corpus) - half + 1, half)}
    blocks = [text[i : i + block] for i in range(0, len(text) - block + 1, block)]
    hits = sum(any(b[o : o + half] in pieces for o in range(half + 1)) and b in corpus for b in blocks)
    return hits / len(blocks) if blocks else 0.0


def heldout_texts(unseen_only: bool = True) -> dict[str, str]:
    """Held-out part of the training corpora; unseen_only: only those with `heldout_repeats` == 0."""
    return {n: split_heldout(load_text(n))[1] for n in TRAIN_TEXTS if not unseen_only or heldout_repeats(n) == 0}


def unseen_texts() -> dict[str, str]:
    """Texts of other domains (Tolstoy, Poe, the requests library's source) that no model here trained on."""
    return {n: load_text(n) for n in UNSEEN_TEXTS}


class _CountsUnpickler(pickle.Unpickler):
    """Allows only what the routing-count pickles contain: Counters, defaultdicts, numpy scalars."""

    _ALLOWED = {
        ("collections", "Counter"): collections.Counter,
        ("collections", "defaultdict"): collections.defaultdict,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "scalar"): None,
        ("numpy._core.multiarray", "scalar"): None,
    }

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name}: not allowed in a routing-count file")
        obj = self._ALLOWED[(module, name)]
        if obj is None:  # numpy's scalar reconstructor, wherever this numpy keeps it (numpy._core from 2.0)
            try:
                from numpy._core.multiarray import scalar as obj  # type: ignore[no-redef]
            except ImportError:
                from numpy.core.multiarray import scalar as obj  # type: ignore[no-redef]
        return obj


COUNT_MODELS = {"olmoe": 64, "mistral": 8}  # folder -> number of experts (OLMoE-1B-7B, Mixtral-8x7B)
COUNT_LAYERS = (0, 7, 15)


def load_routing_counts(model: str, domain: str, top1: bool = False) -> np.ndarray:
    """Real expert-selection counts [3 layers (0, 7, 15), E] for 'olmoe' or 'mistral' on a domain."""
    if model not in COUNT_MODELS:
        raise ValueError(f"model={model!r}: routing counts exist for {sorted(COUNT_MODELS)}")
    kind = "expert_counts_top1" if top1 else "expert_counts"
    rel = f"routing_counts/{model}/{kind}/{domain}.pkl"
    if rel not in _hashes():
        have = sorted(r.split("/")[-1][:-4] for r in _hashes() if r.startswith(f"routing_counts/{model}/{kind}/"))
        raise ValueError(f"domain={domain!r}: no {kind} for {model}; choose one of {have}")
    layers = _CountsUnpickler(io.BytesIO(_read_checked(rel))).load()
    E = COUNT_MODELS[model]
    out = np.zeros((len(layers), E), dtype=np.int64)
    for i, counter in enumerate(layers):
        for e, n in counter.items():
            out[i, int(e)] = int(n)
    return out


def normalised_entropy(counts) -> float:
    """Entropy of a load vector divided by log(E): 1 = perfectly balanced, 0 = one expert."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or len(c) < 2 or not np.isfinite(c).all() or (c < 0).any() or c.sum() <= 0:
        raise ValueError(f"counts of shape {c.shape}: need one finite, non-negative count per expert (at least 2 "
                         "experts) and a positive total")
    p = c / c.sum()
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() / np.log(len(c)))
