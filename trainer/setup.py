"""Build a training Session from a validated TrainConfig: world -> task -> model -> algorithm (its
contract checked once) -> the actor-update options -> data stream -> tracker -> (resume).

The actor-update options are applied by `apply_actor_update` in one visible order:
algorithm surgery (LoRA, ...) -> the pre-flight memory check (trainer/memory.py) -> activation
management -> prompt sharing -> the distributed backend.
The warm-started default model is not built here: the warm-start stage (trainer/warm_start.py)
runs before, and `load_model` only reads its cache entry."""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import yaml

from algorithms import build_algorithm
from algorithms.base import Algorithm, Capabilities, capabilities
from models.loading import build_tiny, load_pretrained
from tasks import DataError, TaskConfig, task_capabilities
from tasks.chat_template import with_chat
from tasks.lengths import LengthLimits, fit_lengths
from trainer import checkpoint, default_model
from trainer.backends import build_backend
from trainer.config import ModelConfig, TrainConfig, to_dict
from trainer.distributed import World
from trainer.evaluation import scored_rows
from trainer.loop import Session, resume
from trainer.precision import Precision, masters
from trainer.prompt_sharing import shared_prompt_logprobs
from trainer.stream import PromptStream
from trainer.tracking import METRICS_FILE, Tracker

ROLLOUT_SEED_OFFSET = 1_000_003  # rollout sampling stream, distinct per rank


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_task_from(data: TaskConfig, model: ModelConfig | None = None):
    """The configured task (`data`: the run's task config, tasks.TASK_CONFIGS). The embedded tasks reject
    template characters outside the tiny tokenizer's charset (they would become <unk>); that check applies
    only to the embedded tiny model (`model` None or without a path), not to a pretrained model's tokenizer."""
    return data.build(check_charset=model is None or model.path is None)


def prompts_for(task, tokenizer, data: TaskConfig, world: World | None = None, positions: int | None = None,
                with_teacher: bool = False):
    """`task` as the run's model reads it: prompts through the tokenizer's chat template when
    data.chat_template says so (auto: when the tokenizer has one), and examples fitted to the length
    limits (data.max_prompt_tokens / data.max_length, unset = the model's `positions`) by
    data.length_policy, both splits checked now, before any eval. Training, rollouts and eval all
    read prompts and examples from the task this returns."""
    main = world is None or world.is_main
    wrapped = with_chat(task, tokenizer, data.chat_template)
    if wrapped is not task and main:
        print("prompts: rendered with the tokenizer's chat template (data.chat_template="
              f"{data.chat_template}; false turns it off)", flush=True)
    limits = LengthLimits(data.max_prompt_tokens, data.max_length, data.length_policy, with_teacher)
    fitted = fit_lengths(wrapped, tokenizer, limits, positions)
    if fitted is not wrapped:
        fitted.train_examples()
        try:
            fitted.test_examples()
        except DataError as err:
            if "no test split" not in str(err):  # a task without one fails where eval asks for it, as before
                raise
    return fitted


def check_heldout_rows(task) -> None:
    """The task's typed declarations, checked once: a malformed one fails before any work. A task whose rows
    train as written (data=chat) has its held-out rows with a completion tokenized now, as the eval's loss
    reads them, so a bad row is one line before anything is written."""
    rows = task_capabilities(task).row_tokens
    if rows is None:
        return
    try:
        examples = task.test_examples()
    except DataError as err:
        if "no test split" in str(err):  # a run without evals: eval says so where it asks
            return
        raise
    for ex in scored_rows(examples):
        rows(ex)


