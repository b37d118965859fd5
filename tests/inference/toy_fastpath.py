"""Two toy fast paths, added the way a new one is: this one module and one registration each, with no
edit to the engine, the lean decoder or the loop (docs/serving.md shows the diff).

- a linear op: `CountingLinear` modules (an nn.Linear that marks its projections) run through
  `counting_linear`, which counts its calls and computes F.linear;
- a route: a model whose config sets `toy_every_other=True` runs only its even layers (an odd layer
  passes its input through and writes no K/V).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from inference.lean import LinearKind, Route, RouteKind, decoder_layer, register_linear, register_route

CALLS = {"linear": 0, "layers": 0}


class CountingLinear(nn.Linear):
    """An nn.Linear whose projections the lean decoder runs with `counting_linear`."""


def counting_linear(x, weight, bias=None):
    CALLS["linear"] += 1
    return F.linear(x, weight, bias)


class EveryOtherLayer(Route):
    def __call__(self, layer, x, w, dims, blocks, rope_rows, cache, slot, mask):
        if layer % 2:
            return x
        CALLS["layers"] += 1
        return decoder_layer(x, w, dims, blocks, rope_rows, cache, layer, slot, mask)


register_linear(CountingLinear, LinearKind(operand=lambda module: module.weight.detach(), op=counting_linear))
register_route(RouteKind(name="toy", route=lambda model, context: EveryOtherLayer()
                         if getattr(model.config, "toy_every_other", False) else None))
