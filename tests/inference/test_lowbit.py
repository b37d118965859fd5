"""The runtime's low-bit path: exact integer GEMM, equality with training's fake-quant forward, the
packed int4 storage, the lean decoder on converted models, and the Triton int4 kernel (under the
Triton interpreter, on CPU)."""
from __future__ import annotations

import json

import copy
import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference import Engine, EngineConfig, SamplingParams
from inference import lean
from inference.lean import LeanBackend, lean_unsupported_reason, read_dims, rope_tables
from inference.lowbit import (
    LowBitLinear, LowBitWeights, int_matmul, lowbit_linear, lowbit_modules, scaled_int_matmul, to_lowbit,
)
from models.loading import random_qwen3
from models.quant import (
    FakeQuantLinear, QuantScheme, apply_fake_quant, fake_quant_tokens, fake_quant_weight, int_range, pack_int4,
    quantize_tokens, token_scale, unpack_int4,
)
from tests.conftest import ROOT

VOCAB = 62
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
ACT_FORMATS = [("W4A4", 0), ("W4A4", 16), ("W4A8", 0), ("W4A8", 16), ("W8A8", 0), ("W8A8", 16)]
WEIGHT_ONLY = [("W4A16", 0), ("W4A16", 16), ("W8A16", 0), ("W8A16", 16)]


def tiny_model() -> nn.Module:
    """Qwen3, hidden 64, 2 layers, 4 heads over 2 KV heads (GQA), MLP 128; weights large enough
    (0.2) that greedy output of a random model is not one repeated token."""
    return random_qwen3(VOCAB, hidden_size=64, num_layers=2, kv_heads=2, initializer_range=0.2).eval()


def fake_quantized(fmt: str, group: int) -> nn.Module:
    model = tiny_model()
    apply_fake_quant(model, QuantScheme.parse(fmt, group))
    return model


def ints(shape, bits: int, generator: torch.Generator) -> torch.Tensor:
    qmin, qmax = int_range(bits)
    return torch.randint(qmin, qmax + 1, shape, generator=generator).to(torch.int8)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 9, 4)]


# ----------------------------------------------------------------------------- integer GEMM


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int_matmul_is_exact(bits, m):
    g = torch.Generator().manual_seed(m)
    a, q = ints((m, 64), 8, g), ints((24, 64), bits, g)
    got = int_matmul(a, q)
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), a.long() @ q.long().t())
    extreme = torch.full((m, 64), -128, dtype=torch.int8)  # the largest products, all of one sign
    assert torch.equal(int_matmul(extreme, extreme[:1].expand(24, 64)).long(),
                       torch.full((m, 24), 64 * 128 * 128, dtype=torch.long))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("groups", [1, 4])
def test_scaled_int_matmul_is_exact_per_group(bits, groups):
    """Power-of-two scales keep every fp32 step exact, so the grouped sum must equal the int64 truth."""
    g = torch.Generator().manual_seed(groups)
    m, n, k = 7, 24, 64
    a, q = ints((m, k), 8, g), ints((n, k), bits, g)
    scale = 2.0 ** torch.randint(-3, 4, (n, groups), generator=g).float()  # (n, groups)
    size = k // groups
    truth = torch.zeros(m, n, dtype=torch.float64)
    for j in range(groups):
        part = a[:, j * size:(j + 1) * size].long() @ q[:, j * size:(j + 1) * size].long().t()  # int64
        truth += part.double() * scale[:, j].double()
    assert torch.equal(scaled_int_matmul(a, q, scale).double(), truth)


# ----------------------------------------------------------------------------- the op vs fake quant


def linear_pair(fmt: str, group: int, seed: int = 0):
    torch.manual_seed(seed)
    linear = nn.Linear(64, 48, bias=True)
    scheme = QuantScheme.parse(fmt, group)
    return FakeQuantLinear.wrap(linear, scheme), LowBitLinear.from_linear(linear, scheme), scheme


