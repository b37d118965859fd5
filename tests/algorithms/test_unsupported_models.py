"""Attuner, skipper and QAD refuse, before any work, models they could train but whose export the
runtime could not serve (or that they cannot train at all): a one-line config error naming the
architecture at config validation, and `UnsupportedModel` at setup for a model handed in memory.
The cells come from benchmarks/support_matrix.py, where each of these failed late before."""
from __future__ import annotations

import pytest
import torch
import transformers as hf

from models.anatomy import UnsupportedModel
from models.tokenizer import build_char_tokenizer

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
MODELS = {
    "mistral": (hf.MistralForCausalLM, lambda: hf.MistralConfig(sliding_window=8, **SMALL)),
    "phi3": (hf.Phi3ForCausalLM, lambda: hf.Phi3Config(**SMALL)),
    "mixtral": (hf.MixtralForCausalLM, lambda: hf.MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **SMALL)),
    "olmo2": (hf.Olmo2ForCausalLM, lambda: hf.Olmo2Config(**SMALL)),
    "gpt-neox": (hf.GPTNeoXForCausalLM, lambda: hf.GPTNeoXConfig(
        **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"})),
    "llama": (hf.LlamaForCausalLM, lambda: hf.LlamaConfig(**SMALL)),
}
CASES = [  # (algo, extra overrides, architecture, what the one line says)
    ("attuner", ["data=artifacts"], "mistral", "algo=attuner cannot train query adapters for MistralForCausalLM: the "
                                               "position-independent cache runs on the lean decoder"),
    ("attuner", ["data=artifacts"], "phi3", "algo=attuner cannot train query adapters for Phi3ForCausalLM"),
    ("skipper", [], "olmo2", "algo=skipper cannot route this model: Olmo2ForCausalLM's decoder layer 0 "
                             "(Olmo2DecoderLayer) has no input_layernorm"),
    ("skipper", [], "gpt-neox", "algo=skipper cannot route this model: GPTNeoXForCausalLM has no rms_norm_eps"),
    ("qad", [], "mixtral", "algo=qad: MixtralForCausalLM is a mixture-of-experts model"),
    ("qad", [], "gpt-neox", "algo=qad: GPTNeoXForCausalLM: its checkpoint names the output head embed_out"),
]


def _dir(tmp_path, arch):
    model_cls, make = MODELS[arch]
    path = tmp_path / arch
    make().save_pretrained(path)  # config validation reads the layout from config.json alone
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("algo, extra, arch, message", CASES)
def test_refused_at_config_with_one_line(tmp_path, algo, extra, arch, message):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config([f"+algo={algo}", "model=hf", f"model.path={_dir(tmp_path, arch)}", *extra], config_schemas())
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("algo, extra, arch, message", [c for c in CASES if c[2] in ("mistral", "olmo2", "mixtral")])
def test_refused_at_setup_before_any_eval(tmp_path, monkeypatch, algo, extra, arch, message):
    """A model handed in memory (no layout known at config time) is refused by prepare_model in build_session."""
    import trainer.loop as loop
    from tests.conftest import tiny_config
    from trainer.distributed import World
    from trainer.setup import build_session

    model_cls, make = MODELS[arch]
    torch.manual_seed(0)
    model = model_cls(make())
    monkeypatch.setattr(loop, "run_eval", lambda s: pytest.fail("an eval ran before the refusal"))
    cfg = tiny_config(tmp_path / "run", *extra, algo=algo)
    with pytest.raises(UnsupportedModel, match=message.split(":")[0]):
        build_session(cfg, World(), model=model, tokenizer=build_char_tokenizer())


@pytest.mark.parametrize("algo, extra", [("attuner", ["data=artifacts"]), ("skipper", []), ("qad", [])])
def test_a_supported_architecture_passes(tmp_path, algo, extra):
    from algorithms import config_schemas
    from trainer.config import load_config

    cfg = load_config([f"+algo={algo}", "model=hf", f"model.path={_dir(tmp_path, 'llama')}", *extra], config_schemas())
    assert cfg.algo.name == algo
