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
    (["+algo=nope"], "unknown algorithm 'nope' (available: attuner, grpo, mass, opsd, qad, seed, sft, skipper, tesd)"),
    (["trainer.max_steps=3"], "no algorithm selected"),
    (["+algo=sft", "trainer.max_steps=abc"], "trainer.max_steps=abc"),
    (["+algo=sft", "trainer.lr=-1"], "trainer.lr"),
    (["+algo=sft", "model.path=/no/such/model"], "model.path=/no/such/model"),
    (["+algo=sft", "model=hf"], "model=hf needs model.path"),
    (["+algo=sft", "algo.bogus=1"], "bogus"),
    (["+algo=sft", "backend=nope"], "backend/nope"),
    (["+algo=sft", "data.on_bad_row=maybe"], "data.on_bad_row=maybe"),
    (["+algo=seed", "backend=fsdp"], "backend=fsdp: algo seed does not run under FSDP2"),
    (["+algo=skipper", "algo.target_skip=1.0"], "algo.target_skip=1.0 must be in [0, 1)"),
    (["+algo=skipper", "algo.target_skip=-0.1"], "algo.target_skip=-0.1 must be in [0, 1)"),
    (["+algo=skipper", "algo.gate=nope"], "algo.gate=nope is not one of soft, hard"),
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
    assert load_config(["+algo=sft", "model=hf", f"model.path={adapter}"], config_schemas()).model.path == str(adapter)
    with pytest.raises(ConfigError, match="no config.json or adapter_config.json there"):
        load_config(["+algo=sft", "model=hf", f"model.path={tmp_path}"], config_schemas())
