"""The runtime on the real model: greedy output equals HF generate, log-probs equal a plain forward."""
from __future__ import annotations

import pytest
import torch

from models.prompts import prompt_ids, render

pytestmark = [pytest.mark.real, pytest.mark.slow]

QUESTIONS = ["What is the capital of France?", "Write one short sentence about the sea.",
             "tom has 12 apples. he gets 7 more. how many apples does he have now?"]
NEW = 24


def chat_prompts(tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, render(tokenizer, q, chat=True)) for q in QUESTIONS]


def test_engine_greedy_equals_hf_generate_alone_and_in_a_padded_batch(smollm2):
    from inference import Engine, SamplingParams

    model, tok = smollm2
    prompts = chat_prompts(tok)
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: the batch is padded
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    batched = Engine(model).generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        if tok.eos_token_id in ref:
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert out.tokens == ref
    assert "Paris" in tok.decode(batched[0].tokens)


def test_engine_logprobs_equal_a_plain_forward(smollm2):
    from inference import Engine, SamplingParams

    model, tok = smollm2
    prompts = chat_prompts(tok)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    worst = 0.0
    for prompt, out in zip(prompts, Engine(model).generate(prompts, params)):
        ids = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.tokens)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(out.logprobs)).abs().max().item())
    assert worst < 1e-4, worst
