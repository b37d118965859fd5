"""Supervised fine-tuning on worked solutions: loss on solution tokens only.

The prompt is the task's student prompt; on data=chat the row is the task's own tokens as written
(`row_tokens`: TRL's SFT ids and loss mask, tasks/chat.py). With `reference_fraction > 0` that share of rows instead
uses the privileged teacher prompt carrying the reference solution (full, or with a random share of
its steps masked), which teaches a model to read a reference -- the warm start of the embedded model
does this so the self-teacher of the distillation algorithms has something to offer.

    python train.py +algo=sft trainer.max_steps=200
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from algorithms import losses
from algorithms.base import Batch, RolloutContext, RowShape, StepOutput, Traits, pad_right
from models.prompts import continuation_ids, prompt_ids
from tasks import DataError, mask_spans, task_capabilities


@dataclass
class SFTConfig:
    traits: ClassVar[Traits] = Traits()
    name: str = "sft"
    reference_fraction: float = 0.0  # share of rows whose prompt carries the reference solution
    masked_fraction: float = 0.5  # of those, share whose reference has steps masked
    mask_ratio: float = 0.3  # share of steps masked in a masked reference
    seed: int = 0

    def validate(self) -> None:
        for key in ("reference_fraction", "masked_fraction", "mask_ratio"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"algo.{key}={getattr(self, key)} must be in [0, 1]")


class SFT:
    name = "sft"

    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model.requires_grad_(True)
        return model

    def row_shape(self) -> RowShape:
        """Prompt + the reference solution + EOS; the teacher prompt too with reference_fraction > 0."""
        return RowShape("reference", teacher_prompt=self.cfg.reference_fraction > 0)

    def check_task(self, task: Any) -> None:
        """A task that tokenizes its rows as written (data=chat): every training row tokenized now, so a bad
        row is one line before any work; the reference-reading prompt applies to question/solution data only."""
        rows = task_capabilities(task).row_tokens
        if rows is None:
            return
        if self.cfg.reference_fraction > 0:
            raise DataError(f"algo.reference_fraction={self.cfg.reference_fraction}: a teacher prompt needs "
                            f"question/solution data; data={task.name} rows train as written (set it to 0)")
        for ex in task.train_examples():
            rows(ex)

    def prompt_text(self, example: Any, task: Any) -> str:
        if self.rng.random() >= self.cfg.reference_fraction:
            return task.prompt(example)
        reference = example.solution
        if self.rng.random() < self.cfg.masked_fraction:
            spans = task.solution_spans(reference)
            flags = [self.rng.random() < self.cfg.mask_ratio for _ in spans]
            reference = mask_spans(spans, flags, task.mask_token)
        return task.teacher_prompt(example, reference)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        tok = ctx.tokenizer
        task_rows = task_capabilities(ctx.task).row_tokens
        if task_rows is not None:  # data=chat: the row's own ids and loss mask
            rows, masks = zip(*(task_rows(ex) for ex in examples))
            ids, attn = pad_right(rows, tok.pad_token_id, ctx.device)
            loss_mask, _ = pad_right(masks, 0, ctx.device)
            return Batch(ids, attn, loss_mask, uids=[ex.uid for ex in examples])
        rows, starts = [], []
        for ex in examples:
            prompt = prompt_ids(tok, self.prompt_text(ex, ctx.task))
            target = continuation_ids(tok, ex.solution) + [tok.eos_token_id]
            rows.append(prompt + target)
            starts.append(len(prompt))
        ids, attn = pad_right(rows, tok.pad_token_id, ctx.device)
        positions = torch.arange(ids.shape[1], device=ctx.device)
        loss_mask = (positions[None, :] >= torch.tensor(starts, device=ctx.device)[:, None]) & attn.bool()
        return Batch(ids, attn, loss_mask.long(), uids=[ex.uid for ex in examples])

    def loss(self, model: torch.nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits  # (B, T, V)
        logprobs = losses.token_logprobs(logits, micro.input_ids)  # (B, T)
        loss, metrics = losses.nll_loss(logprobs, micro.loss_mask, normaliser)
        return StepOutput(loss, {f"sft/{k}": v for k, v in metrics.items()})

    def export(self, model: torch.nn.Module, tokenizer: Any, out_dir: str) -> None:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
