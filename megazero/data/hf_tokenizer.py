"""A recorded megazero tokenizer (a checkpoint's ``tokenizer/``) <-> its Hugging Face form.

``export_tokenizer_to_hf(tokenizer_dir, out_dir)`` writes files that
``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads (a HF tokenizer is copied, GPT-2 BPE
becomes ``GPT2TokenizerFast``, SentencePiece a ``LlamaTokenizer`` converted by transformers) and
returns the ``(bos, eos)`` ids for the model's config (eos = the tokenizer's EOD). The model
weights and config are ``megazero.model.interop.hf``'s (``export_to_hf(..., token_ids=(bos, eos))``).

``import_tokenizer_from_hf(hf_dir, tokenizer_dir)`` records the tokenizer of a Hugging Face model
directory (tokenizer.json, tokenizer_config.json, vocab + merges, a SentencePiece model: whichever
it has) by content, as a ``HuggingFaceTokenizer``, so a converted checkpoint carries it.
"""

from __future__ import annotations

import json
import os
import shutil

from megazero.data.tokenizer import (GPT2BPETokenizer, HuggingFaceTokenizer, Llama2Tokenizer, SentencePieceTokenizer,
                                     Tokenizer)
from megazero.data.tokenizer_files import load_tokenizer_from_dir, save_tokenizer_files

__all__ = ["export_tokenizer_to_hf", "import_tokenizer_from_hf", "HF_TOKENIZER_FILES"]

# Any of these in a model directory means it has a tokenizer (tokenizer_files copies the full set).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def import_tokenizer_from_hf(hf_dir: str, tokenizer_dir: str) -> Tokenizer | None:
    """Record the tokenizer of the Hugging Face model directory ``hf_dir`` into ``tokenizer_dir``
    (``load_tokenizer_from_dir`` rebuilds it); None, writing nothing, when ``hf_dir`` has no tokenizer
    files. A tokenizer that does not load (no end-of-document token, a library missing) raises."""
    if not any(os.path.isfile(os.path.join(hf_dir, n)) for n in HF_TOKENIZER_FILES):
        return None
    tok = HuggingFaceTokenizer(hf_dir)
    save_tokenizer_files(tok, tokenizer_dir)
    return tok


def export_tokenizer_to_hf(tokenizer_dir: str, out_dir: str) -> tuple[int | None, int]:
    """Write the HF form of a recorded megazero tokenizer into ``out_dir``; returns (bos, eos) ids."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    tok = load_tokenizer_from_dir(tokenizer_dir)
    eos, bos = tok.eod, tok.bos
    if isinstance(tok, HuggingFaceTokenizer):
        for name in os.listdir(tokenizer_dir):
            if not name.startswith("megazero_"):
                shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    elif isinstance(tok, GPT2BPETokenizer):
        transformers.GPT2TokenizerFast(os.path.join(tokenizer_dir, "vocab.json"), os.path.join(tokenizer_dir, "merges.txt"),
                                       bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       unk_token="<|endoftext|>").save_pretrained(out_dir)
    elif isinstance(tok, SentencePieceTokenizer):
        if getattr(tok, "vocab_extra_ids", 0):
            raise ValueError("exporting a SentencePiece tokenizer with vocab_extra_ids to HF is not supported")
        sp = tok._sp
        shutil.copyfile(os.path.join(tokenizer_dir, "tokenizer.model"), os.path.join(out_dir, "tokenizer.model"))
        piece = lambda i: None if i is None or i < 0 else sp.id_to_piece(int(i))  # noqa: E731
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": isinstance(tok, Llama2Tokenizer),
                       "add_eos_token": False, "bos_token": piece(bos), "eos_token": piece(eos),
                       "unk_token": piece(sp.unk_id())}, f, indent=1)
        # Let transformers convert the SentencePiece model to its own files (tokenizer.json).
        transformers.AutoTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)
    # NullTokenizer: ids only, no tokenizer files; eos is still its EOD id.
    return bos, eos
