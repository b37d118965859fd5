"""Export a fake-quantized model (`models.quant.apply_fake_quant`) as what it was trained to be, and
read such an export back for the runtime.

    export_compressed(model, tok, out_dir)     # compressed-tensors checkpoint: int4/int8 weights + scales
    export_dequantized(model, tok, out_dir)    # plain HF dir holding the fake-quant weights in float
    ckpt = read_compressed(out_dir)            # (config, scheme, {name: (q, scale)}, other tensors, ignore)

The compressed checkpoint is what vLLM and compressed-tensors load: config.json carries a
`quantization_config` (quant_method "compressed-tensors", format "pack-quantized" for 4-bit weights,
"int-quantized" for 8-bit ones, one config group targeting `Linear` with every unquantized linear
listed in `ignore`). Its integers and scales are exactly `models.quant.quantize_weight`'s: the
compressor of the compressed-tensors package is given the fake-quant weight q * scale (on the grid)
and our scale, recovers our q, and the export checks it did so bit for bit before writing anything.

`read_compressed` is our own reader (safetensors and `unpack_int4`, no compressed-tensors), so the
runtime serves exactly the integers that were trained.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from safetensors import safe_open
from torch import Tensor, nn

from models.anatomy import causal_lm
from models.quant import (FakeQuantLinear, QuantScheme, dequantize_weight, fake_quant_modules, pack_int4,
                          quantize_weight, unpack_int4)

QUANT_METHOD = "compressed-tensors"
PACKED, INT = "pack-quantized", "int-quantized"  # the formats for 4-bit and 8-bit weights
FORMAT_BITS = {PACKED: 4, INT: 8}
CONFIG = "config.json"
DTYPE_BYTES = {"I32": 4, "I8": 1, "F32": 4, "BF16": 2, "F16": 2}  # safetensors header dtypes of qparams


@dataclass
class CompressedCheckpoint:
    """A compressed-tensors checkpoint as the runtime needs it. `quantized`: layer name -> (q int8
    (out, in), scale fp32 (out, groups)); `state`: every other tensor of the checkpoint, keyed as in
    the model's state dict (a tied output head is absent, as in any HF checkpoint)."""

    config: Any  # transformers PretrainedConfig, quantization_config removed
    scheme: QuantScheme
    quantized: dict[str, tuple[Tensor, Tensor]]
    state: dict[str, Tensor]
    ignore: list[str] = field(default_factory=list)


# --- what the low-bit path serves ------------------------------------------------------------------

# Architectures whose checkpoint names differ from their module names in a way the low-bit loader
# (`inference.quantized.load_quantized`, which reads tensors by module name) does not follow; measured by
# benchmarks/support_matrix.py: the export is written, then does not load.
RENAMED_CHECKPOINTS = {"GPTNeoXForCausalLM": "its checkpoint names the output head embed_out, not lm_head"}


def export_problem(model: nn.Module) -> Optional[str]:
    """Why a low-bit export of `model` could not be served by the runtime's low-bit path, or None:
    mixture-of-experts models (their experts are fused 3-D tensors, not linears to quantize, and the
    checkpoint splits them per expert) and the architectures of RENAMED_CHECKPOINTS."""
    lm = causal_lm(model)
    name = type(lm).__name__
    experts = [type(m).__name__ for m in lm.modules() if type(m).__name__.endswith("Experts")]
    if experts or getattr(lm.config, "num_local_experts", 0) or getattr(lm.config, "num_experts", 0):
        return f"{name} is a mixture-of-experts model ({experts[0] if experts else 'experts'}), which the low-bit path does not serve"
    if name in RENAMED_CHECKPOINTS:
        return f"{name}: {RENAMED_CHECKPOINTS[name]}, which the low-bit loader does not follow"
    return None


# --- export -------------------------------------------------------------------------------------------


def model_scheme(modules: dict[str, FakeQuantLinear]) -> QuantScheme:
    """The one scheme of a fake-quantized model's linears; ValueError for none or mixed schemes."""
    schemes = {m.scheme for m in modules.values()}
    if not schemes:
        raise ValueError("quantized export: the model has no FakeQuantLinear (apply_fake_quant first)")
    if len(schemes) > 1:
        found = sorted(f"{s.name}/group_size={s.group_size}" for s in schemes)
        raise ValueError(f"quantized export: one scheme per model is supported, found {found}")
    return schemes.pop()


def weight_format(scheme: QuantScheme) -> str:
    return PACKED if scheme.weight_bits == 4 else INT


