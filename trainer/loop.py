"""The training loop shared by every algorithm.

    prompts -> algo.make_batch(prompts, ctx)   [no grad: rollouts, teacher passes, rewards]
            -> per micro-batch: algo.loss(model, micro, normaliser) -> backward
               (skipped where the algorithm knows the loss is exactly zero on every rank)
            -> optimizer step -> metrics -> (eval, checkpoint)

`fit` reads top to bottom; the pieces it uses are built by trainer/setup.py.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from algorithms.base import Algorithm, Batch, Capabilities, RolloutContext
from algorithms.losses import logprob_gap
from inference import EngineConfig
from models.anatomy import no_kv_cache
from trainer import checkpoint
from trainer.distributed import World
from trainer.evaluation import evaluate, heldout_loss
from trainer.precision import Precision
from trainer.stream import PromptStream
from trainer.tracking import Tracker
from tasks import task_capabilities

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks import Task
    from trainer.activations import ActivationManager
    from trainer.backends import Backend
    from trainer.config import TrainConfig


SKIPPED_STEPS = "train/skipped_steps"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the run stops without saving, so the last good checkpoint stays."""


@dataclass
class Session:
    """Everything one run needs, built once by setup.build_session."""

    cfg: TrainConfig
    world: World
    tokenizer: PreTrainedTokenizerBase
    task: Task
    algo: Algorithm
    caps: Capabilities  # what else the loop may ask of `algo`, resolved at setup
    backend: Backend
    stream: PromptStream
    tracker: Tracker
    generator: torch.Generator  # rollout sampling; checkpointed
    step: int = 0
    skipped_steps: int = 0  # empty steps whose optimizer step was skipped (train/skipped_steps); checkpointed
    activations: Optional["ActivationManager"] = None  # trainer.activations (None for `none`)
    evals: list = field(default_factory=list)  # eval records of this process's run, in order


