"""A torch_dist checkpoint megazero cannot read is refused in one line naming the file, the key and the fix,
through ``tools/convert_from_megatron.py`` and ``pretrain_gpt.py --load``; nothing in it runs, nothing is
written. The checkpoints are megazero's own torch_dist saves, damaged one way each."""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import ROOT, in_pool
from tests.training.test_layout_invariance import flags, launch, write_corpus
from tests.training.test_megatron_resume import MODEL

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this runs ``touch MARKER``: a reader that executes checkpoint code creates the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    runs = tmp_path_factory.mktemp("torch_dist_bad")
    prefix = write_corpus(runs)
    launch(1, flags(prefix, *MODEL, layers=2, iters=1) + ["--save", str(runs / "good"), "--ckpt-format", "torch_dist"],
           runs, "good")
    return runs, prefix


def _copy(good, name: str):
    runs, _ = good
    target = runs / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(runs / "good", target)
    return target, target / "iter_0000001"


def _convert(source, tmp_path) -> tuple[int, str, bool]:
    out = tmp_path / "converted"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_from_megatron.py"), "--input",
                           str(source), "--output", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) <= 1, errors
    return proc.returncode, errors[0] if errors else "", os.path.exists(out / "model_full.safetensors")


def _damage_common(iter_dir, edit) -> None:
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    edit(common)
    torch.save(common, iter_dir / "common.pt")


def test_a_good_checkpoint_converts(good, tmp_path):
    rc, error, written = _convert(good[0] / "good", tmp_path)
    assert rc == 0 and written and not error


def test_corrupt_metadata(good, tmp_path):
    top, it = _copy(good, "corrupt")
    data = (it / ".metadata").read_bytes()
    (it / ".metadata").write_bytes(data[:len(data) // 2])
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and ".metadata" in error and "truncated or corrupt" in error, error


def test_pickle_payloads_are_refused_not_run(good, tmp_path):
    marker = tmp_path / "ran"
    top, it = _copy(good, "evil_meta")
    (it / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "allow-list" in error and ".metadata" in error, error
    top, it = _copy(good, "evil_common")
    _damage_common(it, lambda c: c.update(extra=Payload(str(marker))))
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "common.pt" in error and "system" in error, error
    assert not marker.exists()  # nothing in either file ran


def test_missing_shard(good, tmp_path):
    top, it = _copy(good, "missing")
    os.remove(it / "__0_0.distcp")
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "__0_0.distcp" in error, error


def test_unknown_model_and_unmappable_key(good, tmp_path):
    top, it = _copy(good, "no_args")
    _damage_common(it, lambda c: (c.pop("args"), c.pop("megazero")))
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "common.pt has no 'args'" in error, error
    top, it = _copy(good, "foreign_key")  # a tensor of a model megazero has no place for (a BERT pooler)
    meta = pickle.loads((it / ".metadata").read_bytes())
    key = "decoder.final_layernorm.weight"
    meta.state_dict_metadata["pooler.dense.weight"] = meta.state_dict_metadata[key]
    (it / ".metadata").write_bytes(pickle.dumps(meta))
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "cannot map 'pooler.dense.weight'" in error, error


def test_arguments_that_disagree_with_the_shapes(good, tmp_path):
    top, it = _copy(good, "wrong_args")

    def edit(common):
        common.pop("megazero")  # as Megatron-LM wrote it: the model from args
        args = vars(common["args"])
        args["ffn_hidden_size"] = args["ffn_hidden_size"] * 2
        common["args"] = argparse.Namespace(**args)

    _damage_common(it, edit)
    rc, error, written = _convert(top, tmp_path)
    assert rc == 1 and not written and "linear_fc1" in error and "global shape" in error, error


def test_pretrain_gpt_refuses_before_writing(good, tmp_path):
    runs, prefix = good
    top, it = _copy(good, "missing_for_load")
    os.remove(it / ".metadata")
    save = tmp_path / "save"
    run = in_pool(1, flags(prefix, *MODEL, layers=2, iters=2) + ["--load", str(top), "--save", str(save)],
                  cwd=tmp_path)
    assert run.returncode == 1, run.output[-2000:]
    last = [line for line in run.output.splitlines() if line.strip()][-1]
    assert ".metadata does not exist" in last and "interrupted" in last, run.output[-2000:]
    assert not os.path.exists(save) or not os.listdir(save)
