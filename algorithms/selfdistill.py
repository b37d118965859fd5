"""Self-distillation pieces shared by OPSD, MASS and TESD: their common keys, the teacher-vs-student
divergence loss over completion tokens, and its value checks.

The student sees the question; the teacher is the same model (or a frozen / EMA copy, `teacher`)
shown the question plus privileged context. Per completion token the loss is a divergence between
the two next-token distributions (`losses.chunked_self_distill`: generalized JSD(beta), or the
sampled-token form), built a chunk of tokens at a time from final hidden states and the output head,
weighted per token, summed and divided by the global token count.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, LossChunking, StepOutput, TeacherBatching, Traits
from algorithms.scoring import scatter_tokens, student_features
from algorithms.teacher import ModelTeacher, SelfTeacher, TeacherModelOptions
from models.anatomy import Head
from models.lora import LoRAOptions
from tasks import task_capabilities

TEACHER_MODES = ("fixed", "refresh", "ema", "current")
DIVERGENCES = ("full", "sampled")


@dataclass
class SelfDistillConfig(LoRAOptions, LossChunking, TeacherBatching):
    """The keys OPSD, MASS and TESD share (each config adds `name` and its own keys)."""

    # tiny_lr: the learning-rate sweep's best on the embedded default without its early dip (docs/self_distill.md,
    # section 4: 300 steps, OPSD 3e-4 0.755 / 1e-3 0.800 but 0.200 at step 50; MASS 3e-4 0.790 / 1e-3 0.760)
    traits: ClassVar[Traits] = Traits(needs_reference=True, tiny_lr=3e-4, lora=True)  # the teacher prompt carries the reference

    temperature: float = 1.1  # rollout sampling temperature; the divergence uses logits / temperature too
    top_p: float = 0.95
    teacher: str = "fixed"  # fixed (frozen step-0 weights) | refresh | ema | current
    ema_decay: float = 0.999
    teacher_refresh_margin: float = 0.02  # refresh: held-out accuracy gain since the last refresh that swaps the teacher
    teacher_warn_drop: float = 0.05  # warn when the teacher-prompt accuracy falls this far below its first eval
    beta: float = 0.5  # generalized JSD mixture: 0 forward KL(teacher||student), 1 reverse KL
    divergence: str = "full"  # full (JSD over the vocabulary) | sampled (sampled-token form)
    token_clip: float = 0.0  # > 0: per-token hard clip of the divergence (clipped tokens get no gradient)
    teacher_top_k: int = 0  # > 0: both distributions restricted to the teacher's top-k, renormalised
    top_k_tail: bool = False  # with teacher_top_k: keep each side's mass outside the top-k as one tail bucket
    skip_first_tokens: int = 0  # > 0: the first N completion tokens of each student row carry no loss
    is_clip: float = 0.0  # > 0: weight each token by min(pi_train / pi_sampler, is_clip) of its sampled token
    # log paths/* (on / off the reference's solution path) when the task has several valid paths
    # (`several_paths`, e.g. data=multipath; never on arith); MASS pays one extra teacher pass per row for it
    path_diagnostics: bool = True
    seed: int = 0

    def validate(self) -> None:
        check_self_distill_config(self)


def check_self_distill_config(cfg: Any) -> None:
    """Value checks shared by OPSD, MASS and TESD; raises ValueError naming the key."""
    if cfg.teacher not in TEACHER_MODES:
        raise ValueError(f"algo.teacher={cfg.teacher} is not one of {', '.join(TEACHER_MODES)}")
    if cfg.divergence not in DIVERGENCES:
        raise ValueError(f"algo.divergence={cfg.divergence} is not one of {', '.join(DIVERGENCES)}")
    if not 0.0 <= cfg.beta <= 1.0:
        raise ValueError(f"algo.beta={cfg.beta} must be in [0, 1]")
    if cfg.temperature <= 0:
        raise ValueError(f"algo.temperature={cfg.temperature} must be > 0 (on-policy rollouts sample)")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"algo.top_p={cfg.top_p} must be in (0, 1]")
    if cfg.teacher_refresh_margin < 0 or cfg.teacher_warn_drop < 0:
        raise ValueError("algo.teacher_refresh_margin and algo.teacher_warn_drop must be >= 0")
    if not 0.0 <= cfg.ema_decay < 1.0:
        raise ValueError(f"algo.ema_decay={cfg.ema_decay} must be in [0, 1)")
    cfg.check_teacher_batching()
    cfg.check_loss_chunking()
    if cfg.lora_rank < 0 or cfg.teacher_top_k < 0 or cfg.token_clip < 0:
        raise ValueError("algo.lora_rank, algo.teacher_top_k and algo.token_clip must be >= 0")
    if cfg.skip_first_tokens < 0:
        raise ValueError(f"algo.skip_first_tokens={cfg.skip_first_tokens} must be >= 0")
    if cfg.is_clip < 0 or 0 < cfg.is_clip < 1:
        raise ValueError(f"algo.is_clip={cfg.is_clip} must be 0 (off) or >= 1 (a cap on pi_train / pi_sampler)")
    if cfg.top_k_tail and cfg.teacher_top_k == 0:
        raise ValueError("algo.top_k_tail=true needs algo.teacher_top_k > 0 (the tail is the mass outside the top-k)")


def self_teacher(cfg: Any) -> SelfTeacher | ModelTeacher:
    """The teacher weights the config asks for: a separate model (`teacher_path` of TeacherModelOptions), else the
    policy's own (`teacher`, `ema_decay`, `teacher_refresh_margin`, `teacher_warn_drop`)."""
    if isinstance(cfg, TeacherModelOptions) and cfg.teacher_path is not None:
        return ModelTeacher(cfg.teacher_path, cfg.teacher_dtype or "float32", cfg.teacher_chat_template)
    return SelfTeacher(cfg.teacher, cfg.ema_decay, cfg.teacher_refresh_margin, cfg.teacher_warn_drop)


