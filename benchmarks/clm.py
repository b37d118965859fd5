"""CLM: task success and compute per episode, and serving the same trajectories with cache reuse.

Policies, on the held-out episodes of data=clm (greedy; compute = prefill tokens forwarded with
prefix caching + decoded tokens, per episode):
  append-only  the oracle that never edits (right answers, `next` otherwise), under the budget and
               with the budget lifted (what the context would cost without management);
  scripted     the oracle that rewrites the file into one note past compact_at x budget;
  warm start   the tiny model after SFT on the scripted calls (CLM before RL);
  rl w_eff=W   the warm start after `--steps` CLM steps, per seed (`--seeds`), for each `--w-eff`.
Serving, on the recorded trajectories of the scripted oracle and of the warm start: each episode's
calls replayed (prompt + the output it produced) through the session engine with full re-prefill,
prefix caching and suffix reuse (K = 1, 3, 6 spans), counting forwarded prefill tokens (all calls,
and the calls right after a rewrite), wall time, and the next-token KL of each call against full
re-prefill.

    python benchmarks/clm.py                                  # warm start built once (cached), 3 seeds x 2 w_eff
    python benchmarks/clm.py --steps 20 --seeds 0 --w-eff 0.25 --episodes 40
    python benchmarks/clm.py --skip-rl                        # policies without RL + serving only
    nohup python benchmarks/clm.py --skip-long --tag ds --extra algo.dynamic_sampling=true > /tmp/clm.log 2>&1 &

Every finished RL run, with its held-out success and compute, writes `docs/results/clm/SETTING-sSEED.json`
(SETTING = w{w_eff}[-TAG]; `--results DIR` elsewhere) with the overrides it ran with, and the warm start's
row `warm-start.json`; a restarted benchmark skips every run whose file holds the same overrides, so the
runs accumulate across sessions. `docs/results/clm.md` is rendered from every file there after each run
(`--render` only rewrites it).

Last line JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from algorithms.clm import play_episodes  # noqa: E402
from algorithms.rollouts import encode  # noqa: E402
from inference import SamplingParams  # noqa: E402
from inference.suffix import ReuseConfig, SessionEngine  # noqa: E402
from tasks.clm import CHAIN_FILLERS, CHAIN_QUERY, ClmTask, ContextEnv, Episode, fold_note, scripted_output  # noqa: E402
from tasks.context_file import TINY_FORMAT, ContextFile, ContextFormat, Turn, render_turns  # noqa: E402


RUN_RECORD = "bench_run.json"  # an RL run's wall time and overrides, written once the run finished
# --slack: episodes whose budget varies (200-400 characters, stated in the task text), so folding late is
# possible on some and cheaper (~20% less compute between a fold at 0.3 and 0.7 of the budget, where the
# default task's schedules are within 5%); the warm start is SFT on scripted calls that fold at a share
# drawn per episode (up to where the script would overflow), continued from the data=clm warm start.
SLACK = {"budget_range": [200, 400], "fold_range": [0.3, 0.95]}
SLACK_WARM = {"lr": 1e-3, "batch_size": 32}


def warm_model(cache_dir: str | None) -> str:
    """The data=clm warm start (built once per recipe, cached like every default model)."""
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.warm_start import ensure

    args = ["+algo=clm"] + ([f"model.cache_dir={cache_dir}"] if cache_dir else [])
    cfg = load_config(args, config_schemas())
    return ensure(cfg.model, World())


def data_overrides(data: dict) -> list[str]:
    return [f"data.{k}=[{','.join(str(x) for x in v)}]" for k, v in data.items()]


def slack_warm(base: str, cache_dir: str | None, steps: int) -> str:
    """The --slack warm start: `steps` of SFT on the slack task's scripted calls from `base`, built
    once into CACHE/clm-slack-HASH (trained aside, published by one rename when the run finished)."""
    overrides = ["+algo=sft", "data=clm", "data.view=calls", *data_overrides(SLACK), f"model.path={base}",
                 f"trainer.max_steps={steps}", f"trainer.batch_size={SLACK_WARM['batch_size']}",
                 "trainer.micro_batch_size=32", f"trainer.lr={SLACK_WARM['lr']}",
                 f"trainer.warmup_steps={max(1, steps // 20)}", "trainer.min_lr_ratio=0.05",
                 f"trainer.eval_every={max(1, steps // 4)}", "trainer.eval_examples=100",
                 "trainer.save_every=100000", "trainer.resume=never", "logging.wandb=false", "logging.progress=false"]
    cache = os.path.expanduser(cache_dir or os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain"))
    key = hashlib.sha256(json.dumps(portable(overrides) + [model_digest(base)]).encode()).hexdigest()[:12]
    path = os.path.join(cache, f"clm-slack-{key}")
    if os.path.isdir(path):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    print(f"building the --slack warm start ({steps} SFT steps) in {path}", flush=True)
    started = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": ROOT}
    try:  # whatever ends the build (a failed run, an interrupt), the work dir goes with it
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"output_dir={tmp}"],
                              env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"the --slack warm start failed:\n{proc.stderr[-3000:]}")
        final = os.path.join(tmp, "final")
        shutil.copy(os.path.join(tmp, "metrics.jsonl"), os.path.join(final, "warm_start_metrics.jsonl"))
        with open(os.path.join(final, "slack_warm_start.json"), "w") as fh:
            json.dump({"overrides": portable(overrides), "seconds": time.perf_counter() - started}, fh, indent=1)
        try:
            os.replace(final, path)  # published only when the run finished
        except OSError:
            if not os.path.isdir(path):  # else a benchmark beside this one published the same build first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"--slack warm start built in {time.perf_counter() - started:.0f}s", flush=True)
    return path


def model_digest(path: str) -> str:
    with open(os.path.join(path, "model.safetensors"), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:12]


# --- trajectories --------------------------------------------------------------------------------


def oracle(task: ClmTask, episodes, tok, compact_at, budget: int | None = None, max_calls: int = 16):
    """(per episode: [(prompt ids, output ids)], outcomes, successes) of the scripted oracle; compact_at
    = inf never edits (append-only); a callable gives each episode's own share."""
    trajs, outcomes, success = [], [], []
    count = lambda s: len(encode(tok, s))  # noqa: E731
    for ep in episodes:
        env = ContextEnv(ep, fmt=task.fmt, count_tokens=count, budget=budget or ep.budget or task.budget,
                         max_calls=max_calls)
        share = compact_at(ep) if callable(compact_at) else compact_at
        calls = []
        while not env.done:
            prompt = encode(tok, env.prompt())
            out = scripted_output(env, share)
            calls.append((prompt, encode(tok, out) + [tok.eos_token_id]))
            env.step(out)
        trajs.append(calls)
        outcomes.append(env.outcome)
        success.append(env.outcome == "answered" and task.verify(ep, out).correct)
    return trajs, outcomes, success


DROP = "drop "  # the deletion harness's edit command: `drop m` replaces the m oldest turns by a note


def edited_after(calls, tok, fmt) -> list[bool]:
    """Per call: whether the previous call of the episode edited the context (a rewrite, or the `drop m`
    command of the deletion trajectories)."""
    marks, prev = [], False
    for _, out in calls:
        marks.append(prev)
        first = tok.decode(out, skip_special_tokens=True).split("\n", 1)[0]
        prev = first == fmt.rewrite or first.startswith(DROP)
    return marks


def replay(model, trajs, reuse: ReuseConfig, reference=None):
    """Every episode's calls through a session engine, round by round (one batched call per round).
    Returns per-call (prefill tokens, relocated, KL vs `reference` logits or None), logits, seconds."""
    engine = SessionEngine(model, reuse)
    rounds = max(len(t) for t in trajs)
    stats, logits = [], []
    started = time.perf_counter()
    for k in range(rounds):
        rows = [i for i, t in enumerate(trajs) if len(t) > k]
        out = engine.replay([trajs[i][k][0] for i in rows], [trajs[i][k][1] for i in rows], rows)
        for i in [i for i in rows if len(trajs[i]) == k + 1]:
            engine.end(i)
        logits.append(out.float())
        stats.append([(i, s.prefill_tokens, s.relocated_tokens) for i, s in zip(rows, engine.stats)])
    seconds = time.perf_counter() - started
    per_call = {}
    for k, (round_stats, lg) in enumerate(zip(stats, logits)):
        for row, (i, prefill, relocated) in enumerate(round_stats):
            kl = None
            if reference is not None:
                p = torch.log_softmax(reference[k][row], -1)
                q = torch.log_softmax(lg[row], -1)
                kl = float((p.exp() * (p - q)).sum())
            per_call[(i, k)] = (prefill, relocated, kl)
    return per_call, logits, seconds


def serving(model, trajs, tok, fmt, spans: dict[str, ReuseConfig]) -> list[dict]:
    full_calls, full_logits, full_s = replay(model, trajs, ReuseConfig(mode="full"))
    edited = {(i, k): e for i, t in enumerate(trajs) for k, e in enumerate(edited_after(t, tok, fmt))}
    rows = []
    for name, reuse in [("full", None), *spans.items()]:
        if reuse is None:
            calls, seconds = full_calls, full_s
        else:
            calls, _, seconds = replay(model, trajs, reuse, reference=full_logits)
        kls = [c[2] for c in calls.values() if c[2] is not None]
        rows.append({
            "mode": name, "prefill_tokens": sum(c[0] for c in calls.values()),
            "prefill_edited": sum(c[0] for key, c in calls.items() if edited[key]),
            "relocated": sum(c[1] for c in calls.values()), "seconds": seconds,
            "kl_mean": statistics.mean(kls) if kls else 0.0, "kl_max": max(kls) if kls else 0.0,
        })
    return rows


# --- serving at the reference's scale ------------------------------------------------------------

LONG_PREFIX = ("start at {start}; apply each op. you read tool logs, one per turn. each log hides one op, add d "
               "or sub d, among status words; keep the running value. when the file grows too long, rewrite it: "
               "fold the older logs into one note with the value so far and keep the latest logs as they are. "
               "at the end, answer with the final value.\n\n")


def long_episodes(n: int, seed: int, observations: tuple[int, int] = (10, 14),
                  words: tuple[int, int] = (30, 40)) -> list[Episode]:
    """Chain episodes with long verbose logs (30-40 status words around each op, ~250 characters) and a
    ~330-character protected prefix: contexts of thousands of characters, kept turns of >= 64 tokens."""
    rng = random.Random(seed)
    episodes = []
    for i in range(n):
        value = start = rng.randint(0, 49)
        logs = []
        for _ in range(rng.randint(*observations)):
            d = rng.randint(0, 9)
            op = rng.choice([o for o, ok in (("add", value + d <= 99), ("sub", value - d >= 0)) if ok])
            value += d if op == "add" else -d
            line = [rng.choice(CHAIN_FILLERS) for _ in range(rng.randint(*words))]
            line.insert(rng.randint(0, len(line)), f"{op} {d}")
            logs.append(", ".join(line))
        prefix = LONG_PREFIX.format(start=start)
        episodes.append(Episode(CHAIN_QUERY, "", str(value), f"long{i}", kind="chain", prefix=prefix,
                                observations=tuple(logs), query=CHAIN_QUERY))
    return episodes


def windowed_output(env: ContextEnv, compact_at: float, keep: int) -> str:
    """The scripted compaction with a recent window: answer once asked; past compact_at x budget rewrite
    the file to a note (the value after the logs it drops) + the last `keep` tool turns verbatim."""
    if env.query_shown:
        return f"{env.fmt.answer} {env.episode.answer}"
    if env.context_tokens() <= compact_at * env.budget:
        return "next"
    tools = [t for t in env.context.turns if t.role == "tool"]
    kept = tools[-keep:] if keep else []
    note = fold_note(env.episode, env.shown - len(kept))
    return env.fmt.rewrite + "\n" + render_turns((Turn("assistant", note), *kept), env.fmt)


def long_trajectories(tok, fmt: ContextFormat, n: int, budget: int, compact_at: float, keep: int, seed: int = 0):
    """[(prompt ids, output ids)] per episode of the windowed policy on long_episodes, counted in `tok`'s
    tokens; every episode must end answered inside the budget."""
    trajs = []
    count = lambda s: len(encode(tok, s))  # noqa: E731
    for ep in long_episodes(n, seed):
        env = ContextEnv(ep, fmt=fmt, count_tokens=count, budget=budget, max_calls=64)
        calls = []
        while not env.done:
            prompt, out = encode(tok, env.prompt()), windowed_output(env, compact_at, keep)
            calls.append((prompt, encode(tok, out) + [tok.eos_token_id]))
            env.step(out)
        if env.outcome != "answered":
            raise SystemExit(f"long serving: episode {ep.uid} ended {env.outcome} (budget {budget} too small for "
                             f"keep={keep})")
        trajs.append(calls)
    return trajs


def deletion_trajectories(tok, fmt: ContextFormat, n: int, budget: int, compact_at: float, keep: int,
                          seed: int = 0):
    """The same episodes under a harness whose edit is a short command (`drop m`: the m oldest turns
    are replaced by a one-line note, the rest kept and renumbered), as with shell-style file edits: the
    kept text is not re-emitted, so it survives only in the old prompt, split by the renumbered headers
    into one equal block per kept turn. [(prompt ids, output ids)] per episode."""
    trajs = []
    for ep in long_episodes(n, seed):
        cf, shown, calls = ContextFile(ep.prefix, (Turn("tool", ep.observations[0]),), fmt), 1, []
        while True:
            prompt = encode(tok, cf.prompt())
            if shown > len(ep.observations):  # the query is shown
                calls.append((prompt, encode(tok, f"{fmt.answer} {ep.answer}") + [tok.eos_token_id]))
                break
            if len(prompt) > compact_at * budget:
                tools = [i for i, t in enumerate(cf.turns) if t.role == "tool"]
                cut = tools[-keep] if keep and len(tools) >= keep else len(cf.turns)
                note = Turn("assistant", fold_note(ep, shown - sum(t.role == "tool" for t in cf.turns[cut:])))
                output, cf = f"{DROP}{cut}", ContextFile(ep.prefix, (note, *cf.turns[cut:]), fmt)
            else:
                output, cf = "next", cf.append("assistant", "next")
            calls.append((prompt, encode(tok, output) + [tok.eos_token_id]))
            cf = cf.append("tool", ep.observations[shown]) if shown < len(ep.observations) else cf.append("user", ep.query)
            shown += 1
            if len(encode(tok, cf.prompt())) > budget:
                raise SystemExit(f"long serving: episode {ep.uid} overflows budget {budget} with keep={keep}")
        trajs.append(calls)
    return trajs


def long_model(spec: str):
    """`random`: a random 4-layer Qwen3 (256 wide) over the character tokenizer with 8192 positions;
    else a model directory."""
    from models.loading import load_pretrained, random_qwen3
    from models.tokenizer import build_char_tokenizer

    if spec != "random":
        model, tok = load_pretrained(spec)
        return model.eval(), tok, ContextFormat()
    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), seed=0, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                         max_positions=8192, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return model.eval(), tok, TINY_FORMAT


def print_serving(title: str, rows: list[dict]) -> None:
    prefix_row = next(r for r in rows if r["mode"] == "prefix")
    print(title)
    print(f"{'mode':>22} {'prefill tok':>12} {'x prefix':>9} {'after edit':>11} {'x prefix':>9} {'relocated':>10} "
          f"{'wall s':>8} {'KL mean':>9} {'KL max':>9}")
    for r in rows:
        ratio_all = r["prefill_tokens"] / max(prefix_row["prefill_tokens"], 1)
        ratio = r["prefill_edited"] / max(prefix_row["prefill_edited"], 1)
        print(f"{r['mode']:>22} {r['prefill_tokens']:>12} {ratio_all:>9.3f} {r['prefill_edited']:>11} {ratio:>9.3f} "
              f"{r['relocated']:>10} {r['seconds']:>8.2f} {r['kl_mean']:>9.2e} {r['kl_max']:>9.2e}")


def long_serving(args) -> dict:
    model, tok, fmt = long_model(args.long_model)
    spans = {f"suffix K={k}": ReuseConfig(mode="suffix", max_spans=k) for k in (1, 3, 6)}  # 64 / 16 / 32
    spans["prefix"] = ReuseConfig(mode="prefix")
    out = {"model": args.long_model, "budget": args.long_budget, "keep": args.long_keep}
    for edit, make in (("rewrite", long_trajectories), ("drop", deletion_trajectories)):
        trajs = make(tok, fmt, args.long_episodes, args.long_budget, 0.75, args.long_keep)
        rows = serving(model, trajs, tok, fmt, spans)
        lengths = [len(p) + len(o) for t in trajs for p, o in t]
        how = ("the model's rewrite re-emits the kept text" if edit == "rewrite"
               else "a `drop m` command deletes the oldest turns, the kept text is not re-emitted")
        print_serving(f"== serving at the reference's scale, {edit} edits ({how}): {len(trajs)} long episodes, "
                      f"{sum(map(len, trajs))} calls, budget {args.long_budget} tokens, {args.long_keep} logs kept, "
                      f"prompt+output up to {max(lengths)} tokens, spans >= 64 / re-forward 16 / min gain 32 "
                      f"(model: {args.long_model}) ==", rows)
        out[edit] = {"episodes": len(trajs), "calls": sum(map(len, trajs)), "max_tokens": max(lengths), "rows": rows}
    return out


# --- policies --------------------------------------------------------------------------------------


def model_policy(path: str, task: ClmTask, episodes, max_new_tokens: int, max_calls: int, budget: int = 0):
    from models.loading import load_pretrained

    model, tok = load_pretrained(path)
    model.eval()
    engine = SessionEngine(model, ReuseConfig(mode="prefix"))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    trajs = play_episodes(engine, tok, task, episodes, params, max_calls, budget)
    return model, tok, trajs


def summary(name: str, success: list[bool], compute: list[int], edits: list[int], outcomes: list[str]) -> dict:
    n = max(len(success), 1)
    return {"policy": name, "success": sum(success) / n, "compute": statistics.mean(compute) if compute else 0.0,
            "compute_success": statistics.mean([c for c, s in zip(compute, success) if s]) if any(success) else None,
            "edits": statistics.mean(edits) if edits else 0.0,
            "overflow": sum(o == "overflow" for o in outcomes) / n}


RESULTS = os.path.join(ROOT, "docs", "results", "clm")
RENDER_LOCK = threading.Lock()


def portable(overrides: list[str]) -> list[str]:
    """The overrides as a result file records them: the model's path reduced to its directory name."""
    return [f"model.path={os.path.basename(a.split('=', 1)[1].rstrip('/'))}" if a.startswith("model.path=") else a
            for a in overrides]


def setting_name(w_eff: float, tag: str, task: str = "") -> str:
    return (f"{task}-" if task else "") + f"w{w_eff}" + (f"-{tag}" if tag else "")


def quarters(train: list[dict], key) -> tuple[float, float] | None:
    """The mean of `key(record)` over the first and the last quarter of the train steps (None when absent)."""
    values = [key(r) for r in train]
    values = [v for v in values if v is not None]
    if not values:
        return None
    q = max(1, len(values) // 4)
    return statistics.fmean(values[:q]), statistics.fmean(values[-q:])


def spread_share(r: dict):
    """The share of the groups generated that had a signal: measured before the filter under dynamic
    sampling, 1 - frac_zero_std otherwise."""
    if "rollout/spread_share" in r:
        return r["rollout/spread_share"]
    return 1.0 - r["clm/frac_zero_std"] if "clm/frac_zero_std" in r else None


def rl_run(job) -> dict:
    """One RL run in `where`/w{w_eff}-s{seed}-{hash of its overrides}, then its final model played on the
    held-out episodes. The result goes to `--results`/SETTING-sSEED.json (published when complete); a
    result file holding the same overrides is read back instead of rerun. A training run whose record
    (RUN_RECORD, written last) is in `where` is reused, one left unfinished is started over (its
    directory removed first, so no stale metrics are appended to)."""
    warm, seed, w_eff, args, where = job
    overrides = ["+algo=clm", f"model.path={warm}", f"seed={seed}", f"algo.w_eff={w_eff}",
                 f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch}",
                 f"trainer.eval_every={args.steps}", "trainer.save_every=100000",
                 f"trainer.eval_examples={args.episodes}", "logging.wandb=false", "logging.progress=false",
                 *([f"trainer.lr={args.lr}"] if args.lr else []), *args.data, *args.extra]
    setting = setting_name(w_eff, args.tag, args.task_name)
    result_file = os.path.join(args.results, f"{setting}-s{seed}.json") if args.results else None
    if result_file and os.path.exists(result_file):
        earlier = json.load(open(result_file))
        if earlier.get("overrides") == portable(overrides):
            print(f"rl run {setting} seed={seed}: done earlier ({result_file}), skipped", flush=True)
            return earlier
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:10]
    out = os.path.join(where, f"w{w_eff}-s{seed}-{key}")
    record = os.path.join(out, RUN_RECORD)
    if os.path.exists(record):
        print(f"rl run seed={seed} w_eff={w_eff}: using the finished run in {out}", flush=True)
        with open(record) as fh:
            seconds = json.load(fh)["seconds"]
    else:
        shutil.rmtree(out, ignore_errors=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": ROOT}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"output_dir={out}"],
                              env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"rl run seed={seed} w_eff={w_eff} failed:\n{proc.stderr[-3000:]}")
        seconds = time.perf_counter() - started
        from benchmarks.results_io import write_files

        write_files(os.path.dirname(record), {os.path.basename(record): json.dumps({"seconds": seconds, "overrides": overrides})})
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in records if r.get("split") == "train"]
    task, episodes = args.eval_task
    _, _, trajs = model_policy(os.path.join(out, "final"), task, episodes, args.max_new, args.max_calls)
    result = {"setting": setting, "seed": seed, "w_eff": w_eff, "seconds": seconds,
              **summary(f"rl {setting} seed={seed}", [t.success for t in trajs], [t.compute for t in trajs],
                        [t.edits for t in trajs], [t.outcome for t in trajs]),
              "train_success_first": train[0]["clm/success"], "train_success_last": train[-1]["clm/success"],
              "train_compute_last": train[-1]["clm/compute"], "overrides": portable(overrides)}
    for name, key_fn in (("train_success", lambda r: r.get("clm/success")), ("spread_share", spread_share),
                         ("efficiency_abs", lambda r: r.get("clm/efficiency_abs")),
                         ("train_compute", lambda r: r.get("clm/compute"))):
        pair = quarters(train, key_fn)
        if pair is not None:
            result[f"{name}@first"], result[f"{name}@last"] = pair
    if result_file:
        write_result(args.results, result_file, result)
    print(f"rl run {setting} seed={seed}: held-out success {result['success']:.3f}, compute {result['compute']:.0f} "
          f"({seconds:.0f}s)", flush=True)
    return result


def write_result(results: str, path: str, result: dict) -> None:
    from benchmarks.results_io import write_files

    write_files(os.path.dirname(path), {os.path.basename(path): json.dumps(result, indent=1)})  # published only when complete
    with RENDER_LOCK:  # side-by-side runs finish together: one rewrite of the table at a time
        render(results)


def render(results: str) -> str:
    """RESULTS.md beside the results folder (docs/results/clm -> docs/results/clm.md) from every file in it."""
    runs = [json.load(open(os.path.join(results, f))) for f in sorted(os.listdir(results))
            if f.endswith(".json")] if os.path.isdir(results) else []
    warm = [r for r in runs if r.get("setting", "").endswith("warm-start")]
    runs = [r for r in runs if not r.get("setting", "").endswith("warm-start")]
    lines = ["# CLM RL on the embedded episodes (generated by benchmarks/clm.py)", "",
             "Held-out episodes played greedily by each run's final model; compute = prefill tokens forwarded with",
             "prefix caching + decoded tokens, per episode; `spread`: the share of the episode groups played whose",
             "success differs (with dynamic sampling: whose `dynamic_metric` signal differs, before the filter), first",
             "→ last quarter of the run; `|a_eff|`: mean efficiency advantage, last quarter. Each run's overrides are",
             f"in its file under `{os.path.basename(results.rstrip('/'))}/`.", ""]
    for w in warm:  # one per task setting: `warm-start` (the default episodes), `slack-warm-start` (--slack)
        task = w["setting"][: -len("warm-start")].rstrip("-")
        lines += [f"Warm start{f' of the {task} episodes' if task else ''} (before RL): success {w['success']:.3f}, "
                  f"compute {w['compute']:.1f}, overflow {w['overflow']:.3f} on {w.get('episodes', '?')} episodes.", ""]
    lines += ["| setting | seeds | success (mean ± std) | per seed | compute (mean ± std) | compute, successes | "
              "overflow | train success first → last | spread first → last | |a_eff| | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = sorted((r for r in runs if r["setting"] == setting), key=lambda r: r["seed"])
        succ, comp = [r["success"] for r in rs], [r["compute"] for r in rs]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
        cs = [r["compute_success"] for r in rs if r.get("compute_success") is not None]
        pair = lambda k: (f"{statistics.fmean(r[k + '@first'] for r in rs):.3f} → "  # noqa: E731
                          f"{statistics.fmean(r[k + '@last'] for r in rs):.3f}"
                          if all(k + "@first" in r for r in rs) else "")
        eff = (f"{statistics.fmean(r['efficiency_abs@last'] for r in rs):.4f}"
               if all("efficiency_abs@last" in r for r in rs) else "")
        cs_cell = f"{statistics.fmean(cs):.1f}" if cs else ""
        lines.append(f"| {setting} | {len(rs)} | {statistics.fmean(succ):.3f} ± {sd(succ):.3f} | "
                     f"{' / '.join(f'{v:.2f}' for v in succ)} | {statistics.fmean(comp):.1f} ± {sd(comp):.1f} | "
                     f"{cs_cell} | {statistics.fmean(r['overflow'] for r in rs):.3f} | {pair('train_success')} | "
                     f"{pair('spread_share')} | {eff} | {statistics.fmean(r['seconds'] for r in rs):.0f} |")
    text = "\n".join(lines) + "\n"
    from benchmarks.results_io import write_files

    stem = results.rstrip("/")
    write_files(os.path.dirname(stem) or ".", {os.path.basename(stem) + ".md": text})
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=4, help="task episodes per step (x algo.num_generations)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--w-eff", default="0,0.25")
    ap.add_argument("--episodes", type=int, default=100, help="held-out episodes per evaluation")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--model", default=None, help="a model dir to start from instead of the data=clm warm start")
    ap.add_argument("--skip-rl", action="store_true")
    ap.add_argument("--runs-dir", default=None,
                    help="keep the RL runs here (default: a temporary dir); a finished run with the same overrides "
                         "is read back, not rerun")
    ap.add_argument("--skip-long", action="store_true", help="skip serving at the reference's scale")
    ap.add_argument("--long-only", action="store_true", help="only serving at the reference's scale")
    ap.add_argument("--long-model", default="random", help="random (4-layer, 8192 positions) or a model dir")
    ap.add_argument("--long-episodes", type=int, default=8)
    ap.add_argument("--long-budget", type=int, default=2048, help="context budget of the long episodes (tokens)")
    ap.add_argument("--long-keep", type=int, default=2, help="recent logs each rewrite keeps verbatim")
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for the RL runs")
    ap.add_argument("--results", default=RESULTS,
                    help="one JSON per finished (setting, seed) RL run, skipped when found again with the same "
                         "overrides; the table RESULTS.md is rendered beside it (default docs/results/clm; '' = none)")
    ap.add_argument("--tag", default="", help="a setting name part for runs with other --extra (w0.25-TAG-s0.json)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from --results")
    ap.add_argument("--slack", action="store_true",
                    help=f"episodes with room to spare ({', '.join(f'data.{k}={v}' for k, v in SLACK.items())}) and "
                         f"their own warm start; settings named slack-w...")
    ap.add_argument("--slack-warm-steps", type=int, default=800, help="SFT steps of the --slack warm start")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.max_new, args.max_calls = 72, 16
    if args.render:
        print(render(args.results))
        return

    if args.long_only:
        print(json.dumps({"long_serving": long_serving(args)}))
        return
    data = SLACK if args.slack else {}
    args.data, args.task_name = data_overrides(data), "slack" if args.slack else ""
    warm = args.model or warm_model(args.cache_dir)
    if args.slack and not args.model:
        warm = slack_warm(warm, args.cache_dir, args.slack_warm_steps)
    task = ClmTask(seed=0, n_train=2000, n_test=args.episodes, **data)
    episodes = list(task.test_examples())[: args.episodes]
    args.eval_task = (task, episodes)  # what every RL run's final model is played on
    max_new, max_calls = args.max_new, args.max_calls
    from models.loading import load_pretrained

    model, tok = load_pretrained(warm)
    model.eval()

    # -- policies
    table = []
    prefix_reuse = ReuseConfig(mode="prefix")
    oracle_trajs = {}
    scripted = [("scripted", task.compact_at, None)]
    if args.slack:  # the demonstrations' drawn fold points, and the cheapest schedule that still fits
        scripted = [("scripted, fold past 0.3", 0.3, None), ("scripted, drawn fold points", task.fold_at, None),
                    ("scripted, latest fold that fits", lambda ep: task.last_fold(ep, *task.fold_range), None)]
    for name, compact, budget in (("append-only", math.inf, None), ("append-only, no budget", math.inf, 10 ** 6),
                                  *scripted):
        trajs, outcomes, success = oracle(task, episodes, tok, compact, budget, max_calls)
        calls, _, _ = replay(model, trajs, prefix_reuse) if budget is None or budget < 10 ** 6 else (None, None, None)
        if calls is None:  # beyond the model's positions: count what prefix caching would forward
            compute = [sum(len(p) - (len(trajs[i][k - 1][0]) + len(trajs[i][k - 1][1]) - 1 if k else 0) + len(o)
                           for k, (p, o) in enumerate(t)) for i, t in enumerate(trajs)]
        else:
            compute = [sum(calls[(i, k)][0] + len(o) for k, (_, o) in enumerate(t)) for i, t in enumerate(trajs)]
        edits = [sum(tok.decode(o, skip_special_tokens=True).startswith(task.fmt.rewrite + "\n") for _, o in t)
                 for t in trajs]
        table.append(summary(name, success, compute, edits, outcomes))
        oracle_trajs[name] = trajs

    def model_row(name, path):
        _, _, trajs = model_policy(path, task, episodes, max_new, max_calls)
        row = summary(name, [t.success for t in trajs], [t.compute for t in trajs], [t.edits for t in trajs],
                      [t.outcome for t in trajs])
        return row, [[(c.prompt, list(c.completion.tokens)) for c in t.calls] for t in trajs if t.calls]

    warm_row, warm_trajs = model_row("warm start (before RL)" if args.model is None else "--model (before RL)", warm)
    table.append(warm_row)
    if args.results and args.model is None:  # the row every RL run is measured against
        name = f"{args.task_name}-warm-start" if args.task_name else "warm-start"
        write_result(args.results, os.path.join(args.results, f"{name}.json"),
                     {**warm_row, "setting": name, "episodes": len(episodes)})

    rl = []
    if not args.skip_rl:
        seeds = [int(s) for s in args.seeds.split(",")]
        weights = [float(w) for w in args.w_eff.split(",")]
        with tempfile.TemporaryDirectory() as tmp:
            jobs = [(warm, s, w, args, args.runs_dir or tmp) for w in weights for s in seeds]
            with ThreadPoolExecutor(args.workers) as pool:
                runs = list(pool.map(rl_run, jobs))
            for w in weights:
                rows = [r for r in runs if r["w_eff"] == w]
                rl.extend(rows)
                succ = [r["success"] for r in rows]
                comp = [r["compute"] for r in rows]
                table.append({"policy": f"rl w_eff={w} (mean of {len(rows)})", "success": statistics.mean(succ),
                              "success_std": statistics.stdev(succ) if len(succ) > 1 else 0.0,
                              "compute": statistics.mean(comp),
                              "compute_std": statistics.stdev(comp) if len(comp) > 1 else 0.0,
                              "edits": statistics.mean(r["edits"] for r in rows),
                              "overflow": statistics.mean(r["overflow"] for r in rows)})

    print(f"== policies on {len(episodes)} held-out episodes (compute = prefill forwarded with prefix caching "
          "+ decoded, per episode) ==")
    print(f"{'policy':>34} {'success':>9} {'compute':>9} {'edits':>6} {'overflow':>9}")
    for r in table:
        sd = f"+-{r['success_std']:.3f}" if "success_std" in r else ""
        print(f"{r['policy']:>34} {r['success']:>9.3f}{sd} {r['compute']:>9.1f} {r['edits']:>6.2f} {r['overflow']:>9.3f}")
    for r in rl:
        print(f"{r['policy']:>34} {r['success']:>9.3f} {r['compute']:>9.1f} {r['edits']:>6.2f} {r['overflow']:>9.3f}"
              f"   (train success {r['train_success_first']:.2f} -> {r['train_success_last']:.2f}, {r['seconds']:.0f}s)")

    spans = {f"suffix K={k}": ReuseConfig(mode="suffix", max_spans=k, min_span=16, reforward=4, min_gain=8)
             for k in (1, 3, 6)}
    spans["suffix K=6 (64/16/32)"] = ReuseConfig(mode="suffix")
    spans["prefix"] = ReuseConfig(mode="prefix")
    serve = {}
    served = "scripted, drawn fold points" if args.slack else "scripted"  # the demonstrations' trajectories
    for name, trajs in ((served, oracle_trajs[served]), ("warm start", warm_trajs)):
        if not trajs:
            continue
        rows = serving(model, trajs, tok, task.fmt, spans)
        serve[name] = rows
        print_serving(f"== serving the {name} trajectories ({len(trajs)} episodes, {sum(map(len, trajs))} calls) ==",
                      rows)
    long = None if args.skip_long else long_serving(args)
    print(json.dumps({"policies": table, "rl_runs": rl, "serving": serve, "long_serving": long, "steps": args.steps,
                      "episodes": len(episodes)}))


if __name__ == "__main__":
    main()
