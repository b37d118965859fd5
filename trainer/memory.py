"""The pre-flight memory check: estimate the peak memory of the actor update for the worst micro-batch
the data can produce, before the first step, and refuse (or switch `trainer.activations`) when it
cannot fit -- instead of growing until the kernel's OOM killer ends the run with no message.

    check_memory(cfg, world, model, worst_micro_batch(cfg, world, task, tokenizer, caps, positions))

Why before anything runs: a long row anywhere in the data (legal under the length limits, which only
bound a row by the model's positions) meets the optimizer on whichever step draws it; the run dies
hours in, and on CPU the OOM killer leaves only exit code 137.

What is estimated (per rank, bytes), for the micro-batch of `trainer.micro_batch_size` rows padded to
the longest row (the worst one: `Batch.micro_batches` pads a micro-batch to its longest row):

- activations, from a *measured* profile of the very model the run trains: one forward of a single row
  at three short lengths (PROFILE_LENGTHS) under `saved_tensors_hooks`, under the run's compute dtype
  (autocast) and attention implementation, counting every distinct storage autograd keeps, attributed
  to its decoder layer (a HiLoRe recovery unit) or to the rest (embeddings, head, the log-softmax of the
  loss). Each saved tensor's size is fitted exactly as ``c + a*T + b*T^2`` (three lengths: a constant --
  autocast's low-precision weight copies --, a per-token term, and the quadratic term of attention
  that stores T x T probabilities per head: eager; sdpa / flash store none, except the padding mask),
  then evaluated at the micro-batch's rows x width as ``c + rows * (a*W + b*W^2)``;
- those figures become a `trainer.activations.planner.Profile`, and the HiLoRe planner's peak model
  (`planner._peaks`) gives the peak of the plan the mode implies: `none` every unit full, `checkpoint`
  every unit recomputed, `hilore` at most `activation_memory_budget` x the checkpointing peak (what
  its planner guarantees);
- transients the planner does not model: during a unit's backward the gradients of its activations
  (UNIT_BACKWARD x its largest saved tensor, `UnitProfile.bwd_bytes`), during the head's backward the
  gradient chain of the fp32 logits (HEAD_BACKWARD x the largest saved tensor outside the units), and
  the optimizer step (all gradients plus AdamW's temporaries);
- what the allocator holds beyond the live tensors (ALLOCATOR: a share of the peak less the static
  memory, plus a constant; on CPU glibc keeps freed blocks in its arenas);
- static: parameters + gradients + optimizer state (`activation_optimizer_bytes_per_param`, AdamW 8
  bytes per trainable element), divided by the ranks where the backend shards them, plus DDP's
  gradient buckets.

The worst micro-batch's longest row is found in the tokens the algorithm builds: its prompt plus what
ends the row, which the algorithm declares (algorithms.base.ShapesRows; without it: the longer of the
reference solution and trainer.max_new_tokens, and the teacher prompt when traits.needs_reference).

Measured on tiny Qwen3 models (tests/trainer/memory_worker.py, tests/trainer/test_memory_check.py,
docs/memory.md), over two forward + backward passes and an AdamW step on CPU, for none / checkpoint,
eager / sdpa, two lengths and a padded two-row micro-batch: the estimate is 1.2x - 1.9x the resident
growth under glibc's default malloc (as train.py runs; the test allows 0.95x - 2.25x), its live-tensor
part 1.09x - 1.57x the growth when every large tensor is its own mmap (allowed 0.95x - 1.75x); never
below the measured peak.

Also counted: the full weight copies the algorithm will keep (a frozen or EMA teacher, a KL reference:
algorithms.base.KeepsCopies) as static memory; and, where the algorithm generates, the rollouts' phase
(`rollout_estimate`): one engine call of a rank's rows per step with its KV cache pre-allocated for the
longest prompt + trainer.max_new_tokens, the prefill's working set, beside the weights, optimizer state
and copies (measured: 1.28x - 1.43x the resident growth of the call). Not counted: a batch's stored
teacher states.

Available memory (per rank): `trainer.memory_limit_gb` when set; else on CUDA free device memory (plus
what this process's caching allocator holds unused) and on CPU MemAvailable of /proc/meminfo (or the
cgroup's limit less its usage, when lower) shared by the ranks of this host, or this process's RLIMIT_AS
(prlimit --as) less its virtual size when lower still; plus the model's weights,
which are resident already and counted in the estimate. Every rank computes the estimate; the
smallest available memory and the largest estimate over the ranks decide, so all ranks refuse (or
switch) together.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from trainer.activations.manager import _storage_ptr as _ptr, _tensors_in as _tensors
from trainer.activations.planner import FULL, RECOMPUTE, Profile, UnitProfile, _peaks
from tasks import task_capabilities

if TYPE_CHECKING:  # the algorithms package is imported where a shape is made
    from algorithms.base import RowShape

GIB = 1024 ** 3
PROFILE_LENGTHS = (16, 32, 64)  # three lengths: the constant, per-token and per-token^2 terms are fitted exactly
UNIT_BACKWARD = 2.0  # a unit's backward transient: gradients of its largest activation and of that op's input
HEAD_BACKWARD = 3.0  # the head's backward transient: the log-softmax / gather / slice gradient chain of the logits
MODES = ("error", "auto", "off")  # trainer.memory_check
# What the allocator holds beyond the live tensors, per device: (share of the update's transient bytes --
# the peak less parameters and optimizer state --, a constant). CPU, glibc malloc: measured on SmolLM2-135M
# (one 5,001-token row, fwd + bwd twice + AdamW) 12.0 GiB of resident growth for 10.4 GiB of live tensors
# (15%; train.py's own run, rows of every length: ~25%), and on the tiny test models 120 - 250 MB above the
# live tensors whatever their size (docs/memory.md). CUDA, the caching allocator: not measured here.
ALLOCATOR = {"cpu": (0.25, 256 * 1024 ** 2), "cuda": (0.10, 256 * 1024 ** 2)}
_UNLIMITED = 1 << 60  # cgroup "no limit" values are near 2^63


class MemoryCheckError(RuntimeError):
    """The actor update is estimated not to fit; the message is one line naming the row, the estimate,
    the memory available and the keys that would make it fit. train.py exits with code 7."""


# --- the worst micro-batch ------------------------------------------------------------------------


@dataclass(frozen=True)
class WorstBatch:
    """The micro-batch with the most memory: `rows` rows padded to `width` tokens (its longest row,
    example `uid`, `kind` says what bounds a row: the reference solution or the completion cap)."""

    rows: int
    width: int
    uid: str
    kind: str  # "reference" (prompt + solution + EOS) | "rollout" (prompt + trainer.max_new_tokens)
    max_new_tokens: int = 0
    # the rollouts, where the algorithm generates: one engine call of `rollout_rows` rows (a rank's prompts
    # per step x rows_per_prompt) whose KV cache holds `rollout_width` positions (the longest prompt +
    # trainer.max_new_tokens), the longest prompt being example `rollout_uid`; 0 rows when nothing generates
    rollout_rows: int = 0
    rollout_width: int = 0
    rollout_uid: str = ""
    rows_per_prompt: int = 1


def row_shape(cfg, caps) -> "RowShape":
    """The algorithm's declared rows (algorithms.base.ShapesRows), else the longest it could make:
    either completion, and the teacher prompt when its traits say it carries the reference."""
    from algorithms.base import RowShape

    if caps.row_shape is not None:
        return caps.row_shape()
    return RowShape("either", teacher_prompt=cfg.algo.traits.needs_reference)


def _row_texts(shape, task: Any, ex: Any) -> list[str]:
    """The prompts one example's rows start with: the student prompt, and the teacher prompt carrying
    the reference where that prompt is trained on (and the example has one)."""
    prompts = [task.prompt(ex)]
    if shape.teacher_prompt and ex.solution is not None:
        prompts.append(task.teacher_prompt(ex, ex.solution))
    return prompts


def _completions(shape, cfg, solution_tokens: int) -> tuple[int, str]:
    """(tokens after the prompt, "reference" | "rollout") of the longest row of an example."""
    reference = solution_tokens + 1 if shape.completion in ("reference", "either") else -1  # + EOS
    sampled = cfg.trainer.max_new_tokens if shape.completion in ("sampled", "either") else -1
    return (reference, "reference") if reference >= sampled else (sampled, "rollout")


def _bounds(cfg, shape, task, examples) -> list[int]:
    """Cheap upper bounds of each example's longest row (a token covers at least one byte; +2 slack for
    a BOS and a word-boundary token, as tasks/lengths.py bounds lengths without tokenizing)."""
    size = lambda text: len(text.encode("utf-8")) + 2  # noqa: E731
    if task_capabilities(task).row_lengths is not None:  # rows tokenized as written: measured, not bounded
        return [n for n, _ in _row_lengths(cfg, shape, task, examples)]
    row_budget = task_capabilities(task).row_budget
    out = []
    for ex in examples:
        prompt = max(size(p) for p in _row_texts(shape, task, ex))
        solution = size(ex.solution) if ex.solution is not None else 0
        budget = row_budget(ex) if row_budget is not None else 0
        out.append(prompt + budget + _completions(shape, cfg, solution)[0])
    return out


def _lengths(cfg, shape, task, tokenizer, examples) -> list[tuple[int, str]]:
    """Each example's longest row in tokens of the run's own ids (models.prompts, as the algorithms
    build rows) and what ends it, before the cap at the model's positions."""
    from models.prompts import continuation_lengths, prompt_lengths

    if task_capabilities(task).row_lengths is not None:
        return _row_lengths(cfg, shape, task, examples)
    texts = [_row_texts(shape, task, ex) for ex in examples]
    flat = prompt_lengths(tokenizer, [t for row in texts for t in row])
    prompts, i = [], 0
    for row in texts:
        prompts.append(max(flat[i:i + len(row)]))
        i += len(row)
    solutions = continuation_lengths(tokenizer, [ex.solution or "" for ex in examples])
    # data=clm: a call's context grows up to the episode's budget
    row_budget = task_capabilities(task).row_budget
    budget = [row_budget(ex) if row_budget is not None else 0 for ex in examples]
    out = []
    for p, s, b in zip(prompts, solutions, budget):
        extra, kind = _completions(shape, cfg, s)
        out.append((p + b + extra, kind))
    return out