def distill_terms(feats: torch.Tensor, head: Optional[Head], micro: Batch, sel: torch.Tensor, cfg: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token (divergence, weight, student log-prob of the token) over the tokens `sel` (B, T), and
    the metrics of the importance weights (`is_clip`; empty when off).

    feats/head from `student_features`; the teacher from micro.teacher (hidden states and the head
    they were made with); weights are micro.token_weights (1 where unset), times the clipped
    importance ratio with `is_clip`.
    """
    assert micro.teacher is not None, "make_batch must fill batch.teacher"
    teacher = micro.teacher
    div, token_logp = losses.chunked_self_distill(
        feats[sel], head, teacher.hidden[sel], teacher.head, micro.input_ids[sel], beta=cfg.beta,
        temperature=cfg.temperature, top_k=cfg.teacher_top_k, top_k_tail=cfg.top_k_tail, form=cfg.divergence,
        aggregate=getattr(cfg, "aggregate", "mean"), chunk=chunk_size(cfg, teacher.head, micro),
        view_evidence=None if teacher.view_evidence is None else teacher.view_evidence[sel],
        confidence_temperature=getattr(cfg, "confidence_temperature", 0.0))  # (N,), (N,)
    if cfg.token_clip > 0:
        div = div.clamp(max=cfg.token_clip)
    weights = torch.ones_like(div) if micro.token_weights is None else micro.token_weights[sel].to(div.dtype)
    extra: dict[str, torch.Tensor] = {}
    if cfg.is_clip > 0:
        if micro.rollout_logprobs is None:
            raise ValueError("algo.is_clip > 0 needs the sampler's log-probs of the rollouts (batch.rollout_logprobs)")
        ratio, extra = losses.importance_weights(token_logp, micro.rollout_logprobs[sel], cfg.is_clip)
        weights = weights * ratio.to(weights.dtype)
    return div, weights, token_logp, extra


def skip_leading_tokens(batch: Batch, n: int, rows: Optional[torch.Tensor] = None) -> None:
    """Drop the first `n` completion tokens of each row (of `rows`, a (B,) bool; all rows when None)
    from the loss: out of `loss_mask`, so out of the divergence and of the token count that normalises
    it. The rollout and every teacher pass already used them (they are the prefix of what follows)."""
    if n <= 0:
        return
    mask = batch.loss_mask.bool()
    leading = mask & (mask.long().cumsum(1) <= n)
    if rows is not None:
        leading &= rows.to(mask.device).unsqueeze(1)
    batch.loss_mask = batch.loss_mask.masked_fill(leading, 0)
    if batch.token_weights is not None:
        batch.token_weights = batch.token_weights.masked_fill(leading, 0)


def truncate_after_rejection(batch: Batch, teacher_logp: torch.Tensor, floor: float) -> torch.Tensor:
    """Drop from the loss every completion token after the first one the teacher gives a probability
    below `floor` (the student's first error, as the teacher reads it): out of `loss_mask` (so out of the
    normaliser) and `token_weights`. The rejected token itself keeps its loss (the correction at the
    error). `teacher_logp` (N,): the teacher's log-prob of each sampled token over `batch.loss_mask`,
    row-major. Returns the share of completion tokens dropped.
    Example: teacher probs per row [0.9, 0.2, 0.9, 0.9], floor 0.5 -> the last two leave the loss."""
    sel = batch.loss_mask.bool()
    rejected = torch.zeros_like(sel)
    rejected[sel] = teacher_logp.to(sel.device) < math.log(floor)
    after = (rejected.long().cumsum(1) - rejected.long()) > 0  # strictly after the row's first rejection
    drop = sel & after
    batch.loss_mask = batch.loss_mask.masked_fill(drop, 0)
    if batch.token_weights is not None:
        batch.token_weights = batch.token_weights.masked_fill(drop, 0)
    return drop.sum().float() / sel.sum().clamp(min=1).float()


def chunk_size(cfg: Any, head: Head, batch: Batch) -> int:
    """`loss_chunk_tokens`, or with 0 a size from the vocabulary and the number of teacher views."""
    views = batch.teacher.hidden.shape[2] if batch.teacher is not None else 1
    return cfg.loss_chunk_tokens or losses.auto_chunk(head[0].shape[0], views)


def reference_teacher_tops(batch: Batch, cfg: Any) -> dict[str, torch.Tensor]:
    """{"full": top token per completion token} of the batch's one-view (full-reference) teacher, for
    `path_metrics` (OPSD, TESD)."""
    teacher = batch.teacher
    return {"full": losses.teacher_top_tokens(teacher.hidden[batch.loss_mask.bool()], teacher.head,
                                              temperature=cfg.temperature, chunk=chunk_size(cfg, teacher.head, batch))}


def distill_loss(model: nn.Module, micro: Batch, normaliser: torch.Tensor, cfg: Any, prefix: str = "opsd"
                 ) -> StepOutput:
    """sum_t w_t D(p_S || p_T)_t / normaliser over the completion tokens, and metrics."""
    feats, head = student_features(model, micro.input_ids, micro.attention_mask)  # (B, T, H|V)
    sel = micro.loss_mask.bool()  # (B, T)
    div, weights, token_logp, extra = distill_terms(feats, head, micro, sel, cfg)
    loss = losses.weighted_token_loss(div, weights, normaliser)
    n = max(int(div.numel()), 1)
    metrics = {f"{prefix}/divergence": div.detach().sum() / n, f"{prefix}/weight": weights.detach().sum() / n,
               **{f"{prefix}/{k}": v for k, v in extra.items()}}
    return StepOutput(loss, metrics, scatter_tokens(token_logp, sel))


# ---------------------------------------------------------------------------------------------
# Path diagnostics: does the teacher follow the student off the reference's path?


def diagnoses_paths(cfg: Any, task: Any) -> bool:
    """`path_diagnostics` on a task with several valid solution paths (`several_paths`, e.g. multipath)."""
    return bool(cfg.path_diagnostics and task_capabilities(task).several_paths)


def on_path_flags(task: Any, tokenizer: Any, tokens: Sequence[int], reference: str) -> list[bool]:
    """Per completion token: True when it lies on the reference's path.

    A task with several valid solution paths says which path a text takes (`task.solution_path`:
    e.g. the order of its operations). Each line of the completion is on the reference's path when
    the path written up to the end of that line is a prefix of the reference's path; a token belongs
    to the line it ends in (the newline closes its line). Once a line leaves the path, every later
    line is off it too (a longer path cannot return to a prefix).
    """
    want = list(task.solution_path(reference))
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in tokens]
    text = "".join(pieces)
    line_on, start = [], 0
    while start <= len(text):  # the last line may lack its newline
        end = text.find("\n", start)
        end = len(text) if end < 0 else end + 1
        path = list(task.solution_path(text[:end]))
        line_on.append(path == want[: len(path)])
        if end == len(text):
            break
        start = end
    flags, line = [], 0
    for piece in pieces:
        flags.append(line_on[min(line, len(line_on) - 1)])
        line += piece.count("\n")
    return flags


@torch.no_grad()
def path_metrics(task: Any, tokenizer: Any, examples: Sequence[Any], completions: Sequence[Sequence[int]],
                 batch: Batch, teacher_tops: dict[str, torch.Tensor], kept: Optional[torch.Tensor] = None
                 ) -> dict[str, torch.Tensor]:
    """Per-step diagnostics of the on / off reference-path split (empty when the task has no paths).

    paths/differs: share of rollouts whose path differs from the reference's; paths/on_tokens: share
    of completion tokens on the reference's path; for each teacher NAME, given its top token (N,) over
    the completion tokens `batch.loss_mask` selects (`losses.teacher_top_tokens`),
    paths/agree_NAME_on|off: how often it is the token the student sampled, on / off the path; with
    `kept` (N,) the gate's kept share on each side (paths/kept_on|off). A side with no tokens in this
    batch is left out (the trainer averages a metric over the ranks that report it).
    """
    if task_capabilities(task).solution_path is None:
        return {}
    flags, differs = [], []
    for ex, tokens in zip(examples, completions):
        row = on_path_flags(task, tokenizer, tokens, ex.solution)
        flags.extend(row)
        text = tokenizer.decode(list(tokens), skip_special_tokens=True)
        differs.append(list(task.solution_path(text)) != list(task.solution_path(ex.solution)))
    sel = batch.loss_mask.bool()
    on = torch.tensor(flags, dtype=torch.bool, device=sel.device)
    if on.numel() != int(sel.sum()):
        raise ValueError(f"path_metrics: {on.numel()} token flags for {int(sel.sum())} completion tokens")
    out = {"paths/differs": torch.tensor(sum(differs) / max(len(differs), 1)),
           "paths/on_tokens": on.float().mean() if on.numel() else torch.tensor(0.0)}
    sampled = batch.input_ids[sel]
    shares = {f"agree_{name}": (top == sampled).float() for name, top in teacher_tops.items()}
    if kept is not None:
        shares["kept"] = kept.float()
    for name, values in shares.items():
        for side, mask in (("on", on), ("off", ~on)):
            if mask.any():
                out[f"paths/{name}_{side}"] = values[mask].mean()
    return out
