"""configs/ documents every key: each algo YAML and trainer/default.yaml list every field of their
dataclass with its default, the other groups' full-listing files likewise, and composing the YAML
tree changes no default except the deliberate overrides listed (with their reasons) below.

The kinds of file (full listing vs option) are described in docs/README.md. Recipes (configs/recipe/*.yaml)
are a third kind: the values of a paper's setup on top of an algorithm, each value with a comment saying whose
it is; their keys are checked by composing them through the typed schema (tests/test_recipes.py)."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tasks import TASK_CONFIGS
from trainer.config import BackendConfig, LoggingConfig, ModelConfig, TrainConfig, TrainerConfig

CONFIGS = ROOT / "configs"

# Every value a composed `+algo=NAME` config holds that is not its dataclass default, per algorithm.
# Anything else that differs from a default is a documentation error (the YAML disagrees with the
# dataclass), and so is an entry here that no longer differs.
COMMON_OVERRIDES = {
    # configs/model/tiny.yaml: the embedded default is warm-started (ModelConfig's 0 = random init,
    # which is what model=tiny_init selects). Its null warm-start numbers and `auto` task are resolved
    # by load_config from the run's data (arith here) to that task's recipe (default_model.WARM_NUMBERS).
    "model.warm_start_steps": 300,
    "model.warm_start_task": "arith",
    "model.warm_start_lr": 3e-3,
    "model.warm_start_batch_size": 64,
    "model.warm_start_reference_fraction": 0.5,
}
# trainer.lr is null in the YAML and the dataclass and resolved by load_config (trainer/config.py::default_lr):
# on the embedded tiny model to 1e-3 or the algorithm's Traits.tiny_lr, so every entry lists it.
ALGO_OVERRIDES = {
    "sft": {"trainer.lr": 1e-3},
    # opsd/mass/tesd: 3e-4 on the embedded default (the learning-rate sweep's best without an early dip,
    # docs/self_distill.md section 4); opsd and mass share one 200-step budget, evals/checkpoints every 50.
    "opsd": {"trainer.lr": 3e-4, "trainer.max_steps": 200},
    "mass": {"trainer.lr": 3e-4, "trainer.max_steps": 200},
    "tesd": {"trainer.lr": 3e-4},
    # distill: the teacher is required (the test names a local one); its dtype resolves to model.dtype; the
    # learning rate is the swept best at the default 100 steps on the embedded default (docs/distill.md)
    "distill": {"algo.teacher_path": "TEACHER", "algo.teacher_dtype": "float32", "trainer.lr": 3e-4},
    # grpo: trainer.batch_size counts prompts, 8 prompts x 8 completions; lr 3e-5 (1e-4 collapsed without KL).
    "grpo": {"trainer.batch_size": 8, "trainer.lr": 3e-5},
    # seed: a starting value for full fine-tuning of the tiny default (untuned).
    "seed": {"trainer.lr": 3e-4},
    # qad: a starting value for distilling the tiny default into its fake-quant copy.
    "qad": {"trainer.lr": 3e-4},
    # skipper: measured on the tiny default (routers + adapters only): 3e-3 tracks the skip target with
    # a lower KL than 1e-3 in 100 steps; 1e-2 overshoots.
    "skipper": {"trainer.lr": 3e-3},
    # attuner: q_proj LoRA only, measured on the tiny model (docs/attuner.md); its own task (configs/algo/
    # attuner.yaml selects data=artifacts), so the warm start is the artifacts recipe (plain SFT, 3000 steps).
    "attuner": {"model.warm_start_task": "artifacts", "model.warm_start_steps": 3000, "model.warm_start_batch_size": 32,
                "model.warm_start_reference_fraction": 0.0, "trainer.lr": 5e-3},
    # clm: its own task (configs/algo/clm.yaml selects data=clm), so the warm start is the clm recipe
    # (SFT on the scripted calls); lr 1e-4 (0.17 -> 0.15 held-out in 40 steps, 3e-5 0.13, 5e-4 collapsed:
    # docs/clm.md), 4 tasks x 8 episodes per step, per-call completions that hold the longest scripted output.
    "clm": {"model.warm_start_task": "clm", "model.warm_start_steps": 2000, "model.warm_start_batch_size": 32,
            "model.warm_start_reference_fraction": 0.0, "trainer.lr": 1e-4, "trainer.batch_size": 4, "trainer.micro_batch_size": 32,
            "trainer.max_new_tokens": 72, "trainer.eval_max_new_tokens": 72, "trainer.eval_examples": 100},
}
# Option files of the other groups: the values they set that differ from the dataclass default.
GROUP_OVERRIDES = {
    ("model", "tiny"): {"warm_start_steps": None},  # null = the warm-start task's recipe (see COMMON_OVERRIDES)
    ("model", "tiny_init"): {"name": "tiny_init"},
    ("model", "hf"): {"name": "hf"},
    ("backend", "single"): {"name": "single"},
    ("backend", "ddp"): {"name": "ddp"},
    ("backend", "fsdp"): {"name": "fsdp"},
    ("backend", "deepspeed"): {"name": "deepspeed", "zero_stage": 2},  # ZeRO-2 unless backend.zero_stage says
}
SCHEMAS = {"model": ModelConfig, "backend": BackendConfig, "logging": LoggingConfig, "trainer": TrainerConfig}
# Files that must list every field of their group's dataclass (the others set only what differs;
# each data/NAME.yaml lists every field of its task's own config, see test_data_files_list_their_task_config).
FULL_LISTINGS = [("trainer", "default"), ("logging", "default"), ("backend", "auto"), ("model", "tiny")]


@pytest.fixture(autouse=True)
def _no_cache_env(monkeypatch):
    # model.cache_dir reads $POSTTRAIN_CACHE when set; compare against the built-in default.
    monkeypatch.delenv("POSTTRAIN_CACHE", raising=False)


def field_defaults(cls: type) -> dict:
    """{field: default} of a dataclass (ClassVars are not fields)."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def yaml_keys(path) -> dict:
    """The keys a YAML file itself sets (resolved; `defaults` lists excluded)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    raw.pop("defaults", None)
    return raw


def algo_section(name: str) -> dict:
    """configs/algo/NAME.yaml's algorithm keys (`algo:` under `# @package _global_`, else the file)."""
    raw = yaml_keys(CONFIGS / "algo" / f"{name}.yaml")
    return raw["algo"] if "algo" in raw else raw


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def algorithms() -> list[str]:
    from algorithms import REGISTRY

    return sorted(REGISTRY)


