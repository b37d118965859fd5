"""Query-side LoRA surgery: low-rank adapters on the attention query projections only (peft), the
only trainable parameters, and the arithmetic of how few parameters that is.

    model = apply_query_lora(model, rank=8, alpha=16.0, dropout=0.0)   # a peft model, q_proj only
    check_query_only(model)                                            # every adapter on a query projection
    with adapter_disabled(model): ...                                  # the frozen base, exactly
    trainable_fraction(model.config, rank=8)                           # LoRA / all parameters, from shapes

An adapter on the queries changes what a token looks for, never what it offers: a token's keys and
values are its k/v projections of its own hidden state, so as long as the adapter is off while a
token is encoded, its K/V are the base's. That is what lets a cache of K/V made once by the base be
read by an adapted model (Attuner: `algorithms/attuner.py`, `docs/attuner.md`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from models.anatomy import unwrap

# Module names of the attention query projection (Llama / Qwen / Mistral layout). A fused q|k|v
# projection is not a query projection: an adapter on it would change the keys and values too.
QUERY_PROJECTIONS = ("q_proj",)


class QueryAdapterError(ValueError):
    """An adapter that is not on query projections only, or a model without them; the message names it."""


def apply_query_lora(model: nn.Module, rank: int, alpha: float, dropout: float,
                     targets: Sequence[str] = QUERY_PROJECTIONS, seed: int | None = None) -> nn.Module:
    """LoRA adapters of rank `rank` on the query projections `targets` (peft `LoraConfig`); returns the
    peft model, in which only the adapters train. `seed` seeds the adapters' init (lora_A; lora_B
    starts at zero, so a fresh adapter changes nothing); None draws from the global RNG."""
    from peft import LoraConfig, get_peft_model

    targets = list(targets)
    bad = [t for t in targets if t not in QUERY_PROJECTIONS]
    if bad or not targets:
        raise QueryAdapterError(f"query adapter targets {targets}: only query projections "
                                f"({', '.join(QUERY_PROJECTIONS)}) may carry it -- an adapter on keys or values "
                                "would make the cached K/V depend on it")
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora)
    check_query_only(peft_model, targets)
    return peft_model


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every module carrying LoRA weights (peft's `lora_A`)."""
    return {name: m for name, m in unwrap(model).named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0}


def check_query_only(model: nn.Module, targets: Sequence[str] = QUERY_PROJECTIONS) -> None:
    """QueryAdapterError unless the model carries adapters, each on a module named one of `targets`,
    and nothing but adapter weights trains."""
    wrapped = lora_modules(model)
    if not wrapped:
        raise QueryAdapterError("the model carries no LoRA adapter (apply_query_lora applies one)")
    off_target = sorted(n for n in wrapped if n.rsplit(".", 1)[-1] not in targets)
    if off_target:
        raise QueryAdapterError(f"LoRA adapters on {off_target[:3]}{' ...' if len(off_target) > 3 else ''}: "
                                f"a query adapter sits on {', '.join(targets)} only")
    trainable = sorted(n for n, p in unwrap(model).named_parameters() if p.requires_grad and ".lora_" not in n)
    if trainable:
        raise QueryAdapterError(f"{len(trainable)} non-adapter parameters train (e.g. {trainable[0]}); "
                                "the base must stay frozen")


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes the frozen base: peft's `disable_adapter()` on a peft model
    (through DDP / DeepSpeed wrappers); a model without adapters is the base already."""
    inner = unwrap(model)
    if hasattr(inner, "disable_adapter"):
        with inner.disable_adapter():
            yield
    else:
        yield


def _dims(config: Any) -> dict[str, Any]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return dict(h=config.hidden_size, layers=config.num_hidden_layers, heads=heads, head_dim=head_dim,
                kv=getattr(config, "num_key_value_heads", None) or heads, inter=config.intermediate_size,
                vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                bias=bool(getattr(config, "attention_bias", False)),
                qk_norm=getattr(config, "model_type", "qwen3") in ("qwen3", "qwen3_moe"))


def query_lora_parameters(config: Any, rank: int) -> int:
    """LoRA parameters of rank `rank` on every layer's q_proj: A (r, hidden) + B (heads * head_dim, r)."""
    d = _dims(config)
    return d["layers"] * rank * (d["h"] + d["heads"] * d["head_dim"])


def base_parameters(config: Any) -> int:
    """Parameters of a Llama-layout decoder (Qwen3: + per-head q/k RMSNorm) from its config's shapes:
    embeddings, per layer q/k/v/o (+ biases when `attention_bias`), the SwiGLU MLP and two norms, the
    final norm, and an untied output head."""
    d = _dims(config)
    h, q, kv = d["h"], d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if d["bias"] else 0)
    layer = attn + 3 * h * d["inter"] + 2 * h + (2 * d["head_dim"] if d["qk_norm"] else 0)
    embed = d["vocab"] * h
    return embed * (1 if d["tied"] else 2) + d["layers"] * layer + h


def trainable_fraction(config: Any, rank: int) -> float:
    """Query-LoRA parameters / all parameters of the adapted model (base + adapters, the count peft's
    `get_nb_trainable_parameters` reports), from a config's shapes alone."""
    lora = query_lora_parameters(config, rank)
    return lora / (base_parameters(config) + lora)


def shape_fingerprint(config: Any) -> dict[str, int]:
    """The base shapes an adapter is tied to: an adapter for another shape cannot load onto it."""
    d = _dims(config)
    return {"num_layers": d["layers"], "hidden_size": d["h"], "num_heads": d["heads"], "num_kv_heads": d["kv"],
            "head_dim": d["head_dim"], "vocab_size": d["vocab"]}