def model_positions(model) -> int | None:
    """The positions the model has (config.max_position_embeddings), or None when it does not say."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_model(m: ModelConfig, world: World):
    """The configured model + tokenizer: a path (a low-bit export loads on the low-bit path, its
    LowBitLinear modules frozen), the tiny model at random init (`warm_start_steps=0`),
    or the warm-started tiny model from its cache entry, which the warm-start stage
    (trainer/warm_start.py, run by train.py before the session) has built. Weights load in fp32 whatever
    model.dtype says: they are the master weights, and model.dtype is the compute dtype
    (trainer/precision.py: every forward runs under its autocast)."""
    if m.path is not None:  # through the serving door: loaded as its manifest says (a low-bit export on the
        # low-bit path, as the frozen base config validation admits per algorithm; an adapter merged into its base)
        from inference.serving import ServeOptions, load_weights

        options = ServeOptions(dtype="float32", trust_remote_code=m.trust_remote_code)
        return load_weights(os.path.expanduser(m.path), options)
    m = default_model.resolve(m)
    if m.warm_start_steps == 0:
        return build_tiny(default_model.spec(m), m.seed)
    path = default_model.cache_path(m)
    problem = default_model.entry_problem(m, path)
    if problem is not None:
        raise RuntimeError(f"the warm-started default model in {path} is not ready ({problem}): run the warm-start "
                           "stage first (trainer.warm_start.ensure(cfg.model, world); train.py does)")
    if world.is_main:
        print(f"model: warm-started tiny from {path}", flush=True)
    return load_pretrained(path)


def build_session(cfg: TrainConfig, world: World, model=None, tokenizer=None, task=None) -> Session:
    """All ranks call this. Pass model/tokenizer/task to train something already in memory."""
    seed_everything(cfg.seed)
    task = task if task is not None else build_task_from(cfg.data, cfg.model)
    if model is None:
        model, tokenizer = load_model(cfg.model, world)
    task = prompts_for(task, tokenizer, cfg.data, world, model_positions(model),
                       with_teacher=cfg.algo.traits.needs_reference)
    check_heldout_rows(task)
    algo = build_algorithm(cfg.algo)
    caps = capabilities(algo)  # the contract, checked once; the loop never probes the algorithm
    if caps.check_task is not None:  # e.g. self-distillation needs reference solutions: fail before any work
        caps.check_task(task)
    t = cfg.trainer
    positions = model_positions(model)
    preflight = lambda prepared: check_memory_before_training(cfg, world, prepared, task, tokenizer, caps,  # noqa: E731
                                                              positions)
    backend, activations = apply_actor_update(cfg, world, algo, caps, model, preflight)
    if world.is_main:
        print(Precision(cfg.model.dtype).describe(), flush=True)
        for key, why in getattr(cfg, "defaulted", {}).items():  # values load_config chose (trainer/config.py)
            print(f"{key}: {_value(cfg, key)} (unset: the default for {why})", flush=True)
    stream = PromptStream(task.train_examples(), t.batch_size, cfg.seed, world.rank, world.size)
    resume_from = _resume_path(cfg)
    if world.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        moved = set_aside_old_metrics(cfg.output_dir) if resume_from is None else None
        if moved is not None:
            print(f"starting afresh in {cfg.output_dir}: the earlier run's metrics.jsonl was moved to {moved}",
                  flush=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as fh:
            yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    tracker = Tracker(cfg.output_dir, world.is_main, t.max_steps, use_wandb=cfg.logging.wandb,
                      project=cfg.logging.project, run_name=cfg.logging.run_name, config=to_dict(cfg),
                      progress=cfg.logging.progress)
    generator = torch.Generator().manual_seed(cfg.seed + ROLLOUT_SEED_OFFSET * (world.rank + 1))
    session = Session(cfg, world, tokenizer, task, algo, caps, backend, stream, tracker, generator,
                      activations=activations)
    if resume_from is not None:
        resume(session, resume_from)
        if world.is_main:
            print(f"resumed from {resume_from} at step {session.step}", flush=True)
        if tracker.bar is not None:
            tracker.bar.n = session.step
    return session


def _value(cfg: TrainConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def apply_actor_update(cfg: TrainConfig, world: World, algo: Algorithm, caps: Capabilities, model, preflight=None):
    """The model the optimizer updates, with every actor-update option applied in this order:
    1. the algorithm's surgery (LoRA adapters, ...) and what trains;
    2. `preflight(model)` when given (build_session: the pre-flight memory check, which may raise
       MemoryCheckError, or switch trainer.activations under trainer.memory_check=auto);
    3. activation management (trainer.activations: checkpoint / HiLoRe) on the decoder layers;
    4. prompt sharing (trainer.prompt_sharing): the loss's log-probs from one forward per prompt group;
    5. the distributed backend (DDP / FSDP2 / DeepSpeed), which wraps the result.
    Returns (backend, activation manager or None)."""
    t = cfg.trainer
    model = algo.prepare_model(model).to(world.device)
    precision = Precision(cfg.model.dtype)
    cast = masters(model)  # a caller's low-precision model: what the optimizer updates becomes fp32
    if cast and world.is_main:
        print(f"precision: {len(cast)} trainable parameters cast to fp32 master weights (e.g. {cast[0]})", flush=True)
    if caps.plan is not None:  # e.g. QAD's stages over trainer.max_steps
        caps.plan(t.max_steps)
    if preflight is not None:  # before the activation mode is installed: memory_check=auto may change it
        preflight(model)
    activations = install_activations(model, t)
    if t.prompt_sharing:
        assert caps.share_prompts is not None, "config validation admits prompt sharing only for such algorithms"
        caps.share_prompts(shared_prompt_logprobs)
    micro_steps = -(-_per_rank_batch(t.batch_size, world.size) * caps.rows_per_prompt // t.micro_batch_size)
    backend = build_backend(cfg.backend.name, model, t, world, cfg.backend.zero_stage, micro_steps, precision)
    if caps.place_frozen is not None:  # e.g. a separate teacher: sharded like the student under FSDP / ZeRO-3
        caps.place_frozen(backend.shard_frozen)
    return backend, activations


def check_memory_before_training(cfg: TrainConfig, world: World, model, task, tokenizer, caps: Capabilities,
                                 positions: int | None) -> None:
    """The pre-flight memory check (trainer/memory.py) on every rank, on the prepared model before any
    eval or step: raises MemoryCheckError (train.py: one line, exit code 7) when the actor update's worst
    micro-batch is estimated not to fit; under trainer.memory_check=auto it may set
    trainer.activations=checkpoint instead, and says so on the main rank. Its cost: the byte lengths of
    the training rows, the tokenizer on the few that could be the longest, three forwards of <= 64
    tokens; nothing at all with trainer.memory_check=off."""
    if cfg.trainer.memory_check == "off":
        return
    from trainer.memory import check_memory, worst_micro_batch

    batch = worst_micro_batch(cfg, world, task, tokenizer, caps, positions)
    copies = caps.weight_copies(model) if caps.weight_copies is not None else 0  # a frozen teacher, a reference
    line = check_memory(cfg, world, model, batch, copies)
    if line is not None and world.is_main:
        print(line, flush=True)


def install_activations(model, t):
    """The actor-update activation manager for trainer.activations (None for `none`)."""
    if t.activations == "none":
        return None
    from trainer.activations import ActivationConfig, install

    return install(model, ActivationConfig.from_trainer(t))


def _per_rank_batch(batch_size: int, world_size: int) -> int:
    if batch_size % world_size:
        raise ValueError(f"trainer.batch_size={batch_size} is not divisible by the {world_size} ranks")
    return batch_size // world_size


def completed_run(cfg: TrainConfig) -> Optional[tuple[int, str]]:
    """(step, checkpoint) when `output_dir` already holds this run complete: `trainer.resume=auto` would
    resume from a checkpoint at (or past) `trainer.max_steps` and `final/` was exported. Nothing would train."""
    if cfg.trainer.resume != "auto" or not os.path.isdir(os.path.join(cfg.output_dir, "final")):
        return None
    found = checkpoint.complete_checkpoints(cfg.output_dir)
    if not found or found[-1][0] < cfg.trainer.max_steps:
        return None
    return found[-1]


def recorded_evals(output_dir: str) -> list[dict]:
    """The eval records of the run's metrics.jsonl, in order (none when it is missing or unreadable)."""
    path = os.path.join(output_dir, METRICS_FILE)
    try:
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("split") == "eval"
            and len(r) > 2]


