"""Quantization-aware distillation with the Theseus schedule (JustQuant), and its ablations.

The student is the starting model with every decoder-block linear fake-quantized (models/quant.py:
plain low-bit operators, symmetric per-channel/group weights, dynamic per-token activations,
straight-through gradient) from step 0; the teacher is a frozen full-precision copy of the starting
model. What grows over training is the scope of the distillation, not the precision:

    theseus      stage s = 0, 1, ... trains segments of 2^s consecutive blocks (1, 2, 4, ... while
                 smaller than the model). Each student segment takes the teacher's hidden state at
                 its input and is matched to the teacher's hidden state at its output only (the
                 composed transformation is what must align, not each block inside it). The last
                 stage supervises the whole model at the token level: KL(teacher || student) over
                 the full vocabulary on the completion tokens (the chunked loss of the
                 self-distillation algorithms, so no (B, T, V) logits are built).
    theseus_qat  the Theseus stages as a warm-up, then QAT (cross-entropy on the worked solutions)
                 for the rest of the budget: the small-model regime.
    qad          whole-model KL from step 0 ("naive QAD").    qat: cross-entropy only.
    ptq          round-to-nearest, no training: `trainer.max_steps=0` evaluates and exports.

Choices the method description leaves open are ours, each a key (configs/algo/qad.yaml):
  `hidden_loss` (nmse: ||h_S - h_T||^2 / ||h_T||^2 per token, or mse), `segment_input` (teacher:
  the teacher's state enters each segment; student: the student's own state, detached so a segment
  trains only its own blocks), `stage_steps` (default an equal split of the Theseus budget),
  `hidden_tokens` (all real tokens or the completion only in the hidden stages), the final loss
  (forward KL at `kd_temperature` = 1), the data (`completions`: the worked solutions, or the
  teacher's greedy completions), the Theseus share of theseus_qat (`warmup_fraction`).
  The decoder blocks train; embeddings, final norm and output head stay the teacher's (full
  precision and frozen), so every trained parameter receives a gradient in every stage.

Every loss is a sum over its tokens divided by the trainer's global normaliser (exact under
gradient accumulation and data parallelism); the step counter is checkpointed, so a resumed run
continues the same stage. Logged: `qad/stage`, `qad/segment_blocks`, and every
`block_error_every` steps `qad/block_error/i` -- block i's output error (nmse) given the teacher's
input -- and `qad/path_error` (the student's own final-block state against the teacher's).

    python train.py +algo=qad algo.format=W4A4 algo.schedule=theseus trainer.max_steps=300
    python train.py +algo=qad algo.schedule=ptq trainer.max_steps=0      # RTN export only
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import (Batch, LossChunking, RolloutContext, StepOutput, TeacherBatching, TeacherTerms, Traits,
                             pad_right)
from algorithms.rollouts import completion_mask, encode_prompt, training_completions
from algorithms.scoring import detached_head, predicting, student_features
from models.anatomy import UnsupportedModel, capture_final_hidden, causal_lm, decoder_layers
from models.quant_export import export_problem

SCHEDULES = ("theseus", "theseus_qat", "qad", "qat", "ptq")
SEGMENT_INPUTS = ("teacher", "student")
HIDDEN_LOSSES = ("nmse", "mse")
HIDDEN_TOKENS = ("all", "completion")
COMPLETIONS = ("solutions", "teacher")
HIDDEN, KL, CE = "hidden", "kl", "ce"


@dataclass
class QADConfig(LossChunking, TeacherBatching):
    traits: ClassVar[Traits] = Traits(zero_steps=True, tiny_lr=3e-4, keeps_base=True)  # max_steps=0: evaluate and export the RTN student
    name: str = "qad"
    format: str = "W4A8"  # W4A4 | W4A8 | W8A8 | W4A16 | W8A16
    group_size: int = 0  # weight scale per group of input columns; 0 = per output channel
    keep: list[str] = field(default_factory=lambda: ["lm_head"])  # module patterns kept full precision
    schedule: str = "theseus"  # theseus | theseus_qat | qad | qat | ptq
    stage_steps: list[int] = field(default_factory=list)  # steps of each Theseus stage; [] = equal split
    warmup_fraction: float = 0.5  # theseus_qat with stage_steps []: share of the budget for the Theseus stages
    segment_input: str = "teacher"  # teacher | student: the hidden state entering each segment
    hidden_loss: str = "nmse"  # nmse | mse
    hidden_tokens: str = "all"  # all (every real token) | completion: tokens matched in hidden stages
    kd_temperature: float = 1.0  # the KL stage's temperature
    completions: str = "solutions"  # solutions (worked solutions) | teacher (its greedy completions)
    block_error_every: int = 10  # steps between per-block error measurements (0 = never)
    export_dequantized: bool = False  # also write final/dequantized/: plain HF weights q * scale

    def validate(self) -> None:
        from models.quant import QuantScheme

        for key, allowed in (("schedule", SCHEDULES), ("segment_input", SEGMENT_INPUTS),
                             ("hidden_loss", HIDDEN_LOSSES), ("hidden_tokens", HIDDEN_TOKENS),
                             ("completions", COMPLETIONS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"algo.{key}={getattr(self, key)} is not one of {', '.join(allowed)}")
        try:
            QuantScheme.parse(self.format, self.group_size)
        except ValueError as err:
            raise ValueError(f"algo.format / algo.group_size: {err}") from None
        if any(s < 0 for s in self.stage_steps):
            raise ValueError(f"algo.stage_steps={self.stage_steps} must be >= 0 each")
        if self.stage_steps and self.schedule not in ("theseus", "theseus_qat"):
            raise ValueError(f"algo.stage_steps is for schedule=theseus|theseus_qat, not {self.schedule}")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"algo.warmup_fraction={self.warmup_fraction} must be in [0, 1]")
        if self.kd_temperature <= 0:
            raise ValueError(f"algo.kd_temperature={self.kd_temperature} must be > 0")
        self.check_teacher_batching()
        self.check_loss_chunking()
        if self.block_error_every < 0:
            raise ValueError(f"algo.block_error_every={self.block_error_every} must be >= 0 (0 = never)")

    @property
    def scheme(self):
        from models.quant import QuantScheme

        return QuantScheme.parse(self.format, self.group_size)

    def check_run(self, max_steps: int, skeleton: Optional[Callable[[], nn.Module]]) -> None:
        """Checks that need the budget and the model's layout (a meta-device skeleton, None when it
        cannot be known before loading): the stage lengths, the group size against every target
        layer's width, and that each keep pattern names a module."""
        from models.quant import quant_targets

        if self.schedule == "ptq" and max_steps != 0:
            raise ValueError(f"algo.schedule=ptq trains nothing: set trainer.max_steps=0 (got {max_steps})")
        if skeleton is None:
            return
        model = skeleton()
        check_exportable(model)
        try:
            quant_targets(model, self.scheme, self.keep)
        except ValueError as err:
            raise ValueError(f"algo.{err}") from None
        plan_stages(self, len(decoder_layers(model, user="QAD")), max_steps)