@pytest.mark.parametrize("fmt,group", ACT_FORMATS)
def test_lowbit_linear_equals_fake_quant_with_quantized_activations(fmt, group):
    fq, lowbit, scheme = linear_pair(fmt, group)
    x = torch.randn(2, 5, 64) * 3
    with torch.no_grad():
        expected = fq(x)  # F.linear(fq_tokens(x), fq_weight(W), b), all fp32
    got = lowbit(x)
    assert got.shape == expected.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The integer parts are the same integers: tokens and weights.
    qx, sx = quantize_tokens(x, scheme.act_bits)
    assert torch.equal(qx.float() * sx, fake_quant_tokens(x, scheme.act_bits))
    assert torch.equal(qx.float(), torch.round(fake_quant_tokens(x, scheme.act_bits) / token_scale(x, scheme.act_bits)))
    w_hat = fake_quant_weight(fq.weight.detach(), scheme.weight_bits, scheme.group_size)
    dequant = lowbit.q.float() * lowbit.weight_scale.repeat_interleave(64 // lowbit.weight_scale.shape[1], 1)
    assert torch.equal(dequant, w_hat)


@pytest.mark.parametrize("fmt,group", WEIGHT_ONLY)
def test_weight_only_formats_equal_fake_quant_exactly(fmt, group):
    fq, lowbit, _ = linear_pair(fmt, group)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(lowbit(x), fq(x))  # same dequantized weight, same F.linear


@pytest.mark.parametrize("fmt,group", [("W4A8", 16), ("W8A8", 0), ("W4A16", 32)])
def test_gradient_through_a_lowbit_linear_is_the_fake_quant_one(fmt, group):
    """Under autograd the integer op's value comes out, and the gradient reaching x is the one training's
    fake-quant linear gives (straight through the rounding): what a skipper over a low-bit base trains on."""
    fq, lowbit, _ = linear_pair(fmt, group)
    x = (torch.randn(2, 5, 64) * 3).requires_grad_()
    x_fq = x.detach().clone().requires_grad_()
    out = lowbit(x)
    with torch.no_grad():
        assert torch.equal(out, lowbit(x.detach()))  # the same value as without autograd
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (fq(x_fq) * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_fq.grad, rtol=1e-5, atol=1e-5)
    assert not any(t.requires_grad for t in lowbit.buffers())  # nothing of the low-bit module trains


def test_save_quantized_writes_back_the_stored_integers(tmp_path):
    """load_quantized -> save_quantized -> load_quantized keeps every integer, scale and other tensor."""
    from inference.quantized import load_quantized, save_quantized
    from models.quant_export import export_compressed, is_compressed
    from models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), hidden_size=64, num_layers=2, kv_heads=2, initializer_range=0.2).eval()
    apply_fake_quant(model, QuantScheme.parse("W4A8", 16))
    export_compressed(model, tok, str(tmp_path / "a"))
    first, _ = load_quantized(str(tmp_path / "a"))
    save_quantized(first, tok, str(tmp_path / "b"))
    second, _ = load_quantized(str(tmp_path / "b"))
    assert is_compressed(str(tmp_path / "b"))
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["ignore"] == \
        json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["ignore"]


def test_from_linear_of_a_fake_quant_linear_is_the_same_module():
    fq, lowbit, scheme = linear_pair("W4A8", 16)
    again = LowBitLinear.from_linear(fq, scheme)
    assert torch.equal(again.weight_packed, lowbit.weight_packed)
    assert torch.equal(again.weight_scale, lowbit.weight_scale) and torch.equal(again.bias, lowbit.bias)


