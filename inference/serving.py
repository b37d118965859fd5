"""The serving door: what an export holds (its `serving.json` manifest), one function that loads it
with the fast paths the manifest and the user's options ask for, and completions with their stats.

    server = load_served("runs/x/final")                       # reads final/serving.json
    completions = server.generate(prompt_ids, SamplingParams(max_new_tokens=64))
    server.stats.skip_ratio(), server.stats.mean_accepted       # counts of this server's calls

    completions, stats = serve("runs/x/final", prompt_ids, params, ServeOptions(speculative="seed"))

Every trainer export writes `serving.json` (`trainer/setup.py: export_final`, from `describe` of the
finished directory); an export written before manifests existed is described from its files the same
way, so it still serves. The manifest says which fast path each part of the export takes:
- `weights: compressed` (a `+algo=qad` export): the low-bit path (`inference/quantized.py`);
- `skipper: DIR`: routed layers on the lean decoder (`inference/skip_routing.py`);
- `drafter: seed_drafter.json`: SEED self-speculation when asked (`inference/speculative.py`);
- `adapter: lora` / `base: DIR`: a PEFT adapter merged into its base;
- `adapter: attuner`, `artifact_cache`: a query-side adapter over a position-independent artifact
  cache (`inference/pic.py`; the CLI's `--artifacts`).
A request that cannot be served (a drafter with another vocabulary, a skipper for another base, an
adapter on low-bit weights, a weight format this runtime cannot run) is a `ServingError`: one line
naming the file and the field. Statistics live in the Server, never in module state.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch
from torch import nn

from inference.artifacts import (
    ATTUNER_FILE, FLOAT_WEIGHTS, SEED_DRAFTER_FILE, SERVING_FILE, ManifestError, ServingManifest, read_manifest,
    write_manifest,
)
from inference.engine import Completion, Engine, EngineConfig, OnRound
from inference.sampling import SamplingParams
from inference.skip_routing import SKIP, SkipStats
from inference.speculative import MODES as SPECULATIVE_MODES, SpecStats

__all__ = ["ServeOptions", "ServeStats", "Server", "ServingError", "WeightFormat", "describe", "load_served",
           "load_weights", "manifest_of", "register_weights", "serve", "serve_model", "write_serving_manifest"]

ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter dir
MODEL_CONFIG = "config.json"
# The artifact-cache settings an Attuner export is served with: the cache is encoded by the base, the
# adapter runs on the query and generated tokens only, and the context is read over the cache.
ATTUNER_CACHE = MappingProxyType({"mode": "pic", "adapter_on": "query"})


class ServingError(ValueError):
    """A request that cannot be served: one line naming the file and the field."""


# ----------------------------------------------------------------------------- stored weight formats


@dataclass(frozen=True)
class WeightFormat:
    """A stored weight format the door loads on its own path (a manifest's `weights` other than a float dtype).

    detect(path): the scheme name when the export at `path` is stored this way (None: it is not; ValueError,
    one line naming the file: it is, in a variant this runtime cannot run). load(path, device): (model in eval
    mode on device, tokenizer). refuse(manifest, options): why a request cannot be served on these weights
    (an adapter to merge, speculative decoding, an external drafter or the artifact cache), None when it can.
    """

    name: str
    detect: Callable[[str], Optional[str]]
    load: Callable[[str, str], tuple]
    refuse: Callable[["ServingManifest", "ServeOptions"], Optional[str]] = lambda manifest, options: None


# The weight-format registry, filled when the modules in WEIGHT_FORMAT_MODULES are imported (the first time
# the door reads it); never changed afterwards. A new format is one module that calls `register_weights`,
# plus its name here: `inference/quantized.py` registers compressed-tensors low-bit weights.
WEIGHT_FORMAT_MODULES = ("inference.quantized",)
WEIGHT_KINDS: dict[str, WeightFormat] = {}
_formats_loaded = False


def register_weights(kind: WeightFormat) -> None:
    WEIGHT_KINDS[kind.name] = kind


def weight_formats() -> dict[str, WeightFormat]:
    global _formats_loaded
    if not _formats_loaded:
        for name in WEIGHT_FORMAT_MODULES:
            importlib.import_module(name)
        _formats_loaded = True
    return WEIGHT_KINDS


def _weight_format(path: str, manifest: ServingManifest) -> WeightFormat | None:
    """The registered format of `manifest.weights`, None for a float dtype; ServingError for another name."""
    if manifest.weights in FLOAT_WEIGHTS:
        return None
    kinds = weight_formats()
    if manifest.weights not in kinds:
        raise ServingError(f"{os.path.join(path, SERVING_FILE)}: weights {manifest.weights!r} is not one of "
                           f"{', '.join([*FLOAT_WEIGHTS, *kinds])}")
    return kinds[manifest.weights]


# ----------------------------------------------------------------------------- the manifest


def describe(path: str | os.PathLike) -> ServingManifest:
    """The manifest of the export at `path`, read from its files: config.json (its dtype, a
    compressed-tensors quantization_config), adapter_config.json (+ attuner.json), skipper/,
    seed_drafter.json and the tokenizer. ServingError naming the file for a format this runtime
    cannot run."""
    from models.skipper import SKIPPER_DIR, find_skipper

    path = str(path)
    stop_ids, vocab_size = _tokenizer_facts(path)
    facts: dict[str, Any] = {"stop_ids": stop_ids, "vocab_size": vocab_size}
    if os.path.exists(os.path.join(path, SEED_DRAFTER_FILE)):
        facts["drafter"] = SEED_DRAFTER_FILE
    if find_skipper(path) is not None:
        facts["skipper"] = SKIPPER_DIR
    adapter_config = os.path.join(path, ADAPTER_CONFIG)
    if os.path.exists(adapter_config):
        base = _read_json(adapter_config).get("base_model_name_or_path")
        attuner = os.path.exists(os.path.join(path, ATTUNER_FILE))
        kind = "attuner" if attuner else "lora"
        extra = {"artifact_cache": dict(ATTUNER_CACHE)} if attuner else {}
        weights = _saved_dtype(base) if isinstance(base, str) and os.path.isdir(base) else "float32"
        return ServingManifest(kind=kind, weights=weights, base=base, adapter=kind, **extra, **facts)
    for kind in weight_formats().values():
        try:
            scheme = kind.detect(path)
        except ValueError as err:
            raise ServingError(f"{err}: this runtime cannot run its weights") from None
        if scheme is not None:
            return ServingManifest(kind="quantized", weights=kind.name, scheme=scheme, **facts)
    kind = "skipper" if "skipper" in facts else "seed" if "drafter" in facts else "model"
    return ServingManifest(kind=kind, weights=_saved_dtype(path), **facts)


def write_serving_manifest(path: str | os.PathLike) -> ServingManifest:
    """Describe the finished export at `path` and write its serving.json (atomically)."""
    manifest = describe(path)
    write_manifest(path, manifest)
    return manifest


def manifest_of(path: str | os.PathLike) -> ServingManifest:
    """`path/serving.json`, or the description of its files when it has none (an older export)."""
    try:
        found = read_manifest(path)
    except ManifestError as err:
        raise ServingError(str(err)) from None
    if found is None:
        return describe(path)
    _weight_format(str(path), found)  # a weights name no registered format loads: refused here, by name
    return found


def _tokenizer_facts(path: str) -> tuple[tuple[int, ...], int | None]:
    """(stop ids, vocabulary size) of the export's tokenizer: its EOS, the ids of generation_config.json's
    eos_token_id and the chat template's end of turn (models.prompts.stop_ids)."""
    from transformers import AutoTokenizer

    from models.prompts import stop_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return (), None
    generation = os.path.join(path, "generation_config.json")
    eos = _read_json(generation).get("eos_token_id") if os.path.exists(generation) else None
    return stop_ids(tokenizer, eos), len(tokenizer)


def _read_json(file: str) -> dict:
    try:
        with open(file) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise ServingError(f"{file}: cannot be read ({err})") from None
    if not isinstance(data, dict):
        raise ServingError(f"{file}: expected a JSON object")
    return data


def _saved_dtype(path: str) -> str:
    """The dtype the checkpoint at `path` was saved in (config.json's dtype / torch_dtype), as the
    manifest spells it; float32 when it names none the runtime knows."""
    file = os.path.join(path, MODEL_CONFIG)
    config = _read_json(file) if os.path.exists(file) else {}
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


# ----------------------------------------------------------------------------- options and stats


@dataclass(frozen=True)
class ServeOptions:
    """What the user asks of an export on top of its manifest.

    adapter: a PEFT LoRA adapter dir merged onto the model. skipper: a skipper dir to serve on the
    model (None: the manifest's); use_skipper=False serves the base without it. speculative: None, "seed"
    (the export's seed_drafter.json, or the adapter dir's) or "external" (`drafter`: a model dir
    sharing the tokenizer). draft_len / confidence / adaptive / decoder_layers: override the drafter spec. artifacts:
    serve over a position-independent artifact cache (`Server.artifact_engine`): the base unmerged,
    with `adapter` -- or the export itself, an Attuner adapter -- as its query-side adapter. dtype:
    the dtype full-precision weights load in (None: the one they were saved in; evaluation loads
    float32, as training evals run). engine: the engine's max_seq_len, use_lean, compile and
    skip_mode (how routed layers run: auto, the measured cost gate; routed; masked).
    """

    adapter: str | None = None
    skipper: str | None = None
    use_skipper: bool = True
    speculative: str | None = None
    drafter: str | None = None
    draft_len: int | None = None
    confidence: float | None = None
    adaptive: bool | None = None
    decoder_layers: int | None = None
    artifacts: bool = False
    device: str = "cpu"
    dtype: str | None = None
    trust_remote_code: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise ServingError(f"speculative={self.speculative!r} is not one of {', '.join(SPECULATIVE_MODES)}")
        if self.speculative == "external" and not self.drafter:
            raise ServingError("speculative='external' needs a drafter dir")
        if self.drafter and self.speculative == "seed":
            raise ServingError("a drafter dir is only used with speculative='external'")
        if self.artifacts and (self.speculative or self.skipper):
            raise ServingError("artifacts does not combine with speculative decoding or a skipper")


@dataclass
class ServeStats:
    """What a Server's calls did, summed over its calls: completions, emitted tokens and seconds;
    the routed layer-tokens that ran and were skipped (`skip`, all zero without a skipper); with
    speculation, verify forwards and accepted drafts (`speculative`)."""

    calls: int = 0
    completions: int = 0
    tokens: int = 0
    seconds: float = 0.0
    skip: SkipStats = field(default_factory=SkipStats)
    speculative: SpecStats | None = None

    def skip_ratio(self) -> float:
        """Skipped routed layer-tokens of the decode steps (0 without a skipper)."""
        return self.skip.skip_ratio()

    @property
    def mean_accepted(self) -> float:
        """Tokens per verify forward (0 without speculation)."""
        return self.speculative.mean_accepted if self.speculative is not None else 0.0

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ----------------------------------------------------------------------------- the server


class Server:
    """A model with its fast paths: an export opened by `load_served`, or a live model (a trainer's
    policy) by `serve_model`. `generate` takes what `Engine.generate` takes and returns what it
    returns, so a Server stands wherever an Engine does; `stats` sums its calls."""

    def __init__(self, model: nn.Module, tokenizer: Any, options: ServeOptions,
                 manifest: ServingManifest | None = None, path: str | None = None, skipper: str | None = None,
                 drafter: nn.Module | None = None, seed_dir: str | None = None):
        self.path, self.manifest, self.model, self.tokenizer = path, manifest, model, tokenizer
        self.options, self.skipper, self.drafter = options, skipper, drafter
        self.query_adapter: dict | None = None  # artifacts: layer -> q_proj delta of the query-side adapter
        self.adapter_dir: str | None = None  # artifacts: where that adapter was read
        self.stats = ServeStats(skip=SkipStats(), speculative=SpecStats() if options.speculative else None)
        self.engine = Engine(model, options.engine, route_stats={SKIP: self.stats.skip})
        self.decoder = self._decoder(seed_dir) if options.speculative else None

    def _decoder(self, seed_dir: str | None):
        from inference.speculative import SpeculativeDecoder

        o = self.options
        overrides = {key: value for key, value in (("draft_len", o.draft_len), ("confidence", o.confidence),
                                                   ("adaptive", o.adaptive), ("decoder_layers", o.decoder_layers))
                     if value is not None}
        if o.engine.max_seq_len is not None:
            overrides["max_seq_len"] = o.engine.max_seq_len
        overrides["compile"] = o.engine.compile
        try:
            if o.speculative == "seed":
                if seed_dir is None and self.path is None:
                    return SpeculativeDecoder(self.model, mode="seed", **overrides)  # a live model: the defaults
                return SpeculativeDecoder.from_pretrained_dir(self.model, seed_dir or self.path, **overrides)
            return SpeculativeDecoder(self.model, mode="external", drafter=self.drafter, **overrides)
        except ValueError as err:
            raise ServingError(f"{o.drafter or self.path}: speculative={o.speculative}: {err}") from None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        if self.manifest is not None:
            return self.manifest.stop_ids
        from models.prompts import generation_eos, stop_ids

        return stop_ids(self.tokenizer, generation_eos(self.model)) if self.tokenizer is not None else ()

    def params(self, **fields: Any) -> SamplingParams:
        """SamplingParams stopping at the export's stop ids (unless `stop_token_ids` is given)."""
        fields.setdefault("stop_token_ids", self.stop_ids)
        return SamplingParams(**fields)

    def artifact_engine(self, prefix: list[int] | tuple[int, ...] = (), config: Any = None):
        """A PICEngine over a new artifact cache of this (artifacts) server's base with `prefix`, the
        query-side adapter applied to the query and generated tokens; `config`: a pic.PICConfig."""
        from inference.pic import ArtifactCache, PICEngine

        if not self.options.artifacts:
            raise ServingError(f"{self.path}: opened without artifacts=True: no artifact cache to serve over")
        return PICEngine(self.model, ArtifactCache(self.model, prefix=prefix), config, adapter=self.query_adapter)

    def artifact_server(self, config: Any = None, adapter: dict | None = None):
        """A pic.PICServer over this (artifacts) server's base: prompts given as segments, one artifact
        cache per shared prefix, `adapter` (layer -> q_proj delta; None: this server's query-side adapter,
        or for a live model its own LoRA deltas; {}: none) on the query and generated tokens."""
        from inference.pic import PICServer

        if not self.options.artifacts:
            raise ServingError(f"{self.path}: opened without artifacts=True: no artifact cache to serve over")
        return PICServer(self.model, self.tokenizer, config, adapter=self.query_adapter if adapter is None else adapter)

    def sessions(self, reuse: Any = None):
        """A suffix.SessionEngine over this server's model and engine options: multi-turn sessions whose
        next prompt reuses their previous K/V as `reuse` (a suffix.ReuseConfig) says."""
        from inference.suffix import SessionEngine

        if self.decoder is not None or self.options.artifacts:
            raise ServingError(f"{self.path}: sessions serve plain decoding (no speculative decoding or artifacts)")
        return SessionEngine(self.model, reuse, self.options.engine)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, *, on_round: OnRound | None = None) -> list[Completion]:
        if self.options.artifacts:
            raise ServingError(f"{self.path}: opened for artifacts: generate through artifact_engine(prefix)")
        start = time.perf_counter()
        if self.decoder is None:
            completions = self.engine.generate(prompts, params, generator, on_round=on_round)
        else:
            completions = self.decoder.generate(prompts, params, generator, on_round=on_round)
            self.stats.speculative.add(self.decoder.stats)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.completions += len(completions)
        self.stats.tokens += sum(len(c.tokens) for c in completions)
        return completions


