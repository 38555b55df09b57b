"""Real launch scripts' argument lists run 3 iterations on 4 ranks, with a finite loss.

One Megatron-DeepSpeed script starts with the `deepspeed` launcher and one Megatron-LM script with
`torchrun`, as their users start them; the others run the same program on the test pool's 4 ranks
(`tests/launch.py`)."""

import json
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from megazero.data import IndexedDatasetBuilder
from tests.launch import in_pool
from tests.scripts.test_scripts_parse import script_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
VOCAB = 120  # 119 ordinary tokens + <|endoftext|> (id 119)
DONE = r"iteration\s+3/\s+3"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GPT-2-format vocabulary and a .bin/.idx corpus of its ids (arithmetic progressions)."""
    d = tmp_path_factory.mktemp("scripts")
    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    vocab["<|endoftext|>"] = VOCAB - 1
    (d / "gpt2-vocab.json").write_text(json.dumps(vocab))
    (d / "gpt2-merges.txt").write_text("#version: 0.2\n")
    prefix = str(d / "corpus_text_document")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(300):
        start, step, n = rng.integers(0, VOCAB - 1), rng.integers(1, 4), rng.integers(20, 80)
        builder.add_item(np.append((start + step * np.arange(n)) % (VOCAB - 1), VOCAB - 1))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return dict(DATA=prefix, VOCAB=str(d / "gpt2-vocab.json"), MERGE=str(d / "gpt2-merges.txt"))


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _checked(log, returncode, tmp_path, done):
    (tmp_path / "log.txt").write_text(log)
    assert returncode == 0, log[-6000:]
    assert re.search(done, log), log[-4000:]
    train = [float(x) for x in re.findall(r"lm loss: ([-+0-9.naNEinf]+)", log)]
    valid = [float(x) for x in re.findall(r"end of training for validation data: loss at iteration 3: (\S+)", log)]
    assert len(valid) == 1 and all(math.isfinite(x) for x in train + valid), log[-4000:]
    return log, train


def _launch(cmd, tmp_path, done=DONE):
    """The script's own launcher starting pretrain_gpt.py in fresh processes."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=420)
    return _checked(proc.stdout, proc.returncode, tmp_path, done)


def _on_4_ranks(args, tmp_path, done=DONE):
    """The same program and arguments on the 4 ranks the launcher would start (tests/launch.py); one
    test per launcher still starts it for real."""
    run = in_pool(4, args, cwd=ROOT)
    return _checked(run.stdout + run.stderr, run.returncode, tmp_path, done)


def test_run_deepspeed_example_with_the_deepspeed_launcher(files, tmp_path):
    args = script_args("run_deepspeed_example", TB=str(tmp_path / "tb"), **files)
    log, train = _launch([os.path.join(BIN, "deepspeed"), "--num_gpus", "4", "--master_port", _free_port(),
                   os.path.join(ROOT, "pretrain_gpt.py"), *args], tmp_path)
    assert len(train) == 3  # log interval 1, no step skipped at a 4096 scale
    assert "--loss-scale 12 is superseded by the DeepSpeed JSON's fp16 block" in log
    assert "loss scale: 4096.0" in log  # dynamic, from "initial_scale_power": 12
    assert "fwd" in log and "bwd" in log and "step" in log  # wall_clock_breakdown


def test_pretrain_gpt_distributed_with_mp_with_torchrun(files, tmp_path):
    args = script_args("pretrain_gpt_distributed_with_mp", CKPT=str(tmp_path / "ckpt"), **files)
    log, train = _on_4_ranks(args, tmp_path)
    assert "tp 2 x pp 1 x dp 2" in log
    # fp16 starts at Megatron's 2**32 loss scale: the first steps overflow and are skipped, as in
    # Megatron (hysteresis 2, then halving), so these 3 iterations log no training loss.
    assert "number of skipped iterations:   3" in log and "loss scale: 1073741824.0" in log
    assert os.path.exists(tmp_path / "ckpt" / "latest")


def test_ds_pretrain_gpt_1_3b_token_schedule_with_the_deepspeed_launcher(files, tmp_path):
    args = script_args("ds_pretrain_gpt_1.3B", CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"), **files)
    log, _ = _on_4_ranks(args, tmp_path, done=r"stopping at iteration 3: 768 tokens consumed, --train-tokens 768 reached")
    assert "warmup 64 tokens, decay 768 tokens" in log and "tp 2 x pp 1 x dp 2" in log
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000003")


def test_train_gpt3_175b_distributed_with_torchrun(files, tmp_path):
    args = script_args("train_gpt3_175b_distributed", CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"), **files)
    log, train = _on_4_ranks(args, tmp_path)
    assert "tp 2 x pp 1 x dp 2" in log
    # Ramp 2 -> 8 by 2 every 4 samples: batches of 2, 2, 4 over the 3 iterations (8 samples consumed).
    assert re.search(r"consumed samples:\s+8 \|.*global batch size:\s+4 \|", log), log[-4000:]
    # fp16 at Megatron's 2**32 initial scale: the first steps overflow and are skipped, as in Megatron
    # (hysteresis 2, then halving), so no training loss is logged; the validation loss is finite.
    assert "number of skipped iterations:   3" in log and "loss scale: 1073741824.0" in log
    assert os.path.exists(tmp_path / "ckpt" / "latest")


def test_run_175b_with_the_deepspeed_launcher(files, tmp_path):
    args = script_args("run-175b", TB=str(tmp_path / "tb"), **files)
    log, train = _on_4_ranks(args, tmp_path)
    assert "tp 1 x pp 1 x dp 4" in log
    assert "DeepSpeed JSON keys ignored" in log and "aio" in log
    assert len(train) == 3 and "loss scale: 32768.0" in log  # "initial_scale_power": 15 supersedes --loss-scale 15


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    from megazero.data.tokenizer_training import train_sentencepiece
    from tests.data.conftest import SAMPLE_TEXTS

    return train_sentencepiece(SAMPLE_TEXTS, str(tmp_path_factory.mktemp("spm") / "tiny"), 320, num_threads=1)


def test_pretrain_llama2_distributed_with_torchrun_at_tp2_pp2(files, spm_model, tmp_path):
    # The script launches with torchrun (its DISTRIBUTED_ARGS), not the deepspeed launcher.
    args = script_args("pretrain_llama2_distributed", CKPT=str(tmp_path / "ckpt"), TOKENIZER_MODEL=spm_model,
                       **files)
    log, train = _launch([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "4",
                          os.path.join(ROOT, "pretrain_gpt.py"), *args], tmp_path)
    assert "tp 2 x pp 2 x dp 1" in log
    assert len(train) == 3  # bf16: no loss scale, no step skipped
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000003")
