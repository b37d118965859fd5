"""SEED trains only drafters the runtime can serve: architectures `python -m inference --speculative
seed` refuses (the lean decoder's own predicate) are refused at config validation and at setup,
before any eval, with one line naming the architecture and the reason; a supported one trains,
exports and is served, losslessly (speculative greedy == plain greedy)."""
from __future__ import annotations

import re

import pytest
import torch
import transformers as hf

from models.tokenizer import build_char_tokenizer
from tests.conftest import tiny_config

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
REFUSED = {  # name -> (model class, config, the runtime's reason the one-line error must carry)
    "mistral-sliding-window": (hf.MistralForCausalLM, lambda: hf.MistralConfig(sliding_window=8, **SMALL),
                               "architecture MistralForCausalLM is not one of"),
    "mixtral": (hf.MixtralForCausalLM, lambda: hf.MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **SMALL),
                "architecture MixtralForCausalLM is not one of"),
    "phi3": (hf.Phi3ForCausalLM, lambda: hf.Phi3Config(**SMALL), "architecture Phi3ForCausalLM is not one of"),
    "qwen2-moe": (hf.Qwen2MoeForCausalLM, lambda: hf.Qwen2MoeConfig(
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32, **SMALL),
        "architecture Qwen2MoeForCausalLM is not one of"),
    "llama-rope-scaled": (hf.LlamaForCausalLM, lambda: hf.LlamaConfig(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, **SMALL),
        "rope_type 'linear' (only default RoPE is implemented)"),
    "qwen2-sliding-window": (hf.Qwen2ForCausalLM, lambda: hf.Qwen2Config(
        use_sliding_window=True, sliding_window=8, max_window_layers=0, **SMALL),
        "sliding-window attention"),
}


def _message(model_cls, reason: str) -> str:
    return (f"algo=seed cannot train a drafter for {model_cls.__name__}: `python -m inference --speculative seed` "
            f"could not serve it ({reason}")


def _save(path, model_cls, config, weights: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(0)
        model_cls(config).save_pretrained(path)
    else:
        config.save_pretrained(path)  # config validation reads the layout from config.json alone
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", list(REFUSED))
def test_unservable_architectures_are_config_errors_naming_them(tmp_path, arch):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    model_cls, make, reason = REFUSED[arch]
    path = _save(tmp_path / arch, model_cls, make())
    with pytest.raises(ConfigError, match=re.escape(_message(model_cls, reason))) as err:
        load_config(["+algo=seed", "model=hf", f"model.path={path}", "algo.decoder_layers=1"], config_schemas())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["mixtral", "mistral-sliding-window"])
def test_setup_refuses_before_any_eval_when_the_layout_was_not_known_at_config_time(tmp_path, monkeypatch, arch):
    """A model handed in memory (or a hub id) is checked by prepare_model inside build_session, which
    runs before the loop's step-0 eval."""
    from tasks import build_task
    from trainer import loop
    from trainer.distributed import World
    from trainer.setup import build_session

    evals = []
    monkeypatch.setattr(loop, "run_eval", lambda s: evals.append(s))
    model_cls, make, reason = REFUSED[arch]
    cfg = tiny_config(tmp_path / "run", "algo.decoder_layers=1", algo="seed")
    task = build_task("arith", seed=0, n_train=16, n_test=4, digits=2, steps=1)
    with pytest.raises(ValueError, match=re.escape(_message(model_cls, reason))):
        build_session(cfg, World(), model=model_cls(make()), tokenizer=build_char_tokenizer(), task=task)
    assert evals == []


@pytest.mark.slow  # one SEED step, its evals, export and two CLI generations in-process: ~6 s
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_supported_architecture_trains_exports_and_serves(tmp_path, capsys, arch):
    from algorithms import config_schemas
    from inference.__main__ import main
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    make = {"llama": (hf.LlamaForCausalLM, hf.LlamaConfig), "qwen2": (hf.Qwen2ForCausalLM, hf.Qwen2Config)}[arch]
    config = make[1](**{**SMALL, "num_hidden_layers": 3, "initializer_range": 0.2})
    path = _save(tmp_path / arch, make[0], config, weights=True)
    cfg = load_config(["+algo=seed", "model=hf", f"model.path={path}", "algo.decoder_layers=1",
                       "trainer.max_steps=1", "trainer.batch_size=4", "trainer.micro_batch_size=4",
                       "trainer.eval_examples=4", "trainer.eval_max_new_tokens=12", "data.digits=2", "data.steps=1",
                       "data.n_train=32", "data.n_test=8", "logging.wandb=false", "logging.progress=false",
                       f"output_dir={tmp_path / 'run'}"], config_schemas())
    session = build_session(cfg, World())
    assert fit(session) == "done"
    final = export_final(session)
    session.tracker.close()
    capsys.readouterr()
    prompt = ["--prompt", "q: 12+7?\na: ", "--max-new-tokens", "16", "--device", "cpu"]
    assert main([final, *prompt]) == 0
    plain = capsys.readouterr().out
    assert main([final, *prompt, "--speculative", "seed"]) == 0
    served = capsys.readouterr()
    assert "[speculative seed] acceptance length" in served.err
    assert plain.strip() and served.out == plain  # greedy speculative decoding is lossless
