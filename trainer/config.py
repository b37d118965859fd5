"""Typed configuration: the schema Hydra's composed YAML is validated against at start-up.

Only this module and `train.py` / `evaluate.py` know about Hydra/OmegaConf. Everything below the
edge (models/, algorithms/, inference/) receives plain dataclasses. Validation happens before torch
is imported or anything is written, so a typo costs seconds, not a job slot.

    cfg = load_config(["+algo=sft", "trainer.max_steps=10"])   # -> TrainConfig (validated)
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from models.model_dir import tokenizer_problem  # the standard library only, like this module
from tasks import TASK_CONFIGS, ArithConfig
from trainer.activations.options import ActivationConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CACHE = "~/.cache/posttrain"


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the offending key or value."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: Optional[str] = None  # local HF dir or hub id; None => the embedded tiny model
    # compute dtype of training, rollouts and evals: float32 | bfloat16 | float16. Weights, gradients and the
    # optimizer state stay fp32 (master weights); bfloat16 / float16 run every forward under torch.autocast,
    # float16 with loss scaling (single / ddp only). trainer/precision.py.
    dtype: str = "float32"
    trust_remote_code: bool = False
    cache_dir: str = DEFAULT_CACHE  # where the warm-started tiny model is built and cached
    seed: int = 0  # the embedded tiny model's init and warm start (its own key: the run's `seed` does not rebuild it)
    # Embedded tiny model (Qwen3 architecture, character tokenizer).
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    # Warm start: our own SFT on `warm_start_task`, run once per recipe and cached; 0 steps => random init.
    # auto = the run's data.name when it is arith or artifacts, else arith (resolved by load_config;
    # outside it auto means arith).
    warm_start_task: str = "auto"
    # null => the warm-start task's measured recipe value (trainer/default_model.py::WARM_NUMBERS):
    # arith 300 steps, lr 3e-3, batch 64, reference 0.5; artifacts: see docs/artifacts.md.
    warm_start_steps: Optional[int] = 0
    warm_start_lr: Optional[float] = None
    warm_start_batch_size: Optional[int] = None
    warm_start_reference_fraction: Optional[float] = None  # share of warm-up prompts carrying a (masked) reference
    # A build below this held-out accuracy is not published: it catches a build that learned nothing (an
    # interrupted one scored 0.0) while allowing for seeds (measured: 0.36 at model.seed=0, 0.10 at 1).
    warm_start_min_accuracy: float = 0.05


@dataclass
class BackendConfig:
    name: str = "auto"  # auto | single | ddp | fsdp | deepspeed
    zero_stage: int = 0  # deepspeed only: 1 | 2 | 3
    dist_timeout_s: int = 1800


@dataclass
class LoggingConfig:
    wandb: bool = True  # online with a key, otherwise offline run files in output_dir
    project: str = "posttrain"
    run_name: Optional[str] = None
    progress: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 100
    batch_size: int = 32  # global prompts per optimizer step (all ranks)
    micro_batch_size: int = 16  # per rank per forward/backward
    # None (the default) = resolved by load_config (default_lr): 1e-3 on the embedded tiny model (or the
    # algorithm's Traits.tiny_lr); with model.path set 1e-5 for full fine-tuning, 1e-4 when only LoRA adapters
    # train (algo.lora_rank > 0), or the algorithm's Traits.pretrained_lr. A value set by the user is kept.
    lr: Optional[float] = None
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 1.0
    eval_every: int = 50
    eval_examples: int = 200
    eval_max_new_tokens: int = 160
    extra_eval_examples: int = 32  # held-out examples of an algorithm's extra eval metrics (seed, skipper, attuner)
    save_every: int = 50
    keep_last: int = 2
    resume: str = "auto"  # auto | never | PATH
    max_new_tokens: int = 160  # rollout length for on-policy algorithms
    # The inference engine of rollouts and eval (inference.EngineConfig): null = the lean decoder when the
    # model allows it, false = always the HF forward, true = require the lean decoder; compile: torch.compile it.
    engine_use_lean: Optional[bool] = None
    engine_compile: bool = False
    # Actor-update memory/compute (trainer/activations/): none | checkpoint (every block recomputed) |
    # hilore (per-block full / compressed / recomputed, planned under the budgets below). Declared,
    # defaulted and validated by trainer/activations/options.py::ActivationConfig (trainer.activation_X
    # is its field X); listed here as the user-facing keys.
    activations: str = ActivationConfig.mode
    activation_memory_budget: float = ActivationConfig.memory_budget  # hilore: x the full-checkpointing peak
    activation_risk_budget: float = ActivationConfig.risk_budget  # hilore: summed compression error x exposure
    activation_compress: str = ActivationConfig.compress  # hilore: int8 | fp8
    activation_group_size: int = ActivationConfig.group_size  # hilore: elements per quantisation scale
    activation_stochastic_rounding: bool = ActivationConfig.stochastic_rounding
    activation_replan_tolerance: float = ActivationConfig.replan_tolerance  # hilore: exposure change that re-plans
    activation_profile_steps: int = ActivationConfig.profile_steps  # hilore: micro-batches profiled first
    # hilore: optimizer state counted in the peak (AdamW 8)
    activation_optimizer_bytes_per_param: float = ActivationConfig.optimizer_bytes_per_param
    prompt_sharing: bool = False  # RL algorithms: each prompt computed once per group (trainer/prompt_sharing.py)
    # The pre-flight memory check (trainer/memory.py, docs/memory.md): before the first step, the actor
    # update's peak for the worst micro-batch is estimated against the memory available. error: refuse
    # with one line (exit code 7) | auto: switch trainer.activations none -> checkpoint when that fits,
    # else refuse | off: no check.
    memory_check: str = "error"
    memory_limit_gb: Optional[float] = None  # GiB per rank the update may use; null = what the device / host has free


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    # the selected task's own config dataclass (a tasks.TaskConfig: tasks.TASK_CONFIGS[data.name]), like `algo`
    data: Any = field(default_factory=ArithConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: Any = None  # the selected algorithm's own config dataclass


def _one_line(err: BaseException) -> str:
    """Hydra wraps the OmegaConf error that names the key and the problem; OmegaConf adds lines of
    context. Return one line: the outer message (which override) + the inner one (what is wrong)."""
    lines = []
    while err is not None:
        first = str(err).strip().splitlines()
        if first and first[0].strip() and not first[0].startswith("To append"):
            lines.append(first[0].strip())
        err = err.__cause__
    if not lines:
        return "invalid configuration"
    if lines[0].startswith("Could not override") and len(lines) > 1:
        return f"unknown key: {lines[-1]}"  # "Key 'max_stepz' not in 'TrainerConfig'"
    return ": ".join(dict.fromkeys(lines))


def compose(overrides: list[str]) -> Any:
    """Compose configs/train.yaml with command-line overrides (Hydra syntax), without Hydra's run dir."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hydra.core.config_store import ConfigStore

    # The typed schema is the first entry of train.yaml's defaults list: every key exists with its
    # type, so a typo fails at composition and a wrong type fails at conversion. `data` and `algo` are
    # typed by the selected task's and algorithm's own dataclass after composition (load_config); in
    # composition their YAML files (each listing every key of its dataclass) hold their keys.
    ConfigStore.instance().store(name="train_schema", node=TrainConfig(data=None, algo=None))
    # A registered task without a configs/data/NAME.yaml (which documents its keys) composes from its dataclass.
    for task, schema in TASK_CONFIGS.items():
        if not (CONFIG_DIR / "data" / f"{task}.yaml").exists():
            ConfigStore.instance().store(group="data", name=task, node=schema)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


