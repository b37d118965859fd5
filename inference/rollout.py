"""Output bookkeeping of one generation call, shared by every decoding mode: buffers and stopping.

The token loop (`engine.token_loop`) hands each round's tokens to `Rollout.record`, whatever mode
produced them: one sampled token per row (plain decoding) or a run of accepted drafts plus a
correction (speculative decoding). Stopping is decided here once, by `StopRule`, for both:
a row ends at the first emitted token that is a stop token id or completes a stop sequence (the
stop token / sequence is included), or when it has max_new_tokens tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.sampling import SamplingParams

__all__ = ["Completion", "Emitted", "Rollout", "StopRule"]

STOP, LENGTH, ABORT = "stop", "length", "abort"  # abort: the caller ended the row (`Rollout.cancel`)
# Fills the output buffer left of each row's first token: no token id, so no stop sequence matches it.
NO_TOKEN = -1


@dataclass
class Completion:
    """One generated continuation (prompt not included)."""

    tokens: list[int]  # up to and including the stop token / stop sequence
    logprobs: list[float]  # per token: log_softmax(logits / T)[token] over the full vocab, fp32
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class Emitted:
    """What one round of a decoding mode emits for each live row, in order."""

    tokens: torch.Tensor  # (n, k)
    logprobs: torch.Tensor  # (n, k) fp32
    counts: torch.Tensor | None = None  # (n,) in [1, k]: tokens row r emits (the rest is filler); None = all k

    def last(self) -> torch.Tensor:
        """Each row's last emitted token: (n,)."""
        if self.counts is None:
            return self.tokens[:, -1]
        return self.tokens.gather(1, (self.counts - 1)[:, None]).squeeze(1)

    def advance(self) -> torch.Tensor | int:
        """Tokens each row emitted: (n,), or one int for all rows."""
        return self.tokens.shape[1] if self.counts is None else self.counts


class StopRule:
    """Which emitted tokens end their row: a stop token id, or the last token of a stop sequence."""

    def __init__(self, params: SamplingParams, device: torch.device):
        ids = params.stop_token_ids
        self.ids = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
        self.seqs = [torch.tensor(s, dtype=torch.long, device=device) for s in params.stop_sequences]
        # Tokens before a chunk that a stop sequence ending inside the chunk can reach back to.
        self.history = max((len(s) for s in params.stop_sequences), default=1) - 1

    @property
    def active(self) -> bool:
        return self.ids is not None or bool(self.seqs)

    def hits(self, window: torch.Tensor) -> torch.Tensor:
        """window: (n, history + k) = the `history` tokens each row emitted before a chunk
        (NO_TOKEN where it has fewer), then the chunk's k tokens.

        -> (n, k) bool: True where the row must stop right after that chunk token.
        """
        chunk = window[:, self.history:]  # (n, k)
        if self.ids is not None:
            hit = torch.isin(chunk, self.ids)
        else:
            hit = torch.zeros_like(chunk, dtype=torch.bool)
        for seq in self.seqs:
            length = len(seq)
            ends = window[:, self.history - length + 1:].unfold(1, length, 1)  # (n, k, length)
            hit |= (ends == seq).all(-1)
        return hit


