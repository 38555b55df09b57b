"""pretrain_gpt.py with --context-parallel-size, compared with the one-process run of the same flags:
per-iteration loss and grad norm within 2e-5 (fp32), for each exchange, with dropout 0 and with hidden
and attention dropout keyed by position; the default command with Megatron's dropout; and the
refusals at parse time."""

from __future__ import annotations

import json
import math

import pytest

from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError
from tests.helpers import VOCAB
from tests.launch import in_pool
from tests.training.test_layout_invariance import (assert_resumes_elsewhere, assert_same_run, data, flags,  # noqa: F401
                                                   launch)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope"),
                  tmp_path_factory.mktemp("cp1"), "cp1")


@pytest.mark.parametrize("comm_type,world,extra", [
    ("p2p", 2, []),
    ("a2a", 2, []),
    ("allgather", 2, []),
    ("p2p", 4, ["--zero-stage", "3"]),  # dp 2 x cp 2: ZeRO partitions over data x context
    ("a2a", 4, ["--pipeline-model-parallel-size", "2"]),  # pp 2 x cp 2: the stages pass [s/cp, b, h]
    ("allgather", 4, ["--tp", "2", "--sequence-parallel"]),  # tp 2 (SP) x cp 2
    # interleaved 1F1B: pp 2 x 2 chunks per rank, 4 micro-batches
    ("p2p", 4, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),
])
def test_context_parallel_equals_one_process(data, one_process, tmp_path, comm_type, world, extra):  # noqa: F811
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope",
                 "--context-parallel-size", "2", "--cp-comm-type", comm_type, *extra)
    got = launch(world, args, tmp_path, f"cp2_{comm_type}")
    assert_same_run(got, one_process, what=f"cp 2 {comm_type} world {world}")


DROPOUT = ("--hidden-dropout", "0.1", "--dropout-rng", "position")


@pytest.fixture(scope="module")
def one_process_dropout(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *DROPOUT),
                  tmp_path_factory.mktemp("cp1_dropout"), "cp1_dropout")


@pytest.mark.parametrize("world,extra", [
    (2, ["--cp-comm-type", "p2p"]),
    (4, ["--cp-comm-type", "p2p", "--tp", "2", "--sequence-parallel"]),  # SP slices the CP rows again
    (4, ["--cp-comm-type", "a2a", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"]),
])
def test_hidden_dropout_keyed_by_position_equals_one_process(data, one_process, one_process_dropout, tmp_path,  # noqa: F811
                                                              world, extra):
    # The masks are a function of (sample, token index, feature, site): cp 2 (with SP, with pipeline
    # stages and another micro-batch size) applies the one-process run's masks, so its losses follow.
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *DROPOUT,
                 "--context-parallel-size", "2", *extra)
    got = launch(world, args, tmp_path, "cp2_dropout")
    assert_same_run(got, one_process_dropout, what=f"cp 2 with keyed dropout, world {world} {extra}")
    assert all(abs(one_process_dropout[it]["lm_loss"] - one_process[it]["lm_loss"]) > 1e-4 for it in one_process), \
        "dropout 0.1 left the losses unchanged: the masks are not applied"


@pytest.mark.parametrize("argv,message", [
    (["--seq-length", "18", "--max-position-embeddings", "18"], "not divisible by 2 x --context-parallel-size"),
    (["--cp-comm-type", "a2a", "--num-attention-heads", "6", "--hidden-size", "48", "--context-parallel-size", "4"],
     "a2a"),
    (["--cp-comm-type", "p2p", "a2a", "p2p"], "gives 3 exchanges for 2 layers"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "is for --cp-comm-type a2a+p2p"),
    (["--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel-sizes A P"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"], "A x P"),
    (["--cp-comm-type", "ring"], "choose p2p, a2a, allgather or a2a+p2p"),
])
def test_impossible_context_parallel_settings_are_refused_with_the_numbers(argv, message):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--context-parallel-size", "2"]
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_args(base + argv, world_size=4, check_files=False)
    assert message in str(e.value) or isinstance(e.value, SystemExit), str(e.value)


DOCUMENTS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


@pytest.fixture(scope="module")
def one_process_documents(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *DOCUMENTS),
                  tmp_path_factory.mktemp("cp1_documents"), "cp1_documents")


@pytest.mark.parametrize("comm_type,world,extra", [
    ("p2p", 2, []),  # each sample's documents cut the ring's blocks
    ("a2a", 2, []),
    ("allgather", 4, ["--pipeline-model-parallel-size", "2"]),
])
def test_packed_documents_equal_one_process(data, one_process, one_process_documents, tmp_path,  # noqa: F811
                                            comm_type, world, extra):
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *DOCUMENTS,
                 "--context-parallel-size", "2", "--cp-comm-type", comm_type, *extra)
    got = launch(world, args, tmp_path, f"cp2_documents_{comm_type}")
    assert_same_run(got, one_process_documents, what=f"cp 2 {comm_type} with packed documents, world {world}")
    assert any(abs(one_process_documents[it]["lm_loss"] - one_process[it]["lm_loss"]) > 1e-4 for it in one_process), \
        "the document flags changed nothing: the data has no end-of-document tokens"


@pytest.mark.parametrize("world,extra", [
    # all-to-all inside pairs of context ranks, the ring across the two pairs (cp 4)
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
         "2"]),
    # one exchange per layer (4 layers), Megatron's list form
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "allgather", "p2p"]),
])
def test_hierarchical_and_per_layer_exchanges_equal_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", "--seq-length", "16", *extra)
    got = launch(world, args, tmp_path, "cp_mixed")
    assert_same_run(got, one_process, what=f"world {world} {extra}")


