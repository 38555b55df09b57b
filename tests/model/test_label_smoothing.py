"""GPTModel's loss with label smoothing: padded vocabulary columns (-inf logits) stay out of it."""

import pytest
import torch
import torch.nn.functional as F

from megazero import mpu
from megazero.model import GPTModel
from tests.distributed import run_distributed
from tests.helpers import assert_close
from tests.model.common import batch, tiny_config


def _case(tp):
    mpu.initialize_model_parallel(tp)
    config = tiny_config("gpt", label_smoothing=0.1)  # vocab 70 padded to 96: rank 3 of tp 4 is all padding
    torch.manual_seed(5)
    model = GPTModel(config)
    ids, labels = batch(config)
    loss = model(ids, labels=labels)
    logits = mpu.gather_from_tensor_model_parallel_region(model(ids))  # [b, s, 96]
    ref = F.cross_entropy(logits[..., :config.vocab_size].reshape(-1, config.vocab_size).float(), labels.reshape(-1),
                          reduction="none", label_smoothing=0.1).view_as(labels)
    assert torch.isfinite(loss).all()
    return assert_close(loss, ref, "loss", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [1, 4])
def test_gpt_label_smoothing_matches_unpadded_cross_entropy(tp):
    run_distributed(4, _case, tp)


def test_label_smoothing_range_is_validated():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        tiny_config("gpt", label_smoothing=1.0).validate()