def _row_lengths(cfg, shape, task, examples) -> list[tuple[int, str]]:
    """`_lengths` of a task that tokenizes its rows as written (data=chat): the whole row where the row is
    the reference, the prompt + trainer.max_new_tokens where it is sampled."""
    rows = task_capabilities(task).row_lengths
    out = []
    for ex in examples:
        prompt, whole = rows(ex)
        reference = whole if shape.completion in ("reference", "either") else -1
        sampled = prompt + cfg.trainer.max_new_tokens if shape.completion in ("sampled", "either") else -1
        out.append((reference, "reference") if reference >= sampled else (sampled, "rollout"))
    return out


def longest_row(cfg, caps, task, tokenizer, shape=None) -> tuple[int, str, str]:
    """(tokens, uid, "reference" | "rollout") of the longest training row (of rows shaped `shape`, by
    default the algorithm's). Exact, tokenizing only the examples whose cheap bound could still beat the
    longest found (most data never reaches the tokenizer)."""
    shape = shape if shape is not None else row_shape(cfg, caps)
    examples = list(task.train_examples())
    bounds = _bounds(cfg, shape, task, examples)
    order = sorted(range(len(examples)), key=lambda i: -bounds[i])
    best, uid, kind, chunk, start = -1, "", "reference", 64, 0
    while start < len(order) and bounds[order[start]] > best:
        part = order[start:start + chunk]
        for i, (n, k) in zip(part, _lengths(cfg, shape, task, tokenizer, [examples[i] for i in part])):
            if n > best:
                best, uid, kind = n, examples[i].uid, k
        start += chunk
    return best, uid, kind