def ct_scheme(scheme: QuantScheme):
    """The compressed-tensors QuantizationScheme of ours: symmetric int weights (channel or group,
    static scales), dynamic per-token int activations or none (A16)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    grouped = dict(strategy="group", group_size=scheme.group_size) if scheme.group_size else dict(strategy="channel")
    weights = QuantizationArgs(num_bits=scheme.weight_bits, type="int", symmetric=True, dynamic=False, **grouped)
    acts = None if scheme.act_bits is None else QuantizationArgs(
        num_bits=scheme.act_bits, type="int", symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts, format=weight_format(scheme))


def unquantized_linears(model: nn.Module) -> list[str]:
    """Names of every nn.Linear of the causal LM that is not fake-quantized (the `ignore` list)."""
    return [n for n, m in causal_lm(model).named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, FakeQuantLinear)]


def compress_layer(q: Tensor, scale: Tensor, scheme) -> dict[str, Tensor]:
    """The compressed-tensors tensors of one layer (local names: weight_packed / weight, weight_scale,
    weight_shape), made by the package's own compressor from our on-grid weight q * scale and our
    scale. RuntimeError unless it stored exactly our q (it always should: (q * s) / s rounds to q)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    out = compressor.compress({"weight": dequantize_weight(q, scale), "weight_scale": scale}, scheme)
    stored, ours = (out["weight_packed"], pack_int4(q)) if scheme.format == PACKED else (out["weight"], q)
    if stored.dtype != ours.dtype or not torch.equal(stored, ours):
        raise RuntimeError("compressed-tensors did not store the integers of quantize_weight")
    return {k: v.contiguous() for k, v in out.items()}


def plain_state(lm: nn.Module) -> dict[str, Tensor]:
    """The model's state dict, detached, on the CPU (tied entries kept: save_pretrained drops them)."""
    return {k: v.detach().cpu() for k, v in lm.state_dict().items()}


def layer_qs(modules: dict[str, FakeQuantLinear], scheme: QuantScheme) -> dict[str, tuple[Tensor, Tensor]]:
    return {name: quantize_weight(m.weight.detach().cpu(), scheme.weight_bits, scheme.group_size)
            for name, m in modules.items()}


def export_compressed(model: nn.Module, tokenizer: Any, out_dir: str, algo_name: str = "qad") -> None:
    """A compressed-tensors checkpoint of a fake-quantized model in `out_dir` (config.json with its
    quantization_config, the packed / int8 weights with fp32 scales, the tokenizer, a README).
    Everything is computed and checked before the first file is written."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    lm = causal_lm(model)
    modules = fake_quant_modules(lm)
    scheme = model_scheme(modules)
    group = ct_scheme(scheme)
    ignore = unquantized_linears(lm)
    qconfig = QuantizationConfig(config_groups={"group_0": group}, format=group.format, ignore=ignore,
                                 quantization_status="compressed")
    state = plain_state(lm)
    for name, (q, scale) in layer_qs(modules, scheme).items():
        del state[f"{name}.weight"]
        state.update({f"{name}.{k}": v for k, v in compress_layer(q, scale, group).items()})
    lm.save_pretrained(out_dir, state_dict=state)
    ModelCompressor(quantization_config=qconfig).update_config(out_dir)  # the package writes its own config
    tokenizer.save_pretrained(out_dir)
    write_readme(out_dir, compressed_readme(algo_name, scheme, list(modules), ignore))


def export_dequantized(model: nn.Module, tokenizer: Any, out_dir: str, algo_name: str = "qad") -> None:
    """A plain HF dir (no quantization_config) whose quantized linears hold the fake-quant weights
    dequantize_weight(quantize_weight(W)) in the model's dtype; activations are not quantized there."""
    lm = causal_lm(model)
    modules = fake_quant_modules(lm)
    scheme = model_scheme(modules)
    state = plain_state(lm)
    for name, (q, scale) in layer_qs(modules, scheme).items():
        state[f"{name}.weight"] = dequantize_weight(q, scale).to(state[f"{name}.weight"].dtype)
    lm.save_pretrained(out_dir, state_dict=state)
    tokenizer.save_pretrained(out_dir)
    write_readme(out_dir, dequantized_readme(algo_name, scheme, list(modules)))


# --- READMEs (out_dir is a temp dir renamed later: they name no path of it) ---------------------------


def write_readme(out_dir: str, text: str) -> None:
    with open(os.path.join(out_dir, "README.md"), "w") as fh:
        fh.write(text)


def module_summary(names: list[str]) -> str:
    """`self_attn.q_proj` x 2, ... : the quantized modules by their name within a block."""
    kinds = Counter(n.split(".", 3)[-1] if n.startswith("model.layers.") else n for n in names)
    return ", ".join(f"`{k}` x {c}" for k, c in kinds.items())


def scheme_text(scheme: QuantScheme) -> str:
    grouping = f"group of {scheme.group_size} input columns" if scheme.group_size else "output channel"
    acts = (f"activations quantized dynamically to int{scheme.act_bits}, one scale per token"
            if scheme.act_bits else "activations in 16-bit float (not quantized)")
    return (f"{scheme.name}: symmetric int{scheme.weight_bits} weights, one fp32 scale per {grouping}; {acts}")


