"""Tokenizers recorded by content: save into a directory, rebuild from it alone, and
export to Hugging Face with bos/eos taken from the tokenizer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest


from megazero.data.tokenizer import build_tokenizer
from megazero.data.tokenizer_files import load_tokenizer_from_dir, save_tokenizer_files, tokenizer_files
from tests.data.test_tokenizer import _tiny_bytelevel_bpe

TEXT = "To be, or not to be"


def test_sentencepiece_round_trip_by_content(spm_model, tmp_path):
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    copy = tmp_path / "model.model"
    shutil.copy(spm_model, copy)
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=copy)
    files = tokenizer_files(tok)
    assert set(files) == {"tokenizer.model", "megazero_tokenizer.json"}
    save_tokenizer_files(tok, tmp_path / "ckpt" / "tokenizer")
    copy.unlink()  # the original path is gone: the checkpoint still has the tokenizer
    back = load_tokenizer_from_dir(tmp_path / "ckpt" / "tokenizer")
    assert type(back).__name__ == "Llama2Tokenizer" and back.tokenize(TEXT) == tok.tokenize(TEXT)


def test_gpt2_and_null_round_trip(tmp_path):
    _tiny_bytelevel_bpe(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json", merge_file=tmp_path / "merges.txt")
    save_tokenizer_files(tok, tmp_path / "t")
    assert load_tokenizer_from_dir(tmp_path / "t").tokenize(TEXT) == tok.tokenize(TEXT)
    null = build_tokenizer("NullTokenizer", vocab_size=99)
    save_tokenizer_files(null, tmp_path / "n")
    assert load_tokenizer_from_dir(tmp_path / "n").eod == 99
    desc = json.loads((tmp_path / "t" / "megazero_tokenizer.json").read_text())
    (tmp_path / "t" / "megazero_tokenizer.json").write_text(json.dumps({**desc, "vocab_size": desc["vocab_size"] + 1}))
    with pytest.raises(ValueError, match="files were changed"):
        load_tokenizer_from_dir(tmp_path / "t")


def test_hf_export_writes_tokenizer_and_its_bos_eos(spm_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megazero.data.hf_tokenizer import export_tokenizer_to_hf
    from megazero.model import GPTModel
    from megazero.model.interop.hf import export_to_hf
    from megazero.model.state_dict import gather_full_state_dict
    from tests.model.common import tiny_config

    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    save_tokenizer_files(tok, tmp_path / "tokenizer")
    config = tiny_config("llama", vocab_size=320)
    ids = export_tokenizer_to_hf(str(tmp_path / "tokenizer"), str(tmp_path / "hf"))
    export_to_hf(gather_full_state_dict(GPTModel(config)), config, str(tmp_path / "hf"), token_ids=ids)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (tok.bos, tok.eod) == (1, 2)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eod
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = hf_tok(TEXT).input_ids
    assert ids[0] == tok.bos and hf_tok.decode(ids, skip_special_tokens=True) == TEXT
    assert hf_tok.eos_token_id == tok.eod

    # GPT-2 BPE: eos = bos = <|endoftext|>, not transformers' defaults
    _tiny_bytelevel_bpe(tmp_path)
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json", merge_file=tmp_path / "merges.txt")
    save_tokenizer_files(bpe, tmp_path / "bpe")
    gpt = tiny_config("gpt", vocab_size=bpe.vocab_size)
    ids = export_tokenizer_to_hf(str(tmp_path / "bpe"), str(tmp_path / "hf2"))
    export_to_hf(gather_full_state_dict(GPTModel(gpt)), gpt, str(tmp_path / "hf2"), token_ids=ids)
    cfg2 = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert cfg2["eos_token_id"] == cfg2["bos_token_id"] == bpe.eod
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf2"))(TEXT).input_ids == bpe.tokenize(TEXT)


def test_convert_to_hf_names_protobuf_for_a_sentencepiece_tokenizer(spm_model, tmp_path, monkeypatch, capsys):
    """Without protobuf, transformers' SentencePiece conversion fails asking for tiktoken; the tool says
    protobuf, and how to install it, before writing anything."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed (the tool would name it first)")
    from megazero.model import GPTModel
    from megazero.model.state_dict import gather_full_state_dict, save_full
    from tests.model.common import tiny_config

    config = tiny_config("llama", vocab_size=320)
    save_full(str(tmp_path / "full"), gather_full_state_dict(GPTModel(config)), config)
    save_tokenizer_files(build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model), tmp_path / "full" / "tokenizer")
    spec = importlib.util.spec_from_file_location("convert_to_hf", Path(__file__).resolve().parents[2] / "tools"
                                                  / "convert_to_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setitem(sys.modules, "google.protobuf", None)  # as if protobuf were not installed
    with pytest.raises(SystemExit) as e:
        tool.main(["--input", str(tmp_path / "full"), "--output", str(tmp_path / "hf")])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("convert_to_hf: error: exporting a SentencePiece tokenizer needs the protobuf "
                                       "package, which is not installed: pip install protobuf (or pip install -e "
                                       "'.[hf]' in the megazero checkout)\n")
    assert not (tmp_path / "hf").exists()

