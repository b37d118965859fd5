"""Worker for tests/trainer/test_checkpoint_safety.py: under torchrun (gloo, 2 ranks) train 2 steps with
the given backend, then for every state file of the step-2 checkpoint (and each way of breaking it) try to
resume from a broken copy. Every rank must raise CheckpointError (no rank hangs in a collective the other
never reaches); rank 0 prints one JSON line per file: {"file", "ranks", "errors"}."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import tiny_config  # noqa: E402
from tests.trainer.ckpt_cases import KINDS, broken_copy, state_files  # noqa: E402
from trainer.checkpoint import CheckpointError  # noqa: E402
from trainer.distributed import init_world, shutdown  # noqa: E402
from trainer.loop import fit  # noqa: E402
from trainer.setup import build_session  # noqa: E402


def main() -> None:
    root, marker, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    world = init_world(600)
    session = build_session(tiny_config(root / "run", "trainer.max_steps=2", "trainer.save_every=2", *backend), world)
    fit(session)
    session.tracker.close()
    good = root / "run" / "checkpoints" / "step_2"
    files = state_files(good) if world.is_main else None
    files = world.broadcast_object(files)
    for rel in files:
        errors = []
        for kind in KINDS:
            case = root / "case"
            if world.is_main:
                broken_copy(good, case, rel, kind, marker)
            world.barrier()
            cfg = tiny_config(root / "resumed", "trainer.max_steps=3", f"trainer.resume={case}", *backend)
            try:
                build_session(cfg, world)
                message = None
            except CheckpointError as err:
                message = str(err)
            gathered = world.gather_objects((world.rank, message))
            world.barrier()
            errors.append(gathered)
        if world.is_main:
            ranks = sorted({r for g in errors for r, m in g if m is not None})
            messages = [m for g in errors for _, m in g]
            print(json.dumps({"file": rel, "ranks": ranks if all(m is not None for m in messages) else [],
                              "errors": [m for m in messages if m is not None]}), flush=True)
    shutdown(world, 0)


if __name__ == "__main__":
    main()