def worst_micro_batch(cfg, world, task, tokenizer, caps, positions: Optional[int]) -> WorstBatch:
    """The worst micro-batch: micro_batch_size rows (at most the rows a rank makes per step:
    prompts per rank x rows_per_prompt) padded to the longest row, capped at the model's positions."""
    shape = row_shape(cfg, caps)
    tokens, uid, kind = longest_row(cfg, caps, task, tokenizer, shape)
    if positions:
        tokens = min(tokens, positions)
    t = cfg.trainer
    per_rank = max(t.batch_size // max(world.size, 1), 1) * caps.rows_per_prompt
    rollout_rows, rollout_width, rollout_uid = 0, 0, ""
    if shape.completion != "reference":  # it generates: every prompt of the step in one engine call
        if kind == "rollout":
            rollout_width, rollout_uid = tokens, uid
        else:
            rollout_width, rollout_uid, _ = longest_row(cfg, caps, task, tokenizer, replace(shape, completion="sampled"))
            rollout_width = min(rollout_width, positions) if positions else rollout_width
        rollout_rows = per_rank
    return WorstBatch(min(t.micro_batch_size, per_rank), tokens, uid, kind, t.max_new_tokens, rollout_rows,
                      rollout_width, rollout_uid, caps.rows_per_prompt)


# --- the measured profile -------------------------------------------------------------------------


@dataclass(frozen=True)
class Poly:
    """Bytes of one saved tensor as c + rows * (a*T + b*T^2), fitted from one row at three lengths."""

    c: float
    a: float
    b: float

    def at(self, rows: int, width: int) -> float:
        return max(self.c + rows * (self.a * width + self.b * width * width), 0.0)


@dataclass
class ModelFit:
    """What the profile measured: per unit (decoder layer) its saved tensors and input, the tensors
    saved outside the units, and the parameter bytes."""

    units: list[list[Poly]]
    input_saved: list[bool]
    in_bytes_per_token: float  # a unit's input hidden state (what checkpointing keeps)
    other: list[Poly]  # saved outside the units: embeddings, final norm, head, the loss's log-softmax
    shared: list[Poly]  # what every layer is handed besides its hidden state (masks, rotary tables), held throughout
    unit_grad_bytes: list[float]
    other_grad_bytes: float
    param_bytes: float
    trainable_numel: int
    largest_trainable_bytes: float
    attention: str
    padded: bool
    kv_bytes_per_token: float = 0.0  # one row's K/V over every layer, in the weights' dtype (the engine's cache)


def _fit(xs: Sequence[int], ys: Sequence[float]) -> Poly:
    """The exact c + a*x + b*x^2 through three points (Cramer's rule)."""
    (x1, x2, x3), (y1, y2, y3) = xs, ys
    d = (x1 - x2) * (x1 - x3) * (x2 - x3)
    b = (x3 * (y2 - y1) + x2 * (y1 - y3) + x1 * (y3 - y2)) / d
    a = (x3 * x3 * (y1 - y2) + x2 * x2 * (y3 - y1) + x1 * x1 * (y2 - y3)) / d
    c = y1 - a * x1 - b * x1 * x1
    clean = lambda v: 0.0 if abs(v) < 1e-6 else v  # noqa: E731  (sizes are integers: float noise only)
    return Poly(clean(c), clean(a), clean(b))


def _fit_list(sizes: Sequence[Sequence[int]]) -> list[Poly]:
    """Fit tensor by tensor when the three runs hold the same number of them, else their sum."""
    if len({len(s) for s in sizes}) == 1:
        return [_fit(PROFILE_LENGTHS, column) for column in zip(*sizes)]
    return [_fit(PROFILE_LENGTHS, [sum(s) for s in sizes])]


def _saved_storages(model: nn.Module, layers: Sequence[nn.Module], length: int, padded: bool, device,
                    precision) -> tuple[list[tuple[Any, int]], list[int], list[bool], float]:
    """One forward (with the full-vocabulary log-softmax loss) of one row of `length` tokens under
    counting hooks. Returns the distinct saved storages in first-saved order as (unit index | "other",
    bytes); the distinct storages every layer is handed besides its hidden state (masks, rotary tables:
    kept by checkpointing for the recompute, counted once); whether each unit saves its input; and a
    unit input's bytes per token. Parameters are not counted (static); nothing is kept, no backward runs."""
    from algorithms.losses import token_logprobs
    from models.anatomy import no_kv_cache

    params = {_ptr(p) for p in model.parameters()}
    where: dict[str, Any] = {"unit": None, "inputs": {}, "in_bytes": 0}
    shared: dict[int, int] = {}
    order: dict[int, tuple[Any, int]] = {}
    # every tensor identified by its address is held until the forward is done: a freed one (the 4D
    # mask once the layers are done, a temporary of the loss) would hand its address to a later tensor,
    # which would then be skipped as already seen (measured: an eager profile losing a tensor at random)
    keep: list[torch.Tensor] = []

    def pre(i):
        def hook(module, args, kwargs):
            where["unit"] = i
            hidden = args[0] if args else kwargs.get("hidden_states")
            where["inputs"][i] = _ptr(hidden)
            where["in_bytes"] = hidden.numel() * hidden.element_size()
            keep.append(hidden)
            for t in _tensors(kwargs, []) + _tensors(list(args[1:]), []):
                keep.append(t)
                ptr = _ptr(t)
                if ptr not in (-1, where["inputs"][i]) and ptr not in params:
                    shared.setdefault(ptr, t.untyped_storage().nbytes())
        return hook

    def post(module, args, out):
        where["unit"] = None

    def pack(t: torch.Tensor):
        ptr = _ptr(t)
        if ptr == -1 or ptr in params or ptr in order or ptr in shared:
            return t
        order[ptr] = ("other" if where["unit"] is None else where["unit"], t.untyped_storage().nbytes())
        keep.append(t)
        return t

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(post) for layer in layers]
    ids = torch.arange(length, device=device).remainder(_vocab(model)).unsqueeze(0)
    mask = torch.ones_like(ids)
    if padded:  # a padded micro-batch: the model builds (and attention may save) an explicit mask
        mask[:, -1] = 0
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                precision.autocast(device), no_kv_cache(model), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=ids, attention_mask=mask).logits
            token_logprobs(logits, ids).sum()
            del logits
    finally:
        for h in handles:
            h.remove()
        keep.clear()
    saved_input = [where["inputs"].get(i, -2) in order for i in range(len(layers))]
    return list(order.values()), list(shared.values()), saved_input, where["in_bytes"] / max(length, 1)


