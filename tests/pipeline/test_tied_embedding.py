"""The tied embedding's gradient hook does not keep its synchroniser (or its group) alive."""

import gc
import weakref

import torch

from megazero.pipeline.engine_step import TiedEmbeddingGradSync


def test_the_hook_stashes_gradients_and_is_collected_with_its_owner():
    param = torch.nn.Parameter(torch.ones(3))
    sync = TiedEmbeddingGradSync(param, None)
    (param * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    (param * 2).sum().backward()
    assert torch.equal(sync.stash, torch.tensor([3.0, 4.0, 5.0]))
    gone = weakref.ref(sync)
    del sync
    gc.collect()
    assert gone() is None  # param is alive; its hook must not hold the synchroniser
    (param * 2).sum().backward()  # a hook whose owner is gone does nothing