def _available_algos() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "algo").glob("*.yaml"))


def available_recipes() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml"))


def recipe_algo(name: str) -> str:
    """The algorithm configs/recipe/NAME.yaml selects: the `/algo: NAME` entry of its defaults list."""
    from omegaconf import OmegaConf

    path = CONFIG_DIR / "recipe" / f"{name}.yaml"
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []):
        if isinstance(entry, dict) and list(entry) in (["/algo"], ["algo"]):
            return entry[next(iter(entry))]
    raise ConfigError(f"configs/recipe/{name}.yaml selects no algorithm (its defaults list needs '- /algo: NAME')")


def _override_key(arg: str) -> str:
    return arg.lstrip("+~").split("=")[0]


def _apply_recipe(overrides: list[str]) -> tuple[list[str], Optional[str]]:
    """A `+recipe=NAME` selects its algorithm itself (the `/algo` entry of its defaults list): returns the
    overrides without a `+algo=` that repeats it, and the recipe's algorithm (None without a recipe). A
    `+algo=` naming a different algorithm, an unknown recipe or a second recipe is a ConfigError."""
    recipe_args = [o for o in overrides if _override_key(o) == "recipe"]
    if not recipe_args:
        return overrides, None
    if len(recipe_args) > 1:
        raise ConfigError(f"one recipe per run: got {' and '.join(recipe_args)}")
    arg = recipe_args[0]
    if not arg.startswith("+recipe=") or arg.startswith("++"):
        raise ConfigError(f"{arg}: select a recipe with +recipe=NAME (available: {', '.join(available_recipes())})")
    recipe = arg.split("=", 1)[1]
    if recipe not in available_recipes():
        raise ConfigError(f"unknown recipe '{recipe}' (available: {', '.join(available_recipes())})")
    algo = recipe_algo(recipe)
    algo_args = [o for o in overrides if _override_key(o) == "algo"]
    for a in algo_args:
        if a.partition("=")[2] != algo:
            raise ConfigError(f"{a} conflicts with +recipe={recipe}, which trains algo {algo}: drop {a} (a recipe "
                              f"selects its algorithm), or drop the recipe")
    return [o for o in overrides if o not in algo_args], algo


