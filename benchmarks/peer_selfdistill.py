"""TRL's SDFT trainer beside our OPSD on the same work: the same warm start, data, teacher prompt,
sampling, divergence, schedule and budget, both scored by our verifier.

    nohup python benchmarks/peer_selfdistill.py > /tmp/peer.log 2>&1 &      # TRL, seed 0, 200 steps (~15 min)
    python benchmarks/peer_selfdistill.py --steps 20 --eval-examples 50      # a quick look

TRL side: `trl.experimental.sdft.SDFTTrainer` in one process on the shipped default model of `--data`
(the directory our warm-start stage installs), prompts = our student prompts, the teacher prompt = ours
exactly (`teacher_prompt_template="{privileged_context}"`, set after the config's own check, the
privileged context being our whole teacher prompt: question + reference), teacher `base` (frozen start weights, as our `teacher=fixed`),
`full_logits` JSD with alpha 0.5 (our `beta` 0.5), no importance-sampling clip (each batch is sampled
by the weights it trains, as ours), one completion per prompt at our temperature and top-p, 32 prompts
per step, AdamW lr 3e-5 with betas (0.9, 0.95), 10 warm-up steps then cosine to 0.1 x, grad-norm clip 1.
Held-out accuracy: greedy `generate` on the test split, scored by our task's verifier (the policy
under our student prompt, and under the teacher prompt), before training and every `--eval-every`
steps. Ours: `torchrun --standalone --nproc_per_node=2 train.py +algo=opsd seed=0` (the same settings
are its defaults; its curve is read from the result files of benchmarks/mass_designs.py).

Writes docs/results/peer_selfdistill.json and .md (aside, then renamed); last line JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT_JSON = ROOT / "docs" / "results" / "peer_selfdistill.json"
OUT_MD = ROOT / "docs" / "results" / "peer_selfdistill.md"
OURS = ROOT / "docs" / "results" / "mass_designs"


@torch.no_grad()
def accuracy(model, tok, task, examples, teacher: bool, max_new_tokens: int) -> float:
    """Greedy completions of plain transformers `generate`, scored by the task's verifier."""
    model.eval()
    right = 0
    for start in range(0, len(examples), 32):
        batch = examples[start:start + 32]
        texts = [task.teacher_prompt(ex, ex.solution) if teacher else task.prompt(ex) for ex in batch]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        for ex, row in zip(batch, out[:, enc["input_ids"].shape[1]:]):
            right += bool(task.verify(ex, tok.decode(row, skip_special_tokens=True)).correct)
    model.train()
    return right / len(examples)


def ours(data: str, seed: int) -> dict | None:
    """Our OPSD run at its defaults from benchmarks/mass_designs.py's result file, if there is one."""
    path = OURS / f"{data}-opsd-s{seed}.json"
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    return {"command": run["command"], "evals": [{"step": e["step"], "accuracy": e["accuracy"],
                                                   "teacher_accuracy": e.get("teacher_accuracy")} for e in run["evals"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="arith", choices=["arith", "multipath"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    from algorithms import config_schemas
    from trainer import warm_start
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from

    cfg = load_config(["+algo=opsd", *([f"data={args.data}"] if args.data != "arith" else [])], config_schemas())
    path = warm_start.ensure(cfg.model, World())
    task = build_task_from(cfg.data, cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(args.seed)
    train = list(task.train_examples())[: args.steps * 32]
    test = list(task.test_examples())[: args.eval_examples]
    data = Dataset.from_dict({"prompt": [task.prompt(ex) for ex in train],
                              "privileged_context": [task.teacher_prompt(ex, ex.solution) for ex in train]})
    evals: list[dict] = []

    def evaluate(step: int) -> None:
        row = {"step": step, "accuracy": accuracy(model, tok, task, test, False, args.max_new_tokens),
               "teacher_accuracy": accuracy(model, tok, task, test, True, args.max_new_tokens)}
        evals.append(row)
        print(f"trl sdft step {step}: held-out {row['accuracy']:.3f} (teacher prompt {row['teacher_accuracy']:.3f})",
              flush=True)

    class Evals(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                evaluate(state.global_step)

    c = cfg.algo
    targs = SDFTConfig(
        output_dir=os.path.join("/tmp", f"peer-sdft-{args.data}-{args.seed}"), max_steps=args.steps,
        per_device_train_batch_size=32, gradient_accumulation_steps=1, num_generations=1,
        learning_rate=3e-5, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, warmup_steps=10,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, max_grad_norm=1.0,
        teacher_model_kind="base", distillation_mode="full_logits", distillation_alpha=c.beta,
        distillation_is_clip=None, num_loss_tokens_to_skip=0,
        temperature=c.temperature, top_p=c.top_p, max_completion_length=args.max_new_tokens,
        seed=args.seed, report_to="none", logging_steps=10, save_strategy="no", use_cpu=True, bf16=False)
    # our teacher prompt puts the reference inside the prompt (before "a: "), not after it, so the template is
    # the privileged context alone: set after the config's check, which asks for a {prompt} placeholder
    targs.teacher_prompt_template = "{privileged_context}"
    trainer = SDFTTrainer(model=model, args=targs, train_dataset=data, processing_class=tok, callbacks=[Evals()])
    evaluate(0)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    result = {"data": args.data, "seed": args.seed, "steps": args.steps, "eval_examples": len(test),
              "trl": {"version": __import__("trl").__version__, "evals": evals, "wall_s": round(wall, 1)},
              "ours": ours(args.data, args.seed)}
    lines = ["# TRL's SDFT beside our OPSD (generated by benchmarks/peer_selfdistill.py)", "",
             f"`data={args.data}`, seed {args.seed}, {args.steps} steps x 32 prompts, frozen teacher, JSD(0.5), lr 3e-5; "
             f"held-out accuracy (n={len(test)}), the policy under the teacher prompt in brackets. TRL "
             f"{result['trl']['version']} (`SDFTTrainer`, one process, scored with `generate` + our verifier); ours: "
             f"`{result['ours']['command'] if result['ours'] else 'not run'}`.", "",
             "| step | TRL SDFT | ours (OPSD) |", "|---|---|---|"]
    theirs = {e["step"]: e for e in evals}
    mine = {e["step"]: e for e in (result["ours"] or {"evals": []})["evals"]}
    for step in sorted(set(theirs) | set(mine)):
        cell = lambda e: f"{e['accuracy']:.3f} ({e['teacher_accuracy']:.3f})" if e else ""  # noqa: E731
        lines.append(f"| {step} | {cell(theirs.get(step))} | {cell(mine.get(step))} |")
    from benchmarks.results_io import write_files

    write_files(OUT_JSON.parent, {OUT_JSON.name: json.dumps(result, indent=1), OUT_MD.name: "\n".join(lines) + "\n"})
    print("\n".join(lines))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
