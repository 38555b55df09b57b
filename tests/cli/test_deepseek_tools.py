"""A Hugging Face DeepSeek-V3 through megazero's tools by their command lines: tools/convert_from_hf.py (streamed
one layer at a time), tools/generate.py on its output (transformers' greedy tokens, with the model's tokenizer
at tp 1 and 2 and, without one, token ids as text), tools/convert_to_hf.py (the original tensors bit for bit, DeepSeek's
multi-token prediction layer among them); an HF config megazero cannot represent is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.model.interop.hf import import_from_hf  # noqa: E402
from tests.cli.test_hf_round_trip import (NEW, PROMPT_IDS, VOCAB, assert_same_greedy, generated_ids,  # noqa: E402
                                          hf_greedy, save_tokenizer, word)
from tests.launch import in_pool  # noqa: E402
from tests.model.test_hf_deepseek import add_mtp_layer, random_hf  # noqa: E402


def same_tensors(a: str, b: str) -> None:
    before, after = load_file(a), load_file(b)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_deepseek_converts_generates_and_exports_back(q_lora_rank, tmp_path, capsys):
    hf = random_hf(tmp_path / "hf", q_lora_rank=q_lora_rank)
    save_tokenizer(str(tmp_path / "hf"))
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    saved = json.load(open(mz / "config.json"))
    assert saved["multi_latent_attention"] and saved["q_lora_rank"] == q_lora_rank and saved["mtp_num_layers"] == 0

    prompt = " ".join(map(word, PROMPT_IDS))
    ours = generated_ids(capsys, ["--load", str(mz), "--prompt", prompt])
    assert_same_greedy(ours, hf_greedy(hf, PROMPT_IDS, NEW))
    if q_lora_rank is not None:  # each of 2 ranks reads its heads' shard of the full weights
        at_tp2 = in_pool(2, ["--load", mz, "--tp", "2", "--prompt", prompt, "--temperature", "0", "--max-new-tokens",
                             NEW], script="tools/generate.py")
        assert at_tp2.returncode == 0, at_tp2.stderr[-3000:]
        assert at_tp2.stdout.split() == list(map(word, ours))

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    same_tensors(str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "back" / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))(prompt)["input_ids"] == PROMPT_IDS
    assert hf_greedy(again, PROMPT_IDS, NEW) == hf_greedy(hf, PROMPT_IDS, NEW)


def test_without_a_tokenizer_generate_reads_and_writes_ids(tmp_path, capsys):
    hf = random_hf(tmp_path / "hf")
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz")]) == 0
    assert not (tmp_path / "mz" / "tokenizer").exists()
    capsys.readouterr()
    assert generate.main(["--load", str(tmp_path / "mz"), "--prompt", " ".join(map(str, PROMPT_IDS)),
                          "--temperature", "0", "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr()
    ours, expected = [int(w) for w in out.out.split()], hf_greedy(hf, PROMPT_IDS, NEW)
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == VOCAB - 1), (ours, expected)
    assert "token ids" in out.err


@pytest.mark.parametrize("rope_interleave", [True, False], ids=["interleaved", "rotate_half"])
def test_multi_token_prediction_layers_stream_both_ways(rope_interleave, tmp_path, capsys):
    hf = random_hf(tmp_path / "hf", rope_interleave=rope_interleave)
    add_mtp_layer(tmp_path / "hf", hf)
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    streamed = load_file(str(mz / "model_full.safetensors"))
    _, whole = import_from_hf(str(tmp_path / "hf"))  # the same conversion, all tensors at once
    assert streamed.keys() == whole.keys() and any(k.startswith("mtp.layers.0.transformer_layer.") for k in whole)
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)
    capsys.readouterr()  # the prediction modules are a training-time output: generation is the model's own
    assert generate.main(["--load", str(mz), "--prompt", " ".join(map(str, PROMPT_IDS)), "--temperature", "0",
                          "--max-new-tokens", str(NEW)]) == 0
    ours, expected = [int(w) for w in capsys.readouterr().out.split()], hf_greedy(hf, PROMPT_IDS, NEW)
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == VOCAB - 1), (ours, expected)
    if rope_interleave:  # (a rotate-half checkpoint exports interleaved)
        assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
        same_tensors(str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "back" / "model.safetensors"))
        # fine-tuning it: the flags of multi-latent attention and prediction apply to the checkpoint's
        from megazero.config.arguments import ConfigError, parse_args
        from tests.cli.test_hf_round_trip import TUNE

        start = TUNE + ["--pretrained-checkpoint", str(mz), "--tokenizer-type", "NullTokenizer", "--vocab-size", "89"]
        m = parse_args(start + ["--mtp-loss-scaling-factor", "0.3", "--kv-lora-rank", "16"], 1).model
        assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.kv_lora_rank) == (1, 0.3, 16)
        with pytest.raises(ConfigError, match="--kv-lora-rank 32 disagrees with the checkpoint's --kv-lora-rank 16"):
            parse_args(start + ["--kv-lora-rank", "32"], 1)


def test_a_config_megazero_cannot_represent_is_refused_in_one_line(tmp_path, capsys):
    random_hf(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.load(open(path))
    json.dump({**config, "norm_topk_prob": False}, open(path, "w"))
    capsys.readouterr()
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "norm_topk_prob=False with num_experts_per_tok=2" in errors[0], errors
    assert not os.path.exists(tmp_path / "mz" / "model_full.safetensors")


# The random DeepSeek-V3 of tests/model/test_hf_deepseek.py (hf_config), as a user types its shape for
# pretrain_gpt.py: every flag agrees with the imported checkpoint.
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
         "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rotary-scaling-factor", "4",
         "--mscale", "1.0", "--mscale-all-dim", "0.8", "--yarn-original-max-position-embeddings", "32",
         "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]",
         "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
         "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1",
         "--moe-router-enable-expert-bias"]


@pytest.fixture(scope="module")
def moonlight_eps(tmp_path_factory):
    """A random DeepSeek-V3 whose rms_norm_eps is 1e-5 (as Moonlight's; its latent norms keep 1e-6), with a
    tokenizer, converted."""
    d = tmp_path_factory.mktemp("dsv3_eps")
    hf = random_hf(d / "hf", rms_norm_eps=1e-5)
    save_tokenizer(str(d / "hf"))
    assert convert_from_hf.main(["--input", str(d / "hf"), "--output", str(d / "mz")]) == 0
    return hf, d / "mz"


@pytest.mark.parametrize("shape", [[], SHAPE], ids=["no_shape_flags", "shape_flags"])
def test_a_fine_tune_keeps_the_latent_norms_epsilon_and_exports(moonlight_eps, shape):
    """Fine-tuning the import, with or without its shape flags: the latent norms keep the checkpoint's 1e-6 while
    the other norms take 1e-5 (--norm-epsilon sets those only), so the model still exports to DeepSeek-V3; the
    dropout and the routing's training settings are the checkpoint's."""
    from megazero.model.interop.hf import hf_architecture, hf_config_dict
    from megazero.config.arguments import parse_args
    from tests.cli.test_hf_round_trip import TUNE

    hf, mz = moonlight_eps
    cfg = parse_args(TUNE + ["--pretrained-checkpoint", str(mz)] + shape, 1)
    m = cfg.model
    assert (m.layernorm_epsilon, m.latent_norm_epsilon) == (hf.config.rms_norm_eps, 1e-6)
    assert (m.hidden_dropout, m.attention_dropout, m.moe_router_load_balancing_type) == (0.0, 0.0, "seq_aux_loss")
    assert hf_architecture(m) == "deepseek_v3" and hf_config_dict(m)["rms_norm_eps"] == 1e-5
    assert not any("cannot export" in n or "no load balancing" in n for n in cfg.notes), cfg.notes


@pytest.mark.parametrize("experts", [[], ["--num-experts", "8"]], ids=["from_checkpoint", "given"])
def test_expert_parallelism_applies_to_the_checkpoints_experts(moonlight_eps, experts):
    """--expert-model-parallel-size splits the checkpoint's 8 experts (no --num-experts needed), whose routers
    balance their loads with the expert bias: no 'no load balancing' note; an impossible split names the model's
    expert count."""
    from megazero.config.arguments import ConfigError, parse_args
    from tests.cli.test_hf_round_trip import TUNE

    _, mz = moonlight_eps
    start = TUNE + ["--pretrained-checkpoint", str(mz)] + experts
    cfg = parse_args(start + ["--expert-model-parallel-size", "2"], 2)
    assert (cfg.parallel.ep, cfg.model.num_experts, cfg.model.moe_router_enable_expert_bias) == (2, 8, True)
    assert not any("load balancing" in n for n in cfg.notes), cfg.notes
    with pytest.raises(ConfigError, match="the model's 8 experts .* not divisible by --expert-model-parallel-size 3"):
        parse_args(start + ["--expert-model-parallel-size", "3"], 3)
    with pytest.raises(ConfigError, match="--num-experts 4 disagrees with the checkpoint's --num-experts 8"):
        parse_args(TUNE + ["--pretrained-checkpoint", str(mz), "--num-experts", "4"], 1)


def test_a_model_that_cannot_export_to_its_family_is_said_at_start_up():
    """A DeepSeek-V3-shaped run from flags (multi-latent attention: DeepSeek-V3 is the family that has it) whose
    routing HF cannot express (top-k other than 2 x the group top-k) is warned of once, before it trains; the
    same run with an exportable routing is not."""
    import shlex

    from megazero.config.arguments import parse_args
    from tests.training.test_mla_mtp_flags import BASE

    def notes(*flags: str) -> list[str]:
        cfg = parse_args(shlex.split(BASE) + SHAPE + ["--norm-epsilon", "1e-6", *flags], 1, check_files=False)
        return [n for n in cfg.notes if "cannot export" in n]

    said = notes("--moe-router-topk", "1")
    assert len(said) == 1 and said[0].startswith("warning: tools/convert_to_hf.py cannot export this run's model to "
                                                 "DeepseekV3ForCausalLM"), said
    assert "moe_router_topk=1 with moe_router_group_topk=1" in said[0] and "2 x moe_router_group_topk" in said[0]
    assert notes() == []
    latent = [n for n in parse_args(shlex.split(BASE) + SHAPE, 1, check_files=False).notes if "cannot export" in n]
    assert len(latent) == 1 and "latent_layernorm_epsilon=1e-06" in latent[0], latent  # Megatron's: --norm-epsilon


def test_a_fine_tune_saved_as_torch_dist_exports_with_its_trained_expert_biases(moonlight_eps, tmp_path, capsys):
    """pretrain_gpt.py fine-tunes the import with its shape flags at pp 2 x ep 2 (the expert biases moving every
    step) and saves it as torch_dist; tools/convert_to_hf.py exports that save (the latent norms' 1e-6 kept, or
    it would refuse): the routers' biases become e_score_correction_bias, transformers' logits equal the
    checkpoint's model's (tools/generate.py's loader), and tools/generate.py reads the save to transformers'
    greedy tokens."""
    import types

    from megazero.cli.generate import load_tp_shard
    from megazero.checkpoint.reader import open_checkpoint
    from tests.cli.test_hf_round_trip import TUNE

    hf, mz = moonlight_eps
    ckpt = tmp_path / "ckpt"
    run = in_pool(4, TUNE + SHAPE + ["--pretrained-checkpoint", mz, "--pipeline-model-parallel-size", "2",
                                     "--expert-model-parallel-size", "2", "--save", ckpt, "--save-interval", "3",
                                     "--ckpt-format", "torch_dist"])
    assert run.returncode == 0, run.output[-3000:]
    assert "cannot export" not in run.output and "no load balancing" not in run.output
    assert convert_to_hf.main(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    imported = load_file(str(mz.parent / "hf" / "model.safetensors"))
    biases = [k for k in exported if k.endswith("e_score_correction_bias")]
    assert len(biases) == 1 and not torch.equal(exported[biases[0]], imported[biases[0]])  # trained
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert tuned.config.rms_norm_eps == 1e-5 and tuned.config.attention_dropout == 0.0

    config, reader, _ = open_checkpoint(str(ckpt))
    assert config.latent_norm_epsilon == 1e-6
    model = load_tp_shard(config, reader, types.SimpleNamespace(tp_rank=0, tp_size=1))  # one process, whole
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :config.vocab_size], tuned(ids).logits, rtol=1e-4, atol=1e-4)
    prompt = " ".join(map(word, PROMPT_IDS))
    assert_same_greedy(generated_ids(capsys, ["--load", str(ckpt), "--prompt", prompt]),
                       hf_greedy(tuned, PROMPT_IDS, NEW))
