"""models/quant_export.py: the compressed-tensors export checked against the compressed-tensors
package's own packing and decompression, our reader, the dequantized export and the errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from models.loading import random_qwen3
from models.quant import QuantScheme, apply_fake_quant, dequantize_weight, pack_int4, quantize_weight, unpack_int4
from models.quant_export import (export_compressed, export_dequantized, is_compressed, packed_weight_bytes,
                                 read_compressed)
from models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()
IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 30, 11], [1, 2, 3, 4, 5, 6, 7, 8]])


class Wrapper(nn.Module):
    """Stands in for DDP / DeepSpeed: the model under `.module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def tiny(seed: int = 0, **config) -> nn.Module:
    return random_qwen3(len(TOK), seed=seed, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                        **config).eval()


def quantized_tiny(fmt: str, group: int, keep=("lm_head",), **config):
    """(fake-quantized model, the fake-quant names, a plain copy of its original tensors)."""
    model = tiny(**config)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_fake_quant(model, QuantScheme.parse(fmt, group), keep)
    return model, names, original


def fq_weight(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    return dequantize_weight(*quantize_weight(weight, scheme.weight_bits, scheme.group_size))


# --- packing -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (3, 32), (7, 40), (64, 128), (2, 8 * 129)])
def test_pack_int4_is_compressed_tensors_packing_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    q[0, 0], q[-1, -1] = -8, 7  # both ends of the range (the sign bit of a word is set by 7 + 8 = 15)
    theirs = pack_to_int32(q, 4)
    assert theirs.dtype == torch.int32 and torch.equal(pack_int4(q), theirs)
    assert torch.equal(unpack_int4(theirs), q) and torch.equal(unpack_from_int32(pack_int4(q), 4, q.shape), q)


# --- compressed export: decompressed by compressed-tensors itself ----------------------------------------

CASES = {  # id -> (format, group_size, keep, extra config)
    "W4A4-channel": ("W4A4", 0, ("lm_head",), {}),
    "W4A4-g16": ("W4A4", 16, ("lm_head",), {"attention_bias": True}),
    "W4A16-g32": ("W4A16", 32, ("lm_head", "model.layers.1.mlp.down_proj"), {"tie_word_embeddings": False}),
    "W8A8-channel": ("W8A8", 0, ("lm_head", "model.layers.0.self_attn.k_proj"), {}),
    "W8A16-g16": ("W8A16", 16, ("lm_head",), {"tie_word_embeddings": False, "attention_bias": True}),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def exported(request, tmp_path_factory):
    fmt, group, keep, config = CASES[request.param]
    model, names, original = quantized_tiny(fmt, group, keep, **config)
    out = tmp_path_factory.mktemp(request.param)
    export_compressed(Wrapper(model), TOK, str(out))
    return model, names, original, str(out)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_decompresses_to_the_fake_quant_weights(exported):
    model, names, original, out = exported
    scheme = model.get_submodule(names[0]).scheme
    # transformers' compressed-tensors integration, dequantize=True: the package's compressor decompresses
    loaded = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = loaded.state_dict()
    for name in names:
        assert type(loaded.get_submodule(name)) is nn.Linear
        assert torch.equal(state[f"{name}.weight"], fq_weight(original[f"{name}.weight"], scheme)), name
    quantized_weights = {f"{n}.weight" for n in names}
    assert set(state) == set(original)
    for key, value in original.items():
        if key not in quantized_weights:
            assert torch.equal(state[key], value), key


def test_compressed_load_takes_every_tensor_and_weight_only_runs_as_trained(exported):
    """The default load (compressed-tensors builds its compressed modules, the checkpoint fills them,
    the first forward decompresses them) takes every tensor with no missing, unexpected or mismatched
    key; with activations unquantized its QDQ forward gives the fake-quant model's logits exactly
    (with them, rare rounding ties differ: compressed-tensors divides by the scale, we multiply by
    1 / scale)."""
    model, names, _, out = exported
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    scheme = model.get_submodule(names[0]).scheme
    assert hasattr(loaded.get_submodule(names[0]), "weight_packed" if scheme.weight_bits == 4 else "weight_scale")
    with torch.no_grad():
        logits = loaded(IDS).logits
        if scheme.act_bits is None:
            assert torch.equal(logits, model(IDS).logits)


def test_quantization_config_fields(exported):
    model, names, _, out = exported
    scheme = model.get_submodule(names[0]).scheme
    with open(os.path.join(out, "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    fmt = "pack-quantized" if scheme.weight_bits == 4 else "int-quantized"
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt
    (group,) = qc["config_groups"].values()
    weights, acts = group["weights"], group["input_activations"]
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    assert weights["num_bits"] == scheme.weight_bits and weights["type"] == "int" and weights["symmetric"] is True
    assert weights["dynamic"] is False
    if scheme.group_size:
        assert weights["strategy"] == "group" and weights["group_size"] == scheme.group_size
    else:
        assert weights["strategy"] == "channel"
    if scheme.act_bits is None:
        assert acts is None
    else:
        assert acts["num_bits"] == scheme.act_bits and acts["strategy"] == "token" and acts["dynamic"] is True
        assert acts["type"] == "int" and acts["symmetric"] is True
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert "lm_head" in qc["ignore"] and set(qc["ignore"]) == linears - set(names)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert all(tensors[f"{n}.weight_scale"].dtype == torch.float32 for n in names)
    readme = open(os.path.join(out, "README.md")).read()
    assert fmt in readme and scheme.name in readme and "python -m inference" in readme and "vllm" in readme.lower()
    assert "/tmp" not in readme and out not in readme
    assert is_compressed(out)


def test_read_compressed_returns_quantize_weight_exactly(exported):
    model, names, original, out = exported
    scheme = model.get_submodule(names[0]).scheme
    ckpt = read_compressed(out)
    assert ckpt.scheme == scheme and sorted(ckpt.quantized) == sorted(names)
    for name in names:
        q, scale = quantize_weight(original[f"{name}.weight"], scheme.weight_bits, scheme.group_size)
        got_q, got_scale = ckpt.quantized[name]
        assert got_q.dtype == torch.int8 and got_scale.dtype == torch.float32
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale), name
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(ckpt.state) == set(original) - {f"{n}.weight" for n in names} - tied
    assert all(torch.equal(v, original[k]) for k, v in ckpt.state.items())
    assert "lm_head" in ckpt.ignore and not hasattr(ckpt.config, "quantization_config")
    assert type(ckpt.config) is type(model.config) and ckpt.config.hidden_size == 64


def test_packed_weight_bytes(exported):
    model, names, _, out = exported
    scheme = model.get_submodule(names[0]).scheme
    shapes = [model.get_submodule(n).weight.shape for n in names]
    ints = sum(o * i * scheme.weight_bits // 8 for o, i in shapes)
    scales = sum(o * scheme.groups(i) * 4 for o, i in shapes)
    fp32 = sum(4 * o * i for o, i in shapes)
    assert packed_weight_bytes(out) == {"quantized_bytes": ints + scales, "fp32_bytes": fp32}


# --- dequantized export ------------------------------------------------------------------------------------


def test_export_dequantized_holds_the_fake_quant_weights(tmp_path):
    model, names, original = quantized_tiny("W4A8", 16, ("lm_head", "model.layers.0.mlp.up_proj"))
    scheme = model.get_submodule(names[0]).scheme
    export_dequantized(Wrapper(model), TOK, str(tmp_path))
    with open(tmp_path / "config.json") as fh:
        assert "quantization_config" not in json.load(fh)
    assert not is_compressed(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = dict(original)
    expected.update({f"{n}.weight": fq_weight(original[f"{n}.weight"], scheme) for n in names})
    state = loaded.state_dict()
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())
    reference = tiny(seed=1)
    reference.load_state_dict(expected)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)
    readme = (tmp_path / "README.md").read_text()
    assert "NOT quantized" in readme and "W4A8" in readme and str(tmp_path) not in readme


# --- errors ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w4_dir(tmp_path_factory):
    model, _, _ = quantized_tiny("W4A16", 0)
    out = tmp_path_factory.mktemp("w4")
    export_compressed(model, TOK, str(out))
    return out


def edited_copy(src, dst, edit_config=None, drop_tensor=None):
    """A copy of checkpoint `src` in `dst` with its quantization_config edited / a tensor removed."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    tensors.pop(drop_tensor, None)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def weights_of(qc):
    return qc["config_groups"]["group_0"]["weights"]


def test_read_compressed_rejects_a_plain_dir(tmp_path):
    tiny().save_pretrained(tmp_path)
    assert not is_compressed(str(tmp_path)) and not is_compressed(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"config\.json: not a compressed-tensors checkpoint"):
        read_compressed(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        read_compressed(str(tmp_path / "missing"))


@pytest.mark.parametrize("edit, problem", [
    (lambda qc: weights_of(qc).update(symmetric=False), "symmetric"),
    (lambda qc: weights_of(qc).update(strategy="tensor"), "strategy 'tensor'"),
    (lambda qc: weights_of(qc).update(type="float", num_bits=8), "float"),
    (lambda qc: qc["config_groups"]["group_0"].update(
        format="int-quantized", input_activations={"num_bits": 8, "type": "int", "symmetric": True,
                                                   "strategy": "token", "dynamic": False}), "dynamic=False"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="marlin-24"), "format 'marlin-24'"),
    (lambda qc: qc["config_groups"].update(group_1=qc["config_groups"]["group_0"]), "2 config_groups"),
], ids=["asymmetric", "tensor-strategy", "float", "static-activations", "format", "two-groups"])
def test_read_compressed_rejects_unsupported_formats(w4_dir, tmp_path, edit, problem):
    path = edited_copy(w4_dir, tmp_path / "edited", edit_config=edit)
    with pytest.raises(ValueError, match="unsupported quantization_config") as err:
        read_compressed(path)
    assert problem in str(err.value) and "config.json" in str(err.value)


def test_read_compressed_names_a_missing_tensor(w4_dir, tmp_path):
    key = "model.layers.1.self_attn.o_proj.weight_packed"
    path = edited_copy(w4_dir, tmp_path / "edited", drop_tensor=key)
    with pytest.raises(ValueError, match=f"tensor '{key}' is missing"):
        read_compressed(path)


def test_export_compressed_needs_a_fake_quantized_model(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="no FakeQuantLinear"):
        export_compressed(tiny(), TOK, str(out))
    assert os.listdir(out) == []


def test_export_compressed_needs_one_scheme(tmp_path):
    model, names, _ = quantized_tiny("W4A4", 0)
    model.get_submodule(names[0]).scheme = QuantScheme.parse("W8A8")
    with pytest.raises(ValueError, match="one scheme per model"):
        export_compressed(model, TOK, str(tmp_path))
    assert os.listdir(tmp_path) == []
