"""The CLI/config surface: bad input fails fast with one clear line, before output_dir is touched;
every YAML composes; the algorithm registry matches configs/algo/. (Every key listed with its default:
tests/test_config_yaml.py.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_config

BAD_INPUTS = [
    (["+algo=sft", "trainer.max_stepz=3"], "max_stepz"),
    (["+algo=nope"], "unknown algorithm 'nope' (available: attuner, clm, distill, grpo, mass, opsd, qad, seed, sft, skipper, tesd)"),
    (["trainer.max_steps=3"], "no algorithm selected"),
    (["+algo=sft", "trainer.max_steps=abc"], "trainer.max_steps=abc"),
    (["+algo=sft", "trainer.lr=-1"], "trainer.lr"),
    (["+algo=sft", "model.path=/no/such/model"], "model.path=/no/such/model"),
    (["+algo=sft", "model=hf"], "model=hf needs model.path"),
    (["+algo=sft", "algo.bogus=1"], "unknown key algo.bogus: algo sft has no key 'bogus' (its keys: name, "),
    (["+algo=sft", "backend=nope"], "backend=nope: no such option (available: auto, ddp, deepspeed, fsdp, single)"),
    (["+algo=sft", "data=text", "data.path=x.jsonl", "data.on_bad_row=maybe"], "data.on_bad_row=maybe"),
    # each task validates only its own keys: arith's digits is unknown to the artifacts task attuner runs on
    (["+algo=attuner", "data.digits=3"], "unknown key data.digits: data=artifacts has no key 'digits' (its keys: "),
    (["+algo=sft", "data.name=clm"], "data.name=clm: select the task with data=clm"),
    (["+algo=seed", "backend=fsdp"], "backend=fsdp: algo seed does not run under FSDP2"),
    (["+algo=sft", "model.dtype=float16", "backend=fsdp"], "model.dtype=float16 needs loss scaling, which backend=fsdp"),
    (["+algo=sft", "model.dtype=float16", "backend=deepspeed"], "model.dtype=float16 needs loss scaling, which backend=deepspeed"),
    (["+algo=sft", "model.dtype=fp8"], "model.dtype=fp8 is not one of float32, bfloat16, float16"),
    (["+algo=skipper", "algo.target_skip=1.0"], "algo.target_skip=1.0 must be in [0, 1)"),
    (["+algo=skipper", "algo.target_skip=-0.1"], "algo.target_skip=-0.1 must be in [0, 1)"),
    (["+algo=skipper", "algo.gate=nope"], "algo.gate=nope is not one of soft, hard"),
    (["+recipe=opsd_qwen3_1.7b", "+algo=mass"], "+algo=mass conflicts with +recipe=opsd_qwen3_1.7b, which trains algo opsd"),
    (["+recipe=nope"], "unknown recipe 'nope' (available: "),
]


# Importing any of these means the run got past configuration: the model loader / warm start, the
# process group, the training loop, tracking. A config error must stop before all of them -- that is
# what makes it fail fast (a wall-clock bound would measure the shared machine instead).
HEAVY_MODULES = ("trainer.setup", "trainer.loop", "trainer.distributed", "trainer.warm_start", "models.loading",
                 "transformers", "wandb", "deepspeed")

# `python train.py ARGS` exactly (run as __main__), plus a record of the modules imported by exit.
RECORDING_RUNNER = (
    "import atexit, json, runpy, sys\n"
    "record, script, *args = sys.argv[1:]\n"
    "atexit.register(lambda: open(record, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "sys.argv = [script, *args]\n"
    "runpy.run_path(script, run_name='__main__')\n"
)


@pytest.mark.slow  # one fresh interpreter per case (~3-7 s each on the shared 2-core box)
@pytest.mark.parametrize("args,expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_fails_fast_with_one_line(tmp_path, subprocess_env, args, expected):
    out, record = tmp_path / "run", tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", RECORDING_RUNNER, str(record), str(ROOT / "train.py"), *args,
                           f"output_dir={out}"], capture_output=True, text=True, env=subprocess_env, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip() and "WARNING" not in l]
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0], lines[0]
    assert lines[0].startswith("config error: "), lines[0]  # the one-line ConfigError, not a traceback
    assert not out.exists(), "nothing may be written to output_dir on a config error"
    imported = set(json.loads(record.read_text()))
    assert not imported & set(HEAVY_MODULES), f"got past configuration: imported {sorted(imported & set(HEAVY_MODULES))}"


@pytest.mark.parametrize("args,expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_raises_one_line_config_error(tmp_path, args, expected):
    """The same inputs in-process (the fast tier's check of the messages): one line, nothing written."""
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        load_config([*args, f"output_dir={out}"], config_schemas())
    message = str(info.value)
    assert "\n" not in message and expected in message, message
    assert not out.exists()


def test_missing_model_dir_without_config_json(tmp_path):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="no config.json"):
        tiny_config(tmp_path / "o", f"model.path={tmp_path}")


