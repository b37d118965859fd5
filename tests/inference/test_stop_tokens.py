"""Generation stops on every stop id (models.prompts.stop_ids): the tokenizer's EOS, the model's
generation_config.eos_token_id and the chat template's end of turn, in rollouts, evals and serving.

The model here is built to emit the end-of-turn token at every step (a constant direction in the residual
stream, read by one row of an untied output head), so a run that stops only on the tokenizer's EOS runs to
max_new_tokens while one that knows the end of turn stops at once."""
from __future__ import annotations

import torch

from models.loading import random_qwen3
from models.prompts import end_of_turn_id, stop_ids
from models.tokenizer import build_char_tokenizer

EOT = "<|im_end|>"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>\n{% endif %}")
NEW = 8


def eot_tokenizer(template: str | None = TEMPLATE):
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [EOT]})
    if template:
        tok.chat_template = template
    return tok


def eot_model(tok, eos=None):
    """A Qwen3 whose greedy (and, nearly surely, sampled) next token is always the end of turn."""
    model = random_qwen3(len(tok), seed=0, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    eot = tok.convert_tokens_to_ids(EOT)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # every token's dimension 0: +10
        for layer in model.model.layers:  # the layers add nothing: the stream is the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0  # the final state is (x0 / rms, 0, ...), x0 = 10 > 0
        model.lm_head.weight.zero_()
        model.lm_head.weight[eot, 0] = 5.0  # logit of the end of turn > 0 = every other logit
    model.generation_config.eos_token_id = tok.eos_token_id if eos is None else eos
    return model.eval()


def ctx(model, tok, task, max_new_tokens):
    from algorithms.base import RolloutContext

    return RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), max_new_tokens,
                          policy_fn=lambda: model)


def prompt(tok):
    from models.prompts import prompt_ids, render

    return prompt_ids(tok, render(tok, "hi", chat=bool(tok.chat_template)))


def test_stop_ids_gather_eos_generation_config_and_the_templates_end_of_turn():
    tok = eot_tokenizer()
    eot = tok.convert_tokens_to_ids(EOT)
    assert end_of_turn_id(tok) == eot
    assert stop_ids(tok) == (tok.eos_token_id, eot)
    assert stop_ids(tok, [7, tok.eos_token_id]) == (tok.eos_token_id, 7, eot)
    plain = eot_tokenizer(template=None)
    assert end_of_turn_id(plain) is None and stop_ids(plain, 5) == (plain.eos_token_id, 5)
    char = build_char_tokenizer()
    char.chat_template = TEMPLATE.replace("<|im_end|>", "")  # a turn ending in plain text: no end-of-turn id
    assert end_of_turn_id(char) is None


def test_rollouts_stop_at_the_end_of_turn():
    from algorithms.rollouts import sample

    tok = eot_tokenizer()
    model = eot_model(tok)
    outs = sample(ctx(model, tok, task=None, max_new_tokens=NEW), [prompt(tok)] * 3, 1.0, 1.0)
    eot = tok.convert_tokens_to_ids(EOT)
    assert all(o.tokens == [eot] and o.finish_reason == "stop" for o in outs)


def test_rollouts_stop_on_the_generation_configs_eos_list():
    from algorithms.rollouts import sample

    tok = eot_tokenizer(template=None)
    eot = tok.convert_tokens_to_ids(EOT)
    [stopped] = sample(ctx(eot_model(tok, eos=[tok.eos_token_id, eot]), tok, None, max_new_tokens=NEW),
                       [prompt(tok)], 1.0, 1.0)
    [ran_on] = sample(ctx(eot_model(tok), tok, None, max_new_tokens=NEW), [prompt(tok)], 1.0, 1.0)
    assert stopped.tokens == [eot] and stopped.finish_reason == "stop"
    assert ran_on.tokens == [eot] * NEW and ran_on.finish_reason == "length"  # the tokenizer's EOS alone: no stop


def test_eval_stops_at_the_end_of_turn():
    from inference.serving import ServeOptions, serve_model
    from tasks import Example
    from trainer.distributed import World
    from trainer.evaluation import evaluate

    tok = eot_tokenizer()
    model = eot_model(tok)
    seen = []
    server = serve_model(model, ServeOptions(), tok)
    generate = server.generate
    server.generate = lambda prompts, params, *a, **k: seen.extend(generate(prompts, params, *a, **k)) or seen[-len(
        prompts):]

    class Task:
        name = "t"

        def prompt(self, ex):
            from models.prompts import render
            return render(tok, ex.question, chat=True)

        def verify(self, ex, text):
            from tasks import VerifyResult
            return VerifyResult(text == "", None)

    result = evaluate(model, tok, Task(), [Example("hi", "", "", "e1")], World(), NEW, engine=server)
    assert [c.finish_reason for c in seen] == ["stop"] and result["accuracy"] == 1.0 and "capped" not in result


def test_serving_an_export_stops_at_the_end_of_turn(tmp_path):
    from inference.serving import load_served

    tok = eot_tokenizer()
    model = eot_model(tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    server = load_served(tmp_path)
    eot = tok.convert_tokens_to_ids(EOT)
    assert eot in server.stop_ids
    [out] = server.generate([prompt(tok)], server.params(max_new_tokens=NEW, temperature=0.0))
    assert out.tokens == [eot] and out.finish_reason == "stop"
