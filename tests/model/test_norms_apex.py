"""apex's fused norms are chosen once per process, and only when their CUDA extension imports.

apex is faked: ``apex.normalization.fused_layer_norm`` with the two functions, and the
extension ``fused_layer_norm_cuda`` either present (a fake module) or missing (a finder
that counts the import attempts and finds nothing).
"""

import importlib.abc
import sys
import types

import pytest
import torch

from megazero.model import norms


def _fake_apex(monkeypatch):
    def fused_layer_norm_affine(x, w, b, shape, eps):
        raise AssertionError("the fake fused kernel must not run on CPU tensors")

    def fused_rms_norm_affine(x, w, shape, eps):
        raise AssertionError("the fake fused kernel must not run on CPU tensors")

    mods = {name: types.ModuleType(name) for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm")}
    mods["apex"].normalization = mods["apex.normalization"]
    mods["apex.normalization"].fused_layer_norm = mods["apex.normalization.fused_layer_norm"]
    mods["apex.normalization.fused_layer_norm"].fused_layer_norm_affine = fused_layer_norm_affine
    mods["apex.normalization.fused_layer_norm"].fused_rms_norm_affine = fused_rms_norm_affine
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    norms._apex_fns.cache_clear()  # a fresh process's decision
    return fused_layer_norm_affine, fused_rms_norm_affine


@pytest.fixture(autouse=True)
def _forget_the_decision():
    """The decision made with fake modules is not left for the tests that follow."""
    yield
    norms._apex_fns.cache_clear()


class _CountingFinder(importlib.abc.MetaPathFinder):
    """Counts attempts to import ``fused_layer_norm_cuda`` and finds nothing (extension not built)."""

    def __init__(self):
        self.attempts = 0

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "fused_layer_norm_cuda":
            self.attempts += 1
        return None


def _norms():
    kw = dict(sequence_parallel=False, tp_group=None, params_dtype=torch.float32)
    return [norms.LayerNorm(8, **kw), norms.RMSNorm(8, **kw), norms.LayerNorm(8, **kw)]


def test_apex_without_its_cuda_extension_uses_torch_and_imports_once(monkeypatch):
    _fake_apex(monkeypatch)
    monkeypatch.delitem(sys.modules, "fused_layer_norm_cuda", raising=False)
    finder = _CountingFinder()
    monkeypatch.setattr(sys, "meta_path", [finder] + sys.meta_path)
    built = _norms()
    assert all(n._fused is None for n in built)
    assert finder.attempts == 1  # decided once, not per module or per forward
    x = torch.randn(3, 8)
    for n in built:
        n.reset_parameters()
        n(x)
    assert finder.attempts == 1


def test_apex_with_its_extension_is_chosen(monkeypatch):
    ln, rms = _fake_apex(monkeypatch)
    monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", types.ModuleType("fused_layer_norm_cuda"))
    layer, rms_norm, _ = _norms()
    assert (layer._fused, rms_norm._fused) == (ln, rms)
    layer.reset_parameters()
    rms_norm.reset_parameters()
    x = torch.randn(3, 8)  # CPU inputs still take torch's kernels (the fakes would raise)
    torch.testing.assert_close(layer(x), torch.nn.functional.layer_norm(x, (8,), layer.weight, layer.bias, layer.eps))
    torch.testing.assert_close(rms_norm(x), torch.nn.functional.rms_norm(x, (8,), rms_norm.weight, rms_norm.eps))


@pytest.mark.parametrize("absent", ["apex", "apex.normalization.fused_layer_norm"])
def test_no_apex_uses_torch(monkeypatch, absent):
    _fake_apex(monkeypatch)
    monkeypatch.setitem(sys.modules, absent, None)
    assert all(n._fused is None for n in _norms())
