"""Layer skipping that turns into decode speed: trained skippers, and dense vs naive vs routed decoding.

The model is deep and competent: the embedded 4-layer warm start deepened to 12 layers by identity
blocks (`benchmarks/speculative.py: build_upscaled`, same function and accuracy), trained with
`+algo=skipper` at each `--targets` skip ratio (routers + adapters on the upper half, base frozen;
cached in `--workdir`). Reported per target: the skip ratio the trained routers reach on held-out
greedy decodes (of routed layer-tokens, and of all layer-tokens), held-out `arith` accuracy against
the base's, and decode tokens/s at batch 1, 8 and 32 for

  dense    the base model (no routers at all): the speed to beat;
  naive    every row runs the whole layer and the adapter, then keeps its branch (what a skipper's
           plain generation loop does: `skip_mode=masked`);
  routed   running rows gathered into a dense batch, skipped rows only K/V + adapter (batch 1
           branches; `skip_mode=routed`);
  auto     routed or masked per layer and step, chosen by the measured cost gate (the default).

For speed, each model also runs widened `--widen` times (hidden, heads and MLP; the extra dims are
exact zeros: the same function, decisions and tokens, the compute of a wider model), since at the
tiny width the per-op overhead of eager PyTorch, not layer compute, sets decode time on CPU. The
break-even skip ratio per batch size comes from a synthetic policy (each routed row skips with
probability f, routers still computed) swept over f for routed and naive against dense.

Speed is decode only: each setting prefills held-out prompts (not timed; prefill runs masked) and
then times `--new-tokens` greedy decode steps (no early stop). Variants of one setting run
round-robin `--repeats` times and keep their fastest pass (so the cost gate's one-time calibration
is not in the figure). One thread; last line JSON. Writes docs/results/skipper.{json,md} (skipper-EXTRA.*
with --extra), one file per finished run under docs/results/skipper/ (a rerun skips those).

    python benchmarks/skipper.py                          # build, train (cached), measure
    python benchmarks/skipper.py --targets 0.25 0.5 --extra algo.gate=soft algo.decision_grad=false
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

from inference.lean import LeanBackend, read_dims, rope_tables  # noqa: E402
from inference.skip_routing import SkipRoute, SkipStats, route_for  # noqa: E402


# ----------------------------------------------------------------------------- widening


def widen(model, factor: int):
    """A copy of `model` (Qwen3, tied or untied head) `factor` times wider -- hidden, attention
    heads (same head_dim), kv heads, MLP, and a skipper's router input and adapter -- with the
    same function: the new residual dims are zero and stay zero (their rows of every output
    projection are zero), the new heads' and MLP units' outputs are cut off by zero columns, and
    the RMSNorm weights are scaled by sqrt(factor) ... / factor so the norm of [x, 0] equals x's
    (up to eps). New weights are random (their values cannot reach the output)."""
    from models.skipper import SkipperSpec, apply_skipper, skipper_state

    c = model.config
    C, I, H, Hk = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    cfg = copy.deepcopy(c)
    cfg.hidden_size, cfg.intermediate_size = C * factor, I * factor
    cfg.num_attention_heads, cfg.num_key_value_heads = H * factor, Hk * factor
    cfg.rms_norm_eps = c.rms_norm_eps / factor
    torch.manual_seed(0)
    wide = type(model)(cfg).eval()
    src = {k: v for k, v in model.state_dict().items() if ".skipper." not in k}
    out = wide.state_dict()
    scale = 1.0 / (factor ** 0.5)
    with torch.no_grad():
        for key, value in src.items():
            t = out[key]
            t.normal_(0, 0.02)
            if key.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) or key == "model.norm.weight":
                t.zero_()
                t[:C] = value * scale
            elif key.endswith(("q_norm.weight", "k_norm.weight")):
                t.copy_(value)
            elif key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                t[: value.shape[0], :C] = value
                t[: value.shape[0], C:] = 0
            elif key.endswith("o_proj.weight"):
                t.zero_()
                t[:C, : value.shape[1]] = value
            elif key.endswith(("gate_proj.weight", "up_proj.weight")):
                t[:I, :C] = value
                t[:I, C:] = 0
            elif key.endswith("down_proj.weight"):
                t.zero_()
                t[:C, :I] = value
            elif key in ("model.embed_tokens.weight", "lm_head.weight"):
                t.zero_()
                t[:, :C] = value
            else:
                raise SystemExit(f"widen: no rule for {key}")
    wide.load_state_dict(out)
    state = skipper_state(model)
    if state is not None:
        spec = state.spec
        wspec = SkipperSpec(spec.layers, spec.gate, C * factor, spec.num_layers, spec.router_dim, spec.adapter_dim,
                            spec.eps)
        apply_skipper(wide, wspec)
        with torch.no_grad():
            for i in spec.layers:
                a, b = model.model.layers[i].skipper, wide.model.layers[i].skipper
                for name in ("router.enc", "adapter.gate_proj", "adapter.up_proj"):
                    wa, wb = a.get_submodule(name).weight, b.get_submodule(name).weight
                    wb.zero_()
                    wb[:, :C] = wa
                b.router.norm_weight.copy_(a.router.norm_weight)
                b.router.dec.weight.normal_(0, 0.02)
                b.router.dec.weight[:C] = a.router.dec.weight
                b.router.head.weight.zero_()
                b.router.head.weight[:, :C] = a.router.head.weight
                b.adapter.down_proj.weight.zero_()
                b.adapter.down_proj.weight[:C] = a.adapter.down_proj.weight
    return wide


# ----------------------------------------------------------------------------- timing


class Synthetic(SkipRoute):
    """Each routed row skips with probability `fraction` (the routers still run, for their cost)."""

    def __init__(self, spec, mode: str, fraction: float, seed: int = 0):
        super().__init__(spec, mode)
        self.fraction = fraction
        self.generator = torch.Generator().manual_seed(seed)

    def gates(self, layer, w, h):
        super().gates(layer, w, h)
        skip = torch.rand(h.shape[:2], generator=self.generator) < self.fraction
        return torch.where(skip, 0.25, 0.75)


def decode_time(model, prompts, new_tokens: int, route=None, mode: str = "auto", stats: dict | None = None) -> float:
    """Seconds of `new_tokens` greedy decode steps of the batch after its prefill (not timed; no
    early stop). `stats`, when given, receives the route's decode skip ratio."""
    from inference.engine import left_pad

    batch = left_pad(prompts, torch.device("cpu"))
    B, P = batch.ids.shape
    dims = read_dims(model)
    with torch.inference_mode():
        backend = LeanBackend(model, dims, rope_tables(model, P + new_tokens + 1), B, P + new_tokens + 1,
                              route=route if route is not None else route_for(model, mode))
        logits = backend.prefill(batch.ids, batch.positions, batch.valid)
        positions = batch.lengths.clone()
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = backend.decode(logits.argmax(-1), positions)
            positions += 1
        seconds = time.perf_counter() - start
    if stats is not None and hasattr(backend.route, "stats"):
        stats["skip_ratio"] = backend.route.stats.skip_ratio()
        stats["executed"] = dict(backend.route.stats.executed)
    return seconds


