"""Command line generation: `python -m inference DIR --prompt TEXT [options]`.

Loads a causal LM and its tokenizer through `models.loading` from DIR (e.g. a run's `final/`;
a PEFT adapter dir whose adapter_config.json names its base also works, merged into the base;
a compressed-tensors quantized export, e.g. from `+algo=qad`, runs on the low-bit path:
integer weights and per-token integer activations through integer matmuls, `inference/quantized.py`;
an export with a layer skipper in `DIR/skipper/`, e.g. from `+algo=skipper`, runs with its routers:
routed execution, `inference/skip_routing.py`), completes the prompt with the Engine, stopping at the tokenizer's eos token, and prints the
completion. `--adapter ADAPTER_DIR` serves an exported LoRA adapter on top of DIR as its base.
Models load in the dtype they were saved in (what `from_pretrained` does by default).

    python -m inference runs/x/final --prompt "12+7=" --max-new-tokens 32            # greedy
    python -m inference BASE --adapter runs/lora/final --prompt "12+7="            # LoRA export
    python -m inference runs/lora/final --prompt "12+7="                  # the same, base from the adapter
    python -m inference runs/qad/final --prompt "12+7="                   # quantized export: low-bit path
    python -m inference runs/x/final --prompt "12+7=" --temperature 0.8 --top-p 0.95 --seed 1
    python -m inference runs/skip/final --prompt "12+7="                  # base + skipper/: routed layers
    python -m inference BASE --skipper runs/skip/final/skipper --prompt "12+7="   # a skipper dir on a base
    python -m inference runs/x/final --prompt "12+7=" --speculative seed        # SEED self-drafting
    python -m inference runs/x/final --prompt "12+7=" --speculative external --drafter runs/small/final
    python -m inference BASE --artifacts a.txt b.txt --prompt "q: ..."   # position-independent cache
    python -m inference BASE --adapter runs/attuner/final --artifacts tables.jsonl --prompt "q: kiwo fo?\na: "

With --speculative the completion is followed by a stderr line with the acceptance length (mean
tokens per verify forward) and tokens/s. `--speculative seed` reads seed_drafter.json from the
--adapter dir or else DIR when present (else the defaults); `--drafter DIR2` (loaded the same way
as DIR) alone implies `--speculative external`. With a skipper, a stderr line gives the share of
skipped routed layer-tokens; `--skip-mode` picks routed, masked or auto (the measured cost gate).

`--artifacts FILE...` serves the prompt over a position-independent cache (`inference/pic.py`):
each artifact (a text file, or one per line of a .jsonl / item of a .json list) is encoded on its
own after `--prefix`, placed in that order before the prompt with its keys relocated, and only the
prompt is prefilled. With `--adapter` (an Attuner export, `+algo=attuner`) the adapter runs on the
prompt and generated tokens only; the artifact cache is the base's. `--pic-mode` picks the
comparison modes (full prefill, ape, epic, cacheblend, full_scores). A stderr line reports the
artifacts, the relocation check and the time to first token.

A request that cannot run (a model or --drafter dir that does not exist, has no config or no
tokenizer; an empty --prompt; --max-new-tokens below 1) is refused before anything loads with one
`error:` line on stderr naming the input, exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

EXIT_USAGE = 2
ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter dir



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", help="local directory with an HF model and its tokenizer")
    parser.add_argument("--prompt", required=True, help="text to complete (the user turn with --chat)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="render the prompt as the user turn of the tokenizer's chat template "
                             "(default: on when the tokenizer has one; --no-chat sends the raw text)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--speculative", choices=("seed", "external"),
                        help="speculative decoding: SEED self-drafting or an external --drafter")
    parser.add_argument("--drafter", metavar="DIR", help="drafter model dir (implies --speculative external)")
    parser.add_argument("--draft-len", type=int, default=None, help="max drafts per verify")
    parser.add_argument("--confidence", type=float, default=None,
                        help="stop drafting after a draft whose top probability is below this")
    parser.add_argument("--fixed-draft", action="store_true",
                        help="always draft --draft-len tokens (no confidence-based early stop)")
    parser.add_argument("--adapter", metavar="DIR",
                        help="PEFT (LoRA) adapter dir to apply to the model in model_dir and merge")
    parser.add_argument("--skipper", metavar="DIR",
                        help="layer-skipper dir (skipper.json + skipper.safetensors) to serve on top of model_dir")
    parser.add_argument("--no-skipper", action="store_true", help="ignore model_dir/skipper/: serve the base alone")
    parser.add_argument("--skip-mode", choices=("auto", "routed", "masked"), default="auto",
                        help="how routed layers run: auto (measured cost gate), routed (gather/scatter), masked")
    parser.add_argument("--artifacts", nargs="+", metavar="FILE",
                        help="artifacts to serve from a position-independent cache, in context order")
    parser.add_argument("--prefix", default="", help="--artifacts: shared text before the artifacts")
    parser.add_argument("--pic-mode", choices=("pic", "full", "ape", "epic", "cacheblend", "full_scores"),
                        default="pic", help="--artifacts: how the context is prefilled (default: pic)")
    return parser.parse_args(argv)


def usage_problem(args: argparse.Namespace) -> str | None:
    """The first flag or directory that makes the request impossible, as one line naming it; None if
    none. Checked before anything is loaded."""
    from models.model_dir import model_dir_problem

    if not args.prompt:
        return "--prompt is empty: give the text to complete"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    for flag, path in (("model dir", args.model_dir), ("--drafter", args.drafter)):
        problem = model_dir_problem(path) if path else None
        if problem is not None:
            return f"{flag}: {problem}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = usage_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.drafter and args.speculative is None:
        args.speculative = "external"
    if args.speculative == "external" and not args.drafter:
        print("error: --speculative external needs --drafter DIR", file=sys.stderr)
        return EXIT_USAGE
    if args.speculative == "seed" and args.drafter:
        print("error: --drafter is only used with --speculative external", file=sys.stderr)
        return EXIT_USAGE
    if args.adapter and not os.path.exists(os.path.join(args.adapter, ADAPTER_CONFIG)):
        print(f"error: --adapter {args.adapter} is not a PEFT adapter dir (no {ADAPTER_CONFIG})", file=sys.stderr)
        return EXIT_USAGE
    if args.artifacts:
        if args.speculative or args.skipper:
            print("error: --artifacts does not combine with --speculative or --skipper", file=sys.stderr)
            return EXIT_USAGE
        return _serve_artifacts(args)
    # Imported after argument checks so `--help` and flag errors answer instantly.
    from inference.engine import Engine
    from inference.sampling import SamplingParams

    model, tokenizer = load_model(args.model_dir, args.adapter, args.device)
    try:
        skipper = attach_skipper(model, args)
    except ValueError as err:  # SkipperError: a skipper for another model, or a broken dir
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, stop_token_ids=(eos,) if eos is not None else (),
    )
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    from models.prompts import ChatTemplateError

    try:
        prompt_ids = encode_cli_prompt(tokenizer, args.prompt, args.chat)
    except ChatTemplateError as err:  # --chat with a tokenizer that has no template
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.speculative is None:
        from inference.engine import EngineConfig

        engine = Engine(model, EngineConfig(skip_mode=args.skip_mode))
        completion = engine.generate([prompt_ids], params, generator)[0]
        if skipper is not None and getattr(engine.route, "stats", None) is not None:
            print(f"[skipper {skipper}] skipped {engine.route.stats.skip_ratio():.1%} of routed layer-tokens "
                  f"in decode ({args.skip_mode})", file=sys.stderr)
    else:
        completion = _speculative(args, model, prompt_ids, params, generator)
    print(tokenizer.decode(completion.tokens, skip_special_tokens=True))
    return 0


def encode_cli_prompt(tokenizer, prompt: str, chat: bool | None) -> list[int]:
    """The prompt's ids as training and eval build them (models/prompts.py): the user turn of the chat
    template when `chat` (None: when the tokenizer has one), then one leading BOS where the tokenizer adds one."""
    from models.prompts import prompt_ids, render, use_chat

    return prompt_ids(tokenizer, render(tokenizer, prompt, chat=use_chat(tokenizer, _mode(chat))))


def _mode(chat: bool | None) -> str:
    return "auto" if chat is None else ("true" if chat else "false")


def load_model(model_dir: str, adapter: str | None, device: str):
    """(model in eval mode on `device`, tokenizer) through models.loading: model_dir may itself be
    an adapter dir (load_pretrained merges it into its base); `adapter` is applied on top and
    merged, so the lean decoder runs the result. The tokenizer is model_dir's."""
    from models.loading import load_pretrained
    from models.model_dir import ModelDirError
    from models.quant_export import is_compressed

    if is_compressed(model_dir):  # a quantized export: the low-bit path (integer matmuls)
        if adapter:
            _usage_exit(f"--adapter cannot be applied to the quantized model in {model_dir}")
        from inference.quantized import load_quantized

        return load_quantized(model_dir, device)
    try:
        model, tokenizer = load_pretrained(model_dir, saved_dtype(model_dir))
    except ModelDirError as err:  # e.g. an adapter dir saved without its tokenizer
        _usage_exit(str(err))
    if adapter:
        from peft import PeftModel

        from models.loading import plain_weights

        try:
            with plain_weights(adapter):
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        except ModelDirError as err:  # a weights pickle that is not plain data: refused, nothing of it ran
            _usage_exit(str(err))
    return model.to(device).eval(), tokenizer