def load_served(path: str | os.PathLike, options: ServeOptions | None = None) -> Server:
    """The export at `path` loaded as its manifest (or, without one, its files) says, with the fast
    paths `options` ask for, ready to generate. ServingError (one line naming the file and the
    field) for a request that cannot be served; ModelDirError for a dir that is not a model."""
    options = options or ServeOptions()
    path = str(path)
    manifest = manifest_of(path)
    where = os.path.join(path, SERVING_FILE)
    if options.artifacts:
        return _load_for_artifacts(path, manifest, options)
    if manifest.kind == "attuner":
        raise ServingError(f"{where}: kind attuner is a query-side adapter for an artifact cache: serve it "
                           "with artifacts (ServeOptions(artifacts=True); python -m inference DIR --artifacts ...)")
    drafter = _check_request(path, manifest, options)  # before any weights load
    model, tokenizer = _load_weights(path, manifest, options)
    skipper = _attach_skipper(model, path, manifest, options)
    drafter_model = None
    if drafter is not None:
        drafter_model, _ = _load_dense(options.drafter, drafter, dataclasses.replace(options, adapter=None))
    seed_dir = options.adapter if options.adapter and os.path.exists(
        os.path.join(options.adapter, SEED_DRAFTER_FILE)) else path
    return Server(model, tokenizer, options, manifest, path, skipper, drafter_model, seed_dir)


