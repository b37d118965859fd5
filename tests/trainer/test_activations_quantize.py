"""trainer/activations/quantize.py: the int8 / fp8 per-group quantiser, by hand and statistically."""
from __future__ import annotations

import torch

from trainer.activations import Quantizer


def test_int8_round_trip_error_bound_by_hand():
    q = Quantizer("int8", group_size=4)
    x = torch.tensor([[0.5, -1.27, 0.3, 0.001], [10.0, 2.0, -3.3, 0.0]])
    p = q.pack(x)
    scale = torch.tensor([1.27 / 127, 10.0 / 127])
    assert torch.allclose(p.scale, scale)
    assert p.scale.dtype == torch.float32 and p.codes.dtype == torch.int8
    assert p.codes.tolist() == [[50, -127, 30, 0], [127, 25, -42, 0]]  # round(x / scale)
    y = q.unpack(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert ((y - x).abs() <= scale[:, None] / 2 + 1e-7).all()
    # a length that is not a multiple of the group size (zero-padded tail), bf16 round trip
    z = torch.randn(3, 7, dtype=torch.bfloat16)
    zz = Quantizer("int8", group_size=64).unpack(Quantizer("int8", group_size=64).pack(z))
    assert zz.dtype == torch.bfloat16 and zz.shape == z.shape
    assert (zz.float() - z.float()).abs().max() <= z.float().abs().max() / 127 / 2 + 1e-2


def test_stochastic_rounding_unbiased_and_fp8():
    x = torch.full((64 * 200,), 0.3)
    x[::64] = 1.27  # amax per group -> scale 0.01, 0.3 / 0.01 = 30 exactly; use 0.305 to be between codes
    x[1::64] = 0.305
    q = Quantizer("int8", group_size=64, stochastic=True, seed=0)
    y = q.unpack(q.pack(x))
    vals = y[1::64]
    assert set(torch.round(vals / 0.01).tolist()) <= {30.0, 31.0}
    assert abs(vals.mean().item() - 0.305) < 0.002
    if hasattr(torch, "float8_e4m3fn"):
        xr = torch.randn(4096)
        for stochastic in (False, True):
            f8 = Quantizer("fp8", group_size=64, stochastic=stochastic)
            rel = ((f8.unpack(f8.pack(xr)) - xr).norm() / xr.norm()).item()
            assert rel < 0.05