@pytest.mark.parametrize("name", algorithms())
def test_algo_yaml_lists_every_field_with_its_default(name):
    from algorithms import config_schemas

    defaults = field_defaults(config_schemas()[name])
    listed = algo_section(name)
    assert set(listed) == set(defaults), (f"configs/algo/{name}.yaml: missing {sorted(set(defaults) - set(listed))}, "
                                          f"unknown {sorted(set(listed) - set(defaults))}")
    wrong = {k: (listed[k], defaults[k]) for k in defaults if listed[k] != defaults[k]}
    assert not wrong, f"configs/algo/{name}.yaml disagrees with the dataclass (yaml, default): {wrong}"


@pytest.mark.parametrize("name", algorithms())
def test_composed_config_equals_the_defaults_except_deliberate_overrides(tmp_path, name):
    from algorithms import config_schemas
    from trainer.config import load_config, to_dict

    required = []
    if name == "distill":  # a key without a default: a teacher with the embedded model's tokenizer
        from models.loading import TinySpec, build_tiny

        model, tok = build_tiny(TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), seed=0)
        model.save_pretrained(tmp_path / "teacher")
        tok.save_pretrained(tmp_path / "teacher")
        required = [f"algo.teacher_path={tmp_path / 'teacher'}"]
    overrides = {k: (str(tmp_path / "teacher") if v == "TEACHER" else v) for k, v in ALGO_OVERRIDES[name].items()}
    cfg = load_config([f"+algo={name}", *required], config_schemas())
    composed = flat(to_dict(cfg))
    task = TASK_CONFIGS[cfg.data.name]  # the algorithm's task (configs/algo/NAME.yaml may select one)
    expected = flat(to_dict(TrainConfig(data=task(), algo=config_schemas()[name]())))
    # configs/train.yaml: one output directory per algorithm (the dataclass default is outputs/run).
    expected["output_dir"] = f"outputs/{name}"
    expected.update(COMMON_OVERRIDES)
    expected.update(overrides)
    assert composed.keys() == expected.keys()
    diff = {k: (composed[k], expected[k]) for k in expected if composed[k] != expected[k]}
    assert not diff, f"+algo={name}: (composed, expected) {diff}"
    defaults = flat(to_dict(TrainConfig(data=task(), algo=config_schemas()[name]())))
    for key, value in {**COMMON_OVERRIDES, **overrides}.items():
        assert defaults.get(key) != value, f"{key}={value} is the default now: drop it from the allow-list"


