"""On-policy self-distillation (OPSD): the model, shown the question, learns from itself shown the
question plus a verified reference solution.

Paper: "Self-Distilled Reasoner: On-Policy Self-Distillation for LLMs" (reference code
siyan-zhao/OPSD, built on TRL's GOLD/GKD trainers). The base of MASS (algorithms/mass.py) and TESD
(algorithms/tesd.py); the pieces the three share are in algorithms/selfdistill.py.

Per step: the student samples one completion per question through the inference engine (on-policy,
temperature 1.1, top-p 0.95); the identical completion tokens are scored under the teacher prompt
(question + reference + transition line, the task's `teacher_prompt`) with no grad; the loss per
completion token is the generalized JSD(beta) over the vocabulary between the student and the
teacher, logits divided by the sampling temperature, summed over the vocabulary and averaged over
the global count of completion tokens. Options: per-token hard clip, teacher top-k, sampled-token form.

Teacher weights (`teacher`): `current` (same weights, stop-grad), `fixed` (the weights at the first
step; with LoRA the adapters disabled), `ema` (an exponential moving average, decay 0.999, kept
outside the optimizer). `teacher_path=DIR` names a separate teacher model instead (the student's
tokenizer; algorithms/teacher.py `ModelTeacher`), shown the same privileged prompt. LoRA: `lora_rank > 0`.

Memory: the teacher pass keeps only final hidden states (B, T, K, H); teacher and student logits
are built a chunk of tokens at a time from them and the output head (losses.chunked_self_distill),
so [B, T, V] logits are never materialised (a 151k vocabulary and 2k-token completions fit).

    python train.py +algo=opsd trainer.max_steps=50
    torchrun --nproc_per_node=2 train.py +algo=opsd algo.teacher=ema algo.lora_rank=16
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, RolloutContext, StepOutput, TeacherTerms
from algorithms.rollouts import encode_prompt, require_references, rollout_batch, rollout_metrics, sample
from algorithms.scoring import detached_head, teacher_hidden
from algorithms.teacher import TeacherModelOptions
from algorithms.selfdistill import (SelfDistillConfig, chunk_size, diagnoses_paths, distill_loss, path_metrics,
                                    reference_teacher_tops, self_teacher, skip_leading_tokens,
                                    truncate_after_rejection)
from models.export import export_model
from models.lora import train_all_or_lora


@dataclass
class OPSDConfig(SelfDistillConfig, TeacherModelOptions):
    name: str = "opsd"
    # > 0: each row's loss stops after its first token the teacher gives a probability below this (at the
    # training temperature): the tokens after the student's first error, where the teacher knows little more
    # than the student (docs/self_distill.md), leave the loss
    truncate_below: float = 0.0

    def validate(self) -> None:
        super().validate()
        self.check_teacher_model()
        if not 0.0 <= self.truncate_below < 1.0:
            raise ValueError(f"algo.truncate_below={self.truncate_below} must be in [0, 1)")


class OPSD:
    name = "opsd"

    def __init__(self, cfg: OPSDConfig):
        self.cfg = cfg
        self.teacher = self_teacher(cfg)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def weight_copies(self, model: nn.Module) -> float:
        """The frozen (`fixed`) or `ema` teacher's copy, made at the first step, or `teacher_path`'s model
        (trainer/memory.py)."""
        return self.teacher.copies(model)

    def place_frozen(self, place: Callable[[nn.Module], nn.Module]) -> None:
        self.teacher.place_frozen(place)  # teacher_path's model: sharded like the student under FSDP / ZeRO-3

    def check_task(self, task: Any) -> None:
        require_references(task.train_examples(), self.name)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        tok, task = ctx.tokenizer, ctx.task
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        completions = sample(ctx, prompts, self.cfg.temperature, self.cfg.top_p)
        batch = rollout_batch(prompts, completions, tok.pad_token_id, ctx.device, [ex.uid for ex in examples])
        shown = self.teacher.view_task(task)  # algo.teacher_chat_template: whose template renders its prompt
        views = [[encode_prompt(tok, shown.teacher_prompt(ex, ex.solution))] for ex in examples]
        with self.teacher.weights(ctx.policy) as teacher:
            hidden = teacher_hidden(teacher, views, [c.tokens for c in completions], [len(p) for p in prompts],
                                    batch.input_ids.shape[1], self.cfg.teacher_batch_size, ctx.device, batch.uids)
            batch.teacher = TeacherTerms(hidden, detached_head(teacher))
        batch.metrics, _ = rollout_metrics(task, tok, examples, completions, "rollout")
        if diagnoses_paths(self.cfg, task):
            batch.metrics.update(path_metrics(task, tok, examples, [c.tokens for c in completions], batch,
                                              reference_teacher_tops(batch, self.cfg)))
        if self.cfg.truncate_below > 0:
            sel = batch.loss_mask.bool()
            head = batch.teacher.head
            logp = losses.chunked_token_logprobs(batch.teacher.hidden[sel][:, 0], head, batch.input_ids[sel],
                                                 self.cfg.temperature, chunk_size(self.cfg, head, batch))
            batch.metrics["opsd/truncated"] = truncate_after_rejection(batch, logp, self.cfg.truncate_below)
        skip_leading_tokens(batch, self.cfg.skip_first_tokens)
        return batch

    def after_eval(self, result: dict, model: nn.Module) -> tuple[dict, list[str]]:
        """The teacher's drift and refresh gate at each eval (algorithms/teacher.py)."""
        return self.teacher.after_eval(result, model)

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        return distill_loss(model, micro, normaliser, self.cfg, prefix=self.name)

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)

    def state_dict(self) -> dict:
        return {"teacher": self.teacher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state["teacher"])