class Rollout:
    """Output buffers and per-row bookkeeping of one generation call.

    `rows` maps the live batch (which shrinks as rows finish) back to the caller's prompt order.
    Row r's outputs sit at columns [margin, margin + length) of `tokens` / `logprobs`; the margin
    on the left (NO_TOKEN) lets a stop sequence be matched across a chunk boundary without special
    cases for short outputs, and the last column takes the filler tokens past a row's count.
    While every live row has emitted the same number of tokens (always in plain decoding) that
    number is one host int, `fill`, and a round is written with slices; once rows differ
    (speculative rounds accept different lengths) each row's count lives in `filled` (n,).
    """

    def __init__(self, batch: int, new_tokens: int, params: SamplingParams, device: torch.device):
        self.stop = StopRule(params, device)
        self.new_tokens = new_tokens
        self.margin = self.stop.history
        width = self.margin + new_tokens + 1  # + 1: the filler column
        self.tokens = torch.full((batch, width), NO_TOKEN, dtype=torch.long, device=device)  # (B, W)
        self.logprobs = torch.zeros(batch, width, dtype=torch.float32, device=device)  # (B, W)
        self.rows = torch.arange(batch, device=device)  # (n,)
        self.fill: int | None = 0
        self.filled: torch.Tensor | None = None  # (n,) once rows differ
        self.length = [new_tokens] * batch
        self.reason = [LENGTH] * batch
        self.done = False

    def room(self) -> torch.Tensor | int:
        """Tokens each live row may still emit (>= 1 while not done): (n,), or one int for all."""
        return self.new_tokens - (self.fill if self.fill is not None else self.filled)

    def record(self, emitted: Emitted) -> torch.Tensor | None:
        """Write a round's tokens, apply the stop rule; return the live-row indices to keep (None =
        all). A mode never emits more than `room()` tokens for a row."""
        if emitted.counts is None and self.fill is not None:
            return self._record_uniform(emitted)
        return self._record_rows(emitted)

    def _record_uniform(self, emitted: Emitted) -> torch.Tensor | None:
        k, start = emitted.tokens.shape[1], self.fill
        col = self.margin + start
        self.tokens[self.rows, col: col + k] = emitted.tokens
        self.logprobs[self.rows, col: col + k] = emitted.logprobs
        self.fill = start + k
        self.done = self.fill >= self.new_tokens
        if not self.stop.active:
            return None
        hit = self.stop.hits(self.tokens[self.rows, start: col + k])  # (n, k)
        stopped = hit.any(1) if k > 1 else hit[:, 0]  # (n,)
        if not bool(stopped.any()):  # one host sync per round, on n booleans
            return None
        first = hit.int().argmax(1)  # (n,) the first stopping token
        for row, j in zip(self.rows[stopped].tolist(), first[stopped].tolist()):
            self.length[row], self.reason[row] = start + j + 1, STOP
        return self._keep(~stopped)

    def _record_rows(self, emitted: Emitted) -> torch.Tensor | None:
        n, k = emitted.tokens.shape
        if self.filled is None:
            self.filled = torch.full((n,), self.fill, dtype=torch.long, device=self.rows.device)
            self.fill = None
        counts = emitted.counts if emitted.counts is not None else torch.full_like(self.filled, k)
        j = torch.arange(k, device=counts.device)
        valid = j[None, :] < counts[:, None]  # (n, k)
        filler = self.tokens.shape[1] - 1
        cols = torch.where(valid, self.margin + self.filled[:, None] + j, filler)  # (n, k)
        rows = self.rows[:, None].expand(n, k)
        self.tokens[rows, cols] = emitted.tokens
        self.logprobs[rows, cols] = emitted.logprobs
        stopped = torch.zeros_like(valid[:, 0])  # (n,)
        if self.stop.active:
            span = torch.arange(self.margin + k, device=counts.device)
            window = self.tokens[rows[:, :1], (self.filled[:, None] + span).clamp(max=filler)]  # (n, margin + k)
            hit = self.stop.hits(window) & valid  # (n, k)
            stopped = hit.any(1)
            counts = torch.where(stopped, hit.int().argmax(1) + 1, counts)  # (n,) up to the stop
        self.filled = self.filled + counts
        finished = stopped | (self.filled >= self.new_tokens)  # (n,)
        if not bool(finished.any()):
            return None
        for row, length in zip(self.rows[stopped].tolist(), self.filled[stopped].tolist()):
            self.length[row], self.reason[row] = length, STOP
        return self._keep(~finished)

    def progress(self) -> list[int]:
        """Tokens each row (in the caller's order) has emitted so far: a finished row's final length."""
        out = list(self.length)
        live = self.rows.tolist()
        counts = [self.fill] * len(live) if self.fill is not None else self.filled.tolist()
        for row, count in zip(live, counts):
            out[row] = min(count, self.length[row])
        return out

    def emitted(self, row: int, start: int, end: int) -> list[int]:
        """Row `row`'s emitted tokens [start, end) (caller's order; end <= progress()[row])."""
        return self.tokens[row, self.margin + start: self.margin + end].tolist()

    def cancel(self, rows: set[int]) -> torch.Tensor | None:
        """End the live rows among `rows` (caller's order) now, with what they emitted (finish reason
        `abort`); return the live-row indices to keep (None = all)."""
        live = self.rows.tolist()
        if not any(row in rows for row in live):
            return None
        progress = self.progress()
        for row in live:
            if row in rows:
                self.length[row], self.reason[row] = progress[row], ABORT
        return self._keep(torch.tensor([row not in rows for row in live], device=self.rows.device))

    def _keep(self, alive: torch.Tensor) -> torch.Tensor:
        live = alive.nonzero().squeeze(1)  # (n',)
        self.rows = self.rows[live]
        if self.filled is not None:
            self.filled = self.filled[live]
        self.done = self.done or live.numel() == 0
        return live

    def emitted_tokens(self, row: int) -> list[int]:
        """Tokens prompt `row` has emitted so far (for inspecting a run stopped mid-generation)."""
        live = (self.rows == row).nonzero().flatten()
        if live.numel() == 0:
            count = self.length[row]
        else:
            count = self.fill if self.fill is not None else int(self.filled[live[0]])
        return self.tokens[row, self.margin: self.margin + count].tolist()

    def completions(self) -> list[Completion]:
        cols = slice(self.margin, self.margin + self.new_tokens)
        tokens, logprobs = self.tokens[:, cols].tolist(), self.logprobs[:, cols].tolist()
        return [
            Completion(tokens[i][: self.length[i]], logprobs[i][: self.length[i]], self.reason[i])
            for i in range(len(tokens))
        ]
