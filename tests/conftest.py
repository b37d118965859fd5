"""Shared fixtures: tiny configs that train in seconds on CPU."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Each test process uses one thread: two cores shared with torchrun workers and pytest itself
# oversubscribe badly otherwise (measured: 2 threads under contention ran a step 8x slower).
torch.set_num_threads(1)

TINY_MODEL = ["model=tiny_init", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
              "model.intermediate_size=128"]
# Each task's tiny sizes (a run validates only its task's keys); data=text reads a test's own file.
TINY_SIZES = ["data.n_train=512", "data.n_test=32"]
TINY_DATA = {"arith": ["data.digits=2", "data.steps=1", *TINY_SIZES], "artifacts": TINY_SIZES, "clm": TINY_SIZES,
             "text": [], "chat": []}
TINY_DATA["multipath"] = TINY_DATA["arith"]
TINY_TRAINER = [
    "trainer.batch_size=8", "trainer.micro_batch_size=4", "trainer.eval_every=1000", "trainer.eval_examples=8",
    "trainer.eval_max_new_tokens=40", "trainer.save_every=1000", "trainer.warmup_steps=1", "trainer.lr=3e-3",
    "logging.wandb=false", "logging.progress=false",
]
TINY = [*TINY_MODEL, *TINY_DATA["arith"], *TINY_TRAINER]


def run_task(algo: str, overrides) -> str:
    """The task a run trains on: its `data=NAME` override, else the one configs/algo/ALGO.yaml selects
    (`override /data: NAME` in its defaults list), else arith (configs/train.yaml)."""
    from omegaconf import OmegaConf

    for arg in reversed(list(overrides)):
        if arg.startswith("data="):
            return arg.split("=", 1)[1]
    for entry in OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "algo" / f"{algo}.yaml")).get("defaults", []):
        if isinstance(entry, dict) and "override /data" in entry:
            return entry["override /data"]
    return "arith"


def tiny_overrides(out_dir, *extra: str, algo: str = "sft") -> list[str]:
    return [f"+algo={algo}", *TINY_MODEL, *TINY_DATA.get(run_task(algo, extra), []), *TINY_TRAINER,
            f"output_dir={out_dir}", *extra]


def tiny_config(out_dir, *extra: str, algo: str = "sft"):
    from algorithms import config_schemas
    from trainer.config import load_config

    return load_config(tiny_overrides(out_dir, *extra, algo=algo), config_schemas())


@pytest.fixture
def subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["WANDB_MODE"] = "disabled"
    return env


def torchrun_train(out, env, *overrides: str, algo: str, nproc: int = 2, timeout: int = 420) -> list[dict]:
    """`torchrun --standalone --nproc_per_node=N train.py +algo=ALGO` on the tiny config; asserts it
    succeeded and returns the metrics.jsonl records."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *tiny_overrides(out, *overrides, algo=algo)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    records.append({"split": "stdout", "text": proc.stdout})
    return records