def set_aside_old_metrics(output_dir: str) -> Optional[str]:
    """A fresh start (nothing to resume) never appends to an earlier run's metrics.jsonl: it is renamed
    to metrics.jsonl.old-N (the first free N). Returns the new name, or None when there was none."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return None
    n = 1
    while os.path.exists(f"{path}.old-{n}"):
        n += 1
    os.replace(path, f"{path}.old-{n}")
    return f"{path}.old-{n}"


def _resume_path(cfg: TrainConfig):
    r = cfg.trainer.resume
    if r == "never":
        return None
    if r == "auto":
        return checkpoint.latest_checkpoint(cfg.output_dir)
    return os.path.expanduser(r)


def export_final(s: Session) -> str:
    """Write the algorithm's artifact to output_dir/final/ (rank 0), atomically, with its serving
    manifest (`serving.json`: what the runtime's serving door reads, `inference/serving.py`). An
    algorithm whose export keeps the starting model's function (`Traits.keeps_base`: skipper, qad)
    carries the starting export's SEED drafter spec over, so the fast paths stack."""
    from inference.artifacts import carry_drafter_spec
    from inference.serving import write_serving_manifest

    model = s.backend.full_model()
    final = os.path.join(s.cfg.output_dir, "final")
    if s.world.is_main:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        s.algo.export(model, s.tokenizer, tmp)
        if s.cfg.algo.traits.keeps_base and s.cfg.model.path is not None:
            carry_drafter_spec(os.path.expanduser(s.cfg.model.path), tmp)
        write_serving_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    s.world.barrier()
    return final
