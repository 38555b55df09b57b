"""Tokenizers behind one small interface: ``tokenize``, ``detokenize``, ``vocab_size``, ``eod``.

The trainer and the preprocessing tool only ever see this interface, so switching
between SentencePiece, GPT-2 BPE and a local Hugging Face tokenizer is a flag.

Megatron's type names mean what they mean in Megatron-LM / Megatron-DeepSpeed:

* ``GPTSentencePieceTokenizer``: a SentencePiece model as it is (EOD = its eos);
* ``Llama2Tokenizer``: a SentencePiece model that puts BOS before every document;
* ``HuggingFaceTokenizer`` / ``HFTokenizer``: a local HF tokenizer encoding with its own
  special tokens (e.g. Llama-3's ``<|begin_of_text|>``), as ``tokenizer(text).input_ids``;
* ``SentencePieceTokenizer`` (with ``vocab_extra_ids``): ``<extra_id_0..N-1>`` appended
  to the vocabulary (T5-style sentinels), as Megatron's does.

``bos`` is the beginning-of-sequence id where the tokenizer has one (None otherwise).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from types import SimpleNamespace

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer", "HFTokenizer", "NullTokenizer")

# End-of-document spellings tried, in order, when a tokenizer does not declare one.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")


class Tokenizer(ABC):
    """Text <-> token ids. ``eod`` separates documents in the token stream."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to ids; adds no special tokens (EOD is appended by the caller)."""

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str:
        """Ids to text; the inverse of ``tokenize`` for lossless tokenizers."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (every id is < vocab_size)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, None where the tokenizer has none."""
        return None


def _require_file(path: str | os.PathLike | None, flag: str, what: str) -> Path:
    if path is None:
        raise ValueError(f"{what} is required: pass {flag}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} '{p}' does not exist or is not a file: fix {flag}")
    return p


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; EOD is its ``</s>`` (eos) id."""

    def __init__(self, model_file: str | os.PathLike, vocab_extra_ids: int = 0):
        import sentencepiece as spm

        path = _require_file(model_file, "--tokenizer-model", "SentencePiece model")
        self.model_file = str(path)
        self.vocab_extra_ids = int(vocab_extra_ids or 0)
        self._sp = spm.SentencePieceProcessor(model_file=self.model_file)
        eod = self._sp.eos_id()
        if eod < 0:  # trained with eos_id=-1: fall back to a '</s>' piece if present
            eod = self._sp.piece_to_id("</s>")
            if eod == self._sp.unk_id():
                raise ValueError(
                    f"SentencePiece model '{path}' has no end-of-document piece (eos_id=-1 and "
                    f"no '</s>'); retrain it with tools/train_tokenizer.py"
                )
        self._eod = int(eod)
        # Sentinels: existing pieces are reused, missing ones get ids after the model's.
        self._extra: dict[int, str] = {}
        n = self._sp.get_piece_size()
        for i in range(self.vocab_extra_ids):
            piece = f"<extra_id_{i}>"
            pid = self._sp.piece_to_id(piece)
            if pid == self._sp.unk_id() and piece != self._sp.id_to_piece(pid):
                self._extra[n] = piece
                n += 1
        self._size = n

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        out, run = [], []
        for i in (int(x) for x in ids):
            if i in self._extra:
                out.append(self._sp.decode(run))
                out.append(self._extra[i])
                run = []
            else:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        b = self._sp.bos_id()
        return int(b) if b >= 0 else None

    def __getstate__(self) -> dict:
        return {"model_file": self.model_file, "vocab_extra_ids": self.vocab_extra_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_file"], state.get("vocab_extra_ids", 0))


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama-2 tokenizer: SentencePiece with BOS before every document (EOD = eos)."""

    def __init__(self, model_file: str | os.PathLike):
        super().__init__(model_file)
        if self.bos is None:
            raise ValueError(f"Llama2Tokenizer: SentencePiece model '{model_file}' has no BOS piece "
                             f"(bos_id=-1); use GPTSentencePieceTokenizer for a model without one")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {"model_file": self.model_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_file"])


class _HFTokenizersTokenizer(Tokenizer):
    """Shared code for tokenizers backed by a ``tokenizers.Tokenizer`` object."""

    _tok: "object"
    _eod: int
    _bos: int | None = None
    _add_special_tokens = False

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special_tokens).ids

    @property
    def bos(self) -> int | None:
        return self._bos

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod


def _find_eod(token_to_id, declared: str | None, where: str) -> int:
    for tok in ((declared,) if declared else ()) + _EOD_CANDIDATES:
        i = token_to_id(tok)
        if i is not None:
            return int(i)
    raise ValueError(
        f"{where} has no end-of-document token (looked for {list(_EOD_CANDIDATES)}); "
        f"add one as a special token, e.g. '<|endoftext|>'"
    )