def load_config(overrides: list[str], algo_schemas: dict[str, type], training: bool = True) -> TrainConfig:
    """Compose + validate. Raises ConfigError (one line) on any bad input. `+recipe=NAME`
    (configs/recipe/NAME.yaml) implies its algorithm, so it needs no `+algo=`. training=False (evaluate.py):
    the checks of what the algorithm would train are left out (a low-bit export evaluates as served)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides, name = _apply_recipe(list(overrides))
    if name is None:
        algo_args = [o for o in overrides if _override_key(o) == "algo"]
        if not algo_args:
            raise ConfigError(f"no algorithm selected: add +algo=NAME (available: {', '.join(_available_algos())}) "
                              f"or +recipe=NAME (available: {', '.join(available_recipes())})")
        name = algo_args[-1].split("=", 1)[1]
    if name not in algo_schemas or name not in _available_algos():
        raise ConfigError(f"unknown algorithm '{name}' (available: {', '.join(sorted(algo_schemas))})")
    _refuse_data_name(overrides)
    try:
        raw = compose(overrides)
    except Exception as err:  # Hydra: unknown group option, bad override syntax, missing key
        raise ConfigError(_compose_error(err, overrides, algo_schemas)) from None
    try:
        raw = OmegaConf.to_container(raw, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err)) from None
    algo_raw = raw.pop("algo", {}) or {}
    data_raw = raw.pop("data", {}) or {}
    task = data_raw.get("name")
    if task not in TASK_CONFIGS:  # a task composed but no longer registered (in one process)
        raise ConfigError(_no_such_option("data", task))
    cfg: TrainConfig = _typed(TrainConfig(data=None, algo=None), raw)
    cfg.data = _typed(TASK_CONFIGS[task](), data_raw, "data", f"data={task}")
    cfg.algo = _typed(algo_schemas[name](), algo_raw, "algo", f"algo {name}")
    _resolve_warm_start(cfg)
    _resolve_lr(cfg)
    validate(cfg, training)
    return cfg


TINY_LR = 1e-3  # the embedded ~1M-parameter tiny model, full fine-tuning
PRETRAINED_LR = 1e-5  # full fine-tuning of a pretrained model (1e-3 took a real model's SFT loss 1.47 -> 3.26 in 3 steps)
ADAPTER_LR = 1e-4  # a pretrained model whose weights stay frozen: only LoRA adapters train


def is_default_entry(path: str) -> bool:
    """`path` is a cache entry of the embedded default model (its `warm_start.json` marks one): the same
    weights as leaving model.path unset, so the same default learning rates."""
    from trainer.default_model import DONE

    return os.path.isfile(os.path.join(os.path.expanduser(str(path)), DONE))


def default_lr(cfg: TrainConfig) -> tuple[float, str]:
    """The trainer.lr a run gets when the user leaves it unset, and why (one phrase)."""
    traits = cfg.algo.traits
    if cfg.model.path is None or is_default_entry(cfg.model.path):
        where = "the embedded tiny model" + ("" if cfg.model.path is None else " (model.path is its cache entry)")
        if traits.tiny_lr is not None:
            return traits.tiny_lr, f"{where}, algo {cfg.algo.name}'s value"
        return TINY_LR, where
    if traits.pretrained_lr is not None:
        return traits.pretrained_lr, f"a pretrained model, algo {cfg.algo.name}'s value (only its new modules train)"
    if traits.lora and cfg.algo.lora_rank > 0:
        return ADAPTER_LR, "a pretrained model, LoRA adapters only (algo.lora_rank > 0)"
    return PRETRAINED_LR, "a pretrained model, full fine-tuning"


def _resolve_lr(cfg: TrainConfig) -> None:
    """trainer.lr null -> default_lr(cfg). The reason is kept on the config object (`cfg.defaulted`, not a
    key) for the start-of-run line that says which value was chosen."""
    cfg.defaulted = {}
    if cfg.trainer.lr is None:
        cfg.trainer.lr, why = default_lr(cfg)
        cfg.defaulted["trainer.lr"] = why


def _resolve_warm_start(cfg: TrainConfig) -> None:
    """model.warm_start_task auto -> the run's task (arith or artifacts, else arith), and every null
    model.warm_start_* number -> that task's recipe value, so train.py and evaluate.py (both load
    their config here) build and read the same cache entry."""
    from trainer.default_model import resolve

    try:
        cfg.model = resolve(cfg.model, cfg.data.name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _typed(schema: Any, raw: dict, section: str = "", owner: str = "") -> Any:
    """`raw` merged onto the dataclass instance `schema` (the config's `section`, "" = the top level) and
    converted back to a dataclass. A bad key or value is one line naming `section.KEY`, and an unknown key
    also whose keys these are (`owner`: e.g. "data=arith")."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except ConfigKeyError as err:
        if section and getattr(err, "key", None) is not None:
            raise ConfigError(_unknown_key(section, owner, str(err.key), type(schema))) from None
        raise ConfigError(_describe(err, section)) from None
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err, section)) from None


