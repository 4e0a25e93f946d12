"""The embedded models' shared tokenizer: a byte-level BPE trained on `moelab.data.training_texts()`, and the
unigram baseline the models are compared against (same tokenizer, same text).

Byte-level, so any text encodes without unknown tokens; saved as a transformers `PreTrainedTokenizerFast`, so
`AutoTokenizer.from_pretrained(dir)` loads it next to each model.

    python tools/tokenizer.py            # writes data/models/tokenizer
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|pad|>"
VOCAB_SIZE = 8192


def train_tokenizer(texts: dict[str, str] | None = None, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on `texts` (default: the training texts) -> PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 300 (256 bytes + specials + merges)")
    if texts is None:
        from moelab.data import training_texts

        texts = training_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts.values()), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a long text, no special tokens."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def unigram_perplexity(tokenizer, train_text: str | list[int], eval_text: str | list[int]) -> dict:
    """Perplexity of an add-one-smoothed unigram model fitted on train_text, scored on eval_text: the floor a
    language model must beat by far (it knows token frequencies and nothing else)."""
    V = len(tokenizer)

    def ids(x, name: str) -> list[int]:  # a tensor or array as plain ints (0-d tensors hash by identity)
        if isinstance(x, str):
            return encode(tokenizer, x)
        out = [int(t) for t in (x.tolist() if hasattr(x, "tolist") else x)]
        i = next((i for i, t in enumerate(out) if not 0 <= t < V), None)
        if i is not None:
            raise ValueError(f"{name}: token id {out[i]} at position {i}: must be in [0, vocab_size={V})")
        return out

    eval_ids = ids(eval_text, "eval_text")  # first: the training text is usually the long one
    if not eval_ids:
        raise ValueError("eval_text: encodes to 0 tokens; need at least 1 to score")
    train_ids = ids(train_text, "train_text")
    counts = Counter(train_ids)
    total = len(train_ids) + V
    nll = -sum(math.log((counts.get(t, 0) + 1) / total) for t in eval_ids) / len(eval_ids)
    return {"ppl": math.exp(nll), "nll": nll, "scored_tokens": len(eval_ids), "train_tokens": len(train_ids)}


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    from moelab.models import tokenizer_dir

    print(save_tokenizer(train_tokenizer(), tokenizer_dir()))