def load_weights(path: str | os.PathLike, options: ServeOptions | None = None):
    """(model, tokenizer) of the export at `path` as its manifest says its weights load -- compressed
    weights on the low-bit path, full precision in `options.dtype` (else the saved dtype), an adapter dir
    merged into its base -- without attaching a skipper or a drafter: the trainer's loader. A hub id (no
    local dir) loads as a full-precision model."""
    options = options or ServeOptions()
    path = str(path)
    if not os.path.isdir(path):
        from models.loading import load_pretrained

        return load_pretrained(path, options.dtype or "float32", options.trust_remote_code)
    return _load_weights(path, manifest_of(path), options)


def _load_weights(path: str, manifest: ServingManifest, options: ServeOptions):
    kind = _weight_format(path, manifest)
    if kind is None:
        return _load_dense(path, manifest, options)
    try:
        return kind.load(path, options.device)
    except ValueError as err:
        raise ServingError(f"{os.path.join(path, SERVING_FILE)}: weights {kind.name}: {err}") from None


def _load_for_artifacts(path: str, manifest: ServingManifest, options: ServeOptions) -> Server:
    """The base in full precision, unmerged, and the query-side adapter's q_proj deltas: `options.adapter`
    over the model at `path`, or the export at `path` itself over the base its manifest names."""
    from inference.pic import PICError, load_query_adapter
    from models.loading import load_pretrained
    from models.model_dir import ModelDirError

    if _weight_format(path, manifest) is not None:
        raise ServingError(f"{os.path.join(path, SERVING_FILE)}: weights {manifest.weights}: the artifact cache "
                           "runs full-precision weights")
    base, adapter = path, options.adapter
    if adapter is None and manifest.base is not None:  # the dir is itself an adapter: serve it over its base
        base, adapter = manifest.base, path
    try:
        model, tokenizer = load_pretrained(base, options.dtype or manifest.weights, options.trust_remote_code)
    except ModelDirError as err:
        raise ServingError(str(err)) from None
    model = model.to(options.device).eval()
    try:
        deltas = load_query_adapter(model, adapter) if adapter else {}
    except PICError as err:
        raise ServingError(str(err)) from None
    server = Server(model, tokenizer, options, manifest, path)
    server.query_adapter, server.adapter_dir = deltas, adapter
    return server