def compressed_readme(algo_name: str, scheme: QuantScheme, quantized: list[str], ignore: list[str]) -> str:
    return (
        f"# {algo_name} quantized model ({scheme.name}, compressed-tensors)\n\n"
        f"A compressed-tensors checkpoint, format `{weight_format(scheme)}`: {scheme_text(scheme)}.\n\n"
        f"Quantized: the {len(quantized)} decoder-block linears ({module_summary(quantized)}). "
        f"Not quantized (`ignore`): {', '.join(f'`{n}`' for n in ignore) or 'none'}; "
        "embeddings and norms stay float.\n\n"
        "Load:\n\n"
        "- vLLM: `vllm serve <this directory>` (reads `quantization_config` from config.json);\n"
        "- transformers + compressed-tensors: `AutoModelForCausalLM.from_pretrained(\"<this directory>\")`;\n"
        "- this project's runtime: `python -m inference <this directory> --prompt TEXT`, or "
        "`models.quant_export.read_compressed(\"<this directory>\")` for the integers and scales.\n")


def dequantized_readme(algo_name: str, scheme: QuantScheme, quantized: list[str]) -> str:
    return (
        f"# {algo_name} quantization-aware model ({scheme.name}), dequantized\n\n"
        f"A plain Hugging Face checkpoint: the {len(quantized)} decoder-block linears "
        f"({module_summary(quantized)}) hold their quantized weights q * scale "
        f"({scheme_text(scheme)}) as float. The activations are NOT quantized here, so outputs differ "
        "slightly from the quantized model; use the compressed-tensors export to serve it quantized.\n\n"
        "Load: `AutoModelForCausalLM.from_pretrained(\"<this directory>\")`, or "
        "`python -m inference <this directory> --prompt TEXT`.\n")


# --- reading (independent of compressed-tensors) ------------------------------------------------------


def _config_dict(path: str) -> Optional[dict]:
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        return None
    with open(file) as fh:
        return json.load(fh)


