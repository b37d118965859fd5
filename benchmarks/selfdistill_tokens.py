"""Which tokens carry OPSD's loss as a run goes on, and what the teacher teaches there.

One OPSD run on `data=arith` from the shipped default model (in-process, `--steps` steps of `--batch`
rollouts, `--teacher` weights: `current` reproduces the decline, `fixed` is the default that holds). At
step 0 and after each segment (`--at`) the same `--questions` training questions are rolled out once
each (the training temperature and top-p, a fixed generator) and every completion token is scored with
the loss the run trains on (JSD(beta) between the student prompt and the teacher prompt over the
vocabulary, both at the training temperature, the teacher's weights as the run has them). Tokens fall in
classes by where the student's text stands against the reference (arith has one solution path):

- `working, on` / `answer line, on` / `end, on`: the student's text so far equals the reference's prefix,
  and the reference's next token is in the working lines / in the `####` line / the end of text;
- `first error, on`: the student's first token that differs from the reference's (its text so far was the
  reference's prefix): where its error is, and what the teacher says there;
- `off`: the student's text has left the reference (after its first wrong token).

Per class and step: share of tokens, share of the summed divergence (the loss, hence the gradient's
weight), the teacher's probability of the reference's next token (on the path: how right the target is),
and off the path the teacher's probability of the reference's token at the same position (how hard it
pulls toward text the student's own prefix contradicts), plus held-out accuracy of both prompts.

    python benchmarks/selfdistill_tokens.py                       # current teacher, 300 steps (~15 min)
    python benchmarks/selfdistill_tokens.py --teacher fixed
    python benchmarks/selfdistill_tokens.py --teacher fixed --lr 1e-3 --steps 200 --at 50,100,200 \
        --extra algo.beta=1.0 --tag lr1e-3-beta1     # another rate / loss: its own file (-TAG)

Writes docs/results/selfdistill_tokens-TEACHER[-TAG].json and .md (aside, then renamed); last line JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from algorithms import config_schemas, losses  # noqa: E402
from algorithms.base import RolloutContext  # noqa: E402
from algorithms.rollouts import encode, encode_prompt, rollout_batch, sample  # noqa: E402
from algorithms.scoring import detached_head, predicting, teacher_hidden  # noqa: E402
from models.anatomy import final_hidden  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.distributed import World  # noqa: E402
from trainer.loop import fit  # noqa: E402
from trainer.setup import build_session  # noqa: E402

CLASSES = ("working, on", "answer line, on", "end, on", "first error, on", "off")
ANSWER = "####"


def classes_of(tok, reference: list[int], tokens: list[int]) -> list[str]:
    """Per completion token: its class (module docstring); `reference` ends with EOS."""
    out = []
    answer_from = next((i for i, t in enumerate(reference) if ANSWER[0] in tok.decode([t])), None)  # the #### line
    left = False
    for t in range(len(tokens)):
        left = left or t >= len(reference) or (t > 0 and tokens[t - 1] != reference[t - 1])  # sticky: once off
        if left:
            out.append("off")
        elif tokens[t] != reference[t]:  # the prefix was the reference's: this is where the student errs
            out.append("first error, on")
        elif t == len(reference) - 1:
            out.append("end, on")
        elif answer_from is not None and t >= answer_from:
            out.append("answer line, on")
        else:
            out.append("working, on")
    return out


@torch.no_grad()
def score(session, examples, seed: int) -> dict:
    """The class table of the current weights and the run's teacher (module docstring)."""
    model = session.backend.full_model()
    was = model.training
    model.eval()
    try:
        with session.algo.teacher.weights(model) as teacher:  # the run's teacher weights (fixed: the step-0 copy)
            return _score(model, teacher, session, examples, seed)
    finally:
        model.train(was)


def _score(model, teacher, session, examples, seed: int) -> dict:
    c, tok, task = session.cfg.algo, session.tokenizer, session.task
    ctx = RolloutContext(task, tok, torch.Generator().manual_seed(seed), torch.device("cpu"),
                         session.cfg.trainer.max_new_tokens, policy_fn=lambda: model)
    sums = defaultdict(lambda: defaultdict(float))
    for start in range(0, len(examples), 32):
        exs = examples[start:start + 32]
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in exs]
        comps = sample(ctx, prompts, c.temperature, c.top_p)
        batch = rollout_batch(prompts, comps, tok.pad_token_id, ctx.device, [ex.uid for ex in exs])
        sel = batch.loss_mask.bool()
        tokens = [list(x.tokens) for x in comps]
        hidden = teacher_hidden(teacher, [[encode_prompt(tok, task.teacher_prompt(ex, ex.solution))] for ex in exs],
                                tokens, [len(p) for p in prompts], batch.input_ids.shape[1], 32, ctx.device,
                                [ex.uid for ex in exs])
        t_logp = losses.head_logp(hidden[sel][:, 0], detached_head(teacher), c.temperature)  # (N, V)
        s_logp = losses.head_logp(predicting(final_hidden(model, batch.input_ids, batch.attention_mask))[sel],
                                  detached_head(model), c.temperature)
        div = losses.generalized_jsd(s_logp, t_logp, c.beta)  # (N,)
        i = 0
        for ex, toks in zip(exs, tokens):
            reference = encode(tok, ex.solution) + [tok.eos_token_id]
            for t, cls in enumerate(classes_of(tok, reference, toks)):
                row = sums[cls]
                row["tokens"] += 1
                row["divergence"] += float(div[i])
                if t < len(reference):  # the reference's token here: the next one on the path, or the one it
                    row["teacher_ref_prob"] += float(t_logp[i, reference[t]].exp())  # would write at this place
                    row["student_ref_prob"] += float(s_logp[i, reference[t]].exp())
                    row["with_ref"] += 1
                i += 1
    total_tokens = sum(r["tokens"] for r in sums.values())
    total_div = sum(r["divergence"] for r in sums.values())
    return {cls: {"token_share": r["tokens"] / total_tokens, "loss_share": r["divergence"] / max(total_div, 1e-12),
                  "mean_divergence": r["divergence"] / r["tokens"],
                  "teacher_ref_prob": r["teacher_ref_prob"] / max(r["with_ref"], 1),
                  "student_ref_prob": r["student_ref_prob"] / max(r["with_ref"], 1)}
            for cls, r in sums.items()} | {"tokens": total_tokens}


