"""Worker for tests/algorithms/test_teacher_sharding.py: under torchrun (gloo, 2 ranks) a distill session
with `algo.teacher_path` and the backend named on the command line. Rank 0 prints one JSON line:
- the teacher's parameter bytes on this rank and in the whole model;
- the largest gap between the placed teacher's logits (hidden states from `teacher_hidden`, projected through
  `detached_head`) and the same teacher loaded whole on one rank, on fixed rows;
- whether `lockstep_greedy` through the placed teacher gives the whole teacher's greedy completions;
- the train and eval records of a 2-step run (the teacher's held-out accuracy among them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from algorithms.scoring import detached_head, teacher_hidden  # noqa: E402
from algorithms.teacher import local_bytes, lockstep_greedy  # noqa: E402
from models.anatomy import head_logits  # noqa: E402
from models.loading import load_pretrained  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from trainer.distributed import init_world, shutdown  # noqa: E402
from trainer.loop import fit  # noqa: E402
from trainer.setup import build_session  # noqa: E402


def main() -> None:
    out, teacher_dir, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    world = init_world(600)
    cfg = tiny_config(out, f"algo.teacher_path={teacher_dir}", "algo.teacher_dtype=float32", "trainer.max_steps=2",
                      "trainer.batch_size=4", "trainer.micro_batch_size=2", "trainer.max_new_tokens=16",
                      "trainer.eval_max_new_tokens=16", "trainer.eval_every=2", "trainer.extra_eval_examples=6",
                      *backend, algo="distill")
    session = build_session(cfg, world)
    whole, tok = load_pretrained(teacher_dir)
    whole.eval()
    prompts = ["q: 12+7=? a:", "q: 3*4=? a:", "q: 50-8=?"]
    views = [[tok(p, add_special_tokens=False).input_ids] for p in prompts]
    completions = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    starts = [len(v[0]) for v in views]
    width = max(s + len(c) for s, c in zip(starts, completions))
    with session.algo.teacher.weights(session.backend.full_model()) as teacher, torch.no_grad():
        sharded_bytes = local_bytes(teacher)
        placed = head_logits(teacher_hidden(teacher, views, completions, starts, width, 2, world.device),
                             detached_head(teacher))
        reference = head_logits(teacher_hidden(whole, views, completions, starts, width, 2, world.device),
                                detached_head(whole))
        texts = lockstep_greedy(teacher, tok, prompts[world.rank:], 12)  # each rank its own rows: lengths differ
    whole_texts = lockstep_greedy(whole, tok, prompts[world.rank:], 12)
    report = {"rank_bytes": sharded_bytes, "full_bytes": local_bytes(whole), "sharded": session.algo.teacher.sharded,
              "logit_gap": float((placed - reference).abs().max()),
              "greedy_equal": world.gather_objects(texts == whole_texts)}
    assert fit(session) == "done"
    session.tracker.close()
    if world.is_main:
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        report["records"] = records
        print("REPORT " + json.dumps(report), flush=True)
    shutdown(world, 0)


if __name__ == "__main__":
    main()
