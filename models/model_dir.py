"""What a local model directory must hold before loading is attempted, checked with the standard
library only (config validation runs before torch or transformers is imported): one-line reasons
naming the directory, instead of the loaders' tracebacks (a missing directory reads to them as a
malformed hub id; a missing tokenizer as a missing sentencepiece / tiktoken install)."""
from __future__ import annotations

import os
import re

CONFIG_FILES = ("config.json", "adapter_config.json")  # a Hugging Face model, or a PEFT adapter
# Any one of these lets AutoTokenizer build the tokenizer; with none of them it cannot.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class ModelDirError(ValueError):
    """A local model directory that cannot be loaded; the message is one line naming it."""


def looks_like_hub_id(path: str) -> bool:
    """`owner/name` that is not a local path: `load_pretrained` may fetch it when online."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)


def tokenizer_problem(path: str) -> str | None:
    """Why no tokenizer can be loaded from the directory `path`, or None."""
    if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    return (f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained(DIR)")


def model_dir_problem(path: str) -> str | None:
    """Why `path` is not a loadable local model (or PEFT adapter) directory with its tokenizer, or None."""
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not any(os.path.exists(os.path.join(path, f)) for f in CONFIG_FILES):
        return f"{path} has no config.json or adapter_config.json (not a Hugging Face model or PEFT adapter directory)"
    return tokenizer_problem(path)


def refused_pickle_reason(err: BaseException) -> str:
    """What a weights-only load refused, from torch's multi-line UnpicklingError, in a few words."""
    text = str(err)
    asked = re.search(r"Unsupported global: (?:GLOBAL )?(\S+)", text)
    if asked:
        return f"it asks to build or call `{asked.group(1)}`"
    detail = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    return " ".join(detail.group(1).split())[:200] if detail else "a pickle that is not plain data"