def serve_model(model: nn.Module, options: ServeOptions | None = None, tokenizer: Any = None) -> Server:
    """A live model behind the same door: the fast paths its modules carry (low-bit or fake-quant
    linears, an attached skipper) run as an export's would, with `options`' engine and speculation.
    Rollouts and the trainer's evals decode through this; it loads nothing (`adapter`, `skipper` and
    `drafter` dirs are export options and are refused here)."""
    options = options or ServeOptions()
    for name in ("adapter", "skipper", "drafter"):
        if getattr(options, name):
            raise ServingError(f"serve_model: {name}={getattr(options, name)!r} is a directory to load: use load_served")
    return Server(model, tokenizer, options)


def serve(path: str | os.PathLike, prompts: list[list[int]], params: SamplingParams,
          options: ServeOptions | None = None, generator: torch.Generator | None = None
          ) -> tuple[list[Completion], ServeStats]:
    """One call: load the export at `path` with `options`, complete `prompts`, return (completions, stats)."""
    server = load_served(path, options)
    return server.generate(prompts, params, generator), server.stats


def _load_dense(path: str, manifest: ServingManifest, options: ServeOptions):
    """A full-precision model in the dtype it was saved in; an adapter dir loads its base and merges it,
    and `options.adapter` is merged on top."""
    from models.loading import load_pretrained
    from models.model_dir import ModelDirError

    try:
        model, tokenizer = load_pretrained(path, options.dtype or manifest.weights, options.trust_remote_code)
    except ModelDirError as err:
        raise ServingError(str(err)) from None
    if options.adapter:
        if not os.path.exists(os.path.join(options.adapter, ADAPTER_CONFIG)):
            raise ServingError(f"adapter {options.adapter} is not a PEFT adapter dir (no {ADAPTER_CONFIG})")
        from peft import PeftModel

        from models.loading import plain_weights

        try:
            with plain_weights(options.adapter):
                model = PeftModel.from_pretrained(model, options.adapter).merge_and_unload()
        except ModelDirError as err:
            raise ServingError(str(err)) from None
    return model.to(options.device).eval(), tokenizer