class GPT2BPETokenizer(_HFTokenizersTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (HF ``tokenizers``);
    EOD is ``<|endoftext|>``."""

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike):
        from tokenizers import ByteLevelBPETokenizer

        vocab = _require_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        merges = _require_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        self.vocab_file, self.merge_file = str(vocab), str(merges)
        # add_prefix_space=False as GPT-2: text is encoded exactly as given.
        self._tok = ByteLevelBPETokenizer(self.vocab_file, self.merge_file, add_prefix_space=False)
        self._eod = _find_eod(self._tok.token_to_id, "<|endoftext|>", f"GPT-2 vocab '{vocab}'")
        self._bos = self._eod  # GPT-2 uses <|endoftext|> for both

    def __getstate__(self) -> dict:
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["vocab_file"], state["merge_file"])


class HuggingFaceTokenizer(_HFTokenizersTokenizer):
    """A local Hugging Face tokenizer directory (never downloads).

    Uses ``dir/tokenizer.json`` through ``tokenizers`` when present, else
    ``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``.
    EOD is the declared ``eos_token`` (tokenizer_config.json) or a common spelling.
    Encodes with the tokenizer's own special tokens (its post-processor, e.g. a BOS), as
    Megatron's HuggingFaceTokenizer (``tokenizer(text).input_ids``) does.
    """

    _add_special_tokens = True

    def __init__(self, path: str | os.PathLike):
        p = Path(path) if path is not None else None
        if p is None or not p.exists():
            raise FileNotFoundError(
                f"Hugging Face tokenizer directory '{path}' does not exist: fix --tokenizer-model"
            )
        self.path = str(p)
        directory = p if p.is_dir() else p.parent
        json_file = directory / "tokenizer.json" if p.is_dir() else p
        declared = _declared_eos(directory)
        if json_file.is_file():
            from tokenizers import Tokenizer as _Tok

            self._tok = _Tok.from_file(str(json_file))
            self._eod = _find_eod(self._tok.token_to_id, declared, f"tokenizer '{json_file}'")
        else:
            self._tok = _TransformersAdapter(str(directory))
            self._eod = _find_eod(self._tok.token_to_id, declared, f"tokenizer '{directory}'")
        bos = _declared_special(directory, "bos_token")
        self._bos = self._tok.token_to_id(bos) if bos else None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def _declared_eos(directory: Path) -> str | None:
    return _declared_special(directory, "eos_token")


def _declared_special(directory: Path, key: str) -> str | None:
    cfg = directory / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        tok = json.loads(cfg.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError):
        return None
    if isinstance(tok, dict):  # serialized AddedToken
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


class _TransformersAdapter:
    """Gives a transformers tokenizer the few ``tokenizers.Tokenizer`` methods we use."""

    def __init__(self, directory: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                f"'{directory}' has no tokenizer.json, so loading it needs transformers "
                f"(pip install transformers), or save the tokenizer with tokenizer.json"
            ) from None
        self._t = AutoTokenizer.from_pretrained(directory, local_files_only=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        return SimpleNamespace(ids=self._t.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._t.decode(ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._t)

    def token_to_id(self, token: str) -> int | None:
        return self._t.get_vocab().get(token)  # includes added tokens


class NullTokenizer(Tokenizer):
    """Ids written as space-separated decimal text ("3 1 4"), for tests and for data
    that is already tokenized. As in Megatron, EOD is ``vocab_size`` (the argument)
    and ``vocab_size`` (the property) is one more."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"NullTokenizer needs a positive vocab size: fix --vocab-size (got {vocab_size})")
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer expects space-separated integers: {e}") from None
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} outside [0, {self._n}) (fix --vocab-size)")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
) -> Tokenizer:
    """Build a tokenizer by Megatron type name; errors name the flag to fix."""
    if vocab_extra_ids and tokenizer_type != "SentencePieceTokenizer":
        raise ValueError(f"--vocab-extra-ids adds T5-style sentinels to SentencePieceTokenizer only (as in "
                         f"Megatron, where {tokenizer_type} ignores it); drop it or use SentencePieceTokenizer")
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_flag(tokenizer_model, "--tokenizer-model", tokenizer_type), vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return SentencePieceTokenizer(_flag(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(_flag(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_flag(vocab_file, "--vocab-file", tokenizer_type),
                                _flag(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type in ("HuggingFaceTokenizer", "HFTokenizer"):
        return HuggingFaceTokenizer(_flag(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(_flag(vocab_size, "--vocab-size", tokenizer_type))
    raise ValueError(f"unknown --tokenizer-type '{tokenizer_type}'; choose one of {list(TOKENIZER_TYPES)}")


def _flag(value, flag: str, tokenizer_type: str):
    if value is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    return value
