"""GRPO's update with and without skipping the micro-batches whose advantages are all zero, side by side.

One rollout batch from a random-init Qwen3-architecture model (`--hidden`, `--layers`; the character
tokenizer), `--prompts` x G=8 completions of up to `--new-tokens` tokens. Its advantages are then set
by micro-batch: the first `--zero` micro-batches (in the trainer's order) get all-zero advantages (a
group whose rollouts all got the same reward), the others non-zero ones. `train_step` runs that same
batch alternately with skipping (the default) and with it switched off (every micro-batch runs),
`--repeats` times each from the same starting weights; reported: the median seconds per update (the
rollout is not timed), the ratio, and whether the two runs' weights after one update are identical.
Last line JSON.

    python benchmarks/grpo_skip.py                       # 4 of 8 micro-batches zero
    python benchmarks/grpo_skip.py --zero 6 --repeats 5
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import rollout_context, train_step
    from trainer.setup import build_session

    group, micro = 8, args.micro
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(["+algo=grpo", "model=tiny_init", f"model.hidden_size={args.hidden}",
                           f"model.num_layers={args.layers}", f"model.num_heads={args.hidden // 64}",
                           f"model.intermediate_size={4 * args.hidden}", f"algo.num_generations={group}",
                           f"trainer.batch_size={args.prompts}", f"trainer.micro_batch_size={micro}",
                           f"trainer.max_new_tokens={args.new_tokens}", "trainer.warmup_steps=0",
                           "logging.wandb=false", "logging.progress=false", f"output_dir={tmp}/run"],
                          config_schemas())
        s = build_session(cfg, World())
        batch = s.algo.make_batch(s.stream.next_batch(), rollout_context(s))
        order = torch.sort(batch.attention_mask.sum(1), stable=True).indices
        adv = torch.linspace(-1.0, 1.0, len(batch)) + 1e-3  # non-zero everywhere ...
        adv[order[: args.zero * micro]] = 0.0  # ... but in the first `zero` micro-batches
        batch.policy.advantages = adv
        start = copy.deepcopy(s.backend.train_model.state_dict())
        optim = copy.deepcopy(s.backend.optimizer.state_dict())
        sched = copy.deepcopy(s.backend.scheduler.state_dict())
        caps = {"skip": s.caps, "full": dataclasses.replace(s.caps, zero_loss=None)}
        times: dict[str, list[float]] = {"skip": [], "full": []}
        after: dict[str, dict] = {}
        for _ in range(args.repeats):
            for mode in ("full", "skip"):
                s.backend.train_model.load_state_dict(start)
                s.backend.optimizer.load_state_dict(optim)
                s.backend.scheduler.load_state_dict(sched)
                s.caps, s.step = caps[mode], 1
                t0 = time.perf_counter()
                record = train_step(s, batch)
                times[mode].append(time.perf_counter() - t0)
                after[mode] = {k: v.clone() for k, v in s.backend.train_model.state_dict().items()}
        s.tracker.close()
    full, skip = statistics.median(times["full"]), statistics.median(times["skip"])
    return {"rows": len(batch), "micro_batches": -(-len(batch) // micro), "zero_micro_batches": args.zero,
            "skipped": record["grpo/skipped_micro_batches"], "full_s": full, "skip_s": skip, "ratio": full / skip,
            "identical_weights": all(torch.equal(after["full"][k], after["skip"][k]) for k in after["full"]),
            "times": times, "hidden": args.hidden, "layers": args.layers, "tokens": int(batch.attention_mask.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--zero", type=int, default=4, help="micro-batches with all-zero advantages")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "docs", "results"),
                    help="where grpo_skip-zeroN.json and .md are written, one pair per --zero ('' for nowhere)")
    args = ap.parse_args()
    r = run(args)
    print(f"GRPO update, {r['rows']} rows ({r['tokens']} tokens) in {r['micro_batches']} micro-batches, "
          f"{r['zero_micro_batches']} of them all-zero advantages (hidden {r['hidden']}, {r['layers']} layers)")
    print(f"  every micro-batch runs   {r['full_s']:7.3f} s")
    print(f"  zero ones skipped ({r['skipped']:.0f})  {r['skip_s']:7.3f} s")
    print(f"  speed-up {r['ratio']:.2f}x; weights after the update identical: {r['identical_weights']}")
    if args.out:
        write_results(r, args.out)
    print(json.dumps(r))


def render(r: dict) -> str:
    """The run's table, from its JSON."""
    from benchmarks.results_io import provenance_lines

    return "\n".join([
        "# GRPO's update with and without skipping all-zero micro-batches (generated by benchmarks/grpo_skip.py)", "",
        *provenance_lines(r.get("meta")),
        f"A random-init {r['layers']}-layer hidden-{r['hidden']} model; {r['rows']} rows ({r['tokens']} tokens) in "
        f"{r['micro_batches']} micro-batches, {r['zero_micro_batches']} of them with all-zero advantages; median "
        "seconds per update.", "",
        "| every micro-batch runs | zero ones skipped | micro-batches skipped | speed-up | weights identical |",
        "|---|---|---|---|---|",
        f"| {r['full_s']:.3f} s | {r['skip_s']:.3f} s | {r['skipped']:.0f} | {r['ratio']:.2f}x | {r['identical_weights']} |",
    ]) + "\n"


def write_results(r: dict, out: str) -> None:
    """grpo_skip-zeroN.json and .md under `out`, each written aside and renamed into place."""
    from benchmarks.results_io import write_report

    write_report(out, f"grpo_skip-zero{r['zero_micro_batches']}", r, render)


if __name__ == "__main__":
    main()