def test_trainer_yaml_lists_every_field_with_its_default():
    listed, defaults = yaml_keys(CONFIGS / "trainer" / "default.yaml"), field_defaults(TrainerConfig)
    assert set(listed) == set(defaults), (f"missing {sorted(set(defaults) - set(listed))}, "
                                          f"unknown {sorted(set(listed) - set(defaults))}")
    assert {k: listed[k] for k in defaults} == defaults


@pytest.mark.parametrize("group,option", FULL_LISTINGS, ids=[f"{g}/{o}" for g, o in FULL_LISTINGS])
def test_full_listing_files_list_every_field(group, option):
    listed = yaml_keys(CONFIGS / group / f"{option}.yaml")
    assert set(listed) == set(field_defaults(SCHEMAS[group]))


OPTION_FILES = sorted((p.parent.name, p.stem) for g in SCHEMAS for p in (CONFIGS / g).glob("*.yaml"))


@pytest.mark.parametrize("group,option", OPTION_FILES, ids=[f"{g}/{o}" for g, o in OPTION_FILES])
def test_group_files_set_known_keys_to_defaults_or_listed_overrides(group, option):
    defaults = field_defaults(SCHEMAS[group])
    listed = yaml_keys(CONFIGS / group / f"{option}.yaml")
    assert set(listed) <= set(defaults), f"unknown keys {sorted(set(listed) - set(defaults))}"
    differs = {k: v for k, v in listed.items() if v != defaults[k]}
    assert differs == GROUP_OVERRIDES.get((group, option), {})


def test_data_files_are_the_registered_tasks():
    assert sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml")) == sorted(TASK_CONFIGS)


@pytest.mark.parametrize("task", sorted(TASK_CONFIGS))
def test_data_files_list_their_task_config(task):
    """configs/data/NAME.yaml lists every key of the task's own config with its default, and no other key."""
    listed, defaults = yaml_keys(CONFIGS / "data" / f"{task}.yaml"), field_defaults(TASK_CONFIGS[task])
    assert set(listed) == set(defaults), (f"configs/data/{task}.yaml: missing {sorted(set(defaults) - set(listed))}, "
                                          f"unknown {sorted(set(listed) - set(defaults))}")
    assert listed == defaults


RECIPE_FILES = sorted((CONFIGS / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.stem for p in RECIPE_FILES])
def test_recipe_files_comment_every_value(path):
    bare = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if line.lstrip().startswith("- ") or ":" not in code:
            continue  # the defaults list, comments, blank lines
        if code.split(":", 1)[1].strip() and "#" not in line:  # a value (not a section header) without a comment
            bare.append(f"line {n}: {line.strip()}")
    assert not bare, f"configs/recipe/{path.name}: values without a comment saying whose they are: {bare}"
