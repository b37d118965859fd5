"""Export a trained model: the full model in Hugging Face format with its tokenizer, or, for a peft
model, the adapter with a README saying how to load and serve it."""
from __future__ import annotations

from typing import Any

from torch import nn


def export_model(model: nn.Module, tokenizer: Any, out_dir: str, algo_name: str) -> None:
    """Full model in HF format, or with LoRA the PEFT adapter (plus a README saying how to load it)."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if hasattr(model, "peft_config"):
        base = getattr(model.peft_config["default"], "base_model_name_or_path", None)
        with open(f"{out_dir}/README.md", "w") as fh:  # out_dir is a temp dir renamed later: name no path of it
            fh.write(f"# {algo_name} LoRA adapter\n\nLoad: `PeftModel.from_pretrained(AutoModelForCausalLM."
                     f"from_pretrained({base!r}), \"<this directory>\")`, or "
                     f"`python -m inference {base} --adapter <this directory>`.\n")