class GracefulStop:
    """SIGTERM / first Ctrl-C ask the loop to checkpoint and exit at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True

    def agreed(self, world: World) -> bool:
        """All ranks stop at the same step if any of them was signalled."""
        return bool(world.all_reduce_max(torch.tensor(int(self.requested))).item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def fit(s: Session) -> str:
    """Train to trainer.max_steps (or a stop signal). Returns "done" or "stopped"."""
    t = s.cfg.trainer
    stop = GracefulStop()
    if s.step == 0:  # held-out accuracy before training (and, for self-distillation, the teacher's)
        run_eval(s)
    try:
        while s.step < t.max_steps:
            s.step += 1
            started = time.perf_counter()
            with autocast(s):  # rollouts and no-grad teacher / reference passes in the training compute dtype
                batch = s.algo.make_batch(s.stream.next_batch(), rollout_context(s))
            make_batch_s = time.perf_counter() - started
            record = train_step(s, batch)
            elapsed = time.perf_counter() - started
            record.update(make_batch_s=make_batch_s, step_time_s=elapsed, tokens_per_s=record["tokens"] / elapsed)
            s.tracker.log(record)
            if s.step % t.eval_every == 0 or s.step == t.max_steps:
                result = run_eval(s)
                if "accuracy" in result:
                    record["accuracy"] = result["accuracy"]
                if "loss" in result:  # data=chat's held-out loss, beside the step's training loss
                    record["eval_loss"] = result["loss"]
            s.tracker.progress(s.step, _shown(record))
            signalled = stop.agreed(s.world)
            if s.step % t.save_every == 0 or s.step == t.max_steps or signalled:
                save(s)
            if signalled:
                return "stopped"
    finally:
        stop.restore()
    return "done"


def rollout_context(s: Session) -> RolloutContext:
    return RolloutContext(s.task, s.tokenizer, s.generator, s.world.device, s.cfg.trainer.max_new_tokens,
                          policy_fn=s.backend.full_model, world=s.world, engine_config=engine_config(s.cfg.trainer),
                          draw_examples=s.stream.next_batch)


def engine_config(t) -> EngineConfig:
    """The inference engine of rollouts and eval, from the trainer.engine_* keys."""
    return EngineConfig(use_lean=t.engine_use_lean, compile=t.engine_compile)


def train_step(s: Session, batch: Batch) -> dict:
    """Forward/backward over micro-batches with exact global-token normalisation, then one optimizer step.
    Returns the step's train record (losses and metrics averaged over ranks)."""
    world, backend = s.world, s.backend
    micros = batch.micro_batches(s.cfg.trainer.micro_batch_size)
    real = len(micros)
    if world.distributed:  # rows per rank may differ (clm): every rank runs as many backwards as the busiest
        micros += [zero_weight(micros[0])] * (int(world.all_reduce_max(torch.tensor(real)).item()) - real)
    global_targets = world.all_reduce_sum(batch.num_targets().double())  # scalar, or (G,) per loss group
    normaliser = (global_targets / world.size).clamp(min=1).float()  # backends average grads over ranks
    skip = skipped_micro_batches(s, micros)
    if all(skip):  # an empty step on every rank: no forward, no backward, no optimizer step, no scheduler tick
        return _empty_step(s, batch, len(micros))
    run = [i for i, skipped in enumerate(skip) if not skipped]
    loss_sum, metric_sums, reported, gaps = torch.zeros(()), {}, {}, []
    for i in run:
        micro = micros[i]
        if s.activations is not None:  # the policy-update exposure of these tokens, known before backward
            s.activations.set_exposure(s.caps.exposure(micro) if s.caps.exposure is not None else None)
        # no KV cache in training forwards: activation recompute would append the same keys twice.
        # The gradient sync rides on the last micro-batch that runs (skipped ones add exactly zero).
        with backend.accumulate(last=i == run[-1]), autocast(s), \
                no_kv_cache(backend.train_model):
            out = s.algo.loss(backend.train_model, micro, normaliser)
        _check_finite(s, out.loss, i, micro)
        backend.backward(out.loss)
        if i >= real:  # a zero-weight filler: nothing to log
            continue
        loss_sum += out.loss.detach().float().cpu()
        for k, v in out.metrics.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + v.detach().float().cpu()
            reported[k] = reported.get(k, 0) + 1
        if micro.rollout_logprobs is not None and out.token_logprobs is not None:
            gaps.append(logprob_gap(out.token_logprobs, micro.rollout_logprobs, micro.loss_mask).cpu())
    grad_norm = backend.step(s.cfg.trainer.max_grad_norm)
    # loss metrics are means over the micro-batches that ran and reported them (a micro-batch without,
    # e.g., student tokens leaves the student-token metrics out rather than counting as 0)
    metric_sums = {k: v / reported[k] for k, v in metric_sums.items()}
    metric_sums.update({k: v.detach().float().cpu() for k, v in batch.metrics.items()})
    if s.caps.zero_loss is not None:
        metric_sums[f"{s.algo.name}/skipped_micro_batches"] = torch.tensor(float(sum(skip)))
    if s.activations is not None:
        metric_sums.update({k: v.detach().float().cpu() for k, v in s.activations.metrics().items()})
    if gaps:  # the rollout-vs-trainer log-prob gap: must stay ~0 for on-policy algorithms
        metric_sums["rollout/logprob_gap"] = torch.stack(gaps).mean()
    return _train_record(s, batch, loss_sum, metric_sums, grad_norm)


def _train_record(s: Session, batch: Batch, loss_sum: torch.Tensor, metrics: dict, grad_norm: float) -> dict:
    """The step's train record: loss and metrics averaged over the ranks, the global token count."""
    local_tokens = batch.attention_mask.sum().cpu()
    reduced = _mean_over_ranks(s.world, {"loss": loss_sum, "tokens": local_tokens, **metrics})
    tokens = round(reduced.pop("tokens") * s.world.size)
    record = {"step": s.step, "split": "train", **reduced, "grad_norm": grad_norm, "lr": s.backend.lr, "tokens": tokens}
    if s.caps.zero_loss is not None:
        record[SKIPPED_STEPS] = s.skipped_steps
    return record


