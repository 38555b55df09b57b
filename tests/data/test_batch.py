"""build_batch: Megatron's reset_position_ids / reset_attention_mask / eod_mask_loss, checked
by hand, against a literal transcription of Megatron's loop, and through the model (packed
forward with the reset mask == each document run on its own)."""

import pytest
import torch

from megazero.data.batch import build_batch, masked_mean
from megazero.model import GPTModel
from tests.model.common import tiny_config

EOD = 0


def test_hand_computed():
    text = torch.tensor([[5, 1, 7, 8, EOD, 9, 3, EOD, 4]])
    b = build_batch(text, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert b.tokens.tolist() == [[5, 1, 7, 8, EOD, 9, 3, EOD]]
    assert b.labels.tolist() == [[1, 7, 8, EOD, 9, 3, EOD, 4]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert b.loss_mask.tolist() == [[1, 1, 1, 1, 0, 1, 1, 0]]
    allowed = (~b.attention_mask[0, 0]).int().tolist()
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0]  # the EOD belongs to the document it ends
    assert allowed[5] == [0, 0, 0, 0, 0, 1, 0, 0]  # a new document sees only itself
    assert allowed[7] == [0, 0, 0, 0, 0, 1, 1, 1]
    plain = build_batch(text, EOD)
    assert plain.position_ids.tolist() == [list(range(8))] and plain.attention_mask is None
    assert plain.loss_mask.sum() == 8


def _megatron_reference(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids, transcribed loop for loop."""
    b, s = data.size()
    att_b = b if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for i in range(b):
            eod_index = position_ids[i, data[i] == eod].clone()
            prev = 0
            for j in range(eod_index.size(0)):
                k = int(eod_index[j])
                if reset_attention_mask:
                    attention_mask[i, 0, (k + 1):, :(k + 1)] = 0
                if reset_position_ids:
                    position_ids[i, (k + 1):] -= (k + 1 - prev)
                    prev = k + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)])
def test_matches_megatron_loop(flags):
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 5, (4, 33), generator=g)  # EOD (0) ~1 in 5: runs, starts and ends included
    text[0, 0] = EOD
    text[1, -2] = EOD
    text[2, 3:6] = EOD
    b = build_batch(text, EOD, *flags)
    mask, loss_mask, pos = _megatron_reference(text[:, :-1], EOD, *flags)
    assert torch.equal(b.position_ids, pos)
    assert torch.equal(b.loss_mask, loss_mask)
    if flags[1]:
        assert torch.equal(b.attention_mask, mask)
    else:
        assert b.attention_mask is None and torch.equal(mask[0, 0], torch.ones(32, 32, dtype=torch.bool).triu(1))


def test_masked_mean_and_errors():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert float(masked_mean(loss, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))) == 2.0
    with pytest.raises(ValueError, match="end-of-document id"):
        build_batch(torch.zeros(1, 5, dtype=torch.long), None, eod_mask_loss=True)
    with pytest.raises(ValueError, match=r"seq_length \+ 1"):
        build_batch(torch.zeros(5, dtype=torch.long), EOD)


@pytest.mark.parametrize("arch, backend", [("gpt", "sdpa"), ("llama", "math"), ("llama", "auto")])
def test_packed_forward_equals_per_document_forward(arch, backend):
    config = tiny_config(arch, attention_backend=backend, seq_length=16, max_position_embeddings=16)
    torch.manual_seed(3)
    model = GPTModel(config).eval()
    text = torch.tensor([[7, 8, 9, EOD, 11, 12, EOD, EOD, 13, 14, 15, 16, 17, EOD, 18, 19, 20],
                         [21, 22, 23, 24, 25, 26, 27, EOD, 28, 29, 30, 31, 32, 33, 34, 35, 36]])
    b = build_batch(text, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    with torch.no_grad():
        packed = model(b.tokens, position_ids=b.position_ids, attention_mask=b.attention_mask)
        worst = 0.0
        for row in range(2):
            ends = [i + 1 for i, t in enumerate(b.tokens[row].tolist()) if t == EOD] + [16]
            start = 0
            for end in ends:
                if end == start:
                    continue
                alone = model(b.tokens[row:row + 1, start:end])  # the document on its own, positions from 0
                diff = (alone[0] - packed[row, start:end]).abs()
                worst = max(worst, float(diff[torch.isfinite(diff)].max()))
                start = end
        assert worst < 1e-5, worst
        # and the mask matters: without it the second document sees the first
        unmasked = model(b.tokens, position_ids=b.position_ids)
        assert not torch.allclose(unmasked[0, 4:6], packed[0, 4:6])