# --- the schedule -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    kind: str  # hidden | kl | ce
    blocks: int  # blocks per segment (the model's layer count for kl / ce)
    steps: int


def theseus_sizes(num_layers: int) -> list[int]:
    """Segment sizes of the hidden stages: 1, 2, 4, ... while smaller than the model."""
    sizes, k = [], 1
    while k < num_layers:
        sizes.append(k)
        k *= 2
    return sizes


def equal_split(total: int, parts: int) -> list[int]:
    """`total` steps over `parts` stages, the remainder to the first ones: 10 over 3 -> [4, 3, 3]."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def plan_stages(cfg: QADConfig, num_layers: int, max_steps: int) -> list[Stage]:
    """The schedule as stages in order; ValueError naming the key when stage_steps do not fit."""
    if cfg.schedule in ("qad", "ptq"):
        return [Stage(KL, num_layers, max_steps)]
    if cfg.schedule == "qat":
        return [Stage(CE, num_layers, max_steps)]
    theseus = [(HIDDEN, k) for k in theseus_sizes(num_layers)] + [(KL, num_layers)]
    if cfg.stage_steps:
        if len(cfg.stage_steps) != len(theseus):
            raise ValueError(f"algo.stage_steps={cfg.stage_steps} has {len(cfg.stage_steps)} entries; a "
                             f"{num_layers}-block model has {len(theseus)} Theseus stages (segments of "
                             f"{[k for kind, k in theseus if kind == HIDDEN]} blocks, then the whole-model KL)")
        steps = list(cfg.stage_steps)
    else:
        budget = max_steps if cfg.schedule == "theseus" else round(cfg.warmup_fraction * max_steps)
        steps = equal_split(budget, len(theseus))
    used = sum(steps)
    if cfg.schedule == "theseus" and used != max_steps:
        raise ValueError(f"algo.stage_steps={cfg.stage_steps} sums to {used}, not trainer.max_steps={max_steps}")
    if cfg.schedule == "theseus_qat" and used > max_steps:
        raise ValueError(f"algo.stage_steps={cfg.stage_steps} sums to {used}, more than trainer.max_steps={max_steps}")
    stages = [Stage(kind, k, n) for (kind, k), n in zip(theseus, steps)]
    if cfg.schedule == "theseus_qat":
        stages.append(Stage(CE, num_layers, max_steps - used))
    return stages


def stage_at(stages: Sequence[Stage], step: int) -> tuple[int, Stage]:
    """(index, stage) that trains 0-based step `step`; past the plan, the last stage."""
    end = 0
    for i, stage in enumerate(stages):
        end += stage.steps
        if step < end:
            return i, stage
    return len(stages) - 1, stages[-1]


def boundaries(num_layers: int, blocks: int) -> list[int]:
    """Layer indices where segments of `blocks` start, plus the end: 4 layers, 2 -> [0, 2, 4]."""
    return list(range(0, num_layers, blocks)) + [num_layers]


# --- hidden states at block boundaries ----------------------------------------------------------------


def _set_hidden(args: tuple, kwargs: dict, value: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (value,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def segment_hooks(model: nn.Module, starts: Sequence[int], inputs: Optional[dict[int, torch.Tensor]]
                  ) -> Iterator[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]:
    """Within the block, a forward of `model` runs its decoder blocks in segments starting at the
    block indices `starts`: such a block takes `inputs[index]` as its input state, or with `inputs`
    None its own input detached (either way no gradient crosses a segment boundary). Yields
    (seen, outs): seen[i] is the state block i ran on, outs[i] its output. Hooks removed on exit."""
    layers = decoder_layers(model, user="QAD")
    seen: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    starts = set(starts)

    def pre(index: int):
        def hook(module, args, kwargs):
            if index in starts:
                value = inputs[index] if inputs is not None else _hidden_of(args, kwargs).detach()
                args, kwargs = _set_hidden(args, kwargs, value)
            seen[index] = _hidden_of(args, kwargs)
            return args, kwargs
        return hook

    def post(index: int):
        def hook(module, args, out):
            outs[index] = out[0] if isinstance(out, tuple) else out
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i)))
    try:
        yield seen, outs
    finally:
        for h in handles:
            h.remove()


def run_decoder(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One forward through any wrapper (so DDP prepares its gradient sync); the final normed states."""
    with capture_final_hidden(model) as final:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1)
    return final["hidden"]


