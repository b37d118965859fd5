"""A toy stored weight format, added the way a new one is: this one module and one registration, with no
edit to the door, the CLI, the server or the trainer's loader (docs/serving.md, "Adding a stored weight
format"). An export in it holds every weight halved and a `halved.json` marker; loading doubles them back."""
from __future__ import annotations

import json
import os

import torch

from inference.serving import WeightFormat, register_weights

MARKER = "halved.json"


def save_halved(model: torch.nn.Module, tokenizer, out: str) -> None:
    with torch.no_grad():
        halved = {k: v / 2 for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=halved)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, MARKER), "w") as fh:
        json.dump({"scheme": "half"}, fh)


def _detect(path: str) -> str | None:
    marker = os.path.join(path, MARKER)
    return json.load(open(marker))["scheme"] if os.path.exists(marker) else None


def _load(path: str, device: str):
    from models.loading import load_pretrained

    model, tokenizer = load_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    return model.to(device).eval(), tokenizer


def _refuse(manifest, options) -> str | None:
    return "weights halved: no adapter merges into them" if options.adapter else None


register_weights(WeightFormat(name="halved", detect=_detect, load=_load, refuse=_refuse))