def test_balanced_documents_with_keyed_dropout_equal_one_process(data, tmp_path):  # noqa: F811
    # Rings in every layer: each sample's documents are balanced over the ranks (a placement of its
    # own), and the dropout masks follow each token's index in the sequence, so cp 2 equals cp 1.
    model = ["--num-query-groups", "2", "--position-embedding-type", "rope", *DOCUMENTS, *DROPOUT]
    one = launch(1, flags(data, *model), tmp_path, "cp1_documents_dropout")
    got = launch(2, flags(data, *model, "--context-parallel-size", "2", "--cp-comm-type", "p2p"), tmp_path,
                 "cp2_documents_dropout")
    assert_same_run(got, one, what="cp 2 p2p, documents balanced per sample, keyed dropout")


def test_per_layer_exchanges_with_packed_documents(data, one_process_documents, tmp_path):  # noqa: F811
    # the ring layers take the documents as cut points, the all-to-all layers the mask, in one model
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *DOCUMENTS,
                 "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "a2a", "p2p", "allgather",
                 "--hierarchical-context-parallel-sizes", "2", "2")
    got = launch(4, args, tmp_path, "cp_mixed_documents")
    assert_same_run(got, one_process_documents, what="cp 4, per-layer exchanges, packed documents")


def test_world_not_divisible_by_tp_cp_pp_is_refused():
    with pytest.raises(ConfigError, match="context-parallel-size 2"):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
                    "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                    "--context-parallel-size", "2", "--tp", "2"], world_size=6, check_files=False)


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_at_another_tp_dp(data, one_process, tmp_path):  # noqa: F811
    # Saved every iteration by dp 2 x cp 2 with ZeRO-3 (partitions over data x context); resumed from
    # iteration 2 at cp 1 (one process) and at tp 2 x dp 2 ZeRO-1: iterations 3-4 equal the one-process run.
    model = ["--num-query-groups", "2", "--position-embedding-type", "rope"]
    assert_resumes_elsewhere(data, model, (4, ["--context-parallel-size", "2", "--zero-stage", "3"]),
                             [(1, []), (4, ["--tp", "2", "--zero-stage", "1"])], one_process, tmp_path, "cp2")


def test_deepspeed_ulysses_sequence_parallel_size_is_context_parallelism_by_all_to_all(tmp_path):
    import json

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                              "zero_optimization": {"stage": 1}}))
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--deepspeed", "--deepspeed_config", str(ds)]
    p = parse_args(argv, world_size=4, check_files=False).parallel
    assert (p.cp, p.cp_comm_type, p.dp) == (2, "a2a", 2)
    with pytest.raises(ConfigError, match="sequence_parallel_size"):  # disagreeing with the command line
        parse_args(argv + ["--context-parallel-size", "4"], world_size=4, check_files=False)


ALL_DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--dropout-rng", "position")


@pytest.fixture(scope="module")
def one_process_all_dropout(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *ALL_DROPOUT),
                  tmp_path_factory.mktemp("cp1_all_dropout"), "cp1_all_dropout")