def test_bf16_input_keeps_its_dtype_and_fp32_scales():
    _, lowbit, _ = linear_pair("W8A8", 16)
    scale = lowbit.weight_scale.clone()
    lowbit.to(torch.bfloat16)
    assert lowbit.weight_scale.dtype == torch.float32 and torch.equal(lowbit.weight_scale, scale)
    assert lowbit.bias.dtype == torch.bfloat16 and lowbit.weight.dtype == torch.int8
    assert lowbit(torch.randn(4, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- storage


def test_int4_storage_is_the_packed_checkpoint_layout():
    fq, lowbit, scheme = linear_pair("W4A8", 16)
    q = lowbit.q
    assert lowbit.weight_packed.dtype == torch.int32 and lowbit.weight_packed.shape == (48, 64 // 8)
    assert torch.equal(lowbit.weight_packed, pack_int4(q))
    assert torch.equal(unpack_int4(lowbit.weight_packed), q)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    state = lowbit.state_dict()
    assert set(state) == {"weight_packed", "weight_scale", "bias"}  # the unpacked copy is not saved
    fresh = LowBitLinear(64, 48, scheme, bias=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.q, q)  # the unpacked copy follows the loaded words
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), lowbit(x))


def test_int8_storage_and_from_quantized_checks():
    _, lowbit, scheme = linear_pair("W8A8", 0)
    assert set(lowbit.state_dict()) == {"weight", "weight_scale", "bias"} and lowbit.weight.dtype == torch.int8
    with pytest.raises(ValueError, match="4-bit weights must lie in"):
        LowBitLinear.from_quantized(lowbit.weight, lowbit.weight_scale, None, QuantScheme.parse("W4A8"))
    with pytest.raises(ValueError, match="scale shape"):
        LowBitLinear.from_quantized(lowbit.weight, lowbit.weight_scale, None, QuantScheme.parse("W8A8", 16))


# ----------------------------------------------------------------------------- model conversion and lean


def test_to_lowbit_converts_every_fake_quant_linear():
    model = fake_quantized("W4A8", 16)
    names = set(n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear))
    to_lowbit(model)
    converted = lowbit_modules(model)
    assert set(converted) == names and len(names) == 2 * 7
    assert all(m.scheme == QuantScheme.parse("W4A8", 16) for m in converted.values())
    assert type(model.lm_head) is nn.Linear  # the output head is never a target
    with pytest.raises(ValueError, match="no FakeQuantLinear"):
        to_lowbit(tiny_model())
    direct = to_lowbit(tiny_model(), QuantScheme.parse("W4A8", 16))
    for name, module in lowbit_modules(direct).items():  # same integers as via fake quant
        assert torch.equal(module.weight_packed, converted[name].weight_packed)


def lean_backend(model, batch: int, max_len: int) -> LeanBackend:
    return LeanBackend(model, read_dims(model), rope_tables(model, max_len), batch, max_len)