def _usage_exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def attach_skipper(model, args) -> str | None:
    """Apply `--skipper DIR`, or else `model_dir/skipper/` when the export has one (unless
    --no-skipper); returns the dir applied, or None."""
    from models.skipper import find_skipper, load_skipper

    path = args.skipper or (None if args.no_skipper else find_skipper(args.model_dir))
    if path is None:
        return None
    load_skipper(model, path)
    return path


def saved_dtype(path: str) -> str:
    """Name of the dtype the checkpoint at `path` (an adapter dir: its base) was saved in, as
    models.loading spells it; float32 when the config names none it knows."""
    from transformers import AutoConfig

    from models.loading import DTYPES

    if os.path.exists(os.path.join(path, ADAPTER_CONFIG)):
        from peft import PeftConfig

        path = PeftConfig.from_pretrained(path).base_model_name_or_path
    dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPES else "float32"


def _seed_dir(args) -> str:
    """Where seed_drafter.json is read: the adapter dir when it has one, else the model dir."""
    from inference.artifacts import SEED_DRAFTER_FILE

    if args.adapter and os.path.exists(os.path.join(args.adapter, SEED_DRAFTER_FILE)):
        return args.adapter
    return args.model_dir


def _speculative(args, model, prompt_ids, params, generator):
    """Generate with speculative decoding; report acceptance length and tokens/s on stderr."""
    import time

    from inference.speculative import SpeculativeDecoder

    overrides = {key: value for key, value in (("draft_len", args.draft_len), ("confidence", args.confidence))
                 if value is not None}
    if args.fixed_draft:
        overrides["adaptive"] = False
    if args.speculative == "seed":
        decoder = SpeculativeDecoder.from_pretrained_dir(model, _seed_dir(args), **overrides)
    else:
        drafter, _ = load_model(args.drafter, None, args.device)
        decoder = SpeculativeDecoder(model, mode="external", drafter=drafter, **overrides)
    start = time.perf_counter()
    [completion], stats = decoder.generate([prompt_ids], params, generator)
    seconds = time.perf_counter() - start
    print(f"[speculative {args.speculative}] acceptance length {stats.mean_accepted:.2f} tokens/verify, "
          f"{len(completion.tokens) / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)
    return completion


def _serve_artifacts(args) -> int:
    """--artifacts: the prompt over a position-independent cache of the artifacts (base + optional
    query-side adapter). Bad files, an artifact that does not fit, an adapter for another base: one
    `error:` line, exit 2."""
    import time
    import warnings

    from inference.pic import ArtifactCache, PICConfig, PICEngine, PICError, PICRequest, load_query_adapter, read_artifacts
    from inference.sampling import SamplingParams
    from models.loading import load_pretrained

    try:
        texts = read_artifacts(args.artifacts)
    except PICError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    model_dir, adapter = args.model_dir, args.adapter
    if adapter is None and os.path.exists(os.path.join(model_dir, ADAPTER_CONFIG)):
        from peft import PeftConfig  # the dir is itself an adapter: serve it over the base it names

        model_dir, adapter = PeftConfig.from_pretrained(model_dir).base_model_name_or_path, model_dir
    model, tokenizer = load_pretrained(model_dir, saved_dtype(model_dir))
    model = model.to(args.device).eval()

    from models.prompts import ChatTemplateError, chat_parts, continuation_ids, prompt_ids, use_chat

    def ids(text: str) -> list[int]:
        return continuation_ids(tokenizer, text)

    # As training cuts a templated prompt (tasks/chat.py): the template's head joins the shared prefix,
    # the artifacts and the prompt are the user turn's content, the tail (the assistant cue) ends the query.
    try:
        head, tail = chat_parts(tokenizer) if use_chat(tokenizer, _mode(args.chat)) else ("", "")
    except ChatTemplateError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    prefix = prompt_ids(tokenizer, head + args.prefix)
    request = PICRequest.make(prefix, [ids(t) for t in texts], ids(args.prompt + tail))
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, stop_token_ids=(eos,) if eos is not None else ())
    try:
        deltas = load_query_adapter(model, adapter) if adapter else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            cache = ArtifactCache(model, prefix=prefix)
            engine = PICEngine(model, cache, PICConfig(mode=args.pic_mode), adapter=deltas)
            start = time.perf_counter()
            cache.get_many(request.artifacts)
            encode_s = time.perf_counter() - start
            generator = torch.Generator(device=args.device).manual_seed(args.seed)
            completion = engine.generate([request], params, generator)[0]
    except (PICError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(tokenizer.decode(completion.tokens, skip_special_tokens=True))
    kl = f", relocation check KL {cache.probe_kl:.1e}" if cache.probe_kl is not None else ""
    print(f"[pic {args.pic_mode}] {len(texts)} artifacts ({cache.stats.encoded_tokens} tokens encoded in "
          f"{encode_s * 1e3:.1f} ms{kl}); time to first token {engine.stats.ttft_s * 1e3:.1f} ms over "
          f"{engine.stats.query_tokens} prefilled tokens" + (f"; adapter {adapter}" if adapter else ""),
          file=sys.stderr)
    return 0



if __name__ == "__main__":
    sys.exit(main())
