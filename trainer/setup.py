"""Build a training Session from a validated TrainConfig: world -> task -> model -> algorithm ->
backend -> data stream -> tracker -> (resume). Each piece is one small function."""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import yaml

from algorithms import build_algorithm
from models.loading import load_pretrained
from trainer import checkpoint
from trainer.backends import build_backend
from trainer.config import DataConfig, ModelConfig, TrainConfig, to_dict
from trainer.data import PromptStream, build_task
from trainer.distributed import World
from trainer.loop import Session, resume
from trainer.tracking import Tracker

ROLLOUT_SEED_OFFSET = 1_000_003  # rollout sampling stream, distinct per rank


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_task_from(data: DataConfig):
    templates = {k: v for k, v in (("prompt_template", data.prompt_template),
                                   ("teacher_template", data.teacher_template)) if v is not None}
    if data.name == "arith":
        return build_task("arith", seed=data.seed, n_train=data.n_train, n_test=data.n_test, digits=data.digits,
                          steps=data.steps, ops=tuple(data.ops), **templates)
    return build_task("text", path=data.path, test_path=data.test_path, train_split=data.train_split,
                      test_split=data.test_split, test_fraction=data.test_fraction, seed=data.seed,
                      question_field=data.question_field, solution_field=data.solution_field,
                      answer_field=data.answer_field, on_bad_row=data.on_bad_row,
                      max_examples=data.max_examples, **templates)


def load_model(m: ModelConfig, world: World, seed: int):
    """The configured model + tokenizer: a path, or the embedded tiny model (warm-started and cached)."""
    if m.path is not None:
        return load_pretrained(os.path.expanduser(m.path), m.dtype, m.trust_remote_code)
    from trainer.warm_start import tiny_model

    return tiny_model(m, world, seed)


def build_session(cfg: TrainConfig, world: World, model=None, tokenizer=None, task=None) -> Session:
    """All ranks call this. Pass model/tokenizer/task to train something already in memory."""
    seed_everything(cfg.seed)
    task = task if task is not None else build_task_from(cfg.data)
    if model is None:
        model, tokenizer = load_model(cfg.model, world, cfg.seed)
    algo = build_algorithm(cfg.algo)
    if hasattr(algo, "check_task"):  # e.g. self-distillation needs reference solutions: fail before any work
        algo.check_task(task)
    model = algo.prepare_model(model).to(world.device)
    t = cfg.trainer
    if t.prompt_sharing:
        algo.prompt_sharing = True
    activations = install_activations(model, t)
    per_rank = _per_rank_batch(t.batch_size, world.size)
    micro_steps = -(-per_rank * getattr(algo, "rows_per_prompt", 1) // t.micro_batch_size)
    backend = build_backend(cfg.backend.name, model, t, world, cfg.backend.zero_stage, micro_steps)
    stream = PromptStream(task.train_examples(), t.batch_size, cfg.seed, world.rank, world.size)
    resume_from = _resume_path(cfg)
    if world.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as fh:
            yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    tracker = Tracker(cfg.output_dir, world.is_main, t.max_steps, use_wandb=cfg.logging.wandb,
                      project=cfg.logging.project, run_name=cfg.logging.run_name, config=to_dict(cfg),
                      progress=cfg.logging.progress)
    generator = torch.Generator().manual_seed(cfg.seed + ROLLOUT_SEED_OFFSET * (world.rank + 1))
    session = Session(cfg, world, tokenizer, task, algo, backend, stream, tracker, generator, activations=activations)
    if resume_from is not None:
        resume(session, resume_from)
        if world.is_main:
            print(f"resumed from {resume_from} at step {session.step}", flush=True)
        if tracker.bar is not None:
            tracker.bar.n = session.step
    return session


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


def _resume_path(cfg: TrainConfig):
    r = cfg.trainer.resume
    if r == "never":
        return None
    if r == "auto":
        return checkpoint.latest_checkpoint(cfg.output_dir)
    return os.path.expanduser(r)


def export_final(s: Session) -> str:
    """Write the algorithm's artifact to output_dir/final/ (rank 0), atomically."""
    model = s.backend.full_model()
    final = os.path.join(s.cfg.output_dir, "final")
    if s.world.is_main:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        s.algo.export(model, s.tokenizer, tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    s.world.barrier()
    return final