def is_compressed(path: str) -> bool:
    """Whether `path` holds a compressed-tensors checkpoint (config.json's quantization_config.quant_method)."""
    try:
        config = _config_dict(path)
    except (OSError, ValueError):
        return False
    qc = (config or {}).get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def stored_scheme(path: str) -> QuantScheme:
    """The low-bit scheme of the compressed-tensors checkpoint at `path`, read from its config.json
    alone; ValueError naming the file for a dir that is not one, or a format the runtime cannot run."""
    where = os.path.join(path, CONFIG)
    qc = (_config_dict(path) or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{where}: not a compressed-tensors checkpoint")
    return parse_scheme(qc, where)[0]


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint dir (single file or the index's shards)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return [os.path.join(path, f) for f in sorted(set(json.load(fh)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"{path}: no model.safetensors (or model.safetensors.index.json) in the checkpoint")
    return [single]


def load_tensors(path: str) -> dict[str, Tensor]:
    tensors = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    return tensors


def _args_problem(args: Optional[dict], what: str, strategies: tuple[str, ...], dynamic: bool) -> Optional[str]:
    """Why quantization args are not ones we run (None: they are)."""
    if args is None:
        return None if what == "input_activations" else "no weight quantization"
    bits, kind, sym = args.get("num_bits"), args.get("type"), args.get("symmetric")
    if kind != "int" or sym is not True or bits not in (4, 8):
        return f"{what}: {kind} num_bits={bits} symmetric={sym} (need symmetric int4 / int8)"
    if args.get("strategy") not in strategies:
        return f"{what}: strategy {args.get('strategy')!r} (need {' or '.join(strategies)})"
    if bool(args.get("dynamic")) is not dynamic:
        return f"{what}: dynamic={args.get('dynamic')} (need {dynamic})"
    return None


def parse_scheme(qc: dict, where: str) -> tuple[QuantScheme, str]:
    """(our scheme, format) of a compressed-tensors quantization_config; ValueError naming what is
    not supported: anything but one group of symmetric int channel / group weights with dynamic
    per-token int activations or none."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: unsupported quantization_config: {len(groups)} config_groups (need exactly 1)")
    (group,) = groups.values()
    weights, acts = group.get("weights"), group.get("input_activations")
    fmt = group.get("format") or qc.get("format")
    problem = (_args_problem(weights, "weights", ("channel", "group"), False)
               or _args_problem(acts, "input_activations", ("token",), True))
    if problem is None and group.get("output_activations") is not None:
        problem = "output_activations are quantized"
    if problem is None and FORMAT_BITS.get(fmt) != weights["num_bits"]:
        problem = f"format {fmt!r} with {weights['num_bits']}-bit weights (need {PACKED} / int4 or {INT} / int8)"
    if problem:
        raise ValueError(f"{where}: unsupported quantization_config: {problem}")
    group_size = (weights.get("group_size") or 0) if weights["strategy"] == "group" else 0
    if weights["strategy"] == "group" and group_size < 2:
        raise ValueError(f"{where}: unsupported quantization_config: group strategy with group_size "
                         f"{weights.get('group_size')!r}")
    name = f"W{weights['num_bits']}A{acts['num_bits'] if acts else 16}"
    try:
        return QuantScheme.parse(name, group_size), fmt
    except ValueError as err:
        raise ValueError(f"{where}: unsupported quantization_config: {err}") from None


def _take(tensors: dict[str, Tensor], key: str, path: str) -> Tensor:
    if key not in tensors:
        raise ValueError(f"{path}: tensor {key!r} is missing from the checkpoint")
    return tensors.pop(key)


def read_layer(tensors: dict[str, Tensor], name: str, scheme: QuantScheme, fmt: str,
               path: str) -> tuple[Tensor, Tensor]:
    """(q int8 (out, in), scale fp32 (out, groups)) of layer `name`, its tensors popped from `tensors`."""
    scale = _take(tensors, f"{name}.weight_scale", path).float()
    if fmt == PACKED:
        packed = _take(tensors, f"{name}.weight_packed", path)
        shape = tuple(int(s) for s in _take(tensors, f"{name}.weight_shape", path).tolist())
        if packed.dtype != torch.int32 or len(shape) != 2 or packed.shape != (shape[0], shape[1] // 8) or shape[1] % 8:
            raise ValueError(f"{path}: {name}.weight_packed {packed.dtype} {tuple(packed.shape)} does not pack "
                             f"the int4 weight_shape {shape}")
        q = unpack_int4(packed)
    else:
        q = _take(tensors, f"{name}.weight", path)
        if q.dtype != torch.int8 or q.ndim != 2:
            raise ValueError(f"{path}: {name}.weight is {q.dtype} {tuple(q.shape)}, need a 2-D int8 tensor")
    tensors.pop(f"{name}.weight_zero_point", None)  # symmetric: a zero point is 0 when present at all
    try:
        groups = scheme.groups(q.shape[1])
    except ValueError as err:
        raise ValueError(f"{path}: {err} of {name}") from None
    if scale.shape != (q.shape[0], groups):
        raise ValueError(f"{path}: {name}.weight_scale has shape {tuple(scale.shape)}, need "
                         f"{(q.shape[0], groups)} for {scheme.name} group_size={scheme.group_size}")
    return q, scale


def read_compressed(path: str) -> CompressedCheckpoint:
    """The config, scheme, per-layer integers and scales, and other tensors of a compressed-tensors
    checkpoint written by `export_compressed` (or any with a format we run). ValueError naming the
    file or tensor for a dir that is not such a checkpoint, an unsupported format or a missing tensor."""
    from transformers import AutoConfig

    where = os.path.join(path, CONFIG)
    raw = _config_dict(path)
    if raw is None:
        raise ValueError(f"{where} does not exist: not a model checkpoint")
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{where}: not a compressed-tensors checkpoint (no quantization_config with "
                         f"quant_method {QUANT_METHOD!r})")
    scheme, fmt = parse_scheme(qc, where)
    tensors = load_tensors(path)
    names = sorted(k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale"))
    if not names:
        raise ValueError(f"{path}: the checkpoint has no weight_scale tensor (no quantized layer)")
    quantized = {name: read_layer(tensors, name, scheme, fmt, path) for name in names}
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return CompressedCheckpoint(config, scheme, quantized, tensors, list(qc.get("ignore") or []))


def packed_weight_bytes(path: str) -> dict[str, int]:
    """{quantized_bytes: bytes of the stored integer weights + scales of the quantized layers,
    fp32_bytes: 4 * numel of those layers' weights} of a compressed-tensors checkpoint (read from
    the safetensors headers, no tensor loaded)."""
    info: dict[str, tuple[list[int], str]] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                piece = fh.get_slice(key)
                info[key] = (piece.get_shape(), piece.get_dtype())
    stored = numel = 0
    for key in info:
        if not key.endswith(".weight_scale"):
            continue
        module = key[: -len(".weight_scale")]
        packed = f"{module}.weight_packed" in info
        int_shape, int_dtype = info[f"{module}.weight_packed" if packed else f"{module}.weight"]
        for shape, dtype in (info[key], (int_shape, int_dtype)):
            stored += math.prod(shape) * DTYPE_BYTES[dtype]
        numel += int_shape[0] * int_shape[1] * (8 if packed else 1)
    return {"quantized_bytes": stored, "fp32_bytes": 4 * numel}