def _vocab(model: nn.Module) -> int:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        vocab = model.get_output_embeddings().weight.shape[0]
    return int(vocab)


def measure(model: nn.Module, device: torch.device, dtype: str = "float32", padded: bool = False) -> ModelFit:
    """The model's saved-activation profile (see the module docstring): three short forwards, no
    backward, the RNG state restored; seconds even on a large model."""
    from models.anatomy import causal_lm, decoder_layers
    from trainer.precision import Precision

    lm = causal_lm(model)
    layers = list(decoder_layers(model, user="trainer.memory_check"))
    runs = [_saved_storages(model, layers, n, padded, device, Precision(dtype)) for n in PROFILE_LENGTHS]
    structure = [[key for key, _ in r[0]] for r in runs]
    shared = _fit_list([r[1] for r in runs])
    if structure[0] == structure[1] == structure[2]:  # the same tensors at every length: fit each one
        fits = [(key, _fit(PROFILE_LENGTHS, [r[0][j][1] for r in runs])) for j, key in enumerate(structure[0])]
    else:  # length-dependent control flow: fit the sums per place (and lose the per-tensor maxima)
        keys = list(dict.fromkeys(k for s in structure for k in s))
        fits = [(k, _fit(PROFILE_LENGTHS, [sum(b for kk, b in r[0] if kk == k) for r in runs])) for k in keys]
    units: list[list[Poly]] = [[] for _ in layers]
    other: list[Poly] = []
    for key, poly in fits:
        (other if key == "other" else units[key]).append(poly)
    unit_ids = {id(p) for layer in layers for p in layer.parameters()}
    grad = lambda ps: float(sum(p.numel() * p.element_size() for p in ps if p.requires_grad))  # noqa: E731
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelFit(units=units, input_saved=runs[-1][2], in_bytes_per_token=runs[-1][3], other=other,
                    shared=shared, unit_grad_bytes=[grad(layer.parameters()) for layer in layers],
                    other_grad_bytes=grad(p for p in model.parameters() if id(p) not in unit_ids),
                    param_bytes=float(sum(p.numel() * p.element_size() for p in model.parameters())),
                    trainable_numel=sum(p.numel() for p in trainable),
                    largest_trainable_bytes=float(max((p.numel() * p.element_size() for p in trainable), default=0)),
                    attention=str(getattr(getattr(lm, "config", None), "_attn_implementation", None) or "unknown"),
                    padded=padded, kv_bytes_per_token=kv_bytes_per_token(lm, len(layers)))


