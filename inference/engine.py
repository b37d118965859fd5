"""Batched generation on token ids: left-padded prefill, then one decode step per new token.

Used for rollouts, eval and serving. Works on token ids only (tokenizing is the caller's job).

    engine = Engine(model)                      # lean decoder when the model allows it
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, stop_token_ids=(eos,)))
    outs[0].tokens, outs[0].logprobs, outs[0].finish_reason

How a call runs:
  1. Prompts are left-padded to the longest, P; each row's positions start at 0 at its first real
     token, and pad keys are masked out of attention.
  2. Prefill writes the prompt K/V into a cache pre-allocated for P + max_new_tokens slots.
  3. Each decode step samples one token per live row (see `sampling.py`), checks stop tokens and
     stop sequences, and drops finished rows from the batch (a gather of the live cache rows), so
     the batch shrinks as rollouts of very different lengths finish.

Two backends share that loop: the lean decoder (`lean.py`, our own forward over the same weights;
the speed path) and the model's HF forward (`hf_backend.py`; the always-correct fallback). Both
give the same tokens. Weights are read from the live model at every call, so a trainer can update
the model between rollouts without telling the engine.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch import nn

from inference.hf_backend import HFBackend
from inference.lean import (
    EAGER, LeanBackend, Rope, compiled_blocks, lean_unsupported_reason, read_dims, rope_tables,
)
from inference.sampling import SamplingParams, sample_next

__all__ = ["Completion", "Engine", "SamplingParams"]

# Token id written into pad slots of left-padded prompts; any valid id works since pads are masked.
PAD_ID = 0
STOP, LENGTH = "stop", "length"


@dataclass
class Completion:
    """One generated continuation (prompt not included)."""

    tokens: list[int]  # up to and including the stop token / stop sequence
    logprobs: list[float]  # per token: log_softmax(logits / T)[token] over the full vocab, fp32
    finish_reason: str  # "stop" | "length"


class Backend(Protocol):
    """Forward + KV cache for one call. prefill: (B, P) -> (B, V); decode: (n,) -> (n, V)."""

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def keep(self, rows: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------- batch preparation


@dataclass
class PaddedPrompts:
    ids: torch.Tensor  # (B, P) left-padded token ids
    valid: torch.Tensor  # (B, P) bool, False on pads
    positions: torch.Tensor  # (B, P) 0 at each row's first real token (pads: 0)
    lengths: torch.Tensor  # (B,) real prompt lengths


def left_pad(prompts: list[list[int]], device: torch.device) -> PaddedPrompts:
    """Left-pad so every row's last prompt token sits in the same slot, P - 1."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    P = int(lengths.max())
    ids = torch.full((len(prompts), P), PAD_ID, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    valid = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # (B, P)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    return PaddedPrompts(ids.to(device), valid.to(device), positions.to(device), lengths.to(device))


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {row} has a token id outside [0, {vocab_size})")


# ----------------------------------------------------------------------------- stopping


class StopRule:
    """Which live rows just finished: last token is a stop id, or output ends with a stop sequence."""

    def __init__(self, params: SamplingParams, device: torch.device):
        ids = params.stop_token_ids
        self.ids = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
        self.seqs = [torch.tensor(s, dtype=torch.long, device=device) for s in params.stop_sequences]
        self.longest = max((len(s) for s in params.stop_sequences), default=0)

    @property
    def active(self) -> bool:
        return self.ids is not None or bool(self.seqs)

    def __call__(self, tokens: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                 step: int) -> torch.Tensor:
        """tokens: (n,) just sampled; out: (B, N) all outputs so far; rows: (n,) -> (n,) bool."""
        stopped = torch.zeros_like(tokens, dtype=torch.bool)
        if self.ids is not None:
            stopped |= torch.isin(tokens, self.ids)
        if self.seqs:
            start = max(0, step + 1 - self.longest)
            tail = out[rows, start: step + 1]  # (n, <= longest)
            for seq in self.seqs:
                if len(seq) <= tail.shape[1]:
                    stopped |= (tail[:, -len(seq):] == seq).all(-1)
        return stopped


# ----------------------------------------------------------------------------- the engine


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run in eval mode, then restore every submodule's own training flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


class Engine:
    """Batched generation over a live `transformers` causal LM.

    max_seq_len: cache capacity (prompt + completion); defaults to config.max_position_embeddings.
    use_lean: None = lean decoder when the model supports it (checked at every call, so model
    surgery after construction is respected); True = require it (ValueError naming why not);
    False = always the HF forward.
    compile: torch.compile the cache-free halves of each lean layer (lean path only); off by
    default because on CPU its first call costs tens of seconds (see benchmarks/generate.py).
    """

    def __init__(self, model: nn.Module, *, max_seq_len: int | None = None,
                 use_lean: bool | None = None, compile: bool = False):
        self.model = model
        self.use_lean = use_lean
        self.compile = compile
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        if use_lean:
            self._require_lean()
        self._rope: Rope | None = None  # RoPE tables, reused across calls while still valid

    def _require_lean(self) -> None:
        reason = lean_unsupported_reason(self.model)
        if reason is not None:
            raise ValueError(f"use_lean=True but the lean decoder cannot run this model: {reason}")

    def lean_active(self) -> bool:
        """Whether the next call runs the lean decoder."""
        if self.use_lean is None:
            return lean_unsupported_reason(self.model) is None
        if self.use_lean:
            self._require_lean()
        return self.use_lean

    def _backend(self, batch: int, max_len: int) -> Backend:
        if not self.lean_active():
            return HFBackend(self.model, batch, max_len)
        dims = read_dims(self.model)
        self._rope = rope_tables(self.model, max_len, self._rope)
        blocks = compiled_blocks() if self.compile else EAGER
        return LeanBackend(self.model, dims, self._rope, batch, max_len, blocks)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> list[Completion]:
        """Complete every prompt (token ids). Returns one Completion per prompt, in order."""
        if not prompts:
            return []
        check_prompts(prompts, self.model.get_input_embeddings().num_embeddings)
        longest = max(len(p) for p in prompts)
        if longest >= self.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens leaves no room in max_seq_len={self.max_seq_len}")
        new_tokens = min(params.max_new_tokens, self.max_seq_len - longest)
        # inference_mode on top of no_grad: skips view/version tracking, ~20% per step on CPU here.
        with eval_mode(self.model), torch.inference_mode():
            return self._generate(prompts, params, new_tokens, generator)

    def _generate(self, prompts, params: SamplingParams, new_tokens: int, generator) -> list[Completion]:
        device = next(self.model.parameters()).device
        batch = left_pad(prompts, device)
        B = len(prompts)
        backend = self._backend(B, batch.ids.shape[1] + new_tokens)
        run = Rollout(B, new_tokens, params, device)
        logits = backend.prefill(batch.ids, batch.positions, batch.valid)  # (B, V)
        positions = batch.lengths.clone()  # (n,) position of the token sampled next
        for step in range(new_tokens):
            tokens = run.sample(logits, step, generator)  # (n,)
            live = run.finish_rows(tokens, step)  # (n',) rows still running, or None if all are
            if step + 1 == new_tokens or (live is not None and live.numel() == 0):
                break
            if live is not None:
                backend.keep(live)
                tokens, positions = tokens[live], positions[live]
            logits = backend.decode(tokens, positions)
            positions += 1
        return run.completions()


class Rollout:
    """Output buffers and per-row bookkeeping of one `generate` call.

    `rows` maps the live batch (which shrinks as rows finish) back to the caller's prompt order.
    """

    def __init__(self, batch: int, new_tokens: int, params: SamplingParams, device: torch.device):
        self.params = params
        self.stop = StopRule(params, device)
        self.tokens = torch.zeros(batch, new_tokens, dtype=torch.long, device=device)  # (B, N)
        self.logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=device)  # (B, N)
        self.rows = torch.arange(batch, device=device)  # (n,)
        self.length = [new_tokens] * batch
        self.reason = [LENGTH] * batch

    def sample(self, logits: torch.Tensor, step: int, generator) -> torch.Tensor:
        """Pick and record one token per live row. logits: (n, V) -> tokens (n,)."""
        tokens, logprobs = sample_next(logits, self.params, generator)  # (n,), (n,)
        self.tokens[self.rows, step] = tokens
        self.logprobs[self.rows, step] = logprobs
        return tokens

    def finish_rows(self, tokens: torch.Tensor, step: int) -> torch.Tensor | None:
        """Record rows that stopped at `step`; return the live-row indices to keep (None = all)."""
        if not self.stop.active:
            return None
        stopped = self.stop(tokens, self.tokens, self.rows, step)  # (n,) bool
        if not bool(stopped.any()):  # one host sync per step, on n booleans
            return None
        for row in self.rows[stopped].tolist():
            self.length[row], self.reason[row] = step + 1, STOP
        live = (~stopped).nonzero().squeeze(1)  # (n',)
        self.rows = self.rows[live]
        return live

    def completions(self) -> list[Completion]:
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        return [
            Completion(tokens[i][: self.length[i]], logprobs[i][: self.length[i]], self.reason[i])
            for i in range(len(tokens))
        ]