def _unknown_key(section: str, owner: str, key: str, schema: type) -> str:
    keys = ", ".join(f.name for f in dataclasses.fields(schema))
    return f"unknown key {section}.{key}: {owner} has no key {key!r} (its keys: {keys})"


def _refuse_data_name(overrides: list[str]) -> None:
    """The task is a config group (`data=NAME` selects its file and its keys): `data.name=NAME` would rename
    one task's keys as another's."""
    for arg in overrides:
        if _override_key(arg) == "data.name":
            task = arg.partition("=")[2]
            raise ConfigError(f"{arg}: select the task with data={task} (data.name is the selected task's own)")


def _no_such_option(group: str, option: str) -> str:
    options = TASK_CONFIGS if group == "data" else [p.stem for p in (CONFIG_DIR / group).glob("*.yaml")]
    return f"{group}={option}: no such option (available: {', '.join(sorted(options))})"


def _compose_error(err: BaseException, overrides: list[str], algo_schemas: dict[str, type]) -> str:
    """Hydra's composition error as one line. An override of a key the selected task or algorithm does not
    have names the key and the keys it does have (the selection is read by composing without it)."""
    import re

    line = _one_line(err)
    missing = re.search(r"Could not find '(\w+)/([^']+)'", line)
    if missing is not None:
        return _no_such_option(*missing.groups())
    match = re.search(r"Could not override '((data|algo)\.([^'.]+))'", str(err))
    if match is None:
        return line
    full, section, key = match.groups()
    try:
        rest = compose([o for o in overrides if _override_key(o) != full])
    except Exception:
        return line
    selected = rest[section].get("name") if rest.get(section) is not None else None
    if section == "data" and selected in TASK_CONFIGS:
        return _unknown_key("data", f"data={selected}", key, TASK_CONFIGS[selected])
    if section == "algo" and selected in algo_schemas:
        return _unknown_key("algo", f"algo {selected}", key, algo_schemas[selected])
    return line


