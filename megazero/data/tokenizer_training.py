"""Train a SentencePiece model whose ``decode(encode(text)) == text`` exactly.

SentencePiece's defaults are lossy for code/prose datasets: NFKC normalization,
collapsed whitespace, newlines dropped, unknown characters mapped to <unk>, and
sentences over ``max_sentence_length`` (4192 bytes) silently skipped. The settings
below turn all of that off; long documents are cut into pieces below that limit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

#: SentencePiece silently drops training sentences longer than this many bytes.
SPM_MAX_SENTENCE_BYTES = 4192
#: We cut training text into pieces no longer than this (bytes), safely below the limit.
MAX_PIECE_BYTES = 4000


def split_for_training(text: str, max_bytes: int = MAX_PIECE_BYTES) -> Iterator[str]:
    """Cut a document into non-empty pieces of at most ``max_bytes`` UTF-8 bytes.

    Cuts at newlines (the newline itself is a user-defined symbol, so it needs no
    statistics), then at the last space, and only as a last resort inside a word,
    never inside a UTF-8 character.
    """
    for line in text.split("\n"):
        data = line.encode("utf-8")
        while len(data) > max_bytes:
            cut = data.rfind(b" ", 0, max_bytes + 1)
            if cut <= 0:
                cut = max_bytes
                while cut > 0 and (data[cut] & 0xC0) == 0x80:  # continuation byte
                    cut -= 1
            piece, data = data[:cut], data[cut:]
            if piece.strip():
                yield piece.decode("utf-8")
        if data.strip():
            yield data.decode("utf-8")


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "unigram",
    split_digits: bool = False,
    character_coverage: float = 0.9999,
    input_sentence_size: int = 2_000_000,
    num_threads: int | None = None,
    verbose: bool = False,
) -> str:
    """Train a lossless SentencePiece model on ``texts``; write ``<prefix>.model``
    (and ``.vocab``) atomically and return the ``.model`` path.

    Ids 0..2 are <unk>, <s>, </s>; ``</s>`` is the end-of-document id. Newline is a
    user-defined symbol and byte fallback covers every other character.
    """
    import sentencepiece as spm

    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = model_prefix.with_name(model_prefix.name + f".tmp{os.getpid()}")
    # 3 control ids + 256 byte-fallback pieces + '\n' + room for actual merges.
    min_vocab = 3 + 256 + 1 + 8
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size {vocab_size} is too small for byte fallback; use >= {min_vocab}")

    def sentences() -> Iterator[str]:
        for text in texts:
            yield from split_for_training(text)

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_prefix=str(tmp_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # no invisible leading space: text is encoded as given
            user_defined_symbols=["\n"],
            byte_fallback=True,
            split_digits=split_digits,
            allow_whitespace_only_pieces=True,
            character_coverage=character_coverage,
            max_sentence_length=SPM_MAX_SENTENCE_BYTES,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            hard_vocab_limit=False,  # a tiny corpus may not support the full vocab size
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=num_threads or max(1, os.cpu_count() or 1),
            seed_sentencepiece_size=1_000_000,
            minloglevel=0 if verbose else 2,
        )
        for ext in (".vocab", ".model"):  # .model last: its presence means "done"
            os.replace(f"{tmp_prefix}{ext}", f"{model_prefix}{ext}")
    finally:
        for ext in (".vocab", ".model"):
            Path(f"{tmp_prefix}{ext}").unlink(missing_ok=True)
    return f"{model_prefix}.model"
