"""On-policy distillation from a separate teacher model (GKD: Agarwal et al., "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes"; TRL's `GKDTrainer`).

Per step, for each prompt: with probability `lmbda` the student samples a completion through the
inference engine (on-policy, `temperature`, `top_p`); otherwise the row's completion is the data's own
(the example's reference solution + EOS, as GKD's supervised share). The teacher (`teacher_path`, a
frozen model with the student's tokenizer, algorithms/teacher.py `ModelTeacher`) scores every
completion token in a no-grad forward, shown the student's prompt (`teacher_context=question`, plain
distillation) or the prompt with the reference (`reference`, privileged as OPSD). The loss per
completion token is the generalized JSD(beta) between the student's and the teacher's next-token
distributions (beta 0: forward KL(teacher || student), 1: reverse KL), over the full vocabulary a chunk
of tokens at a time or the teacher's top-k (`teacher_top_k`), logits divided by `temperature`, summed
over the vocabulary and divided by the global count of completion tokens -- the self-distillation loss
of OPSD (algorithms/selfdistill.py) with another model's weights as the teacher.

    python train.py +algo=distill algo.teacher_path=outputs/sft/final
    torchrun --nproc_per_node=2 train.py +algo=distill model=hf model.path=Qwen3-0.6B algo.teacher_path=Qwen3-8B
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, RolloutContext, StepOutput, TeacherTerms, Traits
from algorithms.rollouts import (encode, encode_prompt, greedy_completions, require_references, rollout_batch,
                                rollout_metrics, sample)
from algorithms.scoring import detached_head, teacher_hidden
from algorithms.selfdistill import SelfDistillConfig, chunk_size, distill_loss, self_teacher, skip_leading_tokens
from algorithms.teacher import TeacherModelOptions, lockstep_greedy
from inference.rollout import Completion
from models.export import export_model
from models.lora import train_all_or_lora
from tasks import task_capabilities

TEACHER_CONTEXTS = ("question", "reference")


@dataclass
class DistillConfig(SelfDistillConfig, TeacherModelOptions):
    # tiny_lr: the swept best at the default 100 steps (0.700 held out; 1e-3 dips to 0.285 at step 50 and is 0.525
    # at 100, though 0.850 at 200 vs 3e-4's 0.830): docs/results/distill.md
    traits: ClassVar[Traits] = Traits(tiny_lr=3e-4, lora=True)
    name: str = "distill"
    lmbda: float = 1.0  # share of rows that are on-policy (the student's sample); the rest take the data's completion
    teacher_context: str = "question"  # question (the student's prompt) | reference (+ the reference, as OPSD)

    def validate(self) -> None:
        super().validate()
        self.check_teacher_model()
        if self.teacher_path is None:
            raise ValueError("algo=distill needs algo.teacher_path=DIR (a model with the student's tokenizer)")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"algo.lmbda={self.lmbda} must be in [0, 1]")
        if self.teacher_context not in TEACHER_CONTEXTS:
            raise ValueError(f"algo.teacher_context={self.teacher_context} is not one of {', '.join(TEACHER_CONTEXTS)}")

    def teacher_reads_references(self) -> bool:
        """Rows need the data's reference: off-policy rows train on it, the privileged teacher reads it."""
        return self.lmbda < 1.0 or self.teacher_context == "reference"


