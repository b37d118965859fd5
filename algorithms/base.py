"""The algorithm interface: how a training batch is made and what its loss is.

An algorithm never touches process groups, optimizers or files. The contract is `Algorithm` below;
optional capabilities (`ChecksTask`, `GroupedRollouts`, `SharesPrompts`, `ExposesTokens`,
`ExtraEval`, `ServesEval`, `Scheduled`, `KnowsZeroLoss`, `ShapesRows`, `KeepsCopies`, `KeepsRankState`, `WatchesEval`) are typed protocols resolved once at setup into `Capabilities`, and the config
declares `Traits`. The trainer (trainer/loop.py) calls, per step,

    batch = algo.make_batch(examples, ctx)       # no grad: rollouts, teacher passes, rewards
    for micro in batch.micro_batches(n):          # grad accumulation
        out = algo.loss(model, micro, normaliser) # -> StepOutput(loss, metrics, token_logprobs)

`normaliser` is the global number of loss tokens divided by the data-parallel size (the backend
averages gradients over ranks), so summed micro-batch losses equal the exact global token mean.
A batch whose rows carry `row_group` (e.g. TESD's student and teacher rows) gets a (G,) normaliser,
one per group, so each loss term is a mean over its own tokens.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from models.anatomy import Head


@dataclass
class TeacherTerms:
    """What the no-grad teacher pass of make_batch leaves for the loss (OPSD, MASS, TESD, SEED's anchor)."""

    hidden: Tensor  # (B, T, K, H) teacher final hidden states predicting token t, under K prompts
    head: Head  # the teacher's output head (V, H) when the batch was made: shared by all rows, never split
    boundaries: Optional[Tensor] = None  # (B, T, S, H) teacher states at block boundaries (QAD's segments)
    view_evidence: Optional[Tensor] = None  # (B, T, K) each view's log-likelihood of the completion before t (MASS)


@dataclass
class PolicyTerms:
    """Per-row policy-gradient terms (GRPO; TESD's teacher rows)."""

    advantages: Tensor  # (B,)
    old_logprobs: Optional[Tensor] = None  # (B, T) policy log-probs when the rollouts were made (multi-pass RL)
    ref_logprobs: Optional[Tensor] = None  # (B, T) reference-model log-probs (KL penalty)
    prompt_lengths: Optional[Tensor] = None  # (B,) long: tokens of each row's prompt


@dataclass
class SegmentTerms:
    """Where each prompt token sits when the prompt is cut into segments for a position-independent
    artifact cache (Attuner; `algorithms.pic_forward`)."""

    segment: Tensor  # (B, T) long: 0 the shared prefix, k >= 1 artifact k, -1 after the artifacts (query, completion, pads)


@dataclass
class Batch:
    """One step's training data on one rank, from rollout to loss. Rows are right-padded.

    Token-aligned tensors are (B, T) and index the token itself: `loss_mask[b, t] = 1` when token t
    is a trained target (predicted from positions < t), so position 0 is never a target.
    """

    input_ids: Tensor  # (B, T) prompt + completion
    attention_mask: Tensor  # (B, T) 1 on real tokens
    loss_mask: Tensor  # (B, T) 1 on completion tokens that are trained
    rollout_logprobs: Optional[Tensor] = None  # (B, T) sampler log-prob of each completion token
    token_weights: Optional[Tensor] = None  # (B, T)
    row_group: Optional[Tensor] = None  # (B,) long: loss group of each row, each normalised on its own
    num_groups: int = 1
    row_units: Optional[Tensor] = None  # (B,) normalisation units per row; None = its loss tokens
    share_group: Optional[Tensor] = None  # (B,) long: rows with one id share a prompt; micro-batches keep them together
    uids: list[str] = field(default_factory=list)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # rank-local scalars from make_batch, logged
    # Terms only some algorithms make, grouped so the batch does not grow a field per algorithm.
    teacher: Optional["TeacherTerms"] = None  # self-distillation: the teacher's view of each row
    policy: Optional["PolicyTerms"] = None  # policy gradient: advantages and the log-probs they compare to
    segments: Optional["SegmentTerms"] = None  # artifact cache: the segment of each prompt token
    # What make_batch decided for this step that the loss must follow (e.g. QAD's schedule stage): it
    # travels with the batch, shared by every micro-batch, so nothing rides on the algorithm's counters.
    step_state: Any = None

    def __post_init__(self) -> None:
        assert self.input_ids.dim() == 2, f"input_ids must be (B, T), got {tuple(self.input_ids.shape)}"
        assert self.attention_mask.shape == self.input_ids.shape == self.loss_mask.shape

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def num_targets(self) -> Tensor:
        """Normalisation units -- loss tokens, or `row_units` per row when set (e.g. 1 per sequence for
        a sequence mean): a scalar, or (num_groups,) per loss group when rows carry `row_group`."""
        per_row = self.loss_mask.sum(1) if self.row_units is None else self.row_units
        if self.row_group is None:
            return per_row.sum()
        return torch.zeros(self.num_groups, dtype=per_row.dtype, device=per_row.device).index_add_(
            0, self.row_group, per_row)

    def _map(self, fn: Callable[[Tensor], Tensor], rows: Optional[Tensor] = None) -> "Batch":
        """Apply `fn` to every per-row tensor (fields, and those of the grouped terms); `rows` (an index
        tensor) also selects from list fields. Values that are not tensors (e.g. the teacher head, a
        tuple) are shared by all rows and pass unchanged."""
        return _map_fields(self, fn, rows)

    def to(self, device: torch.device) -> "Batch":
        return self._map(lambda t: t.to(device))

    def micro_batches(self, size: int) -> list["Batch"]:
        """Micro-batches of at most `size` rows, rows grouped by length and trimmed of all-padding
        columns (dim 1 of every tensor with 2+ dims is the token axis). The loss is a sum over rows
        divided by a global normaliser, so the grouping changes
        no result, only how much padding is computed (rows with a privileged reference in the prompt
        are much longer than the rest). Rows carrying `share_group` are ordered by group instead, so
        the rows of one shared prompt land in the same micro-batch (its prefill is computed once)."""
        lengths = self.attention_mask.sum(1).cpu()  # (B,)
        key = lengths if self.share_group is None else self.share_group.cpu()
        order = torch.sort(key, stable=True).indices
        out = []
        for start in range(0, len(self), size):
            rows = order[start : start + size]
            width = int(lengths[rows].max())
            idx = rows.to(self.input_ids.device)
            out.append(self._map(lambda t: t[idx][:, :width] if t.dim() >= 2 else t[idx], rows))
        return out


def _map_fields(obj: Any, fn: Callable[[Tensor], Tensor], rows: Optional[Tensor]) -> Any:
    values = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            v = fn(v)
        elif isinstance(v, (TeacherTerms, PolicyTerms, SegmentTerms)):
            v = _map_fields(v, fn, rows)
        elif isinstance(v, list) and v and rows is not None:  # uids may be left empty
            v = [v[i] for i in rows.tolist()]
        values[f.name] = v
    return type(obj)(**values)


@dataclass
class StepOutput:
    loss: Tensor  # scalar, already divided by the normaliser
    metrics: dict[str, Tensor]  # scalars, averaged by the trainer over micro-batches and ranks
    token_logprobs: Optional[Tensor] = None  # (B, T) trainer log-probs of the rollout tokens (for the gap metric)


class RolloutContext:
    """What make_batch may use: the task, the tokenizer, a seeded generator (checkpointed), and --
    built only on first use, since gathering full weights costs a collective under FSDP/ZeRO-3 --
    the full-weight policy and a generation engine over it."""

    def __init__(self, task: Any, tokenizer: Any, generator: torch.Generator, device: torch.device,
                 max_new_tokens: int, policy_fn: Optional[Callable[[], torch.nn.Module]] = None,
                 world: Any = None, engine_config: Any = None,
                 draw_examples: Optional[Callable[[], Sequence[Any]]] = None):
        self.engine_config = engine_config  # inference.EngineConfig for `engine`; None = its defaults
        # this rank's next slice of the prompt stream, for an algorithm that samples more prompts in a step
        # (dynamic sampling); every rank must call it equally often (None: no more prompts)
        self.draw_examples = draw_examples
        self.world = world  # trainer.distributed.World, for batch-wide statistics (None: this process only)
        self.task = task
        self.tokenizer = tokenizer
        self.generator = generator
        self.device = device
        self.max_new_tokens = max_new_tokens
        self._policy_fn = policy_fn

    @functools.cached_property
    def policy(self) -> torch.nn.Module:
        """The current weights as one full module, for rollouts and no-grad teacher passes."""
        if self._policy_fn is None:
            raise RuntimeError("this RolloutContext was built without a policy")
        return self._policy_fn()

    @functools.cached_property
    def engine(self) -> Any:
        """The policy behind the serving door (`inference.serving.serve_model`): its fast paths, this
        context's engine config."""
        from inference.engine import EngineConfig
        from inference.serving import ServeOptions, serve_model

        return serve_model(self.policy, ServeOptions(engine=self.engine_config or EngineConfig()), self.tokenizer)


@runtime_checkable
class Algorithm(Protocol):
    """What every algorithm provides. The trainer checks it once at setup (`capabilities`)."""

    name: str

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Model surgery (LoRA, routers, fake-quant) and requires_grad; returns the model to train."""

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch: ...

    def loss(self, model: torch.nn.Module, micro: Batch, normaliser: Tensor) -> StepOutput: ...

    def export(self, model: torch.nn.Module, tokenizer: Any, out_dir: str) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# --- optional capabilities: an algorithm has one by implementing it; `capabilities` resolves them once.


@runtime_checkable
class ChecksTask(Protocol):
    def check_task(self, task: Any) -> None:
        """Raise (a DataError naming the example) when the task cannot feed this algorithm."""


@runtime_checkable
class GroupedRollouts(Protocol):
    rows_per_prompt: int  # training rows made per prompt (sets the micro-batch count)


TokenLogprobs = Callable[..., Tensor]  # (model, input_ids, attention_mask, prompt_lengths, temperature, chunk) -> (B, T)


@runtime_checkable
class SharesPrompts(Protocol):
    def share_prompts(self, token_logprobs: TokenLogprobs) -> None:
        """Compute the loss's log-probs with `token_logprobs` (one forward per prompt group); the
        batch then keeps each group in one micro-batch."""


@runtime_checkable
class ExposesTokens(Protocol):
    def exposure(self, micro: Batch) -> Tensor:
        """(B, T) |dL/dlogp| per token as known before the forward (activation management)."""


@runtime_checkable
class KnowsZeroLoss(Protocol):
    def zero_loss(self, micro: Batch) -> bool:
        """True only when `loss(model, micro, normaliser)` is exactly 0 with an exactly zero gradient
        for every weight, whatever the weights are (e.g. GRPO without a KL term on rows whose
        advantages are all 0). The trainer may then skip that micro-batch's forward and backward;
        answering True wrongly changes training, so an algorithm answers False when unsure."""


@runtime_checkable
class ExtraEval(Protocol):
    """Metrics an algorithm adds to each eval beside held-out accuracy (seed: tokens per verify;
    skipper: skip ratios; attuner: the frozen base's full-prefill and naive-PIC accuracy), measured
    on the main rank over the first `trainer.extra_eval_examples` held-out examples."""
    summary_metrics: dict[str, str]  # eval metric -> how train.py's before -> after summary names it

    def extra_eval(self, model: torch.nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict[str, float]: ...


@runtime_checkable
class ServesEval(Protocol):
    def eval_completions(self, model: torch.nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                         max_new_tokens: int) -> list[list[int]]:
        """Greedy completion token ids of `examples`, produced the way the algorithm's artifact is
        served (attuner: over the position-independent cache); held-out accuracy scores these
        instead of the engine's plain decoding of each prompt."""


@runtime_checkable
class Scheduled(Protocol):
    def plan(self, max_steps: int) -> Any:
        """Lay out a schedule over the run's budget (called once at setup, after prepare_model)."""


@dataclass(frozen=True)
class RowShape:
    """What one example's training rows are made of, for the pre-flight memory check (trainer/memory.py),
    which bounds the longest row the actor update will see before the first step."""

    # how a row ends: "reference" (the example's reference solution + EOS), "sampled" (a completion of at
    # most trainer.max_new_tokens) or "either" (the longer of the two counts)
    completion: str = "either"
    teacher_prompt: bool = False  # some rows start with the teacher prompt carrying the reference


@runtime_checkable
class ShapesRows(Protocol):
    def row_shape(self) -> RowShape:
        """The rows this algorithm trains on. Without it the memory check assumes the longest possible:
        either completion, and the teacher prompt when the config's traits say `needs_reference`."""


@runtime_checkable
class KeepsCopies(Protocol):
    def weight_copies(self, model: Any) -> float:
        """How many full copies of the prepared `model`'s weights the algorithm keeps beside it during the
        run (a frozen or EMA teacher, a KL reference; a separate teacher as its bytes over the model's), for
        the pre-flight memory check. Without it: none."""


@runtime_checkable
class KeepsFrozenModels(Protocol):
    def place_frozen(self, place: Callable[[Any], Any]) -> None:
        """Takes the backend's placement for models the algorithm loads beside the policy (a separate
        teacher): `place(model)` shards a frozen model like the trained one under FSDP and ZeRO-3 (every
        forward of it is then a collective of all ranks) and returns it whole otherwise. Called once at
        setup, after the backend is built and before the first step."""


@runtime_checkable
class KeepsRankState(Protocol):
    """An algorithm whose state differs per rank (its own random stream, statistics of the examples
    this rank saw). `state_dict` holds what every rank shares and is written once; the trainer
    gathers `rank_state_dict` from every rank into the checkpoint and gives each rank its own back."""

    def rank_state_dict(self) -> dict: ...

    def load_rank_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class WatchesEval(Protocol):
    def after_eval(self, result: dict, model: torch.nn.Module) -> tuple[dict, list[str]]:
        """Called on every rank after each eval with its `result` (accuracy, teacher_accuracy, ... the
        same on every rank) and the full-weight model; may update the algorithm's state (e.g. refresh a
        frozen teacher). Returns values to add to the eval record and warnings (rank 0 prints them)."""


@runtime_checkable
class ChecksRun(Protocol):
    """An algorithm config whose values are checked against the budget and the model's layout."""

    def check_run(self, max_steps: int, skeleton: Optional[Callable[[], torch.nn.Module]]) -> None:
        """Raise ValueError naming the key; `skeleton()` builds the model on the meta device (None:
        the layout is not known before loading)."""


@dataclass(frozen=True)
class Capabilities:
    """What the trainer may ask of one algorithm beyond the contract, resolved once at setup."""

    rows_per_prompt: int = 1
    check_task: Optional[Callable[[Any], None]] = None
    share_prompts: Optional[Callable[[TokenLogprobs], None]] = None
    exposure: Optional[Callable[[Batch], Tensor]] = None
    extra_eval: Optional[Callable[..., dict]] = None
    summary_metrics: dict[str, str] = field(default_factory=dict)
    plan: Optional[Callable[[int], Any]] = None
    eval_completions: Optional[Callable[..., list]] = None
    zero_loss: Optional[Callable[[Batch], bool]] = None
    row_shape: Optional[Callable[[], RowShape]] = None
    weight_copies: Optional[Callable[[Any], float]] = None
    place_frozen: Optional[Callable[[Callable[[Any], Any]], None]] = None
    extra_eval_every_rank: bool = False  # extra_eval runs on every rank (its models are sharded collectives)
    rank_state: Optional[Callable[[], dict]] = None
    load_rank_state: Optional[Callable[[dict], None]] = None
    after_eval: Optional[Callable[..., tuple[dict, list[str]]]] = None


def capabilities(algo: Any) -> Capabilities:
    """Check `algo` against the contract and list its optional capabilities; TypeError naming what
    is missing."""
    required = ("name", "prepare_model", "make_batch", "loss", "export", "state_dict", "load_state_dict")
    missing = [m for m in required if not hasattr(algo, m)]
    if missing or not isinstance(algo, Algorithm):
        raise TypeError(f"{type(algo).__name__} does not implement the Algorithm contract: missing {', '.join(missing)}")
    extra = isinstance(algo, ExtraEval)
    return Capabilities(
        rows_per_prompt=algo.rows_per_prompt if isinstance(algo, GroupedRollouts) else 1,
        check_task=algo.check_task if isinstance(algo, ChecksTask) else None,
        share_prompts=algo.share_prompts if isinstance(algo, SharesPrompts) else None,
        exposure=algo.exposure if isinstance(algo, ExposesTokens) else None,
        extra_eval=algo.extra_eval if extra else None,
        summary_metrics=dict(algo.summary_metrics) if extra else {},
        plan=algo.plan if isinstance(algo, Scheduled) else None,
        eval_completions=algo.eval_completions if isinstance(algo, ServesEval) else None,
        zero_loss=algo.zero_loss if isinstance(algo, KnowsZeroLoss) else None,
        row_shape=algo.row_shape if isinstance(algo, ShapesRows) else None,
        weight_copies=algo.weight_copies if isinstance(algo, KeepsCopies) else None,
        place_frozen=algo.place_frozen if isinstance(algo, KeepsFrozenModels) else None,
        extra_eval_every_rank=bool(getattr(algo, "extra_eval_every_rank", False)) if extra else False,
        rank_state=algo.rank_state_dict if isinstance(algo, KeepsRankState) else None,
        load_rank_state=algo.load_rank_state_dict if isinstance(algo, KeepsRankState) else None,
        after_eval=algo.after_eval if isinstance(algo, WatchesEval) else None,
    )


# Option groups: config keys several algorithms share, declared once here and composed into each
# algorithm's config dataclass by inheritance (like models.lora.LoRAOptions); each checks its own keys.


@dataclass
class LossChunking:
    """The key of every algorithm whose loss runs over the output head in token chunks (losses.chunked_*)."""

    loss_chunk_tokens: int = 0  # tokens per logits chunk in the loss; 0 = from the vocabulary size (~256 MiB of logits)

    def check_loss_chunking(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"algo.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 0 (0 = from the vocabulary size)")


@dataclass
class TeacherBatching:
    """The key of every algorithm that scores its rows with a frozen teacher in no-grad forwards."""

    teacher_batch_size: int = 32  # rows per no-grad teacher forward

    def check_teacher_batching(self) -> None:
        if self.teacher_batch_size <= 0:
            raise ValueError(f"algo.teacher_batch_size={self.teacher_batch_size} must be > 0")


@dataclass(frozen=True)
class Traits:
    """What an algorithm's config declares before anything is built (checked by config validation)."""

    needs_reference: bool = False  # the teacher prompt carries the reference solution
    prompt_sharing: bool = False  # samples groups of responses per prompt: trainer.prompt_sharing applies
    fsdp: bool = True  # runs under backend=fsdp
    deepspeed: bool = True  # runs under backend=deepspeed (a fixed number of micro-batches per step)
    zero_steps: bool = False  # trainer.max_steps=0 is meaningful (evaluate and export without training)
    # trainer.lr when the user leaves it unset (resolved by trainer/config.py::default_lr). tiny_lr: on the
    # embedded tiny model (None = the trainer's 1e-3). pretrained_lr: with model.path set (None = 1e-4 when
    # only LoRA adapters train, `algo.lora_rank > 0`, else 1e-5 for full fine-tuning of pretrained weights).
    tiny_lr: Optional[float] = None
    lora: bool = False  # the config has models.lora.LoRAOptions' keys (algo.lora_rank > 0: adapters only train)
    pretrained_lr: Optional[float] = None
    # model.path may be a low-bit (compressed-tensors) export: the frozen base runs on the low-bit path and
    # only the algorithm's new modules train (gradients pass through it as through fake quantization)
    low_bit_base: bool = False
    # the export computes the starting model's function (a frozen base, or its quantized copy): what the
    # starting model's export says of that function's fast paths (its SEED drafter spec) carries over
    keeps_base: bool = False


def pad_right(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Right-pad token rows -> (ids (B, T), mask (B, T))."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)