def _skipper_dir(path: str, manifest: ServingManifest, options: ServeOptions) -> str | None:
    """`options.skipper`, else the manifest's skipper dir (unless use_skipper is False), else None."""
    if options.skipper:
        return options.skipper
    if options.use_skipper and manifest.skipper:
        return os.path.join(path, manifest.skipper)
    return None


def _check_request(path: str, manifest: ServingManifest, options: ServeOptions) -> ServingManifest | None:
    """Refuse, before any weights load, what cannot be served: an adapter merged into low-bit weights,
    a skipper for another base, an external drafter with another tokenizer or low-bit weights. Returns
    the external drafter's manifest (None without one)."""
    where = os.path.join(path, SERVING_FILE)
    kind = _weight_format(path, manifest)
    reason = kind.refuse(manifest, options) if kind is not None else None
    if reason is not None:
        raise ServingError(f"{where}: {reason}")
    found = _skipper_dir(path, manifest, options)
    if found is not None:
        from transformers import AutoConfig

        from models.skipper import SkipperError, read_spec

        base = manifest.base or path
        try:
            read_spec(found).check_model(AutoConfig.from_pretrained(base), where=f"the skipper in {found}")
        except SkipperError as err:
            raise ServingError(f"skipper: {err}") from None
        except (OSError, ValueError):
            pass  # no readable config: load_pretrained names the dir
    if options.speculative != "external":
        return None
    drafter = manifest_of(options.drafter)
    where = os.path.join(options.drafter, SERVING_FILE)
    for name in ("vocab_size", "stop_ids"):
        mine, theirs = getattr(drafter, name), getattr(manifest, name)
        if mine is not None and theirs is not None and mine != theirs:
            raise ServingError(f"{where}: field {name} is {_show(mine)}, the target's is {_show(theirs)}: "
                               "a drafter must share the target's tokenizer")
    if _weight_format(options.drafter, drafter) is not None:
        raise ServingError(f"{where}: weights {drafter.weights}: an external drafter runs full-precision weights")
    return drafter


def _attach_skipper(model: nn.Module, path: str, manifest: ServingManifest, options: ServeOptions) -> str | None:
    """Apply the skipper `_skipper_dir` names to `model`; returns its dir, or None."""
    from models.skipper import SkipperError, load_skipper

    found = _skipper_dir(path, manifest, options)
    if found is None:
        return None
    try:
        load_skipper(model, found)
    except SkipperError as err:
        raise ServingError(f"skipper: {err}") from None
    return found


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)