def kv_bytes_per_token(lm: nn.Module, layers: int) -> float:
    """Bytes of one position's keys and values over every layer, in the weights' dtype (the engine's
    KV cache: inference/lean.py::KVCache; the HF fallback's cache is no larger). Without the usual config
    fields: full multi-head attention (2 x hidden per layer), an upper bound."""
    config = getattr(lm, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    first = next(lm.parameters(), None)
    elem = first.element_size() if first is not None else 4
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    per_layer = 2 * kv_heads * head_dim if kv_heads and head_dim else 2 * hidden
    return float(layers * per_layer * elem)


# --- the estimate ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the static memory is held on a rank: sharded shares (1 = a full copy) and DDP's buckets."""

    params: float = 1.0
    grads: float = 1.0
    optimizer: float = 1.0
    buckets: bool = False
    device: str = "cpu"


def layout_of(backend: str, zero_stage: int, world_size: int, device: str) -> Layout:
    """Per-rank shares of parameters / gradients / optimizer state for the configured backend."""
    n = max(world_size, 1)
    if backend == "fsdp":
        return Layout(1 / n, 1 / n, 1 / n, False, device)
    if backend == "deepspeed":
        return Layout(1 / n if zero_stage >= 3 else 1.0, 1 / n if zero_stage >= 2 else 1.0, 1 / n, False, device)
    return Layout(buckets=backend == "ddp" and n > 1, device=device)


@dataclass(frozen=True)
class Estimate:
    peak: float  # bytes per rank
    mode: str
    rows: int
    width: int
    parts: dict = field(default_factory=dict)  # static, activations (the peak less static), phase


def planner_profile(fit: ModelFit, rows: int, width: int, optimizer_bytes_per_param: float,
                    layout: Layout, held: float = 0.0) -> Profile:
    """The measured figures as the HiLoRe planner's per-token Profile for `rows` x `width` tokens;
    `held`: bytes held beside the model throughout (an algorithm's weight copies), counted as static."""
    tokens = float(rows * width)
    units = []
    for polys, grads, saved_in in zip(fit.units, fit.unit_grad_bytes, fit.input_saved):
        sizes = [p.at(rows, width) for p in polys]
        full, largest = sum(sizes) / tokens, max(sizes, default=0.0) / tokens
        units.append(UnitProfile(fit.in_bytes_per_token, full, full, largest, saved_in, 0.0, 0.0, 0.0,
                                 grads * layout.grads, bwd_bytes=UNIT_BACKWARD * largest))
    head = sum(p.at(rows, width) for p in fit.other + fit.shared) / tokens
    static = (fit.param_bytes * layout.params + optimizer_bytes_per_param * fit.trainable_numel * layout.optimizer
              + (sum(fit.unit_grad_bytes) + fit.other_grad_bytes if layout.buckets else 0.0) + held)
    return Profile(units, head, fit.other_grad_bytes * layout.grads, static)


def estimate(fit: ModelFit, rows: int, width: int, mode: str, optimizer_bytes_per_param: float = 8.0,
             layout: Layout = Layout(), memory_budget: float = 1.10, held: float = 0.0) -> Estimate:
    """The actor update's peak for one micro-batch of `rows` x `width` tokens under activation `mode`:
    the peak of its live tensors (parts["live"]) plus what the allocator holds beyond them
    (parts["allocator"], ALLOCATOR of the layout's device). `held`: bytes of weight copies the algorithm
    keeps beside the model (static)."""
    live = _live(fit, rows, width, mode, optimizer_bytes_per_param, layout, memory_budget, held)
    return _with_allocator(live, layout)


def _with_allocator(live: Estimate, layout: Layout, constant: bool = True) -> Estimate:
    """`live` plus the allocator's allowance: ALLOCATOR's share of the transient bytes, and its constant
    (measured above the update's live tensors; the rollouts' resident growth stayed below their live
    tensors, docs/memory.md, so they get the share alone)."""
    share, fixed = ALLOCATOR.get(layout.device, ALLOCATOR["cpu"])
    extra = share * (live.peak - live.parts["static"]) + (fixed if constant else 0.0)
    return replace(live, peak=live.peak + extra, parts={**live.parts, "live": live.peak, "allocator": extra})


def rollout_estimate(fit: ModelFit, rows: int, width: int, optimizer_bytes_per_param: float = 8.0,
                     layout: Layout = Layout(), held: float = 0.0, prompt: Optional[int] = None) -> Estimate:
    """The rollouts' peak: one engine call of `rows` rows whose pre-allocated KV cache holds `width`
    positions each (`prompt` of them the left-padded prompts; default all), beside the weights, the
    optimizer state and `held` (gradients are freed between steps), plus the prefill's working set (one
    layer's activations over the whole prompt batch, from the measured profile: an upper bound, since
    inference keeps less than autograd saves) and the allocator's share as for the update."""
    prompt = width if prompt is None else min(prompt, width)
    static = (fit.param_bytes * layout.params + optimizer_bytes_per_param * fit.trainable_numel * layout.optimizer
              + held)
    kv = rows * width * fit.kv_bytes_per_token
    prefill = max((sum(p.at(rows, prompt) for p in polys) for polys in fit.units), default=0.0)
    prefill += sum(p.at(rows, prompt) for p in fit.shared)
    live = Estimate(static + kv + prefill, "rollout", rows, width,
                    {"static": static, "activations": kv + prefill, "kv_cache": kv, "phase": "rollout"})
    return _with_allocator(live, layout, constant=False)


def _live(fit: ModelFit, rows: int, width: int, mode: str, optimizer_bytes_per_param: float, layout: Layout,
          memory_budget: float, held: float = 0.0) -> Estimate:
    """The peak of the live tensors (bytes torch holds) and the phase it is reached in."""
    if mode == "hilore":  # its planner keeps the peak within memory_budget x the checkpointing peak
        full, gc = (_live(fit, rows, width, m, optimizer_bytes_per_param, layout, memory_budget, held)
                    for m in ("none", "checkpoint"))
        best = full if full.peak <= memory_budget * gc.peak else replace(gc, peak=memory_budget * gc.peak)
        return replace(best, mode="hilore")
    prof = planner_profile(fit, rows, width, optimizer_bytes_per_param, layout, held)
    plan = [FULL if mode == "none" else RECOMPUTE] * len(prof.units)
    tokens = rows * width
    fresh, accumulated = _peaks(prof, plan, tokens)
    grads = sum(u.grad_bytes for u in prof.units) + prof.other_grad_bytes
    stored = sum(tokens * (u.full_bytes if t == FULL else u.in_bytes) for u, t in zip(prof.units, plan))
    head_tensor = max((p.at(rows, width) for p in fit.other), default=0.0)
    head_backward = prof.static_bytes + stored + tokens * prof.head_bytes_per_token + HEAD_BACKWARD * head_tensor + grads
    # the optimizer step: every gradient, plus AdamW's temporaries (CPU: per parameter, two of the largest;
    # CUDA: the multi-tensor path's square roots of every second moment)
    optimizer = prof.static_bytes + grads + (fit.trainable_numel * 4 * layout.optimizer if layout.device == "cuda"
                                             else 2 * fit.largest_trainable_bytes)
    phases = {"backward": max(fresh, accumulated), "head": head_backward, "optimizer": optimizer}
    phase = max(phases, key=phases.get)
    peak = phases[phase]
    return Estimate(peak, mode, rows, width, {"static": prof.static_bytes, "activations": peak - prof.static_bytes,
                                              "phase": phase})


# --- the memory available -------------------------------------------------------------------------


def _meminfo_available() -> Optional[float]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_number(path: str) -> Optional[float]:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else float(text)


def _cgroup_available() -> Optional[float]:
    """The cgroup's limit less its usage (reclaimable inactive file pages counted free), or None
    without a limit; cgroup v2, then v1."""
    for limit_f, usage_f, stat_f, key in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                          ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                           "memory/memory.stat", "total_inactive_file")):
        limit = _read_number(f"/sys/fs/cgroup/{limit_f}")
        usage = _read_number(f"/sys/fs/cgroup/{usage_f}")
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        inactive = 0.0
        try:
            with open(f"/sys/fs/cgroup/{stat_f}") as fh:
                for line in fh:
                    name, _, value = line.partition(" ")
                    if name == key:
                        inactive = float(value)
        except OSError:
            pass
        return max(limit - usage + inactive, 0.0)
    return None


