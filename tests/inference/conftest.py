"""Tiny random decoders (built from config with a fixed seed) for the inference tests."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

SEED = 0
VOCAB = 62
# Larger than HF's 0.02 default so greedy output of a random model is not one repeated token.
INIT_RANGE = 0.2
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=INIT_RANGE,
)
ARCHS = {
    "qwen3": (Qwen3ForCausalLM, lambda **kw: Qwen3Config(head_dim=16, tie_word_embeddings=True, **kw)),
    "llama": (LlamaForCausalLM, lambda **kw: LlamaConfig(tie_word_embeddings=False, **kw)),
    "qwen2": (Qwen2ForCausalLM, lambda **kw: Qwen2Config(tie_word_embeddings=False, **kw)),
}


def build(arch: str = "qwen3", **overrides) -> torch.nn.Module:
    model_cls, make_config = ARCHS[arch]
    torch.manual_seed(SEED)
    return model_cls(make_config(**{**COMMON, **overrides})).eval()


@pytest.fixture(scope="session")
def make_model():
    """Factory: make_model(arch="qwen3", **config_overrides) -> a fresh seeded model in eval mode."""
    return build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, make_model):
    """A saved tiny Qwen3 with the local char tokenizer: what an export of a full model holds."""
    from models.tokenizer import build_char_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    make_model("qwen3").save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def qwen3():
    return build("qwen3")


@pytest.fixture
def prompts() -> list[list[int]]:
    """Prompts of different lengths (so left padding is exercised)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 9, 4)]