@pytest.mark.parametrize("world,extra", [
    (2, ["--cp-comm-type", "p2p"]),
    (2, ["--cp-comm-type", "a2a"]),
    (4, ["--cp-comm-type", "p2p", "--pipeline-model-parallel-size", "2"]),  # pp 2 x cp 2
    (4, ["--cp-comm-type", "allgather", "--tp", "2"]),  # tp 2 x cp 2: each rank keys its own global heads
])
def test_attention_dropout_keyed_by_position_equals_one_process(data, one_process_dropout, one_process_all_dropout,  # noqa: F811
                                                                 tmp_path, world, extra):
    # Attention masks are a function of (sample, global head, query index, key index, layer): every
    # exchange applies the one-process run's masks, beside the hidden-dropout masks.
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope", *ALL_DROPOUT,
                 "--context-parallel-size", "2", *extra)
    got = launch(world, args, tmp_path, "cp2_all_dropout")
    assert_same_run(got, one_process_all_dropout, what=f"cp 2 with keyed attention dropout, world {world} {extra}")
    assert all(abs(one_process_all_dropout[it]["grad_norm"] - one_process_dropout[it]["grad_norm"]) > 1e-4
               for it in one_process_dropout), "attention dropout 0.1 left the gradients unchanged"


DOCUMENTS_ALL_DROPOUT = ["--num-query-groups", "2", "--position-embedding-type", "rope", *DOCUMENTS, *ALL_DROPOUT]


@pytest.fixture(scope="module")
def one_process_documents_all_dropout(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *DOCUMENTS_ALL_DROPOUT), tmp_path_factory.mktemp("cp1_documents_all_dropout"),
                  "cp1_documents_all_dropout")


@pytest.mark.parametrize("world,extra", [
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),  # each sample's documents balanced over the ranks
    # the mask in the all-to-all and all-gather layers, the documents' cut points in the rings
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "a2a", "p2p", "allgather",
         "--hierarchical-context-parallel-sizes", "2", "2"]),
])
def test_packed_documents_with_keyed_attention_dropout_equal_one_process(  # noqa: F811
        data, one_process_documents_all_dropout, tmp_path, world, extra):
    one = one_process_documents_all_dropout
    got = launch(world, flags(data, *DOCUMENTS_ALL_DROPOUT, *extra), tmp_path, "cp_documents_all_dropout")
    assert_same_run(got, one, what=f"packed documents with keyed attention dropout, world {world} {extra}")


NOTE = "dropout under --context-parallel-size 2"
MEGATRON_DEFAULTS = ["--context-parallel-size", "2", "--model-preset", "gpt-tiny", "--mock-data", "--lr", "1e-3",
         "--micro-batch-size", "2", "--train-iters", "20"]


def _losses(run, metrics, says: str) -> list[float]:
    assert run.output.count(NOTE) == 1 and says in run.output, run.output[-2000:]
    losses = [r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "lm_loss" in r]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    return losses


@pytest.mark.parametrize("extra,says", [
    ([], "each rank draws its own masks"),  # Megatron's: the ring's kernels draw them
    (["--dropout-rng", "position", "--cp-comm-type", "a2a"], "masks keyed by position (--dropout-rng position)"),
])
def test_the_default_dropout_trains_under_context_parallelism_with_one_note(data, tmp_path, extra, says):  # noqa: F811
    # A first CP launch with Megatron's default dropout runs (its mock tokens are uniform: nothing to learn); the same
    # flags on the learnable corpus learn.
    if not extra:
        metrics = tmp_path / "defaults.jsonl"
        run = in_pool(2, [*MEGATRON_DEFAULTS, "--log-interval", "1", "--metrics-file", str(metrics)], cwd=tmp_path)
        _losses(run.check("Megatron's default dropout at cp 2"), metrics, says)
    metrics = tmp_path / "corpus.jsonl"
    corpus = [a for a in MEGATRON_DEFAULTS if a != "--mock-data"] + ["--data-path", data, "--tokenizer-type", "NullTokenizer",
                                                         "--vocab-size", str(VOCAB), "--split", "98,2,0"]
    run = in_pool(2, [*corpus, *extra, "--log-interval", "1", "--metrics-file", str(metrics)], cwd=tmp_path)
    losses = _losses(run.check("cp 2 with the default dropout on the corpus"), metrics, says)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