def render(result: dict) -> str:
    lines = [f"# Where OPSD's loss goes, teacher `{result['teacher']}` (generated by benchmarks/selfdistill_tokens.py)",
             "", f"`{result['command']}`: {result['questions']} training questions, one rollout each, per checkpoint. "
             "Shares are of the completion tokens and of the summed JSD (the loss); `p_T(ref)` / `p_S(ref)`: the "
             "teacher's / student's probability of the reference's token at that place." +
             (f" lr {result['lr']:g}; overrides: `{' '.join(result['overrides'])}`." if "lr" in result else ""), "",
             "| step | held-out (teacher prompt) | class | tokens | loss share | mean JSD | p_T(ref) | p_S(ref) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["steps"]:
        head = f"{row['accuracy']:.3f} ({row['teacher_accuracy']:.3f})"
        for cls in CLASSES:
            if cls in row["classes"]:
                r = row["classes"][cls]
                lines.append(f"| {row['step']} | {head} | {cls} | {r['token_share']:.3f} | {r['loss_share']:.3f} | "
                             f"{r['mean_divergence']:.4f} | {r['teacher_ref_prob']:.3f} | {r['student_ref_prob']:.3f} |")
                head = ""
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="current")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", default="25,100,200,300", help="steps after which to score (and evaluate)")
    ap.add_argument("--batch", type=int, default=16, help="rollouts per step")
    ap.add_argument("--questions", type=int, default=96)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="trainer.lr (default: OPSD's default on the tiny model)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides, e.g. algo.beta=1.0 algo.temperature=1.0")
    ap.add_argument("--tag", default="", help="names the result file (selfdistill_tokens-TEACHER-TAG)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["+algo=opsd", f"algo.teacher={args.teacher}", f"trainer.batch_size={args.batch}",
                     f"trainer.max_steps={args.steps}", f"trainer.eval_examples={args.eval}", f"seed={args.seed}",
                     "trainer.eval_every=100000", "trainer.save_every=100000", "logging.wandb=false",
                     "logging.progress=false", "trainer.resume=never",
                     *([f"trainer.lr={args.lr:g}"] if args.lr is not None else []), *args.extra]
        cfg = load_config([*overrides, f"output_dir={tmp}"], config_schemas())
        session = build_session(cfg, World())
        examples = list(session.task.train_examples())[: args.questions]
        rows = [{"step": 0, "classes": score(session, examples, args.seed + 1000)}]  # before any eval or step
        for stop in [int(x) for x in args.at.split(",")]:
            session.cfg.trainer.max_steps = stop
            fit(session)  # trains to `stop` and evaluates there (and, on the first call, at step 0 first)
            rows.append({"step": stop, "classes": score(session, examples, args.seed + 1000)})
        for row in rows:
            ev = next(e for e in session.evals if e["step"] == row["step"])
            row.update(accuracy=ev["accuracy"], teacher_accuracy=ev.get("teacher_accuracy"))
            print(f"step {row['step']}: held-out {ev['accuracy']:.3f} (teacher prompt {ev.get('teacher_accuracy', 0):.3f}); "
                  + ", ".join(f"{k} loss {v['loss_share']:.2f} / tokens {v['token_share']:.2f}"
                              for k, v in row["classes"].items() if k != "tokens"), flush=True)
        session.tracker.close()
    from benchmarks.results_io import provenance, write_files

    result = {"teacher": args.teacher, "questions": len(examples), "steps": rows, "lr": cfg.trainer.lr,
              "overrides": overrides, "command": "python benchmarks/selfdistill_tokens.py " + " ".join(sys.argv[1:]),
              "meta": provenance()}
    stem = f"selfdistill_tokens-{args.teacher}" + (f"-{args.tag}" if args.tag else "")
    write_files(args.out, {stem + ".json": json.dumps(result, indent=1), stem + ".md": render(result)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