def test_registry_matches_config_files():
    from algorithms import REGISTRY

    files = sorted(p.stem for p in (ROOT / "configs" / "algo").glob("*.yaml"))
    assert sorted(REGISTRY) == files


@pytest.mark.parametrize("group", ["model", "data", "backend", "logging", "trainer"])
def test_every_yaml_composes(tmp_path, group):
    from trainer.config import compose

    for option in sorted((ROOT / "configs" / group).glob("*.yaml")):
        extra = {"hf": ["model.path=x/y"], "text": ["data.path=some.jsonl"]}.get(option.stem, [])
        cfg = compose(["+algo=sft", f"{group}={option.stem}", *extra])
        assert cfg[group] is not None


def test_typed_values_reach_dataclasses(tmp_path):
    cfg = tiny_config(tmp_path, "trainer.max_steps=7", "algo.reference_fraction=0.25")
    assert cfg.trainer.max_steps == 7 and isinstance(cfg.trainer.lr, float)
    assert cfg.algo.reference_fraction == 0.25 and cfg.algo.name == "sft"
    assert cfg.model.hidden_size == 64


@pytest.mark.parametrize("override,message", [
    ("trainer.activations=all", "trainer.activations=all is not one of none, checkpoint, hilore"),
    ("trainer.activation_memory_budget=0.9", "trainer.activation_memory_budget=0.9 must be >= 1.0"),
    ("trainer.activation_compress=int4", "trainer.activation_compress=int4 is not one of int8, fp8"),
])
def test_activation_keys_are_checked(tmp_path, override, message):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, override, algo="grpo")


@pytest.mark.parametrize("override", ["trainer.max_new_tokens=0", "trainer.eval_examples=0",
                                      "trainer.eval_max_new_tokens=0", "trainer.max_new_tokens=-3"])
def test_sizes_that_make_a_run_meaningless_are_refused(override):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}={value} must be > 0$"):
        load_config(["+algo=grpo", override], config_schemas())


def test_model_path_takes_a_model_or_an_adapter_directory(tmp_path):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "tokenizer.json").write_text("{}")  # exports save the tokenizer beside the adapter
    assert load_config(["+algo=sft", "model=hf", f"model.path={adapter}"], config_schemas()).model.path == str(adapter)
    with pytest.raises(ConfigError, match="no config.json or adapter_config.json there"):
        load_config(["+algo=sft", "model=hf", f"model.path={tmp_path}"], config_schemas())


def test_model_path_without_a_tokenizer_is_a_config_error_naming_it(tmp_path):
    """A model dir with config.json but no tokenizer file fails at config time with one line naming
    model.path (the loaders would say to install sentencepiece / tiktoken)."""
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"^model.path={model}: {model} has no tokenizer \(none of tokenizer.json") as err:
        load_config(["+algo=sft", "model=hf", f"model.path={model}"], config_schemas())
    assert "\n" not in str(err.value)
    for adapter in (False, True):  # an adapter dir is read the same way: its tokenizer is loaded from it
        (model / "config.json").unlink(missing_ok=True)
        (model / ("adapter_config.json" if adapter else "config.json")).write_text("{}")
        with pytest.raises(ConfigError, match="has no tokenizer"):
            load_config(["+algo=sft", "model=hf", f"model.path={model}"], config_schemas())
    (model / "tokenizer_config.json").write_text("{}")
    assert load_config(["+algo=sft", "model=hf", f"model.path={model}"], config_schemas()).model.path == str(model)


# --- the warm-start task -------------------------------------------------------------------------

# Today's arith recipe, written out by hand: its hash names the existing cache entries, which must be reused.
ARITH_RECIPE = {"version": 2, "spec": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
                "seed": 0, "steps": 300, "lr": 0.003, "batch_size": 64, "reference_fraction": 0.5,
                "data": {"seed": 0, "n_train": 20000, "n_test": 200, "digits": 2, "steps": 2, "ops": ["+", "-"]}}


