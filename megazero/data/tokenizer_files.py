"""A tokenizer by content: the files that define it, to copy into a checkpoint.

A checkpoint that names its tokenizer by absolute path breaks when the path moves or
the file changes. ``tokenizer_files(tok)`` returns the defining files as bytes plus a
small ``megazero_tokenizer.json`` (type and options); ``save_tokenizer_files`` writes
them into a directory (a checkpoint's ``tokenizer/``) and ``load_tokenizer_from_dir``
rebuilds the same tokenizer from that directory alone (``recorded_tokenizer_args``: the type and
``build_tokenizer`` arguments that do it, for a run that takes its tokenizer from a checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megazero.data.tokenizer import (
    GPT2BPETokenizer, HuggingFaceTokenizer, Llama2Tokenizer, NullTokenizer, SentencePieceTokenizer, Tokenizer,
    build_tokenizer,
)

__all__ = ["tokenizer_files", "save_tokenizer_files", "load_tokenizer_from_dir", "recorded_tokenizer_args",
           "DESCRIPTION_NAME"]

DESCRIPTION_NAME = "megazero_tokenizer.json"
# Files of a Hugging Face tokenizer directory that define the tokenizer (weights etc. are not copied).
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja")


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """``{file name: content}`` that ``load_tokenizer_from_dir`` turns back into ``tokenizer``."""
    desc: dict = {"vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "bos": tokenizer.bos}
    files: dict[str, bytes] = {}
    if isinstance(tokenizer, Llama2Tokenizer):
        desc["type"] = "Llama2Tokenizer"
        files["tokenizer.model"] = Path(tokenizer.model_file).read_bytes()
    elif isinstance(tokenizer, SentencePieceTokenizer):
        desc.update(type="SentencePieceTokenizer", vocab_extra_ids=tokenizer.vocab_extra_ids)
        files["tokenizer.model"] = Path(tokenizer.model_file).read_bytes()
    elif isinstance(tokenizer, GPT2BPETokenizer):
        desc["type"] = "GPT2BPETokenizer"
        files["vocab.json"] = Path(tokenizer.vocab_file).read_bytes()
        files["merges.txt"] = Path(tokenizer.merge_file).read_bytes()
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        desc["type"] = "HuggingFaceTokenizer"
        p = Path(tokenizer.path)
        if p.is_file():
            files["tokenizer.json"] = p.read_bytes()
        else:
            files.update({n: (p / n).read_bytes() for n in _HF_FILES if (p / n).is_file()})
    elif isinstance(tokenizer, NullTokenizer):
        desc["type"] = "NullTokenizer"
    else:
        raise TypeError(f"cannot record a {type(tokenizer).__name__} by content")
    files[DESCRIPTION_NAME] = json.dumps(desc, indent=1).encode()
    return files


def save_tokenizer_files(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, data in tokenizer_files(tokenizer).items():
        tmp = os.path.join(directory, f"{name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, name))


def recorded_tokenizer_args(directory: str | os.PathLike) -> tuple[str, dict]:
    """``(tokenizer type, build_tokenizer keyword arguments)`` of the tokenizer recorded in ``directory``
    (its files named inside ``directory``), as ``build_tokenizer(type, **kwargs)`` rebuilds it."""
    d = Path(directory)
    desc = _description(d)
    t = desc["type"]
    if t in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        kw = {"tokenizer_model": str(d / "tokenizer.model")}
        if desc.get("vocab_extra_ids"):
            kw["vocab_extra_ids"] = desc["vocab_extra_ids"]
        return t, kw
    if t == "GPT2BPETokenizer":
        return t, {"vocab_file": str(d / "vocab.json"), "merge_file": str(d / "merges.txt")}
    if t == "HuggingFaceTokenizer":
        return t, {"tokenizer_model": str(d)}
    if t == "NullTokenizer":
        return t, {"vocab_size": desc["vocab_size"] - 1}
    raise ValueError(f"{d / DESCRIPTION_NAME}: unknown tokenizer type {t!r}")


def _description(d: Path) -> dict:
    desc_path = d / DESCRIPTION_NAME
    if not desc_path.is_file():
        raise FileNotFoundError(f"{d} has no {DESCRIPTION_NAME}: not a tokenizer written by save_tokenizer_files")
    return json.loads(desc_path.read_text())


def load_tokenizer_from_dir(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer recorded in ``directory`` by ``save_tokenizer_files``, checked against its record."""
    d = Path(directory)
    desc = _description(d)
    t, kwargs = recorded_tokenizer_args(d)
    tok = build_tokenizer(t, **kwargs)
    if tok.vocab_size != desc["vocab_size"] or tok.eod != desc["eod"]:
        raise ValueError(f"tokenizer rebuilt from {d} has vocab {tok.vocab_size} / eod {tok.eod}, recorded "
                         f"{desc['vocab_size']} / {desc['eod']}: the files were changed")
    return tok
