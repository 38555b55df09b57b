"""--reset-position-ids / --reset-attention-mask / --eod-mask-loss in the trainer, and out-of-vocabulary
data at tp > 1: checked against documents run one by one, and as one agreed error."""

import numpy as np
import pytest
import torch

from megazero.training.loop import Callback
from tests.distributed import run_distributed
from tests.helpers import write_documents as _write

VOCAB = 50  # NullTokenizer: ids < 50, EOD = 50


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Documents of 2-7 tokens + EOD, so every 16-token sample packs several of them."""
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(0, VOCAB, rng.integers(2, 8)), VOCAB) for _ in range(300)]
    return _write(str(tmp_path_factory.mktemp("docs") / "short_text_document"), docs)


def argv(prefix, *extra, tp=2, stage=1, iters=1):
    return ["--tp", str(tp), "--zero-stage", str(stage), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3", "--data-path", prefix,
            "--split", "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", *extra]


def _per_document_loss(engine, text: torch.Tensor, eod: int) -> torch.Tensor:
    """Each document of each sample run on its own (positions from 0, nothing else to attend to); the
    loss averaged over the tokens whose input is not EOD. What the three flags together must give."""
    losses = []
    for row in text:
        tokens, labels = row[:-1], row[1:]
        start = 0
        ends = [i for i in range(len(tokens)) if tokens[i] == eod] + [len(tokens) - 1]
        for end in ends:
            if end < start:
                continue
            seg = slice(start, end + 1)
            per_token = engine(tokens[seg][None], labels=labels[seg][None])[0]
            keep = tokens[seg] != eod
            losses.append(per_token[keep])
            start = end + 1
    return torch.cat(losses).mean()


class Reference(Callback):
    """Before the first step: the losses its first micro-batch must give with and without the flags."""

    def __init__(self):
        self.run, self.seen = None, {}

    def on_train_start(self, state, run):
        self.run = run

    def on_step_start(self, state, batches):
        engine, seen = self.run.engine, self.seen
        if not seen:
            text = batches[0]["text"].long()
            engine.eval()
            with torch.no_grad():
                seen["reference"] = float(_per_document_loss(engine, text, VOCAB))
                seen["plain"] = float(engine(text[:, :-1], labels=text[:, 1:]).mean())
                seen["eods"] = int((text[:, :-1] == VOCAB).sum())
            engine.train()


def _run_with_reference(prefix, flags):
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    reference = Reference()
    result = pretrain(parse_args(argv(prefix, *flags), 2), callbacks=[reference])
    return result.losses[1], reference.seen


def test_eod_flags_match_documents_run_one_by_one(short_docs):
    flags = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
    results = run_distributed(2, _run_with_reference, short_docs, flags)
    for loss, seen in results:  # tp 2: both ranks hold the same loss
        assert seen["eods"] >= 8  # several documents per sample: the flags have something to do
        assert abs(loss - seen["reference"]) < 2e-6, (loss, seen)
        assert abs(loss - seen["plain"]) > 1e-2  # without the flags the loss is another number
    assert results[0][0] == results[1][0]


def test_without_flags_the_loss_is_the_plain_mean(short_docs):
    (loss, seen), _ = run_distributed(2, _run_with_reference, short_docs, ())
    assert abs(loss - seen["plain"]) < 2e-6


def _train_expect_abort(prefix):
    from megazero.config import parse_args
    from megazero.utils.phase_agreement import RunAborted
    from megazero.training.trainer import pretrain

    try:
        pretrain(parse_args(argv(prefix, "--global-batch-size", "8", tp=2, iters=3), 4))
    except RunAborted as e:
        return e.user, e.message
    return None


def test_token_outside_the_vocabulary_names_dataset_and_document_at_tp2(tmp_path):
    rng = np.random.default_rng(2)
    docs = [np.append(rng.integers(0, VOCAB, 12), VOCAB) for _ in range(60)]
    docs[7][3] = VOCAB + 9  # the id 59 exists in no tokenizer of 50 tokens + EOD
    prefix = _write(str(tmp_path / "bad_text_document"), docs)
    results = run_distributed(4, _train_expect_abort, prefix, timeout_s=120)
    for r in results:  # every rank stops with the reading rank's message, as a user error
        assert r is not None, "trained on a token outside the vocabulary"
        user, message = r
        assert user and f"dataset {prefix}" in message and "document 7 holds token id 59" in message
        assert "outside the tokenizer's vocabulary [0, 51)" in message