def _empty_step(s: Session, batch: Batch, micro_batches: int) -> dict:
    """A step whose every micro-batch on every rank has an exactly zero loss and gradient (e.g. GRPO
    groups without reward spread and no KL term): the optimizer is not stepped, so AdamW applies no
    momentum and no weight decay from it, and the learning-rate schedule does not tick. Weights,
    optimizer state and scheduler stay exactly as they were, on every backend (DeepSpeed: no backward
    reaches its accumulation count, so its engine does not step either). Counted in `train/skipped_steps`."""
    s.skipped_steps += 1
    metrics = {k: v.detach().float().cpu() for k, v in batch.metrics.items()}
    metrics[f"{s.algo.name}/skipped_micro_batches"] = torch.tensor(float(micro_batches))
    return _train_record(s, batch, torch.zeros(()), metrics, 0.0)


def skipped_micro_batches(s: Session, micros: list[Batch]) -> list[bool]:
    """Which micro-batches (by index) this step skips: those whose loss the algorithm knows is exactly
    zero with a zero gradient (`KnowsZeroLoss`) on EVERY rank, so all ranks run the same forwards,
    backwards and collectives. Nothing is skipped when the algorithm cannot tell. When every
    micro-batch is skippable the whole step is empty (`train_step` then skips the optimizer step too),
    on every backend; otherwise a backend that counts a fixed number of backwards per step (DeepSpeed)
    runs them all."""
    zero = s.caps.zero_loss
    if zero is None:
        return [False] * len(micros)
    local = torch.tensor([int(bool(zero(m))) for m in micros])
    skip = [bool(x) for x in (-s.world.all_reduce_max(-local)).tolist()]  # a minimum: skippable on every rank
    if all(skip) or _may_skip(s.backend):
        return skip
    return [False] * len(micros)


def _may_skip(backend: Backend) -> bool:
    """DeepSpeed counts backwards to its accumulation boundary (gradient_accumulation_steps): every
    micro-batch must run there."""
    return not getattr(backend, "fixed_micro_steps", False)


def zero_weight(micro: Batch) -> Batch:
    """A one-row micro-batch that trains nothing (no loss tokens): its backward joins the ranks' gradient
    syncs and adds zero, for a rank with fewer micro-batches than the others in a step."""
    one = micro._map(lambda t: t[:1], torch.tensor([0]))
    return dataclasses.replace(one, loss_mask=torch.zeros_like(one.loss_mask))


