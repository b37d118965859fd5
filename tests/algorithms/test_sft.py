"""SFT: hand-computed loss, loss only on solution tokens, every parameter trains, and gradient
accumulation invariance (batch 8 x accum 1 == batch 2 x accum 4)."""
from __future__ import annotations

import math

import torch

from algorithms import losses
from algorithms.base import RolloutContext
from algorithms.sft import SFT, SFTConfig
from models.loading import TinySpec, build_tiny
from tasks import build_task

SPEC = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def test_nll_loss_hand_computed():
    # logprobs [[0, -1, -3], [0, -2, -4]], mask [[0, 1, 1], [0, 1, 0]] -> masked sum -(1 + 3 + 2) = -6;
    # normaliser 3 -> loss 6 / 3 = 2.0; mean nll over the 3 tokens = 2.0
    logprobs = torch.tensor([[0.0, -1.0, -3.0], [0.0, -2.0, -4.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    loss, metrics = losses.nll_loss(logprobs, mask, torch.tensor(3.0))
    assert math.isclose(loss.item(), 2.0) and math.isclose(metrics["nll"].item(), 2.0)


def test_token_logprobs_hand_computed():
    # vocab 2, logits at t=0 are [0, ln 3] -> p(token 1) = 3/4; at T=2 logits/2 = [0, ln 3 / 2] -> p = sqrt3/(1+sqrt3)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    assert torch.allclose(losses.token_logprobs(logits, ids), torch.tensor([[0.0, math.log(0.75)]]))
    s3 = math.sqrt(3.0)
    expected = math.log(s3 / (1 + s3))
    assert math.isclose(losses.token_logprobs(logits, ids, temperature=2.0)[0, 1].item(), expected, rel_tol=1e-6)


def _ctx(tok, task):
    return RolloutContext(task, tok, torch.Generator(), torch.device("cpu"), max_new_tokens=8)


def test_loss_mask_covers_solution_and_eos_only():
    model, tok = build_tiny(SPEC, seed=0)
    task = build_task("arith", seed=0, n_train=16, n_test=4, digits=2, steps=1)
    ex = task.train_examples()[0]
    batch = SFT(SFTConfig()).make_batch([ex], _ctx(tok, task))
    ids = batch.input_ids[0][batch.loss_mask[0].bool()].tolist()
    assert tok.decode(ids[:-1]) == ex.solution and ids[-1] == tok.eos_token_id
    prompt_len = len(tok(task.prompt(ex), add_special_tokens=False).input_ids)
    assert batch.loss_mask[0, :prompt_len].sum() == 0


def test_reference_fraction_one_uses_teacher_prompt():
    model, tok = build_tiny(SPEC, seed=0)
    task = build_task("arith", seed=0, n_train=16, n_test=4, digits=2, steps=1)
    ex = task.train_examples()[0]
    algo = SFT(SFTConfig(reference_fraction=1.0, masked_fraction=0.0))
    batch = algo.make_batch([ex], _ctx(tok, task))
    text = tok.decode(batch.input_ids[0][batch.attention_mask[0].bool()].tolist())
    assert text.startswith(task.teacher_prompt(ex, ex.solution))


def _grads(model, batch, micro_size, algo):
    model.zero_grad()
    normaliser = batch.num_targets().float()
    for micro in batch.micro_batches(micro_size):
        algo.loss(model, micro, normaliser).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_grad_accumulation_invariance():
    model, tok = build_tiny(SPEC, seed=0)
    task = build_task("arith", seed=0, n_train=16, n_test=4, digits=2, steps=1)
    algo = SFT(SFTConfig())
    batch = algo.make_batch(task.train_examples()[:8], _ctx(tok, task))
    full = _grads(model, batch, 8, algo)
    accumulated = _grads(model, batch, 2, algo)
    for a, b in zip(full, accumulated):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_two_steps_change_every_parameter():
    model, tok = build_tiny(SPEC, seed=0)
    task = build_task("arith", seed=0, n_train=16, n_test=4, digits=2, steps=1)
    algo = SFT(SFTConfig())
    model = algo.prepare_model(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        batch = algo.make_batch(task.train_examples()[step * 4 : step * 4 + 4], _ctx(tok, task))
        algo.loss(model, batch, batch.num_targets().float()).loss.backward()
        opt.step()
        opt.zero_grad()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged
