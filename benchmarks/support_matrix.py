"""Which architectures each algorithm and each runtime path supports, measured on tiny random models.

For every architecture below a tiny random-weight model (hidden 32, 4 layers, the embedded char
tokenizer's vocabulary) is built from its transformers config, saved as a local HF dir with
`models.tokenizer.build_char_tokenizer()`, and then:

  algorithms  one in-process run of each `+algo=NAME` (`trainer.config.load_config` with `model=hf
              model.path=DIR` and small sizes like tests/conftest.py's TINY, then `build_session` +
              `fit` (1 step) + `export_final`). A cell is
                yes                    the run completed and exported `final/`
                refused: REASON        load_config raised ConfigError, or setup (`build_session`) raised a
                                       ValueError from this project's own code (a deliberate check)
                FAILS: TYPE: MESSAGE   anything else (an exception in fit / export, or a foreign one in setup)
  runtime     engine    `inference.Engine(model)` greedy on a left-padded batch of 4 prompts equals HF
                        `generate` run on each prompt alone (and which backend the Engine picked)
              lean      `lean_unsupported_reason(model)` is None, and then `Engine(use_lean=True)` equals HF
              seed-spec the SEED run's export served with `speculative="seed"` (`load_served`): greedy equals the
                        Engine's greedy on the same export (when the SEED run was refused, the decoder is built
                        on the base model to show the runtime's own answer)
              low-bit   the QAD run's compressed-tensors export opened by the serving door (`load_served`)
                        and generating; its greedy compared with the trained fake-quant student's HF forward
                        (the reference tests/inference/test_lowbit.py uses), and whether the lean path ran it
              skip      the skipper run's export (base + skipper/) opened as `python -m inference` does
                        (`load_served`, its manifest's skipper), generating; on the lean path the routed and
                        masked skip modes must agree, else the HF forward with the skipper serves it
              pic       `inference.pic.PICEngine` in mode "full" (full prefill) equals the Engine on the same
                        prompts; "pic" mode with one artifact at position 0 (exact by construction) equals it too

    OMP_NUM_THREADS=1 python benchmarks/support_matrix.py                 # everything: 58 s on 2 shared cores
    python benchmarks/support_matrix.py --archs llama,gemma2 --algos sft,seed --no-write

Writes docs/results/support_matrix.md and docs/results/support_matrix.json (unless --no-write).
Everything it builds lives in a temporary directory that is removed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from models.tokenizer import build_char_tokenizer  # noqa: E402

ALGOS = ("sft", "grpo", "opsd", "mass", "tesd", "seed", "qad", "skipper", "attuner", "clm")
RUNTIME = ("engine", "lean", "seed-spec", "low-bit", "skip", "pic")

VOCAB = len(build_char_tokenizer())
PAD, EOS = 0, 1
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 4, 4, 2, 8, 64
POSITIONS = 1024  # the artifacts and clm tasks' prompts are a few hundred characters
# Larger than HF's 0.02 so a random model's greedy output is not one repeated token (as the tests do).
INIT_RANGE = 0.2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
              initializer_range=INIT_RANGE, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
              tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _arch(cls: str, cfg: str, **kw):
    return cls, cfg, kw


ARCHS = {
    "llama": _arch("LlamaForCausalLM", "LlamaConfig"),
    "llama-rope-linear": _arch("LlamaForCausalLM", "LlamaConfig",
                               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "qwen2": _arch("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": _arch("Qwen3ForCausalLM", "Qwen3Config", head_dim=HEAD_DIM, tie_word_embeddings=True),
    "qwen3-moe": _arch("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=HEAD_DIM, decoder_sparse_step=1,
                       mlp_only_layers=[], **MOE),
    "qwen2-moe": _arch("Qwen2MoeForCausalLM", "Qwen2MoeConfig", decoder_sparse_step=1, mlp_only_layers=[],
                       shared_expert_intermediate_size=INTER, **MOE),
    "mistral-swa": _arch("MistralForCausalLM", "MistralConfig", sliding_window=16),
    "mixtral": _arch("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "phi3": _arch("Phi3ForCausalLM", "Phi3Config"),
    "gemma": _arch("GemmaForCausalLM", "GemmaConfig", head_dim=HEAD_DIM, tie_word_embeddings=True),
    "gemma2": _arch("Gemma2ForCausalLM", "Gemma2Config", head_dim=HEAD_DIM, sliding_window=16,
                    tie_word_embeddings=True),
    "gemma3-text": _arch("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=HEAD_DIM, sliding_window=16,
                         sliding_window_pattern=2, tie_word_embeddings=True),
    "olmo2": _arch("Olmo2ForCausalLM", "Olmo2Config"),
    "gpt-neox": _arch("GPTNeoXForCausalLM", "GPTNeoXConfig", num_key_value_heads=None),
    "gpt2": _arch("GPT2LMHeadModel", "GPT2Config", n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER,
                  n_positions=POSITIONS, bos_token_id=EOS, hidden_size=None, intermediate_size=None, num_hidden_layers=None,
                  num_attention_heads=None, num_key_value_heads=None, max_position_embeddings=None),
}

NEW = 12
PROMPTS = ["q: 12+7?\na: ", "q: tom has 3 apples.\na: ", "hi", "q: 40-18?\na: 40"]

# Small sizes as tests/conftest.py's TINY, with the model keys replaced by model=hf model.path=DIR; ARITH are
# the arith task's own keys, for the algorithms that run on it (PER_ALGO names any other task).
ARITH = ["data.digits=2", "data.steps=1"]
SMALL = ["data.n_train=32", "data.n_test=8", "trainer.max_steps=1",
         "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=1000", "trainer.eval_examples=4",
         "trainer.eval_max_new_tokens=8", "trainer.max_new_tokens=16", "trainer.save_every=1000",
         "trainer.warmup_steps=1", "trainer.resume=never", "logging.wandb=false", "logging.progress=false"]
PER_ALGO = {
    "grpo": ["algo.num_generations=2"],
    "seed": ["algo.decoder_layers=1"],
    "attuner": ["data=artifacts"],
    "clm": ["data=clm", "algo.num_generations=2", "algo.max_calls=3", "data.n_train=16", "data.n_test=4"],
}


# ----------------------------------------------------------------------------- models


def build(name: str) -> torch.nn.Module:
    cls_name, cfg_name, extra = ARCHS[name]
    kwargs = {k: v for k, v in {**COMMON, **extra}.items() if v is not None}
    config = getattr(tf, cfg_name)(**kwargs)
    torch.manual_seed(0)
    return getattr(tf, cls_name)(config).eval()


def save(model, path: Path) -> Path:
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def prompt_ids() -> list[list[int]]:
    tok = build_char_tokenizer()
    return [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]


def greedy_params(n: int = NEW):
    from inference.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0)


def hf_greedy(model, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    """The reference: HF `generate`, each prompt alone, no stop token."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 eos_token_id=None, pad_token_id=PAD, top_k=None, top_p=None, temperature=None)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def tokens(completions) -> list[list[int]]:
    return [list(c.tokens) for c in completions]


def rows_equal(got, ref) -> str:
    same = sum(a == b for a, b in zip(got, ref))
    return "yes" if same == len(ref) else f"differs ({len(ref) - same}/{len(ref)} rows)"


_TMP = {"dir": None}  # the run's temporary directory, written as $TMP in messages


def short(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split())
    if _TMP["dir"]:
        text = text.replace(_TMP["dir"], "$TMP")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def failed(err: BaseException, phase: str = "") -> tuple[str, str]:
    where = f" (in {phase})" if phase else ""
    return f"FAILS{where}", f"{type(err).__name__}: {short(err)}"


def refused_or_failed(err: BaseException, phase: str = "") -> tuple[str, str]:
    """A ValueError raised by this project's own code is a deliberate refusal; anything else fails."""
    if isinstance(err, ValueError) and project_frame(err):
        return (f"refused (in {phase})" if phase else "refused"), short(err)
    return failed(err, phase)


# ----------------------------------------------------------------------------- runtime cells


def engine_cell(model, prompts, ref) -> str:
    from inference.engine import Engine

    engine = Engine(model)
    backend = "lean" if engine.lean_active() else "HF forward"
    distinct = len({t for row in ref for t in row})
    weak = f"; the reference has only {distinct} distinct tokens (a weak comparison)" if distinct < 4 else ""
    verdict = rows_equal(tokens(engine.generate(prompts, greedy_params())), ref)
    return f"{verdict.split(' ')[0]} ({backend})", f"{verdict}, Engine on {backend}{weak}"


def lean_cell(model, prompts, ref) -> str:
    from inference.engine import Engine
    from inference.lean import lean_unsupported_reason

    reason = lean_unsupported_reason(model)
    if reason is not None:
        return "no", f"lean_unsupported_reason: {reason}"
    verdict = rows_equal(tokens(Engine(model, use_lean=True).generate(prompts, greedy_params())), ref)
    return verdict.split(" ")[0], f"lean decoder vs HF generate: {verdict}"


def pic_cell(model, prompts) -> str:
    from inference.engine import Engine
    from inference.pic import ArtifactCache, PICConfig, PICEngine, PICRequest

    # Each prompt cut into one artifact (its first half) and a query (the rest).
    requests = [PICRequest.make([], [p[:max(1, len(p) // 2)]], p[max(1, len(p) // 2):] or p[-1:]) for p in prompts
                if len(p) >= 2]
    ref = tokens(Engine(model).generate([r.tokens() for r in requests], greedy_params()))
    full = tokens(PICEngine(model, config=PICConfig(mode="full")).generate(requests, greedy_params()))
    verdict = rows_equal(full, ref)
    pic = tokens(PICEngine(model, ArtifactCache(model), PICConfig(mode="pic")).generate(requests, greedy_params()))
    pic_verdict = rows_equal(pic, ref)
    both = "yes" if verdict == pic_verdict == "yes" else "differs"
    return both, f"mode full vs Engine: {verdict}; mode pic at one artifact vs Engine: {pic_verdict}"


def seed_spec_cell(base, export: str | None, prompts) -> str:
    from inference.engine import Engine
    from inference.speculative import SpeculativeDecoder

    if export is None:  # the SEED run was refused or failed: ask the runtime directly on the base model
        try:
            SpeculativeDecoder(base, mode="seed", decoder_layers=1)
        except ValueError as err:
            return "no", f"no SEED export; SpeculativeDecoder(base, mode='seed') says: {short(err)}"
        return "no export", "SpeculativeDecoder builds on the base model, but there is no SEED export to serve"
    from inference.serving import ServeOptions, load_served

    try:
        server = load_served(export, ServeOptions(speculative="seed"))
    except Exception as err:  # noqa: BLE001 -- the SEED run exported this dir: not serving it is a failure
        return failed(err, "load_served")
    ref = tokens(Engine(server.model).generate(prompts, greedy_params()))
    got = server.generate(prompts, greedy_params())
    verdict = rows_equal(tokens(got), ref)
    return verdict.split(" ")[0], (f"speculative seed on the SEED export vs its Engine greedy: {verdict} "
                                   f"(acceptance length {server.stats.mean_accepted:.2f})")


def lowbit_cell(export: str | None, student, prompts) -> str:
    from inference.engine import Engine, EngineConfig
    from inference.serving import load_served

    if export is None:
        return "no export", "the QAD run exported nothing"
    try:
        model = load_served(export).model
    except Exception as err:  # noqa: BLE001 -- the QAD run exported this dir: not loading it is a failure
        return failed(err, "load_served")
    engine = Engine(model)
    got = tokens(engine.generate(prompts, greedy_params()))
    path = "lean" if engine.lean_active() else "HF forward"
    if not all(got):
        return "FAILS", f"loads, but generated nothing ({path})"
    ref = tokens(Engine(student, EngineConfig(use_lean=False)).generate(prompts, greedy_params()))
    verdict = rows_equal(got, ref)
    return (f"{verdict.split(' ')[0]} ({'lean' if path == 'lean' else 'HF'})",
            f"load_served loads + generates on the {path}; vs the fake-quant student's HF forward: {verdict}")


def skip_cell(export: str | None, prompts) -> str:
    from inference.engine import Engine, EngineConfig
    from inference.serving import ServeOptions, load_served

    if export is None:
        return "no export", "the skipper run exported nothing"
    try:
        server = load_served(export, ServeOptions(engine=EngineConfig(skip_mode="routed")))
    except Exception as err:  # noqa: BLE001 -- the skipper run exported this dir: not loading it is a failure
        return failed(err, "load_served")
    if server.skipper is None:
        return "FAILS", "the export's manifest names no skipper"
    model, engine = server.model, server.engine
    routed = tokens(server.generate(prompts, greedy_params()))
    if not engine.lean_active():
        if not all(routed):
            return "FAILS", "generated nothing (HF forward with the skipper)"
        return "yes (HF)", "served by the HF forward with the skipper's routed layers (the lean path cannot run it)"
    ratio = server.stats.skip_ratio()
    masked = tokens(Engine(model, EngineConfig(skip_mode="masked")).generate(prompts, greedy_params()))
    hf = tokens(Engine(model, EngineConfig(use_lean=False)).generate(prompts, greedy_params()))
    a, b = rows_equal(routed, masked), rows_equal(routed, hf)
    return ("yes (lean)" if a == b == "yes" else "differs (lean)",
            f"lean, skipped {ratio:.0%} of routed layer-tokens; routed vs masked: {a}; vs the HF forward: {b}")


# ----------------------------------------------------------------------------- algorithm cells


def project_frame(err: BaseException) -> bool:
    """Whether the exception was raised in this project's own code (not in torch / transformers)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return False
    where = os.path.abspath(frames[-1].filename)
    return where.startswith(str(ROOT)) and "site-packages" not in where


def run_algo(algo: str, model_dir: Path, out_dir: Path, log) -> tuple[tuple[str, str], str | None, object]:
    """((verdict, detail), final dir or None, the trained model or None)."""
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    own = PER_ALGO.get(algo, [])
    task = [] if any(o.startswith("data=") for o in own) else ARITH
    overrides = [f"+algo={algo}", "model=hf", f"model.path={model_dir}", *SMALL, *task, *own, f"output_dir={out_dir}"]
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = load_config(overrides, config_schemas())
        except ConfigError as err:
            return ("refused (config)", short(err)), None, None
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(file=log)
            return failed(err, "config"), None, None
        try:
            session = build_session(cfg, World())
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(file=log)
            return refused_or_failed(err, "setup"), None, None
        phase = "fit"
        try:
            status = fit(session)
            phase = "export"
            final = export_final(session)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(file=log)
            return failed(err, phase), None, None
        finally:
            session.tracker.close()
        if status != "done":
            return ("FAILS (in fit)", f"fit returned {status!r}"), None, None
        if not os.path.isdir(final) or not os.listdir(final):
            return ("FAILS (in export)", "final/ is empty"), None, None
        with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
            steps = [r["step"] for r in map(json.loads, fh) if r.get("split") == "train"]
        if steps != [1]:
            return ("FAILS (in fit)", f"train records for steps {steps}, expected [1]"), None, None
        return ("yes", ""), final, session.backend.full_model()


# ----------------------------------------------------------------------------- driver


def measure(name: str, work: Path, algos, log) -> dict:
    from models.loading import load_pretrained

    row: dict = {"arch": name, "class": ARCHS[name][0]}
    try:
        model_dir = save(build(name), work / name / "model")
        base, _ = load_pretrained(str(model_dir))  # through the project's own loader, as a run does
        base.eval()
    except Exception as err:  # noqa: BLE001
        row["not_built"] = f"{type(err).__name__}: {short(err)}"
        return row
    prompts = prompt_ids()
    cells: dict[str, tuple[str, str]] = {}
    times: dict[str, float] = {}

    def timed(key, fn, *args):
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cells[key] = fn(*args)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(file=log)
            cells[key] = refused_or_failed(err)
        times[key] = round(time.perf_counter() - start, 1)

    ref = hf_greedy(base, prompts)
    timed("engine", engine_cell, base, prompts, ref)
    timed("lean", lean_cell, base, prompts, ref)
    timed("pic", pic_cell, base, prompts)
    exports, trained = {}, {}
    for algo in algos:
        start = time.perf_counter()
        print(f"[{name}] {algo} ...", file=log, flush=True)
        cell, final, model = run_algo(algo, model_dir, work / name / algo, log)
        cells[algo], exports[algo], trained[algo] = cell, final, model
        times[algo] = round(time.perf_counter() - start, 1)
    if "seed" in algos:
        timed("seed-spec", seed_spec_cell, base, exports["seed"], prompts)
    if "qad" in algos:
        timed("low-bit", lowbit_cell, exports["qad"], trained["qad"], prompts)
    if "skipper" in algos:
        timed("skip", skip_cell, exports["skipper"], prompts)
    row.update(cells={k: {"verdict": v, "detail": d} for k, (v, d) in cells.items()}, seconds=times)
    return row


def table(rows: list[dict], columns: list[str]) -> tuple[str, list[str]]:
    """The markdown table (short cells with note numbers) and the numbered notes with the full text."""
    notes: list[str] = []
    index: dict[str, int] = {}

    def cell(entry: dict | None) -> str:
        if entry is None:
            return "-"
        verdict, detail = entry["verdict"], entry["detail"]
        if not detail:
            return verdict
        text = f"{verdict}: {detail}"
        if text not in index:
            notes.append(text)
            index[text] = len(notes)
        return f"{verdict} [{index[text]}]"

    lines = ["| arch | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for row in rows:
        if "not_built" in row:
            lines.append(f"| {row['arch']} | " + " | ".join(["not built"] * len(columns)) + " |")
            continue
        lines.append(f"| {row['arch']} | " + " | ".join(cell(row["cells"].get(c)) for c in columns) + " |")
    return "\n".join(lines), [f"[{i}] {text}" for i, text in enumerate(notes, 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--algos", default=",".join(ALGOS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "support_matrix.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--log", default=None, help="where the runs' own output goes (default: a temp file)")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    archs = [a for a in args.archs.split(",") if a]
    algos = [a for a in args.algos.split(",") if a]
    unknown = sorted(set(archs) - set(ARCHS)) + sorted(set(algos) - set(ALGOS))
    if unknown:
        parser.error(f"unknown: {unknown}")
    os.environ.setdefault("WANDB_MODE", "disabled")
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="support-matrix-") as tmp:
        _TMP["dir"] = tmp
        log_path = args.log or os.path.join(tmp, "runs.log")
        with open(log_path, "w") as log:
            for name in archs:
                t0 = time.perf_counter()
                row = measure(name, Path(tmp), algos, log)
                rows.append(row)
                print(f"{name}: {time.perf_counter() - t0:.0f} s "
                      + (row.get("not_built") or json.dumps({k: v["verdict"] for k, v in row["cells"].items()})), flush=True)
    total = time.perf_counter() - start
    runtime_cols = [c for c in RUNTIME if c not in ("seed-spec", "low-bit", "skip")
                    or {"seed-spec": "seed", "low-bit": "qad", "skip": "skipper"}[c] in algos]
    algo_md, algo_notes = table(rows, algos)
    run_md, run_notes = table(rows, runtime_cols)
    env = (f"torch {torch.__version__}, transformers {tf.__version__}, CPU, {torch.get_num_threads()} thread(s); "
           f"models: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads ({KV_HEADS} KV), vocab {VOCAB} (char tokenizer), "
           f"init range {INIT_RANGE}; whole run {total:.0f} s")
    not_built = [f"- {r['arch']} ({r['class']}): {r['not_built']}" for r in rows if "not_built" in r]
    md = "\n".join([
        "# Support matrix: architectures x algorithms and runtime paths (measured)",
        "",
        "Generated by `benchmarks/support_matrix.py` (" + env + "). Every cell is the outcome of running the",
        "thing on a tiny random-weight model of that architecture; the numbered notes give each cell's full text.",
        "",
        "## Algorithms: one in-process step of `+algo=NAME` with `model=hf model.path=DIR`, then `export_final`",
        "",
        "`yes` = the run completed and exported; `refused` = ConfigError at config loading, or a ValueError",
        "raised by the project's own code in `build_session`; `FAILS` = any other exception.",
        "",
        algo_md, "", *algo_notes, "",
        "## Runtime paths",
        "",
        "engine: Engine greedy on a padded batch of 4 prompts vs HF `generate` per prompt (backend in brackets);",
        "lean: `lean_unsupported_reason` and, when None, the lean decoder vs HF; seed-spec: speculative `seed`",
        "serving of the SEED run's export vs the Engine on it (the base model when no export); low-bit: the QAD",
        "run's export through `load_served` vs the trained fake-quant student's HF forward; skip: the skipper",
        "run's export served with its skipper; pic: `PICEngine` full-prefill mode (and pic mode at one artifact)",
        "vs the Engine.",
        "",
        run_md, "", *run_notes, "",
        *(["## Not built", "", *not_built, ""] if not_built else []),
    ])
    print()
    print(md)
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps({"environment": env, "seconds": round(total, 1),
                                                        "rows": rows}, indent=1) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
