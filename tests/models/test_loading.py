"""models/: the character tokenizer and the embedded tiny model, and loading from a local directory."""
from __future__ import annotations

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from models.loading import TinySpec, build_tiny, count_parameters, load_pretrained
from models.tokenizer import CHARSET, build_char_tokenizer


def test_char_tokenizer_round_trips_and_saves(tmp_path):
    tok = build_char_tokenizer()
    text = "tom has 345 apples.\n45+37: 5+7=12. #### 82"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == len(CHARSET) + 3 and tok.unk_token_id not in ids
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False).input_ids == ids and again.padding_side == "left"


def test_default_tiny_is_qwen3_in_the_1_to_10M_range_and_seeded():
    a, tok = build_tiny(TinySpec(), seed=3)
    b, _ = build_tiny(TinySpec(), seed=3)
    assert type(a).__name__ == "Qwen3ForCausalLM"
    assert 1_000_000 <= count_parameters(a) <= 10_000_000
    assert a.config.vocab_size == len(tok) and a.config.tie_word_embeddings
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_load_pretrained_from_local_dir_adds_missing_pad(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(build_char_tokenizer()), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    tok = build_char_tokenizer()
    model.save_pretrained(tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_pretrained(str(tmp_path))
    assert loaded_tok.pad_token_id == loaded_tok.eos_token_id
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
