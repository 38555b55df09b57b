"""Megatron's tokenizer type names with Megatron's meaning, and --vocab-extra-ids."""

from __future__ import annotations

import pickle

import pytest

from megazero.data.tokenizer import TOKENIZER_TYPES, HuggingFaceTokenizer, Llama2Tokenizer, build_tokenizer
from tests.data.test_tokenizer import _tiny_bytelevel_bpe

TEXT = "To be, or not to be"


def test_type_names():
    assert {"GPTSentencePieceTokenizer", "Llama2Tokenizer", "HFTokenizer", "HuggingFaceTokenizer"} <= set(TOKENIZER_TYPES)


def test_gpt_sentencepiece_and_llama2(spm_model):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=spm_model)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert gpt.tokenize(TEXT) == plain.tokenize(TEXT) and gpt.vocab_size == plain.vocab_size == 320
    assert (gpt.eod, gpt.bos) == (2, 1)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    assert isinstance(llama, Llama2Tokenizer)
    assert llama.tokenize(TEXT) == [1] + plain.tokenize(TEXT)  # BOS before every document, no EOS
    assert llama.detokenize(llama.tokenize(TEXT)) == TEXT and llama.vocab_size == 320 and llama.eod == 2
    assert pickle.loads(pickle.dumps(llama)).tokenize(TEXT) == llama.tokenize(TEXT)


def test_vocab_extra_ids(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model, vocab_extra_ids=3)
    assert tok.vocab_size == 323
    assert tok.detokenize(tok.tokenize("To be") + [321]) == "To be<extra_id_1>"
    assert pickle.loads(pickle.dumps(tok)).vocab_size == 323
    with pytest.raises(ValueError, match="--vocab-extra-ids .* SentencePieceTokenizer only"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=spm_model, vocab_extra_ids=2)


def test_hf_tokenizer_adds_its_own_special_tokens(tmp_path):
    from tokenizers.processors import TemplateProcessing

    bpe = _tiny_bytelevel_bpe(tmp_path)
    eot = bpe.token_to_id("<|endoftext|>")
    plain_ids = bpe.encode(TEXT).ids
    bpe.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)])
    (tmp_path / "hf").mkdir()
    bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}')
    for name in ("HFTokenizer", "HuggingFaceTokenizer"):
        tok = build_tokenizer(name, tokenizer_model=tmp_path / "hf")
        assert isinstance(tok, HuggingFaceTokenizer)
        assert tok.tokenize(TEXT) == [eot] + plain_ids  # as Megatron's tokenizer(text).input_ids
        assert (tok.bos, tok.eod) == (eot, eot)