def _mean_over_ranks(world: World, values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each metric's mean over the ranks that report it. A metric may be missing on some ranks (e.g. a
    diagnostic of tokens one rank's rollouts do not have), so under torchrun the ranks first agree on
    the union of their keys; one reduction then sums the values and counts the ranks reporting each."""
    keys = sorted(values)
    if world.distributed:
        keys = sorted(set().union(*world.gather_objects(keys)))
    if not keys:
        return {}
    stacked = torch.tensor([[float(values[k]) if k in values else 0.0 for k in keys],
                            [1.0 if k in values else 0.0 for k in keys]], dtype=torch.float64)
    sums, counts = world.all_reduce_sum(stacked).tolist()
    return {k: total / count for k, total, count in zip(keys, sums, counts) if count}


def _check_finite(s: Session, loss: torch.Tensor, micro_index: int, micro: Batch) -> None:
    bad = s.world.all_reduce_max(torch.tensor(int(not torch.isfinite(loss.detach()).all())))
    if bad.item():
        raise NonFiniteLossError(
            f"non-finite loss at step {s.step}, micro-batch {micro_index} (examples {', '.join(micro.uids[:4])}"
            f"{', ...' if len(micro.uids) > 4 else ''}); last good checkpoint kept in {s.cfg.output_dir}/checkpoints"
        )


def autocast(s: Session):
    """The run's compute dtype (model.dtype, trainer/precision.py) on its device, CPU or GPU: every forward
    of the run -- the loss, rollouts, teacher passes and evals -- runs in it; fp32 disables autocast."""
    return Precision(s.cfg.model.dtype).autocast(s.world.device)


def run_eval(s: Session) -> dict:
    """Greedy held-out accuracy (in the run's compute dtype, like its rollouts) of the student prompt; for
    algorithms that distil from a reference, also of the teacher prompt (question + reference) as
    `teacher_accuracy` -- self-distillation only helps when that is well above the student's."""
    with autocast(s):
        return _run_eval(s)


def _run_eval(s: Session) -> dict:
    t = s.cfg.trainer
    examples = list(s.task.test_examples())[: t.eval_examples]
    model = s.backend.full_model()
    engine = engine_config(t)
    serve = s.caps.eval_completions  # e.g. attuner: served over the position-independent cache
    generate = None if serve is None else (
        lambda chunk: serve(model, s.tokenizer, s.task, chunk, t.eval_max_new_tokens))
    caps = task_capabilities(s.task)
    result = {}
    if caps.row_tokens is not None:  # data=chat: the loss on its held-out rows (TRL's eval_loss)
        result = heldout_loss(model, caps.row_tokens, examples, s.world, s.tokenizer.pad_token_id)
    if caps.verifiable:
        result.update(evaluate(model, s.tokenizer, s.task, examples, s.world, t.eval_max_new_tokens,
                               engine_config=engine, generate=generate))
    if s.cfg.algo.traits.needs_reference and caps.verifiable:
        teacher = evaluate(model, s.tokenizer, s.task, examples, s.world, t.eval_max_new_tokens,
                           prompt=lambda ex: s.task.teacher_prompt(ex, ex.solution), engine_config=engine)
        result["teacher_accuracy"] = teacher["accuracy"]
        if "path_differs" in teacher:  # how closely the teacher follows the reference's path
            result["teacher_path_differs"] = teacher["path_differs"]
    if s.caps.after_eval is not None:  # e.g. the self-teacher's drift and refresh gate
        extra, notes = s.caps.after_eval(result, model)
        result.update(extra)
        if s.world.is_main:
            for note in notes:
                print(f"warning: step {s.step}: {note}", file=sys.stderr, flush=True)
    extra = s.caps.extra_eval
    # e.g. SEED: mean tokens per verify forward, greedy; on every rank where its models are sharded (distill)
    if extra is not None and (s.world.is_main or s.caps.extra_eval_every_rank):
        result.update(extra(model, s.tokenizer, s.task, examples[:t.extra_eval_examples], t.eval_max_new_tokens))
    record = {"step": s.step, "split": "eval", **result}
    s.tracker.log(record)
    s.evals.append(record)
    return result


def save(s: Session) -> str:
    state = {"step": s.step, "skipped_steps": s.skipped_steps, "stream": s.stream.state_dict(),
             "algo": s.algo.state_dict(),
             "generator": s.world.gather_objects(s.generator.get_state())}  # each rank's rollout stream
    if s.caps.rank_state is not None:  # e.g. MASS's mask stream and influence scores, one per rank
        state["algo_rank"] = s.world.gather_objects(s.caps.rank_state())
    return checkpoint.save_checkpoint(s.cfg.output_dir, s.step, s.backend, s.world, state, s.cfg.trainer.keep_last)


def resume(s: Session, path: Optional[str]) -> None:
    state = checkpoint.load_checkpoint(path, s.backend, s.world)
    where = f"{path}/{checkpoint.STATE_NAME}"
    s.step = int(state["step"])
    s.skipped_steps = int(state.get("skipped_steps", 0))
    checkpoint.apply_part(path, checkpoint.STATE_NAME, s.stream.load_state_dict, state["stream"])
    checkpoint.apply_part(path, checkpoint.STATE_NAME, s.algo.load_state_dict, state["algo"])
    generators = state.get("generator")
    if generators is None:
        raise checkpoint.CheckpointError(f"{where}: no rollout generator state")
    mine = generators[s.world.rank] if isinstance(generators, list) else generators
    checkpoint.apply_part(path, checkpoint.STATE_NAME, s.generator.set_state, mine)
    if s.caps.load_rank_state is not None:
        per_rank = state.get("algo_rank")
        if not isinstance(per_rank, list) or len(per_rank) != s.world.size:
            raise checkpoint.CheckpointError(f"{where}: no per-rank {s.cfg.algo.name} state for {s.world.size} ranks")
        checkpoint.apply_part(path, checkpoint.STATE_NAME, s.caps.load_rank_state, per_rank[s.world.rank])
    s.tracker.truncate_after(s.step)


def _shown(record: dict) -> dict:
    keys = ("loss", "accuracy", "eval_loss", "tokens_per_s")
    return {k: record[k] for k in keys if k in record}
