"""Data and tokenizer: data paths and split, the tokenizer type and the files it needs."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megazero.config.resolve.common import default
from megazero.config.train_config import ConfigError, DataConfig

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer", "HFTokenizer", "NullTokenizer")
DEFAULT_TOKENIZER = "GPT2BPETokenizer"  # Megatron's pretrain_gpt.py args_defaults


def _parse_prefixes(flag_name: str, items: list[str]) -> tuple[list[str], Optional[list[float]]]:
    from megazero.data.gpt_dataset import parse_data_prefix  # lazy: numpy etc.

    try:
        return parse_data_prefix(items)
    except ValueError as e:
        raise ConfigError(f"{flag_name}: {e}") from None


# Flags that describe data read from files: beside --mock-data they would be ignored.
_FILE_DATA_FLAGS = (("data_path", "--data-path"), ("train_data_path", "--train-data-path"),
                    ("valid_data_path", "--valid-data-path"), ("test_data_path", "--test-data-path"),
                    ("data_cache_path", "--data-cache-path"), ("split", "--split"))


def _refuse_beside_mock_data(ns: argparse.Namespace) -> None:
    given = [flag for attr, flag in _FILE_DATA_FLAGS if getattr(ns, attr)]
    if given:
        raise ConfigError(f"--mock-data trains on synthetic tokens and reads no files, so {', '.join(given)} would "
                          f"be ignored; drop {'it' if len(given) == 1 else 'them'}, or drop --mock-data")


def _tokenizer_files(t: str, ns: argparse.Namespace) -> list[tuple[str, Optional[str], str]]:
    """``(flag, value, kind)`` of each file or directory tokenizer ``t`` is built from."""
    model_file = ("--tokenizer-model", ns.tokenizer_model, "file")
    model_dir = ("--tokenizer-model", ns.tokenizer_model, "directory")
    return {"SentencePieceTokenizer": [model_file], "GPTSentencePieceTokenizer": [model_file],
            "Llama2Tokenizer": [model_file], "HuggingFaceTokenizer": [model_dir], "HFTokenizer": [model_dir],
            "GPT2BPETokenizer": [("--vocab-file", ns.vocab_file, "file"), ("--merge-file", ns.merge_file, "file")],
            "NullTokenizer": []}.get(t, [])


def read_data_args_files(ns: argparse.Namespace, check_files: bool) -> None:
    """--data-args-path / --per-split-data-args-path (Megatron's get_blend_and_blend_per_split): the --data-path words,
    or the --train/valid/test-data-path words of a JSON file's "train", "valid" and "test", read into ``ns`` in
    place of the flags, before anything checks the data flags. A file that is not there is refused, or left
    unread without ``check_files`` (a plan made for another machine)."""
    import json

    for flag_name, path, flags in (("--data-args-path", ns.data_args_path, ("data_path",)),
                                   ("--per-split-data-args-path", ns.per_split_data_args_path,
                                    ("train_data_path", "valid_data_path", "test_data_path"))):
        if path is None:
            continue
        given = [f"--{f.replace('_', '-')}" for f in flags if getattr(ns, f)]
        if given:
            raise ConfigError(f"{flag_name} {path} stands for {' and '.join(given)}: give one of them")
        if not os.path.isfile(path):
            if check_files:
                raise ConfigError(f"{flag_name} {path}: no such file")
            continue
        text = open(path).read()
        if len(flags) == 1:
            ns.data_path = text.split()
            continue
        try:
            splits = json.loads(text)
            words = {split: splits[split] for split in ("train", "valid", "test")}
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{flag_name} {path}: need a JSON object with \"train\", \"valid\" and \"test\" "
                              f"(each a string or a list of weights and prefixes): {e!r}") from None
        for split, value in words.items():
            setattr(ns, f"{split}_data_path", value.split() if isinstance(value, str) else [str(w) for w in value])


def _default_note(ns: argparse.Namespace) -> str:
    return " (the default without --tokenizer-type, as Megatron's pretrain_gpt.py)" if ns.tokenizer_type is None else ""


def missing_data_flags(ns: argparse.Namespace, tokenizer: bool = True) -> list[str]:
    """The required data flags ``ns`` lacks (and the tokenizer's files, with ``tokenizer``), as
    ``arguments.missing_required`` lists them."""
    if ns.mock_data:
        return []
    missing = []
    if not (ns.data_path or ns.train_data_path or ns.valid_data_path or ns.test_data_path):
        missing.append("--data-path PREFIX (a .bin/.idx prefix from tools/preprocess_data.py; or --mock-data "
                       "for synthetic tokens)")
    t = ns.tokenizer_type or DEFAULT_TOKENIZER
    absent = [flag for flag, value, _ in _tokenizer_files(t, ns) if value is None] if tokenizer else []
    if absent:
        whose = f"--tokenizer-type {t}" if ns.tokenizer_type else f"{t}, the default --tokenizer-type"
        missing.append(f"{' and '.join(absent)} (the files of {whose})")
    return missing


def resolve_data(ns: argparse.Namespace, check_files: bool) -> DataConfig:
    from megazero.data.gpt_dataset import parse_split  # lazy: numpy etc.

    d = DataConfig(data_path=list(ns.data_path or []), split=default(ns.split, "969,30,1"),
                   mock_data=bool(ns.mock_data), tokenizer_type=ns.tokenizer_type,
                   tokenizer_model=ns.tokenizer_model, vocab_file=ns.vocab_file, merge_file=ns.merge_file,
                   vocab_size=ns.vocab_size, train_data_path=list(ns.train_data_path or []),
                   valid_data_path=list(ns.valid_data_path or []), test_data_path=list(ns.test_data_path or []),
                   data_cache_path=ns.data_cache_path, num_workers=default(ns.num_workers, 0),
                   reset_position_ids=bool(ns.reset_position_ids), reset_attention_mask=bool(ns.reset_attention_mask),
                   eod_mask_loss=bool(ns.eod_mask_loss), vocab_extra_ids=default(ns.vocab_extra_ids, 0))
    if d.num_workers < 0 or d.vocab_extra_ids < 0:
        raise ConfigError(f"--num-workers and --vocab-extra-ids must be >= 0, got {d.num_workers}, {d.vocab_extra_ids}")
    try:
        parse_split(d.split)
    except ValueError as e:
        raise ConfigError(f"--split: {e}") from None
    separate = d.train_data_path or d.valid_data_path or d.test_data_path
    if d.mock_data:
        _refuse_beside_mock_data(ns)
    if separate and d.data_path:
        raise ConfigError("give either --data-path (split by --split) or --train-data-path/--valid-data-path/"
                          "--test-data-path, not both")
    if separate and not d.train_data_path:
        raise ConfigError("--valid-data-path/--test-data-path need --train-data-path")
    prefixes = []
    if d.data_path:
        d.prefixes, d.weights = _parse_prefixes("--data-path", d.data_path)
        prefixes += d.prefixes
    for flag_name, items in (("--train-data-path", d.train_data_path), ("--valid-data-path", d.valid_data_path),
                             ("--test-data-path", d.test_data_path)):
        if items:
            prefixes += _parse_prefixes(flag_name, items)[0]
    if check_files and not d.mock_data:
        for prefix in prefixes:
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(f"data prefix '{prefix}': missing {' and '.join(missing)}; give the prefix "
                                  f"without extension, as written by tools/preprocess_data.py (or use --mock-data)")

    t = d.tokenizer_type
    if t is None:
        if d.mock_data and d.vocab_file is None:
            asked = [f for f, on in (("--reset-position-ids", d.reset_position_ids),
                                     ("--reset-attention-mask", d.reset_attention_mask),
                                     ("--eod-mask-loss", d.eod_mask_loss)) if on]
            if asked:
                raise ConfigError(f"{', '.join(asked)} need the end-of-document token of a tokenizer; with "
                                  f"--mock-data pass --tokenizer-type (e.g. NullTokenizer --vocab-size N)")
            return d
        t = d.tokenizer_type = DEFAULT_TOKENIZER
    from megazero.data.tokenizer import TOKENIZER_TYPES as built

    if t not in built:
        raise ConfigError(f"--tokenizer-type {t} is not available in this build's megazero.data (it has "
                          f"{', '.join(built)}); use one of those")
    for flag_name, value, kind in _tokenizer_files(t, ns):
        if value is None:
            raise ConfigError(f"--tokenizer-type {t}{_default_note(ns)} needs {flag_name}")
        if check_files and not os.path.exists(value):
            raise ConfigError(f"{flag_name} '{value}' does not exist (the {kind} of the {t})")
    if d.vocab_extra_ids and t != "SentencePieceTokenizer":
        raise ConfigError(f"--vocab-extra-ids {d.vocab_extra_ids}: Megatron adds the <extra_id_N> sentinels to "
                          f"SentencePieceTokenizer only ({t} would ignore them); drop the flag or use "
                          f"--tokenizer-type SentencePieceTokenizer")
    if t == "NullTokenizer" and (d.vocab_size is None or d.vocab_size < 1):
        raise ConfigError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {d.vocab_size})")
    return d
