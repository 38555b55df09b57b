"""Data pipeline: tokenizers, Megatron .bin/.idx datasets, GPT samples, DP sampling,
and the embedded Shakespeare corpus. Independent of the model/parallel code: data-
parallel rank and size are plain ints.

Names are imported on first use, so the command-line tools (which need only numpy
and a tokenizer) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "GPTBatch": "batch", "build_batch": "batch", "masked_mean": "batch", "to_device": "batch",
    "pin_memory_for": "batch",
    "BlendedDataset": "blended_dataset", "build_blending_indices": "blended_dataset",
    "DEFAULT_VOCAB_SIZE": "corpus", "prepare_default_dataset": "corpus",
    "write_shakespeare_jsonl": "corpus",
    "GPTDataset": "gpt_dataset", "build_train_valid_test_datasets": "gpt_dataset",
    "parse_data_prefix": "gpt_dataset", "split_ranges": "gpt_dataset",
    "IndexedDataset": "indexed_dataset", "IndexedDatasetBuilder": "indexed_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "MegatronPretrainingSampler": "sampler", "build_pretraining_data_loader": "sampler",
    "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer",
    "tokenizer_files": "tokenizer_files", "save_tokenizer_files": "tokenizer_files",
    "load_tokenizer_from_dir": "tokenizer_files",
    "train_sentencepiece": "tokenizer_training",
    "export_tokenizer_to_hf": "hf_tokenizer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # static tools see the real imports
    from megazero.data.batch import GPTBatch, build_batch, masked_mean, pin_memory_for, to_device  # noqa: F401
    from megazero.data.blended_dataset import BlendedDataset, build_blending_indices  # noqa: F401
    from megazero.data.corpus import (  # noqa: F401
        DEFAULT_VOCAB_SIZE, prepare_default_dataset, write_shakespeare_jsonl,
    )
    from megazero.data.gpt_dataset import (  # noqa: F401
        GPTDataset, build_train_valid_test_datasets, parse_data_prefix, split_ranges,
    )
    from megazero.data.hf_tokenizer import export_tokenizer_to_hf  # noqa: F401
    from megazero.data.indexed_dataset import (  # noqa: F401
        IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
    )
    from megazero.data.sampler import MegatronPretrainingSampler, build_pretraining_data_loader  # noqa: F401
    from megazero.data.tokenizer import Tokenizer, build_tokenizer  # noqa: F401
    from megazero.data.tokenizer_files import (  # noqa: F401
        load_tokenizer_from_dir, save_tokenizer_files, tokenizer_files,
    )
    from megazero.data.tokenizer_training import train_sentencepiece  # noqa: F401


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megazero.data' has no attribute '{name}'")
    return getattr(importlib.import_module(f"megazero.data.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
