"""How good a target is each self-distillation teacher, token by token? OPSD's full-reference teacher
against MASS's view aggregates, scored against the task's own ground truth on the student's rollouts.

    python benchmarks/mass_teachers.py                 # arith and multipath, 96 questions each (~3 min)
    python benchmarks/mass_teachers.py --data multipath --questions 192

From the shipped default model of each data set: one student rollout per question (the training
temperature and top-p), the teacher passes MASS makes (K masked views, drawn as in training, plus the
full reference), and per completion token the set of **valid next tokens**: the next token of every
valid solution (every valid order on `multipath`, the reference on `arith`) whose text starts with
what the student wrote so far. Tokens after the student's first mistake have no such set and are left
out. A token is **on** the reference's path when the student's text so far is a prefix of the
reference, else **off** it (another valid order). Per teacher:

- `valid mass`: the teacher's probability on the valid next tokens (the student's own, for comparison);
- `top valid`: its top token is a valid one;
- `mass where wrong`: its valid mass where the student sampled an invalid token (the corrections);
- `helpful` / `harmful`: tokens where the student sampled an invalid token and the teacher's top is
  valid / the student's token was valid and the teacher's top is not.

Writes docs/results/mass_teachers.json and docs/results/mass_teachers.md (aside, then renamed).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from algorithms import config_schemas, losses  # noqa: E402
from algorithms.base import RolloutContext  # noqa: E402
from algorithms.mass import MASS, view_evidence  # noqa: E402
from algorithms.rollouts import encode, encode_prompt, rollout_batch, sample  # noqa: E402
from algorithms.scoring import detached_head, predicting, teacher_hidden  # noqa: E402
from models.anatomy import final_hidden  # noqa: E402
from tasks.arith import format_solution  # noqa: E402
from tasks.multipath import steps_of, valid_orders  # noqa: E402
from trainer import warm_start  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.distributed import World  # noqa: E402
from trainer.setup import build_task_from, load_model  # noqa: E402

OUT_JSON = ROOT / "docs" / "results" / "mass_teachers.json"
OUT_MD = ROOT / "docs" / "results" / "mass_teachers.md"
TEACHERS = ("student", "full reference (OPSD)", "geometric", "mean", "backed", "confident", "posterior",
            "posterior + full view")
CLASSES = ("all", "on", "off")


def valid_solutions(task, example, tok) -> tuple[list[list[int]], list[int]]:
    """Token ids (+ EOS) of every valid solution of `example`, and of its reference."""
    eos = [tok.eos_token_id]
    reference = encode(tok, example.solution) + eos
    if getattr(task, "several_paths", False):
        start, ops = task.start_and_ops(example)
        return [encode(tok, format_solution(steps_of(start, order))) + eos for order in valid_orders(start, ops)], reference
    return [reference], reference


def teacher_logps(model, tok, task, algo, full_algo, examples, comps, prompts, batch, c) -> dict[str, torch.Tensor]:
    """(N, V) log-probs per teacher over the batch's completion tokens."""
    sel = batch.loss_mask.bool()
    tokens, starts, width = [x.tokens for x in comps], [len(p) for p in prompts], batch.input_ids.shape[1]
    uids = [ex.uid for ex in examples]
    head = detached_head(model)
    chunk = losses.auto_chunk(head[0].shape[0], c.num_views)

    def views_of(a):
        refs = [a.views(ex, task, tok)[0] for ex in examples]
        hidden = teacher_hidden(model, [[encode_prompt(tok, task.teacher_prompt(ex, r)) for r in rr]
                                        for ex, rr in zip(examples, refs)], tokens, starts, width, 32, batch.input_ids.device, uids)
        return hidden, losses.head_logp(hidden[sel].transpose(0, 1), head, c.temperature)  # (K, N, V)

    hidden, views = views_of(algo)
    evidence = view_evidence(hidden, head, batch.input_ids, sel, c.temperature, chunk)[sel].transpose(0, 1)
    hidden_f, views_f = views_of(full_algo)
    evidence_f = view_evidence(hidden_f, head, batch.input_ids, sel, c.temperature, chunk)[sel].transpose(0, 1)
    full = teacher_hidden(model, [[encode_prompt(tok, task.teacher_prompt(ex, ex.solution))] for ex in examples],
                          tokens, starts, width, 32, batch.input_ids.device, uids)
    student = predicting(final_hidden(model, batch.input_ids, batch.attention_mask))[sel]
    tau = c.confidence_temperature
    return {"student": losses.head_logp(student, head, c.temperature),
            "full reference (OPSD)": losses.head_logp(full[sel][:, 0], head, c.temperature),
            "geometric": losses.aggregate_views(views, "geometric"),
            "mean": losses.aggregate_views(views, "mean"),
            "backed": losses.aggregate_views(views, "backed"),
            "confident": losses.aggregate_views(views, "confident", confidence_temperature=tau),
            "posterior": losses.aggregate_views(views, "posterior", evidence, tau),
            "posterior + full view": losses.aggregate_views(views_f, "posterior", evidence_f, tau)}