def _describe(err: Exception, section: str = "") -> str:
    key = getattr(err, "full_key", None)
    if key and section:
        key = f"{section}.{key}"
    msg = _one_line(err)
    if key and key not in msg:
        msg = f"{key}: {msg}"
    return msg


CHOICES = {
    "backend.name": ("auto", "single", "ddp", "fsdp", "deepspeed"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "trainer.memory_check": ("error", "auto", "off"),  # trainer/memory.py::MODES
}


def validate(cfg: TrainConfig, training: bool = True) -> None:
    """Value checks the type system cannot express. Nothing here touches the disk except to read."""
    from algorithms.base import ChecksRun
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}={value} is not one of {', '.join(allowed)}")
    t = cfg.trainer
    try:  # every trainer.activation* key, checked where they are declared
        ActivationConfig.from_trainer(t).validate()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # Sizes that would make a run meaningless (rollouts or evals of nothing report accuracy 0) are refused.
    traits = cfg.algo.traits  # declared by every algorithm config (algorithms.base.Traits)
    for key in ("max_steps", "batch_size", "micro_batch_size", "eval_every", "save_every", "keep_last",
                "max_new_tokens", "eval_examples", "eval_max_new_tokens", "extra_eval_examples"):
        if key == "max_steps" and traits.zero_steps and t.max_steps == 0:
            continue  # e.g. qad's ptq: evaluate and export the untrained student
        if getattr(t, key) <= 0:
            raise ConfigError(f"trainer.{key}={getattr(t, key)} must be > 0")
    if t.memory_limit_gb is not None and not t.memory_limit_gb > 0:
        raise ConfigError(f"trainer.memory_limit_gb={t.memory_limit_gb} must be > 0 (or null: the memory available)")
    if t.lr is not None and t.lr <= 0:  # None only before load_config's resolution (a config built in code)
        raise ConfigError(f"trainer.lr={t.lr} must be > 0")
    if t.prompt_sharing and not traits.prompt_sharing:
        raise ConfigError(f"trainer.prompt_sharing=true: algo {cfg.algo.name} does not sample groups of responses "
                          "per prompt (use it with +algo=grpo)")
    if cfg.backend.name == "fsdp" and not traits.fsdp:
        raise ConfigError(f"backend=fsdp: algo {cfg.algo.name} does not run under FSDP2 yet (use backend=ddp or "
                          "backend=deepspeed)")
    if cfg.backend.name == "deepspeed" and not traits.deepspeed:
        raise ConfigError(f"backend=deepspeed: algo {cfg.algo.name} makes a different number of training rows "
                          "each step, and DeepSpeed fixes the micro-batches per step (use backend=ddp or backend=fsdp)")
    if cfg.model.dtype == "float16" and cfg.backend.name in ("fsdp", "deepspeed"):
        raise ConfigError(f"model.dtype=float16 needs loss scaling, which backend={cfg.backend.name} does not do here "
                          "(use model.dtype=bfloat16, or backend=ddp)")
    if cfg.backend.name == "deepspeed" and cfg.backend.zero_stage not in (1, 2, 3):
        raise ConfigError(f"backend.zero_stage={cfg.backend.zero_stage} must be 1, 2 or 3 for deepspeed")
    if cfg.backend.name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("backend=deepspeed: DeepSpeed is not installed (pip install deepspeed, or the project's "
                          "gpu extra: pip install -e '.[gpu]')")
    if t.resume not in ("auto", "never") and not os.path.isdir(os.path.expanduser(t.resume)):
        raise ConfigError(f"trainer.resume={t.resume}: no such checkpoint directory")
    _validate_model_path(cfg.model)
    if training:
        _validate_low_bit_base(cfg, traits)
    try:
        cfg.data.validate()  # every task config checks its own values (and normalises data.chat_template)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _validate_chat_template(cfg)
    try:
        cfg.algo.validate()  # every algorithm config checks its own values
        _validate_teacher_model(cfg)
        if isinstance(cfg.algo, ChecksRun):  # ... and some against the budget and the model's layout
            cfg.algo.check_run(t.max_steps, model_skeleton(cfg.model))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    problem = cfg.data.reference_problem() if traits.needs_reference else None
    if problem is not None:
        raise ConfigError(f"algo {cfg.algo.name} distils from reference solutions, but {problem}")
    if cfg.model.name == "hf" and cfg.model.path is None:
        raise ConfigError("model=hf needs model.path=DIR (a local model directory, or a hub id when online)")


