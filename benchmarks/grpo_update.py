"""The GRPO actor update, side by side in one run:

1. activations (benchmarks/hilore_bench.py): `none` / `checkpoint` / `hilore` on a CPU-sized model
   deep and wide enough that activations dominate -- step time, peak memory (each mode in its own
   process), gradient cosine vs exact;
2. prompt sharing (benchmarks/augtree_bench.py): flattened vs shared-prompt (1 process) vs context
   parallel on 2 ranks (both replay modes), prompt 1024 tokens, G = 8, responses 64;
3. GRPO end to end: our trainer (+algo=grpo) vs TRL's GRPOTrainer on the same warm-started tiny model,
   data, reward (the arith step-checking verifier) and settings (8 prompts x G=8, 160 new tokens,
   temperature 1, lr 3e-5, token-mean loss, no KL, no gradient checkpointing): steps/s.

    python benchmarks/grpo_update.py                  # all three
    python benchmarks/grpo_update.py --parts trl --trl-steps 3

Prints one table per part; the last line is JSON with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def ours_vs_trl(steps: int, prompts: int, group: int, max_new_tokens: int, lr: float, threads: int) -> dict:
    """Mean seconds per GRPO step (rollouts + update) of our trainer and of TRL's GRPOTrainer."""
    import torch

    torch.set_num_threads(threads)
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import rollout_context, train_step
    from trainer.setup import build_session

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(["+algo=grpo", f"algo.num_generations={group}", f"trainer.batch_size={prompts}",
                           "trainer.micro_batch_size=16", f"trainer.max_new_tokens={max_new_tokens}",
                           f"trainer.lr={lr}", f"trainer.max_steps={steps}", "trainer.warmup_steps=0",
                           "logging.wandb=false", "logging.progress=false", f"output_dir={tmp}/ours"],
                          config_schemas())
        s = build_session(cfg, World())
        ours = []
        for _ in range(steps):
            start = time.perf_counter()
            s.step += 1
            train_step(s, s.algo.make_batch(s.stream.next_batch(), rollout_context(s)))
            ours.append(time.perf_counter() - start)
        trl_times = _trl_steps(cfg, steps, prompts, group, max_new_tokens, lr, tmp)  # the same warm start, reloaded
    ours_s = sorted(ours)[len(ours) // 2]
    trl_s = sorted(trl_times)[len(trl_times) // 2]
    return {"ours_s_per_step": ours_s, "trl_s_per_step": trl_s, "ours_steps_per_s": 1 / ours_s,
            "trl_steps_per_s": 1 / trl_s, "speedup": trl_s / ours_s, "ours_all": ours, "trl_all": trl_times}


def _trl_steps(cfg, steps: int, prompts: int, group: int, max_new_tokens: int, lr: float, tmp: str) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks import score
    from trainer.distributed import World
    from trainer.setup import build_task_from, load_model
    from trainer.warm_start import ensure

    ensure(cfg.model, World())
    model, tok = load_model(cfg.model, World())
    task = build_task_from(cfg.data)
    examples = task.train_examples()
    data = Dataset.from_list([{"prompt": task.prompt(ex), "idx": i} for i, ex in enumerate(examples[:4096])])

    def reward(prompts, completions, idx, **_):
        return [score(task.verify(examples[i], text), "steps") for i, text in zip(idx, completions)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    rows = prompts * group
    args = GRPOConfig(output_dir=f"{tmp}/trl", per_device_train_batch_size=min(16, rows),
                      gradient_accumulation_steps=max(1, rows // 16), num_generations=group,
                      max_completion_length=max_new_tokens, temperature=1.0, learning_rate=lr, max_steps=steps,
                      logging_steps=1, report_to=[], use_cpu=True, beta=0.0, loss_type="dapo", save_strategy="no",
                      bf16=False, gradient_checkpointing=False, disable_tqdm=True, warmup_steps=0)
    GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                callbacks=[Timer()]).train()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="activations,sharing,trl")
    ap.add_argument("--trl-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"),
                    help="where grpo_update.json and .md (the tables) are written ('' for nowhere)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    results: dict = {}
    if "activations" in parts:
        import hilore_bench

        results["activations"] = hilore_bench.run(threads=args.threads)
        print(hilore_bench.report(results["activations"]), flush=True)
    if "sharing" in parts:
        import augtree_bench

        results["sharing"] = augtree_bench.run()
        print("\n" + augtree_bench._table(results["sharing"]), flush=True)
    if "trl" in parts:
        r = ours_vs_trl(args.trl_steps, prompts=8, group=8, max_new_tokens=160, lr=3e-5, threads=args.threads)
        results["trl"] = r
        print("\nGRPO step (8 prompts x 8 completions, <= 160 new tokens; median of "
              f"{args.trl_steps} steps, {args.threads} thread(s))")
        print(f"  ours  {r['ours_s_per_step']:7.2f} s/step  {r['ours_steps_per_s']:.3f} steps/s")
        print(f"  TRL   {r['trl_s_per_step']:7.2f} s/step  {r['trl_steps_per_s']:.3f} steps/s")
        print(f"  ours / TRL throughput: {r['speedup']:.2f}x")
    results["args"] = vars(args)
    if args.out:
        write_results(results, args.out)
    print(json.dumps(results, default=float))


def render(results: dict) -> str:
    """grpo_update.md: each part's table, from the run's JSON (the parts' own report functions)."""
    from benchmarks.results_io import provenance_lines

    out = ["# The GRPO actor update (generated by benchmarks/grpo_update.py)", "", *provenance_lines(results.get("meta"))]
    if "activations" in results:
        import hilore_bench

        out += ["## Activations (benchmarks/hilore_bench.py)", "", "```", hilore_bench.report(results["activations"]),
                "```", ""]
    if "sharing" in results:
        import augtree_bench

        out += ["## Prompt sharing (benchmarks/augtree_bench.py)", "", "```", augtree_bench._table(results["sharing"]),
                "```", ""]
    if "trl" in results:
        r = results["trl"]
        out += ["## A GRPO step, ours vs TRL's GRPOTrainer", "",
                f"8 prompts x 8 completions, <= 160 new tokens, the same warm-started tiny model, reward and settings; "
                f"median of {results['args']['trl_steps']} steps, {results['args']['threads']} thread(s).", "",
                "| | s/step | steps/s |", "|---|---|---|",
                f"| ours | {r['ours_s_per_step']:.2f} | {r['ours_steps_per_s']:.3f} |",
                f"| TRL | {r['trl_s_per_step']:.2f} | {r['trl_steps_per_s']:.3f} |", "",
                f"Ours / TRL throughput: {r['speedup']:.2f}x.", ""]
    return "\n".join(out)


def write_results(results: dict, out: str) -> None:
    """grpo_update.json and .md under `out`, each written aside and renamed into place."""
    from benchmarks.results_io import write_report

    write_report(out, "grpo_update", results, render)


if __name__ == "__main__":
    main()