def available(device: torch.device, resident: float, limit_gb: Optional[float] = None) -> tuple[float, str]:
    """(bytes this rank's update may use, how that was found). `resident`: bytes of the estimate already
    held (the model's weights), which the free-memory figures no longer include."""
    if limit_gb is not None:
        return limit_gb * GIB, f"trainer.memory_limit_gb={limit_gb:g}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached + resident, f"free on {device} + the weights already there"
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    share = f" / {local} ranks on this host" if local > 1 else ""
    figures = [(v / local, name + share) for v, name in ((_meminfo_available(), "MemAvailable"),
                                                        (_cgroup_available(), "cgroup limit less usage"))
               if v is not None]
    own = _address_space_available()  # this process's own limit (prlimit --as, ulimit -v): not shared
    if own is not None:
        figures.append((own, "the address-space limit (RLIMIT_AS) less this process's size"))
    if not figures:
        return math.inf, "unknown (no /proc/meminfo)"
    free, name = min(figures)
    return free + resident, f"{name} + the weights already resident"


def _address_space_available() -> Optional[float]:
    """RLIMIT_AS less the process's current virtual size (every new allocation adds to it), or None
    without such a limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    try:
        with open("/proc/self/status") as fh:
            size = next(float(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return None
    return max(soft - size, 0.0)


# --- the check ------------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def remedies(fit_for, batch: WorstBatch, mode: str, room: float, opt: float, layout: Layout,
             budget: float, held: float = 0.0) -> list[str]:
    """The keys that would make the update fit, each re-estimated alone: another activation mode, fewer
    rows per micro-batch, a shorter longest row; when neither the mode nor the rows alone fit, checkpointing
    together with the most rows per micro-batch that then fit."""
    out = []
    for other in ("checkpoint", "hilore"):
        if other != mode and (mode == "none" or other == "checkpoint"):
            e = estimate(fit_for(batch.rows), batch.rows, batch.width, other, opt, layout, budget, held)
            if e.peak <= room:
                out.append(f"trainer.activations={other} ({gib(e.peak)})")
    for rows in range(batch.rows - 1, 0, -1):
        e = estimate(fit_for(rows), rows, batch.width, mode, opt, layout, budget, held)
        if e.peak <= room:
            out.append(f"trainer.micro_batch_size={rows} ({gib(e.peak)})")
            break
    if not out and mode != "checkpoint":  # the two together keep the whole row
        for rows in range(batch.rows - 1, 0, -1):
            e = estimate(fit_for(rows), rows, batch.width, "checkpoint", opt, layout, budget, held)
            if e.peak <= room:
                out.append(f"trainer.activations=checkpoint with trainer.micro_batch_size={rows} ({gib(e.peak)})")
                break
    width = _longest_fitting_width(lambda w: estimate(fit_for(batch.rows), batch.rows, w, mode, opt, layout, budget,
                                                      held).peak, batch.width, room)
    if width is not None:
        if batch.kind == "reference":
            out.append(f"data.max_length={width} with data.length_policy=skip or truncate_left")
        else:  # a rollout row is prompt + completion: shorten either by the excess
            if width > batch.max_new_tokens:
                out.append(f"data.max_prompt_tokens={width - batch.max_new_tokens} with data.length_policy=skip or "
                           "truncate_left")
            excess = batch.width - width
            if batch.max_new_tokens > excess:
                out.append(f"trainer.max_new_tokens={batch.max_new_tokens - excess}")
    return out


def _longest_fitting_width(peak_at, width: int, room: float) -> Optional[int]:
    """The longest row below `width` (a multiple of 64 when above 128) whose `peak_at(row)` fits, or None."""
    lo, hi = 0, width - 1  # the estimate grows with the width: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_at(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo < 1:
        return None
    return lo - lo % 64 if lo >= 128 else lo


def check_memory(cfg, world, model: nn.Module, batch: WorstBatch, copies: float = 0) -> Optional[str]:
    """Raise MemoryCheckError when the rollouts or the actor update are estimated not to fit; with
    memory_check=auto switch `trainer.activations` none -> checkpoint when that makes the update fit
    (cfg.trainer is updated, so the config written to output_dir says so). `copies`: full copies of the
    weights the algorithm keeps beside the model (algorithms.base.KeepsCopies), counted in both phases.
    Returns the line to print on the main rank, or None."""
    t = cfg.trainer
    if t.memory_check == "off":
        return None
    layout = layout_of(cfg.backend.name, cfg.backend.zero_stage, world.size, world.device.type)
    fits: dict[bool, ModelFit] = {}

    def fit_for(rows: int) -> ModelFit:  # padded rows (an explicit mask) whenever the micro-batch has several
        padded = rows > 1
        if padded not in fits:
            fits[padded] = measure(model, world.device, cfg.model.dtype, padded)
        return fits[padded]

    opt, budget = t.activation_optimizer_bytes_per_param, t.activation_memory_budget
    resident = fit_for(batch.rows).param_bytes * layout.params
    held = copies * resident  # made after this check (at the first step): not resident yet
    room, how = available(world.device, resident, t.memory_limit_gb)
    if batch.rollout_rows:
        _check_rollouts(cfg, world, fit_for(batch.rollout_rows), batch, room, how, opt, layout, held, copies)
    est = estimate(fit_for(batch.rows), batch.rows, batch.width, t.activations, opt, layout, budget, held)
    peak, room = _agree(world, est.peak, room)
    if peak <= room:
        return None
    if t.memory_check == "auto" and t.activations == "none":
        gc = estimate(fit_for(batch.rows), batch.rows, batch.width, "checkpoint", opt, layout, budget, held)
        gc_peak, _ = _agree(world, gc.peak, room)
        if gc_peak <= room:
            t.activations = "checkpoint"
            return (f"memory check: trainer.activations=none -> checkpoint (trainer.memory_check=auto): the worst "
                    f"micro-batch, {_describe(batch)}, is estimated at {gib(peak)} without it and {gib(gc_peak)} with it; "
                    f"{gib(room)} available ({how})")
    fixes = remedies(fit_for, batch, t.activations, room, opt, layout, budget, held)
    fix = f"fits with: {'; '.join(fixes)}" if fixes else ("nothing alone fits: combine trainer.activations=checkpoint, "
                                                         "trainer.micro_batch_size and data.max_length")
    raise MemoryCheckError(
        f"memory check: the actor update's worst micro-batch, {_describe(batch)}, is estimated to peak at {gib(peak)} "
        f"(trainer.activations={t.activations}, {fit_for(batch.rows).attention} attention, model.dtype={cfg.model.dtype}"
        f"{_copies(copies)}), "
        f"above the {gib(room)} available ({how}); {fix}; or trainer.memory_check=off to run anyway")


def _copies(copies: float) -> str:
    return f", {copies:.3g} frozen cop{'y' if copies == 1 else 'ies'} of the weights" if copies else ""


def _check_rollouts(cfg, world, fit: ModelFit, batch: WorstBatch, room: float, how: str, opt: float, layout: Layout,
                    held: float, copies: int) -> None:
    """Refuse when the rollouts' engine call is estimated not to fit (the activation mode does not help
    there): one line naming the longest prompt, the estimate and the keys that shrink the call."""
    prompt = lambda width: max(width - cfg.trainer.max_new_tokens, 1)  # noqa: E731  (the longest prompt)
    peak, room = _agree(world, rollout_estimate(fit, batch.rollout_rows, batch.rollout_width, opt, layout, held,
                                                prompt(batch.rollout_width)).peak, room)
    if peak <= room:
        return
    t, per_rank = cfg.trainer, max(batch.rollout_rows // max(batch.rows_per_prompt, 1), 1)
    fixes = []
    for prompts in range(per_rank - 1, 0, -1):  # fewer prompts per step: a smaller engine call
        rows = prompts * batch.rows_per_prompt
        e = rollout_estimate(fit, rows, batch.rollout_width, opt, layout, held, prompt(batch.rollout_width))
        if e.peak <= room:
            fixes.append(f"trainer.batch_size={prompts * max(world.size, 1)} ({gib(e.peak)})")
            break
    width = _longest_fitting_width(lambda w: rollout_estimate(fit, batch.rollout_rows, w, opt, layout, held,
                                                              prompt(w)).peak, batch.rollout_width, room)
    if width is not None:
        excess = batch.rollout_width - width
        if t.max_new_tokens > excess:
            fixes.append(f"trainer.max_new_tokens={t.max_new_tokens - excess}")
        if width > t.max_new_tokens:
            fixes.append(f"data.max_prompt_tokens={width - t.max_new_tokens} with data.length_policy=skip or "
                         "truncate_left")
    fix = f"fits with: {'; '.join(fixes)}" if fixes else "nothing alone fits: combine trainer.batch_size and " \
                                                         "trainer.max_new_tokens"
    raise MemoryCheckError(
        f"memory check: the rollouts, {batch.rollout_rows} rows whose KV cache holds {batch.rollout_width:,} positions "
        f"each (the longest prompt: {batch.rollout_uid}, + trainer.max_new_tokens={t.max_new_tokens}), are estimated to "
        f"peak at {gib(peak)} (model.dtype={cfg.model.dtype}{_copies(copies)}), above the {gib(room)} available ({how}); "
        f"{fix}; or trainer.memory_check=off to run anyway")


def _describe(batch: WorstBatch) -> str:
    rows = f"{batch.rows} rows padded to" if batch.rows > 1 else "1 row of"
    cap = f", prompt + trainer.max_new_tokens={batch.max_new_tokens}" if batch.kind == "rollout" else ""
    return f"{rows} {batch.width:,} tokens (the longest row: {batch.uid}{cap})"


def _agree(world, peak: float, room: float) -> tuple[float, float]:
    """The largest estimate and the smallest available memory over the ranks: every rank decides alike."""
    if not world.distributed:
        return peak, room
    both = world.all_reduce_max(torch.tensor([peak, -min(room, 1e300)], dtype=torch.float64))
    return float(both[0]), -float(both[1])