def round_robin(fns: dict, repeats: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            best[k] = min(best[k], fn())
    return best


# ----------------------------------------------------------------------------- training and quality


def base_dir(args) -> str:
    """The 12-layer identity-deepened warm start (built once, shared with benchmarks/speculative.py's)."""
    from speculative import build_upscaled

    from trainer.config import load_config
    from trainer.default_model import cache_path
    from trainer.distributed import World
    from trainer.warm_start import ensure

    path = os.path.join(os.path.expanduser("~/.cache/posttrain/bench-speculative"), f"upscaled-l{args.layers}")
    if not os.path.exists(path):
        from algorithms import config_schemas

        cfg = load_config(["+algo=sft"], config_schemas())
        ensure(cfg.model, World())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        build_upscaled(cache_path(cfg.model), args.layers, path)
    return path


def train(args, target: float) -> str:
    """final/ of a `+algo=skipper` run at `target` (cached by its settings in --workdir)."""
    extra = [f"algo.target_skip={target}", f"trainer.lr={args.lr}", *args.extra]
    out = os.path.join(args.workdir, run_name(args, target))
    final = os.path.join(out, "final")
    if not os.path.exists(os.path.join(final, "skipper", "skipper.json")):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "+algo=skipper", "model=hf", f"model.path={base_dir(args)}",
               f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}", f"trainer.save_every={args.steps}",
               "trainer.eval_examples=50", "trainer.resume=never", "logging.wandb=false", "logging.progress=false",
               f"output_dir={out}", *extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.train_threads), WANDB_MODE="disabled")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"skipper training failed:\n{proc.stderr[-3000:]}")
        print(f"trained target {target} ({args.steps} steps) in {time.perf_counter() - started:.0f}s", flush=True)
    return final


