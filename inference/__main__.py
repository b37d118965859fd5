"""Command line generation: `python -m inference DIR --prompt TEXT [options]`.

Loads a local Hugging Face causal LM and its tokenizer from DIR (e.g. a run's `final/`), completes
the prompt with the Engine, stopping at the tokenizer's eos token, and prints the completion.

    python -m inference runs/x/final --prompt "12+7=" --max-new-tokens 32            # greedy
    python -m inference runs/x/final --prompt "12+7=" --temperature 0.8 --top-p 0.95 --seed 1
    python -m inference runs/x/final --prompt "12+7=" --speculative seed        # SEED self-drafting
    python -m inference runs/x/final --prompt "12+7=" --speculative external --drafter runs/small/final

With --speculative the completion is followed by a stderr line with the acceptance length (mean
tokens per verify forward) and tokens/s. `--speculative seed` reads DIR/seed_drafter.json when
present (else the defaults); `--drafter DIR2` alone implies `--speculative external`.
"""
from __future__ import annotations

import argparse
import sys

import torch

# Flags whose fast paths later issues add; they are accepted now so the CLI surface is stable.
NOT_YET = {"adapter": "loading a PEFT adapter"}
EXIT_UNSUPPORTED = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", help="local directory with an HF model and its tokenizer")
    parser.add_argument("--prompt", required=True, help="text to complete")
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
    parser.add_argument("--adapter", metavar="DIR", help="PEFT adapter dir (not supported yet)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drafter and args.speculative is None:
        args.speculative = "external"
    if args.speculative == "external" and not args.drafter:
        print("error: --speculative external needs --drafter DIR", file=sys.stderr)
        return EXIT_UNSUPPORTED
    if args.speculative == "seed" and args.drafter:
        print("error: --drafter is only used with --speculative external", file=sys.stderr)
        return EXIT_UNSUPPORTED
    for flag, what in NOT_YET.items():
        if getattr(args, flag):
            print(f"error: --{flag} ({what}) is not supported yet", file=sys.stderr)
            return EXIT_UNSUPPORTED
    # Imported after argument checks so `--help` and flag errors answer instantly.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.engine import Engine
    from inference.sampling import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(args.device).eval()
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, stop_token_ids=(eos,) if eos is not None else (),
    )
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    prompt_ids = tokenizer.encode(args.prompt)
    if args.speculative is None:
        completion = Engine(model).generate([prompt_ids], params, generator)[0]
    else:
        completion = _speculative(args, model, prompt_ids, params, generator)
    print(tokenizer.decode(completion.tokens, skip_special_tokens=True))
    return 0


def _speculative(args, model, prompt_ids, params, generator):
    """Generate with speculative decoding; report acceptance length and tokens/s on stderr."""
    import time

    from transformers import AutoModelForCausalLM

    from inference.speculative import SpeculativeDecoder

    overrides = {key: value for key, value in (("draft_len", args.draft_len), ("confidence", args.confidence))
                 if value is not None}
    if args.fixed_draft:
        overrides["adaptive"] = False
    if args.speculative == "seed":
        decoder = SpeculativeDecoder.from_pretrained_dir(model, args.model_dir, **overrides)
    else:
        drafter = AutoModelForCausalLM.from_pretrained(args.drafter).to(args.device).eval()
        decoder = SpeculativeDecoder(model, mode="external", drafter=drafter, **overrides)
    start = time.perf_counter()
    [completion], stats = decoder.generate([prompt_ids], params, generator)
    seconds = time.perf_counter() - start
    print(f"[speculative {args.speculative}] acceptance length {stats.mean_accepted:.2f} tokens/verify, "
          f"{len(completion.tokens) / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)
    return completion


if __name__ == "__main__":
    sys.exit(main())
