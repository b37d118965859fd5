"""Per-token features of a model for the losses: final hidden states + output head (so [B, T, V]
logits are never built), the predicting-state shift, teacher passes under other prompts, and the
scatter of per-token values back to (B, T).

    feats, head = student_features(model, ids, mask)     # (B, T, H) + head, or (B, T, V) logits + None
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, pad_right
from models.anatomy import Head, causal_lm, detach_head, final_hidden, output_head


def student_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, Optional[Head]]:
    """(features predicting token t at [:, t], head): hidden states + head, or logits + None."""
    head = output_head(model)
    if head is not None:
        feats = final_hidden(model, input_ids, attention_mask)  # (B, T, H)
    else:
        feats = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return predicting(feats), head


def predicting(states: torch.Tensor) -> torch.Tensor:
    """Shift (B, T, D) states so [:, t] is the state that predicts token t (zeros at t = 0)."""
    return torch.nn.functional.pad(states[:, :-1], (0, 0, 1, 0))


@torch.no_grad()
def teacher_hidden(teacher: nn.Module, views: list[list[list[int]]], completions: list[list[int]],
                   starts: list[int], width: int, rows_per_pass: int, device: torch.device,
                   uids: Optional[list[str]] = None) -> torch.Tensor:
    """Final hidden states of the teacher over each row's completion, under K prompts per row.

    views[b][k]: the k-th teacher prompt of row b; completions[b]: its completion tokens, which sit
    at student positions starts[b] + j. Returns (B, width, K, H) aligned with the student row:
    [b, starts[b] + j, k] is the hidden state that predicts completion token j under prompt k.
    The teacher prompt is used whole, however long (it is never cut to the student's length); a
    teacher row (prompt + completion) longer than the model's positions is a ValueError naming the
    example (`uids[b]`), not a silent read past the positions the model was built for.
    """
    flat = [(b, k, prompt) for b, row in enumerate(views) for k, prompt in enumerate(row)]
    check_teacher_rows(teacher, flat, completions, uids)
    k_views = len(views[0])
    out: Optional[torch.Tensor] = None
    for start in range(0, len(flat), rows_per_pass):
        part = flat[start: start + rows_per_pass]
        ids, attn = pad_right([prompt + completions[b] for b, _, prompt in part], 0, device)
        hidden = final_hidden(teacher, ids, attn)  # (n, T', H)
        if out is None:
            out = hidden.new_zeros(len(views), width, k_views, hidden.shape[-1])
        for i, (b, k, prompt) in enumerate(part):
            n = len(completions[b])
            out[b, starts[b]: starts[b] + n, k] = hidden[i, len(prompt) - 1: len(prompt) - 1 + n]
    assert out is not None
    return out


def check_teacher_rows(teacher: nn.Module, flat: list[tuple[int, int, list[int]]], completions: list[list[int]],
                       uids: Optional[list[str]]) -> None:
    positions = getattr(getattr(teacher, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return
    for b, _, prompt in flat:
        length = len(prompt) + len(completions[b])
        if length > positions:
            who = f"example {uids[b]}" if uids is not None else f"row {b}"
            raise ValueError(f"teacher row of {who}: {len(prompt)} teacher-prompt + {len(completions[b])} completion "
                             f"tokens = {length} > the model's {positions} positions (lower trainer.max_new_tokens "
                             "or data.max_length)")


def scatter_tokens(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """(N,) per selected token -> (B, T) detached, zeros elsewhere."""
    out = torch.zeros(sel.shape, dtype=torch.float32, device=values.device)
    out[sel] = values.detach().float()
    return out


def detached_head(teacher: nn.Module) -> Head:
    """The teacher's output head, detached, for projecting its stored hidden states in the loss; a
    soft-capped head (Gemma-2) carries its cap (`models.anatomy.head_logits` applies it); a sharded
    teacher's (FSDP / ZeRO-3) gathered into a full copy, every rank calling together."""
    head = output_head(teacher, softcap=True, gather=True)  # a sharded teacher's head: gathered (all ranks)
    if head is None:
        raise ValueError(f"self-distillation needs a linear output head on the teacher ({type(causal_lm(teacher)).__name__}: "
                         "logit scaling is not supported)")
    return detach_head(head)


def policy_logprobs(model: nn.Module, batch: Batch, temperature: float, chunk: int, rows_per_pass: int
                    ) -> torch.Tensor:
    """(B, T) log-probs of the batch's completion (loss-mask) tokens under `model` (no grad), 0 elsewhere,
    `rows_per_pass` rows per forward: the stored old / reference log-probs of GRPO and CLM."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    with torch.no_grad():
        for start in range(0, len(batch), rows_per_pass):
            ids = batch.input_ids[start: start + rows_per_pass]
            attn = batch.attention_mask[start: start + rows_per_pass]
            sel = batch.loss_mask[start: start + rows_per_pass].bool()
            feats, head = student_features(model, ids, attn)
            c = chunk or losses.auto_chunk(feats.shape[-1] if head is None else head[0].shape[0], 0)
            out[start: start + rows_per_pass] = scatter_tokens(
                losses.chunked_token_logprobs(feats[sel], head, ids[sel], temperature, c).float(), sel)
    return out


@torch.no_grad()
def sliced_final_hidden(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor, rows_per_forward: int) -> torch.Tensor:
    """Final normed states (B, T, H) of `model` over every row, `rows_per_forward` rows per forward
    (a frozen teacher's states; the caller sets which model that is, e.g. routers forced or the
    adapter off)."""
    return torch.cat([final_hidden(model, ids[s:s + rows_per_forward], attn[s:s + rows_per_forward])
                      for s in range(0, ids.shape[0], rows_per_forward)])