def hidden_error(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token error (B, T) fp32 between (B, T, H) states: nmse or mse."""
    diff = (student.float() - teacher.float()).pow(2).sum(-1)
    if kind == "mse":
        return diff / student.shape[-1]
    return diff / teacher.float().pow(2).sum(-1).clamp(min=1e-12)


# --- the algorithm -------------------------------------------------------------------------------------



def check_exportable(model: nn.Module) -> None:
    """ValueError naming the architecture when the runtime's low-bit path could not serve the export."""
    problem = export_problem(model)
    if problem is not None:
        raise UnsupportedModel(f"algo=qad: {problem}")


class QAD:
    name = "qad"

    def __init__(self, cfg: QADConfig):
        self.cfg = cfg
        self.teacher: Optional[nn.Module] = None
        self.stages: list[Stage] = []
        self.steps_done = 0  # make_batch calls so far (checkpointed): the schedule position
        self.num_layers = 0

    # setup

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Teacher = a frozen full-precision copy; the model itself becomes the fake-quant student.
        The decoder blocks train; embeddings, final norm and head stay frozen at the teacher's."""
        from models.quant import apply_fake_quant

        check_exportable(model)
        self.teacher = copy.deepcopy(causal_lm(model)).requires_grad_(False).eval()
        apply_fake_quant(model, self.cfg.scheme, self.cfg.keep)
        model.requires_grad_(False)
        layers = decoder_layers(model, user="QAD")
        layers.requires_grad_(True)
        self.num_layers = len(layers)
        return model

    def plan(self, max_steps: int) -> list[Stage]:
        self.stages = plan_stages(self.cfg, self.num_layers, max_steps)
        return self.stages

    def current_stage(self) -> tuple[int, Stage]:
        if not self.stages:
            raise RuntimeError("QAD.plan(max_steps) must run before training (the trainer calls it)")
        return stage_at(self.stages, self.steps_done)

    # batches

    def completions(self, examples: Sequence[Any], prompts: list[list[int]], ctx: RolloutContext) -> list[list[int]]:
        def teacher_greedy(prompts, params):  # the full-precision teacher behind the serving door
            from inference import EngineConfig
            from inference.serving import ServeOptions, serve_model

            options = ServeOptions(engine=ctx.engine_config or EngineConfig())
            return serve_model(self._teacher(ctx.device), options).generate(prompts, params)

        return training_completions(self.cfg.completions, examples, prompts, ctx, teacher_greedy)

    def _teacher(self, device: torch.device) -> nn.Module:
        assert self.teacher is not None, "prepare_model builds the teacher"
        if next(self.teacher.parameters()).device != device:
            self.teacher.to(device)
        return self.teacher

    @torch.no_grad()
    def teacher_states(self, ids: torch.Tensor, attn: torch.Tensor, device: torch.device, boundaries: bool = True
                       ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(input state of every block and the last block's output (B, T, L + 1, H) -- None unless
        `boundaries` --, final normed states (B, T, H)) of the teacher, `teacher_batch_size` rows
        per forward."""
        teacher = self._teacher(device)
        states, finals = [], []
        for start in range(0, ids.shape[0], self.cfg.teacher_batch_size):
            rows = slice(start, start + self.cfg.teacher_batch_size)
            with segment_hooks(teacher, [], None) as (seen, outs):
                finals.append(run_decoder(teacher, ids[rows], attn[rows]))
            if boundaries:
                L = self.num_layers
                states.append(torch.stack([seen[i] for i in range(L)] + [outs[L - 1]], 2))
        return (torch.cat(states) if boundaries else None), torch.cat(finals)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        index, stage = self.current_stage()
        step = self.steps_done
        self.steps_done += 1
        tok = ctx.tokenizer
        prompts = [encode_prompt(tok, ctx.task.prompt(ex)) for ex in examples]
        targets = self.completions(examples, prompts, ctx)
        ids, attn = pad_right([p + c for p, c in zip(prompts, targets)], tok.pad_token_id, ctx.device)
        loss_mask = completion_mask(prompts, targets, ids)
        if stage.kind == HIDDEN and self.cfg.hidden_tokens == "all":
            loss_mask = attn.clone()
            loss_mask[:, 0] = 0
        metrics = {"qad/stage": torch.tensor(float(index)), "qad/segment_blocks": torch.tensor(float(stage.blocks))}
        batch = Batch(ids, attn, loss_mask, uids=[ex.uid for ex in examples], metrics=metrics, step_state=stage)
        if stage.kind == CE and not self._measure(step):
            return batch
        # block-boundary states only where used: a hidden stage, or a block-error measurement
        states, final = self.teacher_states(ids, attn, ctx.device, stage.kind == HIDDEN or self._measure(step))
        if self._measure(step):
            metrics.update(self.block_errors(ctx.policy, ids, attn, states))
        if stage.kind == HIDDEN:
            cut = boundaries(self.num_layers, stage.blocks)
            batch.teacher = TeacherTerms(predicting(final)[:, :, None], detached_head(self.teacher),
                                         boundaries=states[:, :, cut])
        elif stage.kind == KL:
            batch.teacher = TeacherTerms(predicting(final)[:, :, None], detached_head(self.teacher))
        return batch

    def _measure(self, step: int) -> bool:
        every = self.cfg.block_error_every
        return every > 0 and step % every == 0

    @torch.no_grad()
    def block_errors(self, student: nn.Module, ids: torch.Tensor, attn: torch.Tensor, states: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
        """Each block's output error given the teacher's input (nmse, mean over real tokens; one
        forward with every block fed the teacher's state), and the error of the student's own path
        at the last block's output."""
        L = self.num_layers
        real = attn.bool()
        was_training = student.training
        student.eval()
        try:
            with segment_hooks(student, range(L), {i: states[:, :, i] for i in range(L)}) as (_, outs):
                run_decoder(student, ids, attn)
            metrics = {f"qad/block_error/{i}": hidden_error(outs[i], states[:, :, i + 1], "nmse")[real].mean()
                       for i in range(L)}
            with segment_hooks(student, [], None) as (_, outs):
                run_decoder(student, ids, attn)
            metrics["qad/path_error"] = hidden_error(outs[L - 1], states[:, :, L], "nmse")[real].mean()
        finally:
            student.train(was_training)
        return metrics

    # loss

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        stage = micro.step_state  # the stage make_batch built this batch for
        assert isinstance(stage, Stage), "a QAD batch carries its stage (make_batch sets step_state)"
        sel = micro.loss_mask.bool()
        if stage.kind == HIDDEN:
            per_token = self.segment_error(model, micro, stage.blocks)  # (B, T)
            total = per_token[sel].sum()
            return StepOutput(total / normaliser, {"qad/hidden_error": total.detach() / sel.sum().clamp(min=1)})
        feats, head = student_features(model, micro.input_ids, micro.attention_mask)  # (B, T, H|V)
        targets = micro.input_ids[sel]
        if stage.kind == CE:
            logp = losses.chunked_token_logprobs(feats[sel], head, targets, chunk=self._chunk(micro))
            total = -logp.sum()
            return StepOutput(total / normaliser, {"qad/ce": total.detach() / sel.sum().clamp(min=1)})
        assert micro.teacher is not None, "make_batch fills the teacher terms of a KL stage"
        div, _ = losses.chunked_self_distill(feats[sel], head, micro.teacher.hidden[sel], micro.teacher.head,
                                             targets, beta=0.0, temperature=self.cfg.kd_temperature,
                                             chunk=self._chunk(micro))
        total = div.sum()
        return StepOutput(total / normaliser, {"qad/kl": total.detach() / sel.sum().clamp(min=1)})

    def _chunk(self, micro: Batch) -> int:
        vocab = causal_lm(self.teacher).config.vocab_size
        return self.cfg.loss_chunk_tokens or losses.auto_chunk(vocab, 1)

    def segment_error(self, model: nn.Module, micro: Batch, blocks: int) -> torch.Tensor:
        """(B, T) error of each token, averaged over the segments of `blocks` blocks."""
        assert micro.teacher is not None and micro.teacher.boundaries is not None
        cut = boundaries(self.num_layers, blocks)
        teacher = micro.teacher.boundaries  # (B, T, S + 1, H) at cut
        starts = cut[:-1]
        inputs = {c: teacher[:, :, j] for j, c in enumerate(starts)} if self.cfg.segment_input == "teacher" else None
        with segment_hooks(model, starts, inputs) as (_, outs):
            run_decoder(model, micro.input_ids, micro.attention_mask)
        errors = [hidden_error(outs[end - 1], teacher[:, :, j + 1], self.cfg.hidden_loss)
                  for j, end in enumerate(cut[1:])]
        return torch.stack(errors).mean(0)

    # artifacts and state

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        import os

        from models.quant_export import export_compressed, export_dequantized

        export_compressed(model, tokenizer, out_dir, self.name)
        if self.cfg.export_dequantized:
            export_dequantized(model, tokenizer, os.path.join(out_dir, "dequantized"), self.name)

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = int(state["steps_done"])
