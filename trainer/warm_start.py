"""The embedded default model: tiny Qwen3 + character tokenizer, warm-started by our own SFT on
`data=arith`, built on first use and cached under `model.cache_dir/tiny-<recipe hash>/`.

The recipe (architecture, data, steps, lr, seed, RECIPE_VERSION) is hashed into the directory
name, so changing any of it builds a new model; the same recipe on the same machine gives the same
weights. Part of the warm-up prompts carry the reference solution (full, or with steps masked), so
the warm model can read a privileged reference -- without that, the self-teacher of the
distillation algorithms would be no better than the student.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time

import torch

from models.loading import TinySpec, build_tiny, load_pretrained
from trainer.distributed import World

RECIPE_VERSION = 2
DONE = "warm_start.json"
# Same seed as the default data=arith, so the warm-up trains on its train split only and never sees
# its held-out questions.
WARM_DATA = {"seed": 0, "n_train": 20000, "n_test": 200, "digits": 2, "steps": 2, "ops": ["+", "-"]}
WARM_EVAL_EXAMPLES = 100
WARM_MICRO_BATCH = 32  # two length-grouped micro-batches: student rows and (longer) reference rows


def recipe(m, seed: int) -> dict:
    return {
        "version": RECIPE_VERSION,
        "spec": dataclasses.asdict(TinySpec(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size)),
        "seed": seed,
        "steps": m.warm_start_steps,
        "lr": m.warm_start_lr,
        "batch_size": m.warm_start_batch_size,
        "reference_fraction": m.warm_start_reference_fraction,
        "data": WARM_DATA,
    }


def cache_path(m, seed: int) -> str:
    key = hashlib.sha256(json.dumps(recipe(m, seed), sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser(m.cache_dir), f"tiny-{key}")


def tiny_model(m, world: World, seed: int):
    """Model + tokenizer for model=tiny. Rank 0 builds the cache entry if missing; others wait."""
    spec = TinySpec(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size)
    if m.warm_start_steps == 0:
        return build_tiny(spec, seed)
    path = cache_path(m, seed)
    if world.is_main and not os.path.exists(os.path.join(path, DONE)):
        print(f"building the warm-started tiny model (once) in {path}", flush=True)
        build(m, seed, path)
    world.barrier()
    if world.is_main:
        print(f"model: warm-started tiny from {path}", flush=True)
    return load_pretrained(path)


def build(m, seed: int, path: str) -> None:
    """SFT the random tiny model on arith in this process (all cores), then publish atomically."""
    from algorithms.sft import SFTConfig
    from trainer.config import BackendConfig, DataConfig, LoggingConfig, TrainConfig, TrainerConfig
    from trainer.loop import fit
    from trainer.setup import build_session, build_task_from, export_final

    r = recipe(m, seed)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = TrainConfig(
        output_dir=tmp, seed=seed, model=m, data=DataConfig(name="arith", **{**WARM_DATA, "ops": list(WARM_DATA["ops"])}),
        backend=BackendConfig(name="single"), logging=LoggingConfig(wandb=False),
        trainer=TrainerConfig(max_steps=r["steps"], batch_size=r["batch_size"], micro_batch_size=WARM_MICRO_BATCH,
                              lr=r["lr"], warmup_steps=max(1, r["steps"] // 20), min_lr_ratio=0.05,
                              eval_every=max(1, r["steps"] // 3), eval_examples=WARM_EVAL_EXAMPLES, save_every=10**9, resume="never"),
        algo=SFTConfig(reference_fraction=r["reference_fraction"], seed=seed),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # torchrun sets 1 thread per worker; this runs alone
    started = time.perf_counter()
    try:
        model, tokenizer = build_tiny(TinySpec(**r["spec"]), seed)
        session = build_session(cfg, World(), model=model, tokenizer=tokenizer, task=build_task_from(cfg.data))
        fit(session)
        session.tracker.close()
        export_final(session)
        shutil.copy(os.path.join(tmp, "metrics.jsonl"), os.path.join(tmp, "final", "warm_start_metrics.jsonl"))
        accuracy = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl")) if '"eval"' in l][-1]["accuracy"]
        with open(os.path.join(tmp, "final", DONE), "w") as fh:
            json.dump({"recipe": r, "seconds": time.perf_counter() - started, "accuracy": accuracy}, fh, indent=1)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.replace(os.path.join(tmp, "final"), path)  # atomic publish
        except OSError:
            if not os.path.exists(os.path.join(path, DONE)):
                raise
            # Another job published the same recipe first; same recipe + seed gives the same weights.
        print(f"warm start done in {time.perf_counter() - started:.0f}s, held-out accuracy {accuracy:.2f}", flush=True)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