def _arith_entry() -> str:
    import hashlib
    import os

    from trainer.config import DEFAULT_CACHE

    return os.path.join(os.path.expanduser(DEFAULT_CACHE), "tiny-" + hashlib.sha256(
        json.dumps(ARITH_RECIPE, sort_keys=True).encode()).hexdigest()[:12])


def test_the_arith_warm_start_recipe_and_entry_are_unchanged(monkeypatch):
    from algorithms import config_schemas
    from trainer import default_model
    from trainer.config import ModelConfig, load_config

    monkeypatch.delenv("POSTTRAIN_CACHE", raising=False)
    assert _arith_entry().endswith("tiny-0e55b5e22a46")  # the name of the entries built before this change
    for args in ([], ["data=text", "data.path=x.jsonl"], ["data=artifacts", "model.warm_start_task=arith"]):
        m = load_config(["+algo=sft", *args], config_schemas()).model
        assert m.warm_start_task == "arith" and default_model.recipe(m) == ARITH_RECIPE
        assert default_model.cache_path(m) == _arith_entry()
    assert default_model.cache_path(ModelConfig(warm_start_steps=300)) == _arith_entry()  # auto outside load_config


def test_data_artifacts_warm_starts_on_artifacts(monkeypatch):
    from algorithms import config_schemas
    from trainer import default_model
    from trainer.config import load_config

    monkeypatch.delenv("POSTTRAIN_CACHE", raising=False)
    m = load_config(["+algo=sft", "data=artifacts"], config_schemas()).model
    numbers = default_model.WARM_NUMBERS["artifacts"]
    assert m.warm_start_task == "artifacts" and m.warm_start_steps == numbers["steps"]
    assert (m.warm_start_lr, m.warm_start_batch_size, m.warm_start_reference_fraction) == (
        numbers["lr"], numbers["batch_size"], numbers["reference_fraction"])
    r = default_model.recipe(m)
    assert r["task"] == "artifacts" and r["data"] == default_model.WARM_DATA_ARTIFACTS
    assert default_model.cache_path(m) != _arith_entry()
    # evaluate.py loads its config the same way (algo replaced by sft): the same entry as train.py's
    evaluating = load_config(["data=artifacts", "+algo=sft"], config_schemas()).model
    assert default_model.cache_path(evaluating) == default_model.cache_path(
        load_config(["+algo=grpo", "data=artifacts"], config_schemas()).model)
    assert load_config(["+algo=sft", "data=artifacts", "model.warm_start_steps=7"],
                       config_schemas()).model.warm_start_steps == 7  # a given number wins over the recipe's
    assert load_config(["+algo=sft", "data=artifacts", "model=tiny_init"], config_schemas()).model.warm_start_steps == 0


def test_bad_warm_start_task_is_one_line():
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^model.warm_start_task=gsm8k is not one of auto, arith, multipath, artifacts, clm$"):
        load_config(["+algo=sft", "model.warm_start_task=gsm8k"], config_schemas())


# --- trainer.lr: resolved when unset ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small pretrained-model directory (random Qwen3 + the char tokenizer), as model=hf reads it."""
    from models.loading import random_qwen3
    from models.tokenizer import build_char_tokenizer

    path = tmp_path_factory.mktemp("hf")
    tok = build_char_tokenizer()
    random_qwen3(len(tok), hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64).save_pretrained(path)  # seed: a drafter in the top 2 of 4
    tok.save_pretrained(path)
    return str(path)


def _lr(*args):
    from algorithms import config_schemas
    from trainer.config import load_config

    cfg = load_config(list(args), config_schemas())
    return cfg.trainer.lr, cfg.defaulted


@pytest.mark.parametrize("algo,expected", [("sft", 1e-3), ("opsd", 3e-4), ("mass", 3e-4), ("tesd", 3e-4), ("grpo", 3e-5), ("skipper", 3e-3),
                                           ("attuner", 5e-3)])
def test_unset_lr_on_the_tiny_model_keeps_its_tuned_value(algo, expected):
    lr, defaulted = _lr(f"+algo={algo}")
    assert lr == expected and "trainer.lr" in defaulted  # the values the algo YAMLs used to set