def lean_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill all but the last token of ids (1, T), then decode the last: both last-position logits."""
    T = ids.shape[1]
    b = lean_backend(model, 1, T + 1)
    with torch.inference_mode():
        first = b.prefill(ids[:, :-1], torch.arange(T - 1)[None], torch.ones(1, T - 1, dtype=torch.bool))
        second = b.decode(ids[:, -1], torch.tensor([T - 1]))
    return [first, second]


def hf_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        logits = model(ids).logits  # (1, T, V)
    return [logits[:, -2], logits[:, -1]]


@pytest.mark.parametrize("fmt,group", [("W4A8", 16), ("W8A8", 0), ("W4A4", 32), ("W4A16", 16), ("W8A16", 0)])
def test_lean_on_a_converted_model_equals_its_hf_forward(fmt, group):
    model = to_lowbit(fake_quantized(fmt, group))
    assert lean_unsupported_reason(model) is None
    ids = torch.tensor([[5, 9, 11, 3, 7, 40, 2]])
    for got, expected in zip(lean_logits(model, ids), hf_logits(model, ids)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    w = lean_backend(model, 1, 8).weights.layers[0]
    attn = model.model.layers[0].self_attn
    assert isinstance(w.qkv.weight, LowBitWeights) and w.qkv.op is lowbit_linear  # fused, one op
    assert torch.equal(w.qkv.weight.q, torch.cat([attn.q_proj.q, attn.k_proj.q, attn.v_proj.q]))
    assert w.qkv.weight.scale.shape == (attn.q_proj.out_features + 2 * attn.k_proj.out_features,
                                        QuantScheme.parse(fmt, group).groups(64))
    assert isinstance(w.gate_up.weight, LowBitWeights)


def test_mixed_projections_run_separately_and_concatenate():
    """k_proj in another scheme and layer 1's v_proj left in float: q|k|v cannot be fused."""
    model = to_lowbit(fake_quantized("W4A8", 16))
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    plain = tiny_model().model.layers[1].self_attn.v_proj
    attn0.k_proj = LowBitLinear.from_linear(tiny_model().model.layers[0].self_attn.k_proj, QuantScheme.parse("W8A8"))
    attn1.v_proj = plain
    assert lean_unsupported_reason(model) is None
    ids = torch.tensor([[5, 9, 11, 3, 7, 40, 2]])
    for got, expected in zip(lean_logits(model, ids), hf_logits(model, ids)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layers = lean_backend(model, 1, 8).weights.layers
    for lw in layers:
        assert lw.qkv.op is lean._concat and len(lw.qkv.weight) == 3
    assert layers[1].qkv.weight[2].weight is not None and layers[1].qkv.weight[2].op is F.linear
    assert isinstance(layers[0].gate_up.weight, LowBitWeights)  # the MLP still fuses


@pytest.mark.parametrize("fmt,group", [("W4A8", 16), ("W8A8", 0), ("W4A16", 32)])
def test_greedy_tokens_of_the_lowbit_engine_equal_the_fake_quant_hf_path(fmt, group):
    fake = fake_quantized(fmt, group)
    reference = Engine(fake, EngineConfig(use_lean=False)).generate(prompts(), GREEDY)
    lowbit = to_lowbit(copy.deepcopy(fake))
    from inference.serving import ServeOptions, serve_model

    server = serve_model(lowbit, ServeOptions(engine=EngineConfig(use_lean=True)))  # through the serving door
    assert server.engine.lean_active()  # (use_lean=True raises if the lean path cannot run it)
    outs = server.generate(prompts(), GREEDY)
    assert [o.tokens for o in outs] == [o.tokens for o in reference]
    assert len(set(outs[0].tokens)) > 1
    if fmt.startswith("W4"):  # int4 changes this model's greedy output: the comparison can tell
        assert [o.tokens for o in outs] != [o.tokens for o in Engine(tiny_model()).generate(prompts(), GREEDY)]


@pytest.mark.parametrize("fmt,group", [("W4A4", 0), ("W4A8", 16), ("W8A8", 0), ("W8A8", 16), ("W4A16", 32)])
def test_fake_quant_forward_equals_the_lowbit_op_bit_for_bit(fmt, group):
    """Training's fake-quant forward runs the same fp32 operations in the same order as the
    runtime's integer GEMM, so a quantized export reproduces it exactly (not just to rounding)."""
    fq, module, _ = linear_pair(fmt, group)
    x = torch.randn(3, 7, 64) * 2
    with torch.no_grad():
        assert torch.equal(module(x), fq(x))


def test_lean_runs_a_fake_quant_model_with_the_lowbit_op_and_equals_its_export():
    """The trainer's eval of a fake-quant student (lean, low-bit op on integers taken from the live
    weights) gives the tokens its converted export gives: the same forward, the same integers."""
    fake = fake_quantized("W4A4", 0)
    assert lean_unsupported_reason(fake) is None
    engine = Engine(fake)
    assert engine.lean_active()
    served = to_lowbit(copy.deepcopy(fake))
    long = SamplingParams(max_new_tokens=24, temperature=0.0)
    with torch.no_grad():
        assert [o.tokens for o in engine.generate(prompts(), long)] == \
            [o.tokens for o in Engine(served).generate(prompts(), long)]
        layer = lean.read_weights(fake, lean.read_dims(fake)).layers[0]
    assert isinstance(layer.qkv.weight, LowBitWeights) and layer.qkv.op is lowbit_linear


# ----------------------------------------------------------------------------- the Triton kernel


INTERPRETER_CHECK = textwrap.dedent("""
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    import triton  # noqa: F401  (imported after the variable is set)
    from inference import lowbit_triton
    from inference.lowbit import LowBitLinear, lowbit_linear, scaled_int_matmul
    from models.quant import QuantScheme, pack_int4, quantize_tokens

    g = torch.Generator().manual_seed(0)
    # (M, N, K, group): masked M and N edges, decode-sized M, per channel and per group.
    for M, N, K, group in [(20, 72, 64, 0), (3, 40, 128, 32), (1, 64, 64, 0), (70, 16, 96, 32)]:
        groups = K // (group or K)
        a = torch.randint(-128, 128, (M, K), generator=g).to(torch.int8)
        q = torch.randint(-8, 8, (N, K), generator=g).to(torch.int8)
        ones = lowbit_triton.int4_matmul(a, torch.ones(M, 1), pack_int4(q), torch.ones(N, groups))
        assert torch.equal(ones.long(), a.long() @ q.long().t()), (M, N, K, group)  # exact int accumulation
        scale, xs = torch.rand(N, groups, generator=g) + 0.1, torch.rand(M, 1, generator=g) + 0.1
        got = lowbit_triton.int4_matmul(a, xs, pack_int4(q), scale)
        torch.testing.assert_close(got, scaled_int_matmul(a, q, scale) * xs, rtol=1e-6, atol=1e-5)
    # A real layer, A4 and A8: the kernel on the stored packed words == the torch path of the op.
    for fmt in ("W4A8", "W4A4"):
        linear = torch.nn.Linear(64, 48, bias=True)
        module = LowBitLinear.from_linear(linear, QuantScheme.parse(fmt, 32))
        x = torch.randn(5, 64)
        qx, sx = quantize_tokens(x, module.scheme.act_bits)
        got = lowbit_triton.int4_matmul(qx, sx, module.weight_packed, module.weight_scale) + module.bias
        torch.testing.assert_close(got, lowbit_linear(x, module.weights(), module.bias), rtol=1e-6, atol=1e-5)
    assert not lowbit_triton.supported(64, 16) and lowbit_triton.supported(64, 32)
    print("INTERPRETER OK")
""")


@pytest.mark.slow  # a subprocess under the Triton interpreter: ~7 s
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_int4_kernel_under_the_interpreter(subprocess_env):
    env = {**subprocess_env, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "INTERPRETER OK" in proc.stdout, proc.stderr[-3000:]


def test_cpu_tensors_never_take_the_triton_path(monkeypatch):
    from inference import lowbit

    _, module, _ = linear_pair("W4A8", 32)
    calls = []
    real = lowbit.cpu_int_matmul
    monkeypatch.setattr(lowbit, "cpu_int_matmul", lambda a, packed, bits: calls.append(a.shape) or real(a, packed, bits))
    module(torch.randn(3, 64))
    assert calls == [(3, 32), (3, 32)]  # one integer GEMM per weight group, on the CPU kernel


@pytest.mark.skipif(not __import__("inference.lowbit").lowbit._cpu_gemm_available(), reason="no FBGEMM in this torch build")
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_integer_gemm_is_exact_at_the_extremes(bits):
    """FBGEMM sums pairs of u8 x s8 products in int16 (saturating on AVX2): the layouts of
    `cpu_int_matmul` keep every pair inside int16, checked on the worst cases and random values."""
    from inference.lowbit import _prepack, cpu_int_matmul

    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    k, n = 64, 24
    gen = torch.Generator().manual_seed(bits)
    cases = []
    for a_value in (-128, 127):
        for w_value in (qmin, qmax):
            cases.append((torch.full((3, k), a_value, dtype=torch.int8), torch.full((n, k), w_value, dtype=torch.int8)))
    cases.append((torch.randint(-128, 128, (17, k), generator=gen, dtype=torch.int8),
                  torch.randint(qmin, qmax + 1, (n, k), generator=gen, dtype=torch.int8)))
    for a, w in cases:
        ref = (a.long() @ w.long().t()).double()
        assert torch.equal(cpu_int_matmul(a, _prepack(w), bits).double(), ref)