@torch.no_grad()
def measure(data: str, questions: int, seed: int) -> dict:
    cfg = load_config(["+algo=mass", f"data={data}"], config_schemas())
    world = World()
    warm_start.ensure(cfg.model, world)
    model, tok = load_model(cfg.model, world)
    model.eval()
    task = build_task_from(cfg.data, cfg.model)
    c = cfg.algo
    algo = MASS(c)
    full_algo = MASS(type(c)(**{**c.__dict__, "full_view": True}))
    ctx = RolloutContext(task, tok, torch.Generator().manual_seed(seed), torch.device("cpu"), cfg.trainer.max_new_tokens,
                         policy_fn=lambda: model)
    examples = list(task.train_examples()[:questions])
    rows = defaultdict(lambda: defaultdict(list))  # class -> teacher -> [(valid mass, top valid, student wrong)]
    for start in range(0, len(examples), 32):
        exs = examples[start:start + 32]
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in exs]
        comps = sample(ctx, prompts, c.temperature, c.top_p)
        batch = rollout_batch(prompts, comps, tok.pad_token_id, ctx.device, [ex.uid for ex in exs])
        logps = teacher_logps(model, tok, task, algo, full_algo, exs, comps, prompts, batch, c)
        i = 0
        for ex, comp in zip(exs, comps):
            solutions, reference = valid_solutions(task, ex, tok)
            for t, token in enumerate(comp.tokens):
                prefix = comp.tokens[:t]
                valid = sorted({s[t] for s in solutions if len(s) > t and s[:t] == prefix})
                if valid:
                    place = "on" if reference[:t] == prefix else "off"
                    wrong = token not in valid
                    for name, lp in logps.items():
                        mass = lp[i, valid].exp().sum().item()
                        top_valid = int(lp[i].argmax()) in valid
                        for cls in ("all", place):
                            rows[cls][name].append((mass, top_valid, wrong))
                i += 1
    result = {"data": data, "questions": len(examples), "num_views": c.num_views, "mask_ratio": c.mask_ratio,
              "confidence_temperature": c.confidence_temperature, "classes": {}}
    for cls in CLASSES:
        if cls not in rows:
            continue
        per = {}
        for name in TEACHERS:
            vals = rows[cls][name]
            n, wrong = len(vals), [v for v in vals if v[2]]
            per[name] = {"valid_mass": sum(v[0] for v in vals) / n, "top_valid": sum(v[1] for v in vals) / n,
                         "mass_where_wrong": sum(v[0] for v in wrong) / max(len(wrong), 1),
                         "helpful": sum(v[1] and v[2] for v in vals), "harmful": sum((not v[1]) and (not v[2]) for v in vals)}
        result["classes"][cls] = {"tokens": len(rows[cls]["student"]),
                                  "student_wrong": sum(v[2] for v in rows[cls]["student"]), "teachers": per}
    return result


def render(results: list[dict]) -> str:
    lines = ["# Self-distillation teachers scored token by token (generated by benchmarks/mass_teachers.py)", "",
             "From the shipped default model of each data set, one student rollout per question; per completion token",
             "the valid next tokens come from every valid solution that starts with the student's text so far (tokens",
             "after the student's first mistake are left out). `on` / `off`: the student's text so far is / is not a",
             "prefix of the reference (off = another valid order, `multipath` only). `helpful`: the student's token is",
             "invalid and the teacher's top is valid; `harmful`: the student's token is valid and the teacher's top is not.",
             ""]
    for r in results:
        lines += [f"## `data={r['data']}` ({r['questions']} questions, K={r['num_views']} views, mask ratio "
                  f"{r['mask_ratio']}, confidence temperature {r['confidence_temperature']})", ""]
        for cls, block in r["classes"].items():
            lines += [f"**{cls}** tokens: {block['tokens']} ({block['student_wrong']} sampled invalid)", "",
                      "| teacher | valid mass | top valid | mass where wrong | helpful | harmful |", "|---|---|---|---|---|---|"]
            for name, m in block["teachers"].items():
                lines.append(f"| {name} | {m['valid_mass']:.3f} | {m['top_valid']:.3f} | {m['mass_where_wrong']:.3f} | "
                             f"{m['helpful']} | {m['harmful']} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", action="append", choices=["arith", "multipath"])
    parser.add_argument("--questions", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = []
    for data in args.data or ["arith", "multipath"]:
        results.append(measure(data, args.questions, args.seed))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "classes"}), flush=True)
    from benchmarks.results_io import write_files

    write_files(OUT_JSON.parent, {OUT_JSON.name: json.dumps(results, indent=1), OUT_MD.name: render(results) + "\n"})
    print(render(results))


if __name__ == "__main__":
    main()
