"""LoRA surgery: low-rank adapters on named projections (peft), the only trainable parameters.

    model = apply_lora(model, LoRAOptions(lora_rank=16))     # a peft model; export saves the adapter
    model = train_all_or_lora(model, opts)                   # LoRA when lora_rank > 0, else every weight trains

`LoRAOptions` holds the keys an algorithm config inherits to offer LoRA (`algo.lora_rank=...`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class LoRAOptions:
    """LoRA keys shared by the algorithms that can train adapters only (apply_lora)."""

    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"])


def apply_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """LoRA adapters on `cfg.lora_targets` (rank `lora_rank`); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def train_all_or_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """LoRA adapters when `cfg.lora_rank > 0` (only they train), else every weight trains."""
    if cfg.lora_rank > 0:
        return apply_lora(model, cfg)
    model.requires_grad_(True)
    return model
