"""Shared set-up for the OPSD / MASS / TESD tests: a tiny model, the arith task, a rollout context."""
from __future__ import annotations

import torch

from algorithms.base import RolloutContext
from models.loading import TinySpec, build_tiny
from tasks import build_task

SPEC = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def tiny():
    return build_tiny(SPEC, seed=0)


def arith(steps: int = 2):
    return build_task("arith", seed=0, n_train=32, n_test=4, digits=2, steps=steps)


def ctx(model, tok, task, seed: int = 0, max_new_tokens: int = 24, draw_examples=None):
    return RolloutContext(task, tok, torch.Generator().manual_seed(seed), torch.device("cpu"), max_new_tokens,
                          policy_fn=lambda: model, draw_examples=draw_examples)


def grads(model, algo, batch, micro_size):
    model.zero_grad()
    normaliser = batch.num_targets().float()
    for micro in batch.micro_batches(micro_size):
        algo.loss(model, micro, normaliser).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def two_steps_change_every_trainable_parameter(algo, model, tok, task, lr=1e-2):
    model = algo.prepare_model(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=lr)
    examples = task.train_examples()
    for step in range(2):
        batch = algo.make_batch(examples[step * 4: step * 4 + 4], ctx(model, tok, task, seed=step))
        normaliser = batch.num_targets().float()
        for micro in batch.micro_batches(4):
            algo.loss(model, micro, normaliser).loss.backward()
        opt.step()
        opt.zero_grad()
    return [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])], model