def quality(model, tok, args) -> dict:
    """Held-out greedy accuracy, with the skip ratios of the decode steps when `model` has a skipper."""
    from inference import Engine
    from tasks import build_task
    from trainer.distributed import World
    from trainer.evaluation import evaluate

    task = build_task("arith", seed=0, n_train=20000, n_test=200, digits=2, steps=2, ops=("+", "-"))
    stats = SkipStats()  # the routed layers' counts, summed over every eval batch
    engine = Engine(model, route_stats={"skip": stats})
    result = evaluate(model, tok, task, list(task.test_examples())[: args.eval_examples], World(), 128, engine=engine)
    routed = getattr(getattr(model, "skipper_state", None), "spec", None)
    if routed is not None:
        result["skip_ratio"] = stats.skip_ratio()
        result["layer_skip_ratio"] = stats.skip_ratio() * len(routed.layers) / model.config.num_hidden_layers
        result["per_layer"] = {str(k): round(v, 3) for k, v in stats.layer_skip_ratio().items()}
    return result


def eval_prompts(tok, n: int) -> list[list[int]]:
    from tasks import build_task

    task = build_task("arith", seed=0, n_train=20000, n_test=200, digits=2, steps=2, ops=("+", "-"))
    return [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in list(task.test_examples())[:n]]


def speed_table(dense, skip, prompts_all, args, eos) -> tuple[dict, dict]:
    """Decode tokens/s per batch size of dense (the base) and the skipper model (its trained routers)
    in each skip mode, `--new-tokens` steps after the prompts' prefill; and, per batch size, the
    skip ratio of those decode steps and how the auto mode executed them."""
    rows, info = {}, {}
    for B in args.batches:
        prompts = prompts_all[:B]
        seen: dict = {}
        fns = {"dense": lambda: decode_time(dense, prompts, args.new_tokens)}
        for mode, name in (("masked", "naive"), ("routed", "routed"), ("auto", "auto")):
            fns[name] = lambda mode=mode, name=name: decode_time(skip, prompts, args.new_tokens, mode=mode,
                                                                 stats=seen.setdefault(name, {}))
        best = round_robin(fns, args.repeats)
        rows[B] = {k: B * args.new_tokens / v for k, v in best.items()}
        info[B] = {"skip_ratio": round(seen["routed"]["skip_ratio"], 4), "auto_executed": seen["auto"]["executed"]}
    return rows, info


def break_even(dense, skip, prompts_all, args) -> dict:
    """Synthetic policy sweep: speedup over dense of routed and naive at each skip fraction f of
    routed rows, and the interpolated break-even f of routed per batch size."""
    spec = skip.skipper_state.spec
    out = {}
    for B in args.batches:
        prompts = (prompts_all * 4)[:B]
        fns = {"dense": lambda: decode_time(dense, prompts, args.new_tokens)}
        for f in args.fractions:
            for mode in ("masked", "routed", "auto"):
                fns[f"{mode}@{f}"] = (lambda f=f, mode=mode: decode_time(
                    skip, prompts, args.new_tokens, route=Synthetic(spec, mode, f), mode=mode))
        best = round_robin(fns, args.repeats)
        speed = {k: best["dense"] / v for k, v in best.items() if k != "dense"}
        routed = [(0.0, speed_at_zero(speed))] + [(f, speed[f"routed@{f}"]) for f in args.fractions]
        out[B] = {"speedup": {k: round(v, 3) for k, v in speed.items()}, "break_even_f": crossing(routed)}
    return out


def speed_at_zero(speed: dict) -> float:
    return min(1.0, min(v for k, v in speed.items() if k.startswith("masked@")))


def crossing(points: list[tuple[float, float]]):
    """First skip fraction where the speedup curve crosses 1 (linear between points); None if never."""
    for (f0, s0), (f1, s1) in zip(points, points[1:]):
        if s0 < 1.0 <= s1:
            return round(f0 + (1.0 - s0) * (f1 - f0) / (s1 - s0), 3)
        if s0 >= 1.0:
            return round(f0, 3)
    return None


def run_name(args, target: float) -> str:
    """The name of a target's training run (its cache dir under --workdir)."""
    name = f"skip-t{target}-s{args.steps}-lr{args.lr:g}" + ("-" + "-".join(args.extra) if args.extra else "")
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)  # a path Hydra accepts as a value


