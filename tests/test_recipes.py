"""configs/recipe/: one file per paper's headline setup (`python train.py +recipe=NAME model.path=DIR
data.path=FILE`). Every recipe file is found by globbing the directory, so a new one is covered by every
test here: it composes through load_config, its own values reach the config (a command-line value still
wins), it is listed in docs/recipes.md, and it trains one step on CPU with the tiny model in place of the
real one (and a small file written in the recipe's own data fields in place of the user's)."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT, TINY
from trainer.config import ConfigError, available_recipes, load_config, recipe_algo, to_dict

RECIPES = sorted(p.stem for p in (ROOT / "configs" / "recipe").glob("*.yaml"))
ALGOS = sorted(p.stem for p in (ROOT / "configs" / "algo").glob("*.yaml"))

# A real model's and a user file's stand-ins for composition only: a hub id is accepted without a download
# (nothing is fetched at config time), and data.path is not opened until the run loads its data.
REAL = ["model.path=org/model", "data.path=train.jsonl"]

# The smoke run: the tiny model at random init with conftest's small sizes, but 4 layers (SEED's drafter is
# the top 2 of them and needs more below), and the smallest step: 2 prompts, 8 new tokens, 2 eval problems.
SMOKE = [*(o for o in TINY if o.startswith("model.") and not o.startswith("model.num_layers")),
         "model=tiny_init", "model.num_layers=4",
         "trainer.max_steps=1", "trainer.batch_size=2", "trainer.micro_batch_size=2", "trainer.max_new_tokens=8",
         "trainer.eval_examples=2", "trainer.eval_max_new_tokens=8", "trainer.eval_every=1000",
         "trainer.save_every=1000", "trainer.warmup_steps=0", "trainer.resume=never",
         "logging.wandb=false", "logging.progress=false"]


def _load(*overrides: str):
    from algorithms import config_schemas

    return load_config(list(overrides), config_schemas())


def recipe_keys(name: str) -> dict:
    """The values configs/recipe/NAME.yaml sets itself, flattened (`trainer.lr`, ...; lists kept whole)."""
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "recipe" / f"{name}.yaml"))
    raw.pop("defaults", None)

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    return flat(raw)


def flat_config(cfg) -> dict:
    out = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(to_dict(cfg))
    return out


def test_the_recipe_directory_is_what_load_config_offers():
    assert RECIPES and RECIPES == available_recipes()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_for_a_real_model_and_implies_its_algorithm(name):
    algo = recipe_algo(name)
    assert algo in ALGOS
    cfg = _load(f"+recipe={name}", *REAL)  # no +algo: the recipe selects it
    assert cfg.algo.name == algo
    assert cfg.model.name == "hf" and cfg.model.path == "org/model"
    assert cfg.data.name in ("text", "clm") and cfg.data.chat_template == "auto"
    assert cfg.output_dir == f"outputs/{name}"
    assert "trainer.lr" not in cfg.defaulted  # every recipe states its learning rate


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_values_reach_the_config(name):
    cfg = flat_config(_load(f"+recipe={name}", *REAL))
    own = {k: v for k, v in recipe_keys(name).items() if k not in ("model.path", "data.path")}
    assert own, f"{name} sets nothing"
    assert {k: cfg[k] for k in own} == own


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_needs_the_model_path(name):
    with pytest.raises(ConfigError, match=r"model=hf needs model\.path="):
        _load(f"+recipe={name}", "data.path=train.jsonl")


def test_opsd_recipe_carries_the_papers_setup():
    # Independent of the file: the OPSD paper's Qwen3-1.7B run (LoRA rank 64 / alpha 128 at lr 2e-4, fixed
    # teacher, JSD beta 0.5, temperature 1.1, top-p 0.95, 2048-token rollouts, 8 GPUs x 2 x 2 = 32 prompts).
    cfg = _load("+recipe=opsd_qwen3_1.7b", *REAL)
    assert cfg.trainer.lr == 2e-4 and cfg.trainer.batch_size == 32 and cfg.trainer.max_new_tokens == 2048
    a = cfg.algo
    assert (a.lora_rank, a.lora_alpha, a.teacher, a.beta, a.temperature, a.top_p) == (64, 128.0, "fixed", 0.5, 1.1, 0.95)
    assert cfg.model.dtype == "bfloat16" and cfg.data.solution_field == "solution"


def test_command_line_values_override_the_recipe():
    cfg = _load("+recipe=opsd_qwen3_1.7b", *REAL, "trainer.lr=1e-5", "algo.teacher=ema", "output_dir=runs/x")
    assert (cfg.trainer.lr, cfg.algo.teacher, cfg.output_dir) == (1e-5, "ema", "runs/x")
    assert cfg.algo.lora_rank == 64  # the rest of the recipe stays


def test_a_matching_algo_argument_is_accepted():
    cfg = _load("+recipe=opsd_qwen3_1.7b", "+algo=opsd", *REAL)
    assert cfg.algo.name == "opsd" and cfg.algo.lora_rank == 64


@pytest.mark.parametrize("args,expected", [
    (["+recipe=opsd_qwen3_1.7b", "+algo=mass"],
     "+algo=mass conflicts with +recipe=opsd_qwen3_1.7b, which trains algo opsd: drop +algo=mass (a recipe "
     "selects its algorithm), or drop the recipe"),
    (["+algo=mass", "+recipe=opsd_qwen3_1.7b"], "+algo=mass conflicts with +recipe=opsd_qwen3_1.7b"),
    (["+recipe=opsd_qwen3_1.7b", "algo=grpo"], "algo=grpo conflicts with +recipe=opsd_qwen3_1.7b"),
    (["+recipe=nope"], "unknown recipe 'nope' (available: "),
    (["+recipe=opsd_qwen3_1.7b", "+recipe=mass_qwen3_1.7b"], "one recipe per run"),
    (["recipe=opsd_qwen3_1.7b"], "select a recipe with +recipe=NAME"),
])
def test_recipe_errors_are_one_line(args, expected):
    with pytest.raises(ConfigError) as err:
        _load(*args, *REAL)
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_no_algorithm_and_no_recipe_names_both():
    with pytest.raises(ConfigError, match=r"add \+algo=NAME .* or \+recipe=NAME \(available: .*opsd_qwen3_1\.7b"):
        _load("trainer.max_steps=3")


def test_docs_list_every_recipe():
    table = (ROOT / "docs" / "recipes.md").read_text()
    missing = [n for n in RECIPES if f"`{n}`" not in table or f"+recipe={n}" not in table]
    assert not missing, f"docs/recipes.md does not list {missing}"
    for page in (ROOT / "docs" / "README.md", ROOT / "README.md"):
        assert "recipes.md" in page.read_text(), page


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_header_states_the_papers_figure_and_hardware(name):
    head = (ROOT / "configs" / "recipe" / f"{name}.yaml").read_text().split("defaults:")[0]
    assert head.startswith("# @package _global_\n")
    for part in ("Expected figure:", "Hardware:", f"+recipe={name}"):
        assert part in head, f"{name}: no '{part}' in the header comment"


def _write_rows(cfg, path, n: int) -> None:
    """A small JSONL in the recipe's own field names (lowercase, inside the tiny tokenizer's alphabet); rows
    carry an artifacts list, which attuner needs and the other algorithms place before the question."""
    d = cfg.data
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            a, b = 10 + i, 3 + i % 5
            row = {d.question_field: f"tom has {a} apples. he gets {b} more. how many apples?"}
            solution = f"{a}+{b}={a + b}\n#### {a + b}"
            if d.solution_field:
                row[d.solution_field] = solution
            if d.answer_field and d.answer_field != d.solution_field:
                row[d.answer_field] = str(a + b)
            if d.artifacts_field:
                row[d.artifacts_field] = [f"apples: {a}", f"more: {b}"]
            fh.write(json.dumps(row) + "\n")


@pytest.mark.slow  # one training step per recipe: ~1-4 s each
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_one_step_on_the_tiny_model(tmp_path, name):
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    user_file = _load(f"+recipe={name}", *REAL).data.name == "text"  # else its own task (clm: synthetic episodes)
    # a user file's rows are written below; clm's synthetic episodes are sized here
    files = [f"data.path={train}", f"data.test_path={test}"] if user_file else ["data.n_train=64", "data.n_test=8"]
    cfg = _load(f"+recipe={name}", *SMOKE, f"output_dir={tmp_path / 'run'}", *files)
    if user_file:
        _write_rows(cfg, train, 16)
        _write_rows(cfg, test, 4)
    assert cfg.algo.name == recipe_algo(name) and cfg.model.path is None
    session = build_session(cfg, World())
    try:
        assert fit(session) == "done"
    finally:
        session.tracker.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1]
    assert [r["step"] for r in records if r["split"] == "eval"][:1] == [0]


@pytest.mark.slow  # one evaluation of the tiny model: ~1 s
def test_evaluate_reads_a_recipe(tmp_path, capsys):
    import evaluate

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    args = ["+recipe=opsd_qwen3_1.7b", *SMOKE, f"data.path={train}", f"data.test_path={test}"]
    cfg = _load(*args)
    _write_rows(cfg, train, 16)
    _write_rows(cfg, test, 4)
    assert evaluate.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["n"] == 2 and 0.0 <= result["accuracy"] <= 1.0
