"""Fake-quant arithmetic by hand, the straight-through gradient, the surgery and its errors, and our
numerics against torchao's QAT fake-quantizers (run in a side process: see `torchao_peer`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from models.loading import random_qwen3
from models.quant import (
    FakeQuantLinear, QuantScheme, apply_fake_quant, dequantize_weight, fake_quant, fake_quant_modules,
    fake_quant_tokens, fake_quant_weight, pack_int4, quant_targets, quantize_tokens, quantize_weight,
    unpack_int4, weight_scale,
)
from tests.conftest import ROOT


def test_int4_per_channel_by_hand():
    # row amax 3.75 -> scale 3.75 / 7.5 = 0.5; x / s = [7.5, -3, 0.6, -7.5] -> round half to even
    # [8, -3, 1, -8] -> clamp to [-8, 7] -> [7, -3, 1, -8]
    w = torch.tensor([[3.75, -1.5, 0.3, -3.75]])
    q, s = quantize_weight(w, 4)
    assert s.tolist() == [[0.5]]
    assert q.tolist() == [[7, -3, 1, -8]] and q.dtype == torch.int8
    assert fake_quant_weight(w, 4).tolist() == [[3.5, -1.5, 0.5, -4.0]]


def test_int8_per_group_by_hand():
    # group 2: amax [2.55, 0.51] -> scales [0.02, 0.004]; 2.55 / 0.02 = 127.5 -> 128 -> 127
    w = torch.tensor([[2.55, 1.0, 0.51, -0.1]])
    q, s = quantize_weight(w, 8, group_size=2)
    assert torch.allclose(s, torch.tensor([[0.02, 0.004]]))
    assert q.tolist() == [[127, 50, 127, -25]]
    assert torch.allclose(dequantize_weight(q, s), torch.tensor([[2.54, 1.0, 0.508, -0.1]]))


def test_per_token_activation_scales_by_hand():
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]])  # (1, 2 tokens, 4)
    q, s = quantize_tokens(x, 8)
    assert torch.allclose(s[0, 0], torch.tensor([1.0 / 127.5]))
    assert q[0, 0].tolist() == [127, -64, 32, 0]  # 127.5 -> 128 -> 127; -63.75 -> -64; 31.875 -> 32
    assert q[0, 1].tolist() == [0, 0, 0, 0] and s[0, 1].item() > 0  # an all-zero token: a tiny scale, zeros
    x4 = torch.tensor([[0.75, -0.1, 0.35]])
    assert quantize_tokens(x4, 4)[0].tolist() == [[7, -1, 4]]  # s = 0.1: 7.5 -> 8 -> 7, -1, 3.5 -> 4
    assert torch.allclose(fake_quant_tokens(x4, 4), torch.tensor([[0.7, -0.1, 0.4]]))


def test_ste_gradient_is_identity_inside_the_clip_range_and_zero_outside():
    scale = torch.tensor(0.5)
    # int4 range [-8, 7]: x / s = [-9, -8, -0.4, 3.2, 7, 7.4, 7.6, 10]
    x = torch.tensor([-4.5, -4.0, -0.2, 1.6, 3.5, 3.7, 3.8, 5.0], requires_grad=True)
    out = fake_quant(x, scale, 4)
    assert out.tolist() == [-4.0, -4.0, -0.0, 1.5, 3.5, 3.5, 3.5, 3.5]
    upstream = torch.arange(1.0, 9.0)
    out.backward(upstream)
    inside = torch.tensor([0.0, 1, 1, 1, 1, 1, 0, 0])  # round(7.6) = 8 > 7 is clipped
    assert x.grad.tolist() == (upstream * inside).tolist()


def test_fake_quant_linear_gradients_reach_weights_and_inputs():
    lin = nn.Linear(16, 8)
    fq = FakeQuantLinear.wrap(lin, QuantScheme.parse("W4A4"))
    assert fq.weight is lin.weight and fq.bias is lin.bias  # shared, not copied
    x = torch.randn(3, 16, requires_grad=True)
    fq(x).square().sum().backward()
    assert lin.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    # forward = F.linear of the two fake-quantized operands (computed in the integer domain, so
    # equal to fp32 rounding), and the same straight-through gradients
    grads = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = lin.weight.grad = None
    ref = torch.nn.functional.linear(fake_quant_tokens(x, 4), fake_quant_weight(lin.weight, 4), lin.bias)
    torch.testing.assert_close(fq(x), ref, rtol=1e-5, atol=1e-6)
    ref.square().sum().backward()
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads[1], lin.weight.grad, rtol=1e-4, atol=1e-6)


def test_weight_only_formats_leave_activations_alone():
    lin = nn.Linear(16, 8)
    fq = FakeQuantLinear.wrap(lin, QuantScheme.parse("W8A16", group_size=8))
    x = torch.randn(2, 16)
    ref = torch.nn.functional.linear(x, fake_quant_weight(lin.weight, 8, 8), lin.bias)
    assert torch.equal(fq(x), ref)


def test_apply_fake_quant_swaps_block_linears_only_and_keeps_the_state_dict():
    model = random_qwen3(40, hidden_size=64, num_layers=2, intermediate_size=96)
    keys = list(model.state_dict())
    names = apply_fake_quant(model, QuantScheme.parse("W8A8"), keep=["lm_head", "model.layers.1.mlp"])
    assert list(model.state_dict()) == keys  # same parameters, same names: checkpoints and exports unchanged
    assert len(names) == 7 + 4  # layer 0: q k v o gate up down; layer 1: attention only
    assert set(names) == set(fake_quant_modules(model))
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, FakeQuantLinear)


@pytest.mark.parametrize("fmt,group,keep,message", [
    ("W3A8", 0, ["lm_head"], "is not one of W4A4"),
    ("W4A8", 48, ["lm_head"], "group_size=48 does not divide the input width 64 of model.layers.0.self_attn.q_proj"),
    ("W4A8", 0, ["lm_head", "model.layer.*"], "keep pattern 'model.layer.*' matches no module"),
    ("W4A8", 0, ["model.layers"], "no decoder-block linear is left"),
])
def test_surgery_errors_name_the_bad_input(fmt, group, keep, message):
    model = random_qwen3(40, hidden_size=64, num_layers=2, intermediate_size=96)
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace(".", r"\.")):
        quant_targets(model, QuantScheme.parse(fmt, group), keep)


def test_pack_int4_layout_by_hand():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    # nibbles (q + 8) = [0, 1, 8, 9, 10, 11, 14, 15], nibble j at bits 4j: 0xFEBA9810
    word = 0xFEBA9810 - 2 ** 32
    assert pack_int4(q).tolist() == [[word]]
    assert torch.equal(unpack_int4(pack_int4(q)), q)


# --- torchao, our peer for the weight path (its symmetric per-token activation path raises
# NotImplementedError, so activations are checked by hand above) -----------------------------------

TORCHAO = "torchao==0.18.0"


@pytest.fixture(scope="module")
def torchao_peer():
    """A side directory holding torchao (never installed into the project's environment: transformers
    imports torchao whenever it is importable, adding seconds and warnings to every process).
    Installed once from the package registry into the cache; skipped only when pip cannot reach it."""
    root = Path(os.path.expanduser(os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain"))) / "peers" / TORCHAO
    if not (root / "torchao").exists():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), TORCHAO],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.skip(f"cannot install {TORCHAO} from the package registry: {proc.stderr.strip()[-300:]}")
        root.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, root)
    return root


PEER_SCRIPT = r"""
import json, sys, torch
from torchao.quantization.qat import IntxFakeQuantizeConfig, IntxFakeQuantizer
w = torch.load(sys.argv[1])
out = {}
for bits, dtype in ((4, torch.int4), (8, torch.int8)):
    for group in (0, 16):
        cfg = IntxFakeQuantizeConfig(dtype, "per_channel") if group == 0 else IntxFakeQuantizeConfig(dtype, group_size=group)
        y = IntxFakeQuantizer(cfg)(w)
        out[f"{bits}/{group}"] = {"value": y.detach()}
torch.save(out, sys.argv[2])
"""


@pytest.mark.slow  # a torchao side process (and, once, its installation): ~10 s
def test_weight_fake_quant_equals_torchao(torchao_peer, tmp_path):
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.rand(24, 1) * 3  # rows of different ranges
    torch.save(w, tmp_path / "w.pt")
    env = {**os.environ, "PYTHONPATH": f"{torchao_peer}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(tmp_path / "w.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peer = torch.load(tmp_path / "out.pt")
    for bits in (4, 8):
        for group in (0, 16):
            y = fake_quant_weight(w, bits, group)
            ref = peer[f"{bits}/{group}"]
            assert torch.equal(y.detach(), ref["value"]), (bits, group)
            # (gradients are not compared: torchao's backward also differentiates through its dynamic
            # scale, the row's amax, which ours treats as a constant -- plain STE, tested by hand above)
            assert weight_scale(w, bits, group).shape == (24, 64 // (group or 64))