def measure_target(args, target: float, tok, wide_base, prompts) -> dict:
    """Train (cached) the skipper at `target`, then its held-out quality and decode speed."""
    from inference.serving import load_served

    final = train(args, target)
    model = load_served(final).model  # the serving door: the base with its skipper/ routers
    q = quality(model, tok, args)
    wide = widen(model, args.widen) if args.widen > 1 else model
    agree = _agreement(model, wide, prompts[:8], tok.eos_token_id)
    speeds, decode_info = speed_table(wide_base, wide, prompts, args, tok.eos_token_id)
    return {"accuracy": q["accuracy"], "n": q["n"], "skip_ratio": round(q["skip_ratio"], 4),
            "layer_skip_ratio": round(q["layer_skip_ratio"], 4), "per_layer": q["per_layer"],
            "wide_agreement": agree, "tokens_per_s": {str(b): {k: round(v, 1) for k, v in r.items()}
                                                       for b, r in speeds.items()},
            "speedup": {str(b): {k: round(v / r["dense"], 3) for k, v in r.items() if k != "dense"}
                        for b, r in speeds.items()},
            "decode": {str(b): v for b, v in decode_info.items()}}


def measure_tag(args) -> str:
    """"" at the default measurement settings, else a short hash of them: a per-run file measured
    otherwise (other batch sizes, steps, repeats, fractions or eval size) is never read back as this one."""
    def key(a):
        return [a.eval_examples, a.new_tokens, a.repeats, a.batches, a.fractions]

    if key(args) == key(parser().parse_args([])):
        return ""
    import hashlib

    return "-m" + hashlib.sha1(json.dumps(key(args)).encode()).hexdigest()[:6]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/posttrain/bench-skipper"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.5])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3,
                    help="the skipper's lr (the base is a local HF dir, for which the trainer's default is the "
                         "pretrained 1e-4; only the new routers and adapters train)")
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for the skipper runs")
    ap.add_argument("--widen", type=int, default=4)
    ap.add_argument("--eval-examples", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=40, help="timed decode steps per setting")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"),
                    help="skipper.json / skipper.md go here, one file per finished run under skipper/ (a rerun "
                         "skips those); '' writes nothing")
    return ap


def main() -> None:
    args = parser().parse_args()
    from benchmarks.results_io import provenance, remembered
    from models.loading import load_pretrained

    def kept(name: str):
        return os.path.join(args.out, "skipper", name + measure_tag(args) + ".json") if args.out else None

    meta = provenance()
    torch.set_num_threads(1)
    base, tok = load_pretrained(base_dir(args))
    base.eval()
    base_q = remembered(kept(f"base-l{args.layers}-n{args.eval_examples}"),
                        lambda: {k: v for k, v in quality(base, tok, args).items() if k in ("accuracy", "n")})
    print(f"base: accuracy {base_q['accuracy']:.3f} (n={base_q['n']})", flush=True)
    prompts = eval_prompts(tok, max(args.batches))
    wide_base = widen(base, args.widen) if args.widen > 1 else base
    report = {"base_accuracy": base_q["accuracy"], "widen": args.widen, "args": vars(args), "meta": meta,
              "targets": {}}
    for target in args.targets:
        def run(target=target):
            torch.set_num_threads(1)
            return measure_target(args, target, tok, wide_base, prompts)

        entry = remembered(kept(f"{run_name(args, target)}-w{args.widen}"), run)
        report["targets"][str(target)] = entry
        print(f"target {target}: accuracy {entry['accuracy']:.3f} vs base {base_q['accuracy']:.3f}; skipped "
              f"{entry['skip_ratio']:.1%} of routed / {entry['layer_skip_ratio']:.1%} of all layer-tokens; per "
              f"layer {entry['per_layer']}; widened x{args.widen} greedy agreement {entry['wide_agreement']:.2f}",
              flush=True)
        for b, r in entry["tokens_per_s"].items():
            info = entry["decode"][b]
            print(f"  batch {b:>2}: decode skip {info['skip_ratio']:.1%}; dense {r['dense']:.0f} tok/s | "
                  + " | ".join(f"{k} {v:.0f} (x{v / r['dense']:.2f})" for k, v in r.items() if k != "dense")
                  + f" | auto ran {info['auto_executed']}", flush=True)

    def sweep_all():
        from models.skipper import apply_skipper, make_spec

        wide_skip = copy.deepcopy(wide_base)
        apply_skipper(wide_skip, make_spec(wide_skip.config))
        return {str(b): v for b, v in break_even(wide_base, wide_skip, prompts, args).items()}

    report["synthetic"] = remembered(kept(f"synthetic-l{args.layers}-w{args.widen}"), sweep_all)
    for b, v in report["synthetic"].items():
        print(f"synthetic policy, batch {b:>2}: break-even skip fraction of routed rows {v['break_even_f']}; "
              + ", ".join(f"{k} x{s:.2f}" for k, s in v["speedup"].items()), flush=True)
    if args.out:
        from benchmarks.results_io import write_report

        stem = "skipper" + ("-" + "_".join(args.extra) if args.extra else "")
        write_report(args.out, "".join(c if c.isalnum() or c in "-._=" else "_" for c in stem), report, render)
    print(json.dumps(report))