def model_skeleton(m: ModelConfig):
    """A function building the configured model on the meta device (module layout, no weights), or
    None when the layout is not known before loading (a hub id, a PEFT adapter dir)."""
    if m.path is None:
        def tiny():
            from models.loading import meta_model, tiny_config
            from models.tokenizer import build_char_tokenizer

            from trainer.default_model import spec

            return meta_model(tiny_config(spec(m), build_char_tokenizer()))
        return tiny
    path = os.path.expanduser(m.path)
    if not os.path.exists(os.path.join(path, "config.json")):
        return None

    def local():
        from transformers import AutoConfig

        from models.loading import meta_model

        return meta_model(AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code))
    return local


def _validate_model_path(model: ModelConfig) -> None:
    if model.path is None:
        return
    path = os.path.expanduser(model.path)
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
            raise ConfigError(f"model.path={model.path}: no config.json or adapter_config.json there (not a Hugging "
                              "Face model or PEFT adapter directory)")
        problem = tokenizer_problem(path)  # train.py loads the tokenizer from the same directory
        if problem is not None:
            raise ConfigError(f"model.path={model.path}: {problem}")
        return
    looks_like_hub_id = model.path.count("/") == 1 and not model.path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ConfigError(f"model.path={model.path}: no such directory")


def _validate_low_bit_base(cfg: TrainConfig, traits) -> None:
    """A low-bit (compressed-tensors) export as model.path: only for an algorithm that trains new modules
    over a frozen base (its traits say `low_bit_base`), and under the single or DDP backend."""
    from models.quant_export import is_compressed

    if cfg.model.path is None or not is_compressed(os.path.expanduser(cfg.model.path)):
        return
    if not traits.low_bit_base:
        raise ConfigError(f"model.path={cfg.model.path} is a low-bit (compressed-tensors) export: algo {cfg.algo.name} "
                          "trains the base's weights, which it holds only as integers (train from the de-quantized "
                          "copy, +algo=qad algo.export_dequantized=true writes final/dequantized/; or +algo=skipper)")
    if cfg.backend.name in ("fsdp", "deepspeed"):
        raise ConfigError(f"backend={cfg.backend.name}: a low-bit base (model.path={cfg.model.path}) runs under "
                          "backend=single or backend=ddp (the sharding backends shard float parameters)")


