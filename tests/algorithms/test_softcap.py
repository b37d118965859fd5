"""Soft-capped output heads (Gemma-2's final_logit_softcapping): the teacher head of OPSD / MASS /
TESD carries the cap, its log-probs equal the Hugging Face model's own, and each algorithm trains a
tiny random Gemma-2 through the step-0 eval and a step (it used to fail at step 1)."""
from __future__ import annotations

import pytest
import torch
import transformers as hf

from algorithms import losses
from algorithms.scoring import detached_head
from models.anatomy import final_hidden, output_head
from models.tokenizer import build_char_tokenizer
from tests.conftest import tiny_config

CAP = 2.0  # small, so the random model's logits (init range 0.5) are well inside tanh's bend


def gemma2(cap: float = CAP):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = hf.Gemma2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                             final_logit_softcapping=cap, sliding_window=16, max_position_embeddings=256,
                             initializer_range=0.5, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             bos_token_id=None, attn_implementation="eager")
    return hf.Gemma2ForCausalLM(config), tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_capped_head_log_probs_equal_the_models_own(temperature):
    model, tok = gemma2()
    rows = [tok("q: 12+7?\na: 19").input_ids, tok("q: 3+4?\na: 7").input_ids]
    ids = torch.full((2, max(map(len, rows))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # right-padded, as training batches are
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    head = detached_head(model)
    assert len(head) == 3 and head[2] == CAP and output_head(model) is None  # plain callers still fall back
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
        got = losses.head_logp(final_hidden(model, ids, mask), head, temperature)
        uncapped = losses.head_logp(final_hidden(model, ids, mask), head[:2], temperature)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert (uncapped[real] - want[real]).abs().max() > 0.1  # the cap matters on this model


@pytest.mark.parametrize("algo", ["opsd", "mass", "tesd"])
def test_self_distillation_trains_a_soft_capped_model(tmp_path, algo):
    from tasks import build_task
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    model, tok = gemma2()
    task = build_task("arith", seed=0, n_train=32, n_test=4, digits=2, steps=1)
    cfg = tiny_config(tmp_path / algo, "trainer.max_steps=1", "trainer.batch_size=2", "trainer.micro_batch_size=2",
                      "trainer.eval_examples=2", "trainer.eval_max_new_tokens=8", "trainer.max_new_tokens=8",
                      algo=algo)
    session = build_session(cfg, World(), model=model, tokenizer=tok, task=task)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert fit(session) == "done"
    session.tracker.close()
    assert [r["step"] for r in session.evals] == [0, 1]
    moved = [n for n, p in session.backend.full_model().named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved  # the step trained the model