def render(report: dict) -> str:
    """docs/results/skipper.md from the run's JSON."""
    from benchmarks.results_io import provenance_lines

    a = report["args"]
    lines = ["# Layer skipping (generated by benchmarks/skipper.py)", "", *provenance_lines(report.get("meta")),
             f"Model: the {a['layers']}-layer identity-deepened warm start; skippers trained {a['steps']} steps "
             f"at lr {a.get('lr', 0):g} (`{' '.join(a['extra']) or 'otherwise defaults'}`). Base held-out accuracy {report['base_accuracy']:.3f}. "
             f"Speed on the model widened {report['widen']}x without changing its function, decode only "
             f"({a['new_tokens']} steps after the prompts' prefill), one thread, best of {a['repeats']} "
             "round-robin passes; ratios against dense."]
    for target, e in report["targets"].items():
        lines += ["", f"## target_skip {target}", "",
                  f"Held-out accuracy {e['accuracy']:.3f} (n={e.get('n', a['eval_examples'])}) against the base's "
                  f"{report['base_accuracy']:.3f}; skipped {e['skip_ratio']:.1%} of routed layer-tokens "
                  f"({e['layer_skip_ratio']:.1%} of all); per routed layer "
                  + ", ".join(f"{k}: {v:.2f}" for k, v in e["per_layer"].items()) + "; the widened model's "
                  f"greedy completions equal the narrow one's on {e['wide_agreement']:.0%} of "
                  f"{min(8, max(a['batches']))} prompts.", "",
                  "| decode tokens/s | dense (base) | naive (compute all, mix) | routed | auto (cost gate) "
                  "| decode skip | auto executed |", "|---|---|---|---|---|---|---|"]
        for b, r in e["tokens_per_s"].items():
            cells = [f"batch {b}", f"{r['dense']:.1f}"]
            cells += [f"{r[k]:.1f} (x{r[k] / r['dense']:.2f})" for k in ("naive", "routed", "auto")]
            info = e["decode"][b]
            cells += [f"{info['skip_ratio']:.1%}", ", ".join(f"{k} {v}" for k, v in info["auto_executed"].items())]
            lines.append("| " + " | ".join(cells) + " |")
    syn = report.get("synthetic") or {}
    if syn:
        fr = a["fractions"]
        lines += ["", "## Synthetic policy", "",
                  "Each routed row skips with probability f (routers still computed); speedup over dense per "
                  "batch size, and the interpolated skip fraction where routed breaks even.", "",
                  "| batch | " + " | ".join(f"routed f={f:g}" for f in fr) + " | "
                  + " | ".join(f"naive f={f:g}" for f in fr) + " | break-even f |",
                  "|" + "---|" * (2 + 2 * len(fr))]
        for b, v in syn.items():
            sp = v["speedup"]
            lines.append("| " + " | ".join([b] + [f"x{sp[f'routed@{f}']:.2f}" for f in fr]
                                           + [f"x{sp[f'masked@{f}']:.2f}" for f in fr]
                                           + [str(v["break_even_f"])]) + " |")
    return "\n".join(lines) + "\n"


def _agreement(narrow, wide, prompts, eos) -> float:
    """Share of prompts whose greedy completion is identical on the narrow and the widened model."""
    from inference import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=(eos,))
    a = Engine(narrow).generate(prompts, params)
    b = Engine(wide).generate(prompts, params)
    return sum(x.tokens == y.tokens for x, y in zip(a, b)) / len(prompts)


if __name__ == "__main__":
    main()
