"""Command line generation: `python -m inference DIR --prompt TEXT [options]`.

Opens DIR through the serving door (`inference/serving.py`: `load_served`), as its `serving.json`
manifest says (an export without one is described from its files): a full model; a PEFT adapter dir
merged into the base it names; a compressed-tensors quantized export (`+algo=qad`) on the low-bit
path (integer matmuls, `inference/quantized.py`); an export with a layer skipper in `DIR/skipper/`
(`+algo=skipper`) with its routers (routed execution, `inference/skip_routing.py`). It completes the
prompt, stopping at the manifest's stop ids (the tokenizer's eos), and prints the completion.
`--adapter` serves an exported LoRA adapter on top of DIR as its base. Models load in the dtype
they were saved in (what `from_pretrained` does by default).

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
`error:` line on stderr naming the input, exit code 2; so is one the serving door refuses (a
drafter with another tokenizer, a skipper for another base, an adapter on low-bit weights, a weight
format this runtime cannot run), naming the file and the field.
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
    from inference.engine import EngineConfig
    from inference.serving import ServeOptions, ServingError, load_served
    from models.prompts import ChatTemplateError

    options = ServeOptions(adapter=args.adapter, skipper=args.skipper, use_skipper=not args.no_skipper,
                           speculative=args.speculative, drafter=args.drafter,
                           draft_len=args.draft_len, confidence=args.confidence,
                           adaptive=False if args.fixed_draft else None, device=args.device,
                           engine=EngineConfig(skip_mode=args.skip_mode))
    try:
        server = load_served(args.model_dir, options)
        prompt_ids = encode_cli_prompt(server.tokenizer, args.prompt, args.chat)
    except (ServingError, ChatTemplateError) as err:  # e.g. a skipper for another model; --chat without a template
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    params = server.params(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    [completion] = server.generate([prompt_ids], params, generator)
    stats = server.stats
    if server.skipper is not None and args.speculative is None:
        print(f"[skipper {server.skipper}] skipped {stats.skip_ratio():.1%} of routed layer-tokens "
              f"in decode ({args.skip_mode})", file=sys.stderr)
    if args.speculative is not None:
        print(f"[speculative {args.speculative}] acceptance length {stats.mean_accepted:.2f} tokens/verify, "
              f"{stats.speculative.mean_round_ms:.2f} ms/round, {stats.tokens_per_s():.1f} tokens/s", file=sys.stderr)
    print(server.tokenizer.decode(completion.tokens, skip_special_tokens=True))
    return 0


def encode_cli_prompt(tokenizer, prompt: str, chat: bool | None) -> list[int]:
    """The prompt's ids as training and eval build them (models/prompts.py): the user turn of the chat
    template when `chat` (None: when the tokenizer has one), then one leading BOS where the tokenizer adds one."""
    from models.prompts import prompt_ids, render, use_chat

    return prompt_ids(tokenizer, render(tokenizer, prompt, chat=use_chat(tokenizer, _mode(chat))))


def _mode(chat: bool | None) -> str:
    return "auto" if chat is None else ("true" if chat else "false")


def _serve_artifacts(args) -> int:
    """--artifacts: the prompt over a position-independent cache of the artifacts (base + optional
    query-side adapter). Bad files, an artifact that does not fit, an adapter for another base: one
    `error:` line, exit 2."""
    import time
    import warnings

    from inference.pic import PICConfig, PICError, PICRequest, read_artifacts
    from inference.serving import ServeOptions, ServingError, load_served

    try:
        texts = read_artifacts(args.artifacts)
        server = load_served(args.model_dir, ServeOptions(adapter=args.adapter, artifacts=True, device=args.device))
    except (PICError, ServingError) as err:  # a bad artifacts file; an adapter for another base; low-bit weights
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    tokenizer, adapter = server.tokenizer, server.adapter_dir

    from models.prompts import ChatTemplateError, chat_parts, continuation_ids, prompt_ids, use_chat

    def ids(text: str) -> list[int]:
        return continuation_ids(tokenizer, text)

    # As training cuts a templated prompt (tasks/chat_template.py): the template's head joins the shared prefix,
    # the artifacts and the prompt are the user turn's content, the tail (the assistant cue) ends the query.
    try:
        head, tail = chat_parts(tokenizer) if use_chat(tokenizer, _mode(args.chat)) else ("", "")
    except ChatTemplateError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    prefix = prompt_ids(tokenizer, head + args.prefix)
    request = PICRequest.make(prefix, [ids(t) for t in texts], ids(args.prompt + tail))
    params = server.params(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            engine = server.artifact_engine(prefix, PICConfig(mode=args.pic_mode))
            cache = engine.cache
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
