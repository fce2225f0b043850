"""Byte-level BPE tokenizer trained with `tokenizers` on the bundled text.

Byte-level pre-tokenization (GPT-2 style, no prefix space, no normalizer) makes every string
representable and `decode(encode(x)) == x` exact. Special tokens take the first ids in a fixed
order so that their ids are stable across retrains.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["SPECIAL_TOKENS", "VOCAB_SIZE", "train_tokenizer"]

# id 0..4, in this order; the trainer uses <|image|> / <|audio|> as placeholders for encoder output.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|image|>", "<|audio|>")
# Small enough for a tiny model's embedding table; ~1.3 MB of text fills it with frequent merges.
VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], out: Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on `texts` and save it as JSON at `out`.

    Args:
        texts: training documents (captions, transcripts, passages).
        out: path of the `tokenizer.json` to write.
        vocab_size: total vocabulary, special tokens and the 256 byte symbols included.

    Returns:
        The trained tokenizer; special token i of `SPECIAL_TOKENS` has id i.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out), pretty=False)
    return tokenizer