def _validate_teacher_model(cfg: TrainConfig) -> None:
    """A separate teacher (algo.teacher_path, TeacherModelOptions): its dtype defaults to model.dtype, and its
    tokenizer must be the student's (models.prompts.tokenizer_mismatch) -- checked here, before any weights
    load, with the student's tokenizer from model.path (the embedded tiny model's when unset)."""
    from algorithms.teacher import TeacherModelOptions

    algo = cfg.algo
    if not isinstance(algo, TeacherModelOptions) or algo.teacher_path is None:
        return
    if algo.teacher_dtype is None:
        algo.teacher_dtype = cfg.model.dtype
    problem = cfg.data.reference_problem() if algo.teacher_reads_references() else None
    if problem is not None:
        raise ValueError(f"algo {cfg.algo.name} reads reference solutions here (algo.lmbda < 1 trains on them, "
                         f"algo.teacher_context=reference shows them to the teacher), but {problem}")
    teacher_dir = os.path.expanduser(algo.teacher_path)
    positions = _config_value(teacher_dir, "max_position_embeddings")
    if isinstance(positions, int) and cfg.data.max_length is not None and positions < cfg.data.max_length:
        raise ValueError(f"algo.teacher_path={algo.teacher_path} has {positions} positions, fewer than data.max_length="
                         f"{cfg.data.max_length}: the teacher must read every training row")
    student_dir = os.path.expanduser(cfg.model.path) if cfg.model.path is not None else None
    if student_dir is not None and not os.path.isdir(student_dir):
        return  # a hub id: its tokenizer is compared with the teacher's where it loads
    from transformers import AutoTokenizer

    from models.prompts import tokenizer_mismatch
    from models.tokenizer import build_char_tokenizer

    if os.path.exists(os.path.join(teacher_dir, "adapter_config.json")) and tokenizer_problem(teacher_dir) is not None:
        return  # an adapter dir without its own tokenizer: the base's, compared where it loads
    student = AutoTokenizer.from_pretrained(student_dir) if student_dir else build_char_tokenizer()
    why = tokenizer_mismatch(student, AutoTokenizer.from_pretrained(teacher_dir))
    if why is not None:
        raise ValueError(f"algo.teacher_path={algo.teacher_path} does not share the student's tokenizer "
                         f"({cfg.model.path or 'the embedded tiny model'}): {why}; the teacher must score the "
                         "student's token ids (distillation across tokenizers is not done)")


def _config_value(path: str, key: str) -> Any:
    """`key` of the model dir's config.json (a multimodal config's text_config too), or None."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config.get(key, (config.get("text_config") or {}).get(key))


def _validate_chat_template(cfg: TrainConfig) -> None:
    """data.chat_template=true (normalised by the task config's validate) refused up front where the model's
    tokenizer has no template."""
    if cfg.data.chat_template != "true":
        return
    if cfg.model.path is None:
        raise ConfigError("data.chat_template=true: the embedded tiny model's tokenizer has no chat template "
                          "(use a model=hf model.path=DIR whose tokenizer has one)")
    path = os.path.expanduser(cfg.model.path)
    if os.path.isdir(path) and not _has_chat_template_file(path):
        raise ConfigError(f"data.chat_template=true: the tokenizer in model.path={cfg.model.path} has no chat template "
                          "(use data.chat_template=auto or false)")


def _has_chat_template_file(path: str) -> bool:
    """Whether a local model dir's tokenizer files carry a chat template (a .jinja file or the config key)."""
    import json

    if os.path.exists(os.path.join(path, "chat_template.jinja")) or os.path.exists(
            os.path.join(path, "chat_template.json")):
        return True
    if os.path.exists(os.path.join(path, "adapter_config.json")) and not os.path.exists(
            os.path.join(path, "tokenizer_config.json")):
        return True  # an adapter dir without its own tokenizer: the base's, checked when it loads
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            return bool(json.load(fh).get("chat_template"))
    except (OSError, ValueError):
        return False


def to_dict(cfg: TrainConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out["algo"] = dataclasses.asdict(cfg.algo) if dataclasses.is_dataclass(cfg.algo) else cfg.algo
    return out