@pytest.mark.parametrize("args,expected", [
    (["+algo=sft"], 1e-5),  # full fine-tuning
    (["+algo=opsd"], 1e-5),
    (["+algo=seed"], 1e-5),  # seed and qad train every weight
    (["+algo=qad"], 1e-5),
    (["+algo=opsd", "algo.lora_rank=8"], 1e-4),  # LoRA adapters only
    (["+algo=grpo", "algo.lora_rank=16"], 1e-4),
    (["+algo=skipper"], 1e-4),  # new routers + adapters on a frozen base
    (["+algo=attuner", "data=artifacts"], 5e-4),  # q_proj LoRA; the value docs/attuner.md measured on SmolLM2
])
def test_unset_lr_on_a_pretrained_model_is_safe(hf_dir, args, expected):
    lr, defaulted = _lr(*args, "model=hf", f"model.path={hf_dir}")
    assert lr == expected
    assert defaulted["trainer.lr"].startswith("a pretrained model")


@pytest.mark.parametrize("algo,expected", [("sft", 1e-3), ("opsd", 3e-4), ("grpo", 3e-5)])
def test_the_default_models_own_cache_entry_as_model_path_keeps_the_tiny_rates(hf_dir, tmp_path, algo, expected):
    """model.path naming a cache entry of the embedded default (warm_start.json marks one) is the same model
    as no model.path: the same default rates, not the pretrained 1e-5 (benchmarks pass the entry's path)."""
    import shutil

    from trainer.default_model import DONE

    entry = tmp_path / "tiny-entry"
    shutil.copytree(hf_dir, entry)
    assert _lr(f"+algo={algo}", "model=hf", f"model.path={entry}")[0] == 1e-5  # no marker: a pretrained model
    (entry / DONE).write_text("{}")
    lr, defaulted = _lr(f"+algo={algo}", "model=hf", f"model.path={entry}")
    assert lr == expected and "its cache entry" in defaulted["trainer.lr"]


def test_lora_trait_marks_the_configs_with_lora_keys():
    from algorithms import config_schemas
    from models.lora import LoRAOptions

    for name, schema in config_schemas().items():  # default_lr reads algo.lora_rank only where declared
        assert schema.traits.lora == issubclass(schema, LoRAOptions), name


@pytest.mark.parametrize("args", [["+algo=sft"], ["+algo=opsd", "algo.lora_rank=8"], ["+algo=skipper"]])
def test_a_user_set_lr_is_kept(hf_dir, args):
    assert _lr(*args, "model=hf", f"model.path={hf_dir}", "trainer.lr=2e-3") == (2e-3, {})
    assert _lr(*args, "trainer.lr=7e-4") == (7e-4, {})  # and on the tiny model


def test_the_resolved_lr_reaches_the_optimizer_and_is_printed(hf_dir, tmp_path, capsys):
    from trainer.distributed import World
    from trainer.setup import build_session

    cfg = tiny_config(tmp_path / "run", "model=hf", f"model.path={hf_dir}", "trainer.lr=null")
    session = build_session(cfg, World())
    assert [g["initial_lr"] for g in session.backend.optimizer.param_groups] == [1e-5]  # the schedule's peak
    assert "trainer.lr: 1e-05 (unset: the default for a pretrained model, full fine-tuning)" in capsys.readouterr().out


@pytest.mark.slow  # one fresh interpreter: ~5 s
def test_backend_deepspeed_without_deepspeed_installed_is_one_config_line(tmp_path, subprocess_env):
    """DeepSpeed is a test and gpu extra, not a dependency: asking for it where it is not installed is a config
    error (exit 2) naming how to install it, before anything is written. The test hides the installed one."""
    runner = ("import runpy, sys\n"
              "sys.modules['deepspeed'] = None  # importlib.util.find_spec('deepspeed') is None: not installed\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", runner, str(ROOT / "train.py"), "+algo=sft", "backend=deepspeed",
                           "backend.zero_stage=2", f"output_dir={out}"], capture_output=True, text=True,
                          env=subprocess_env, cwd=tmp_path, timeout=120)
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip() and "WARNING" not in l]
    assert proc.returncode == 2 and lines == ["config error: backend=deepspeed: DeepSpeed is not installed (pip "
                                              "install deepspeed, or the project's gpu extra: pip install -e '.[gpu]')"]
    assert not out.exists()