class Distill:
    name = "distill"
    summary_metrics = {"distill/teacher_accuracy": "the teacher's held-out accuracy (greedy; the student's ceiling)"}
    extra_eval_every_rank = True  # a sharded teacher decodes only with every rank taking part

    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.teacher = self_teacher(cfg)  # the ModelTeacher of teacher_path
        self.rng = random.Random(cfg.seed)  # which rows are on-policy (checkpointed)
        self.teacher_accuracy: float | None = None  # measured once, at the first eval

    def extra_eval(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict[str, float]:
        """The teacher's greedy held-out accuracy on the student's prompts (the first trainer.extra_eval_examples
        held-out examples), measured at the first eval and logged beside the student's at every eval; empty
        when the task has no verifier. Called on every rank: a whole teacher decodes on the main rank alone
        (the others return nothing), a sharded one on every rank together over the same prompts."""
        if not examples or not task_capabilities(task).verifiable:
            return {}
        if self.teacher_accuracy is None:
            shown = self.teacher.view_task(task)  # the prompts it reads in training (algo.teacher_chat_template)
            with self.teacher.weights(model) as teacher:
                if self.teacher.sharded:
                    texts = lockstep_greedy(teacher, tokenizer, [shown.prompt(ex) for ex in examples], max_new_tokens)
                elif not _is_main():
                    return {}
                else:
                    texts = [tokenizer.decode(o.tokens, skip_special_tokens=True)
                             for o in greedy_completions(teacher, tokenizer, shown, examples, max_new_tokens)]
            right = [task.verify(ex, text).correct for ex, text in zip(examples, texts)]
            self.teacher_accuracy = sum(right) / len(right)
        return {"distill/teacher_accuracy": self.teacher_accuracy}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def weight_copies(self, model: nn.Module) -> float:
        return self.teacher.copies(model)

    def place_frozen(self, place: Callable[[nn.Module], nn.Module]) -> None:
        self.teacher.place_frozen(place)  # sharded like the student under FSDP / ZeRO-3

    def check_task(self, task: Any) -> None:
        if self.cfg.teacher_reads_references():
            require_references(task.train_examples(), self.name)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        c, tok, task = self.cfg, ctx.tokenizer, ctx.task
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        on_policy = [self.rng.random() < c.lmbda for _ in examples]
        sampled = iter(sample(ctx, [p for p, on in zip(prompts, on_policy) if on], c.temperature, c.top_p)
                       if any(on_policy) else [])
        completions = [next(sampled) if on else _reference(tok, ex) for ex, on in zip(examples, on_policy)]
        batch = rollout_batch(prompts, completions, tok.pad_token_id, ctx.device, [ex.uid for ex in examples])
        shown = self.teacher.view_task(task)  # algo.teacher_chat_template: whose template renders its prompt
        views = [[encode_prompt(tok, shown.teacher_prompt(ex, ex.solution) if c.teacher_context == "reference"
                                else shown.prompt(ex))] for ex in examples]
        with self.teacher.weights(ctx.policy) as teacher:
            hidden = teacher_hidden(teacher, views, [x.tokens for x in completions], [len(p) for p in prompts],
                                    batch.input_ids.shape[1], c.teacher_batch_size, ctx.device, batch.uids)
            batch.teacher = TeacherTerms(hidden, detached_head(teacher))
        if c.is_clip > 0 and not all(on_policy):  # the data's completions have no sampler log-probs: weight 1
            batch.rollout_logprobs = None
        batch.metrics, _ = rollout_metrics(task, tok, examples, completions, "rollout")
        batch.metrics["distill/on_policy"] = torch.tensor(sum(on_policy) / max(len(on_policy), 1))
        sel, head = batch.loss_mask.bool(), batch.teacher.head  # the teacher's log-prob of the rows' tokens
        logp = losses.chunked_token_logprobs(batch.teacher.hidden[sel][:, 0], head, batch.input_ids[sel],
                                             c.temperature, chunk_size(c, head, batch))
        batch.metrics["distill/teacher_logprob"] = logp.mean() if logp.numel() else torch.tensor(0.0)
        skip_leading_tokens(batch, c.skip_first_tokens)
        return batch

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        return distill_loss(model, micro, normaliser, self.cfg, prefix=self.name)

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)

    def state_dict(self) -> dict:
        return {"teacher": self.teacher.state_dict(), "rng": self.rng.getstate(),
                "teacher_accuracy": self.teacher_accuracy}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.rng.setstate(state["rng"])
        self.teacher_accuracy = state.get("teacher_accuracy")


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _reference(tok: Any, example: Any) -> Completion:
    """The data's own completion of an off-policy row: the reference solution + EOS (no sampler log-probs)."""
    tokens = encode(tok, example.solution) + [tok.eos_token_id]
    return Completion(tokens, [0.0] * len(tokens), "stop")
