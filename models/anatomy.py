"""The anatomy of a Hugging Face causal LM, through any wrapper: the one place that knows where the
decoder, its layers, the output head and the final hidden states are.

Every trainer, algorithm and benchmark that needs a piece of the model asks here, so a wrapper
(DDP, DeepSpeed, PEFT) or an architecture difference is handled once:

    lm = causal_lm(model)                  # the *ForCausalLM inside DDP / DeepSpeed / PEFT
    layers = decoder_layers(model)         # the repeated transformer blocks
    hidden = final_hidden(model, ids, mask)  # (B, T, H) final normed states, logits of 1 position only
    head = output_head(model)              # (weight (V, H), bias) or None when not a plain linear
    logits = head_logits(hidden, head)     # hidden @ weight.T + bias, soft-capped when the head says so
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
from torch import Tensor, nn

# The output layer as tensors: (weight (V, H), bias (V,) or None), or (weight, bias, cap) for a head
# whose logits are soft-capped, cap * tanh(logits / cap) (Gemma-2's final_logit_softcapping; only
# `output_head(model, softcap=True)` returns one). `head_logits` applies either kind.
Head = Union[tuple[Tensor, Optional[Tensor]], tuple[Tensor, Optional[Tensor], float]]


class UnsupportedModel(ValueError):
    """An algorithm cannot train (or the runtime cannot serve what it would export for) this model; the
    message names the architecture and why. Raised at config validation or setup, before any work;
    train.py reports it as a one-line config error."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DeepSpeed wrappers (their `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM inside wrappers (DDP / DeepSpeed, then PEFT)."""
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings -> layers -> final norm) of a causal LM, through any wrapper."""
    lm = causal_lm(model)
    return lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", lm)


def decoder_layers(model: nn.Module, user: str = "this") -> nn.ModuleList:
    """The repeated transformer blocks (`model.model.layers` for Llama / Qwen / Mistral ...).
    `user` names the feature asking, for the error on a model without them."""
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{user}: cannot find the decoder layers (get_decoder().layers) of "
                         f"{type(causal_lm(model)).__name__}")
    return layers


def output_head(model: nn.Module, softcap: bool = False, gather: bool = False) -> Optional[Head]:
    """(weight (V, H), bias) of the output layer when it can be applied directly to final hidden
    states; None when not (sharded FSDP2 / ZeRO-3 weights unless `gather`, logit scaling, and logit
    soft-capping unless `softcap`): then a caller falls back to the model's own logits. With
    `softcap=True` a soft-capped head comes back as (weight, bias, cap), for callers that project through
    `head_logits`. With `gather=True` sharded weights come back as full copies, gathered from every rank
    (a collective: all ranks call it together), not tied to the parameters -- for a frozen model's head."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    config = getattr(inner, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if not isinstance(head, nn.Linear) or (cap and not softcap) or getattr(config, "logit_scale", None):
        return None
    weight, bias = head.weight, head.bias
    if type(weight.data) is not torch.Tensor or weight.numel() == 0:  # DTensor shard or ZeRO-3 partition
        if not gather:
            return None
        weight, bias = _gathered(weight), None if bias is None else _gathered(bias)
    return (weight, bias, float(cap)) if cap else (weight, bias)


def _gathered(p: Tensor) -> Tensor:
    """A full, detached copy of a sharded parameter: an FSDP2 DTensor or a ZeRO-3 partition."""
    if hasattr(p, "full_tensor"):
        return p.detach().full_tensor()
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        return p.detach().clone()


def head_logits(hidden: Tensor, head: Head) -> Tensor:
    """The logits of final hidden states (..., H) -> (..., V) through `head`, soft-capped as the
    model's own forward does when the head carries a cap."""
    logits = torch.nn.functional.linear(hidden, head[0], head[1])
    cap = head[2] if len(head) > 2 else None
    return cap * torch.tanh(logits / cap) if cap else logits


def detach_head(head: Head) -> Head:
    """`head` with its tensors detached (the cap, a float, unchanged)."""
    return tuple(t.detach() if isinstance(t, Tensor) else t for t in head)  # type: ignore[return-value]


@contextlib.contextmanager
def capture_final_hidden(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Within the block, each forward of `model` stores the decoder's output (the final normed hidden
    states (B, T, H)) in the yielded dict under "hidden". One hook on the decoder, removed on exit."""
    store: dict[str, Tensor] = {}

    def hook(module, args, out):
        store["hidden"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    handle = decoder(model).register_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def final_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs) -> Tensor:
    """Final (normed) hidden states (B, T, H) through any wrapper, without the full logits: the
    forward keeps the logits of one position only. `kwargs` go to the model call (e.g. position_ids)."""
    with capture_final_hidden(model) as store:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, **kwargs)
    return store["hidden"]


@contextlib.contextmanager
def no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Training forwards inside the block build no KV cache (`config.use_cache` off, restored after).

    A cache is useless in a training forward, and harmful when a layer's forward runs twice for one
    token (activation recompute): the second run appends the same keys again and attention sees
    2T keys for T queries."""
    config = getattr(causal_lm(model), "config", None)
    previous = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = False
    try:
        yield
    finally:
        if config is not None:
            config.use_cache = previous
