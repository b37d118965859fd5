"""Load a causal LM + tokenizer: any HF model from a local dir (or hub id when online), or the
embedded tiny Qwen3 built from a config with the local character tokenizer (no downloads).

    model, tok = load_pretrained("path/to/dir")
    model, tok = build_tiny(TinySpec(hidden_size=64, num_layers=2), seed=0)
"""
from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from models.model_dir import ModelDirError, looks_like_hub_id, model_dir_problem, refused_pickle_reason
from models.tokenizer import build_char_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_HEAD_DIM = 32
TINY_MAX_POSITIONS = 1024


@dataclass(frozen=True)
class TinySpec:
    """Architecture of the embedded tiny model (Qwen3: RMSNorm, RoPE, q/k-norm, SwiGLU, tied embeddings)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512


def qwen3_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 intermediate_size: int = 128, *, kv_heads: int | None = None, head_dim: int | None = None,
                 max_positions: int = 256, **extra) -> Qwen3Config:
    """The config of a small Qwen3 (RMSNorm, RoPE, q/k-norm, SwiGLU, tied embeddings unless `extra`
    says otherwise): the one builder of the embedded model, the tests' and the benchmarks' models.
    `extra` passes any other Qwen3Config field (initializer_range, pad_token_id, ...)."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=kv_heads or num_heads, head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_positions, **{"tie_word_embeddings": True, **extra})


def random_qwen3(vocab_size: int, *, seed: int | None = 0, **config) -> Qwen3ForCausalLM:
    """A randomly initialised small Qwen3 (`qwen3_config` keys). Seeds the global RNG with `seed`
    first (None: leaves it as it is), as the tests and benchmarks expect."""
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen3ForCausalLM(qwen3_config(vocab_size, **config))


def tiny_config(spec: TinySpec, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    head_dim = min(TINY_HEAD_DIM, spec.hidden_size // spec.num_heads)
    return qwen3_config(len(tokenizer), spec.hidden_size, spec.num_layers, spec.num_heads, spec.intermediate_size,
                        head_dim=head_dim, max_positions=TINY_MAX_POSITIONS, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=None)


def build_tiny(spec: TinySpec, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A randomly initialised tiny model, deterministic by `seed`, and its character tokenizer."""
    tokenizer = build_char_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_config(spec, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def load_pretrained(
    path: str, dtype: str = "float32", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model + tokenizer from a directory (or hub id). Adds a pad token if the tokenizer lacks one.
    A PEFT adapter directory (adapter_config.json) loads its base model and merges the adapter in.
    A local directory that is missing, or lacks a config or a tokenizer, raises ModelDirError (one
    line naming it) before any loader runs."""
    if not looks_like_hub_id(path):
        problem = model_dir_problem(path)
        if problem is not None:
            raise ModelDirError(problem)
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return _load_adapter(path, dtype, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with plain_weights(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model, tokenizer


@contextlib.contextmanager
def plain_weights(path: str):
    """Weights load as data only: safetensors, or a `.bin` pickle read by transformers / peft with
    `weights_only=True`. A pickle that asks for more is refused there (nothing of it runs); here that
    refusal becomes one line naming the directory."""
    try:
        yield
    except pickle.UnpicklingError as err:
        raise ModelDirError(f"{path}: a weights file is not plain data ({refused_pickle_reason(err)}); nothing of "
                            "it ran. Save weights as safetensors (save_pretrained's default)") from None


def _load_adapter(path: str, dtype: str, trust_remote_code: bool):
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    model, _ = load_pretrained(base, dtype, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with plain_weights(path):
        return PeftModel.from_pretrained(model, path).merge_and_unload(), tokenizer


def meta_model(config) -> PreTrainedModel:
    """The causal LM of `config` on the meta device: its module layout without allocating weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def export_gguf(gguf_path: str, out_dir: str) -> str:
    """Write the GGUF checkpoint at `gguf_path` (model + tokenizer, de-quantized to fp32 by transformers'
    `gguf` reader) as a plain Hugging Face directory `out_dir`, which `load_pretrained` then reads like
    any other. Written to a temporary sibling and renamed into place only when complete; an existing
    complete `out_dir` is reused as is. Needs the `gguf` package."""
    import shutil
    import tempfile

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The reader marks the model as quantized with gguf (which cannot be saved); the weights it holds are
    # already de-quantized fp32, so the marks are dropped before saving.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-gguf-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(out_dir, "config.json")):
            raise
    return out_dir
