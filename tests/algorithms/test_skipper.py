"""Layer skipper: the skip penalty and its gradient by hand, the losses against full-logit references,
forced routing against the base and a hand-built adapter-only path, training mechanics (what trains,
gradient accumulation), the export and its reload, bad input, and train.py / torchrun runs."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
import torch

from algorithms import losses
from algorithms.skipper import Skipper, SkipperConfig, skip_penalty
from models.loading import TinySpec, build_tiny
from models.skipper import (
    SkipperError, apply_skipper, forced, load_skipper, make_spec, record_gates, routed_layers, save_skipper,
)
from tests.algorithms.selfdistill_helpers import arith, ctx
from tests.conftest import ROOT, tiny_overrides, torchrun_train

SPEC = TinySpec(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)


def tiny(spec: TinySpec = SPEC, seed: int = 0):
    return build_tiny(spec, seed=seed)


def setup(**keys):
    """(algo, prepared model, an untouched copy of the base, tokenizer, task)."""
    model, tok = tiny()
    base = copy.deepcopy(model).eval()
    algo = Skipper(SkipperConfig(**keys))
    return algo, algo.prepare_model(model), base, tok, arith()


def randomize_adapters(model, seed: int = 1):
    """The adapters start with a zero output projection (a fresh skip adds nothing); give them weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for skipper in routed_layers(model).values():
            for p in skipper.adapter.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


# --- the penalty by hand ------------------------------------------------------------------------------------


def test_penalty_and_its_straight_through_gradient_by_hand():
    # two routed layers, one row of three tokens; token 0 is not a loss token
    g2 = torch.tensor([[0.9, 0.3, 0.6]], requires_grad=True)  # decisions (run = g > 0.5): 1 0 1
    g3 = torch.tensor([[0.2, 0.4, 0.7]], requires_grad=True)  # 0 0 1
    sel = torch.tensor([[False, True, True]])
    skip, pen = skip_penalty({2: g2, 3: g3}, sel, 0.25)
    # token 1 skips both layers (1.0), token 2 none (0.0)
    assert torch.equal(skip, torch.tensor([1.0, 0.0]))
    assert torch.allclose(pen, torch.tensor([0.5625, 0.0625])) and torch.isclose(pen.sum(), torch.tensor(0.625))
    pen.sum().backward()
    # d pen_t / d g_l(t) = 2 (skip_t - target) * d skip_t / d g = 2 (skip_t - 0.25) * (-1/2)
    expected = torch.tensor([[0.0, -0.75, 0.25]])
    assert torch.allclose(g2.grad, expected) and torch.allclose(g3.grad, expected)


def test_the_loss_adds_alpha_times_the_summed_penalty_over_the_normaliser():
    algo, model, _, tok, task = setup(alpha=0.0)
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    normaliser = torch.tensor(7.0)  # any global normaliser
    plain = algo.loss(model, batch, normaliser).loss
    algo.cfg.alpha = 2.5
    out = algo.loss(model, batch, normaliser)
    with torch.no_grad(), record_gates(model) as rec:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    sel = batch.loss_mask.bool()
    layers = sorted(rec.gates)
    assert layers == [2, 3]  # the upper half of 4 layers
    skipped = torch.stack([(rec.gates[i] <= 0.5).float()[sel] for i in layers], -1)  # (N, 2) by hand
    pen = ((skipped.mean(-1) - 0.25) ** 2).sum()
    assert torch.allclose(out.loss - plain, 2.5 * pen / normaliser, atol=1e-6)
    n = sel.sum()
    assert torch.isclose(out.metrics["skipper/penalty"], pen / n)
    assert torch.isclose(out.metrics["skipper/skip_ratio"], skipped.sum() / (2 * n))
    assert torch.isclose(out.metrics["skipper/skip/3"], skipped[:, 1].sum() / n)
    assert torch.isclose(out.metrics["skipper/gate_mean"], torch.stack([rec.gates[i][sel] for i in layers]).mean())


# --- the losses against full-logit references -------------------------------------------------------------


def test_kl_is_forward_kl_from_the_base_over_the_full_vocabulary():
    algo, model, base, tok, task = setup(alpha=0.0, kd_temperature=2.0)
    randomize_adapters(model)
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    out = algo.loss(model, batch, batch.num_targets().float())
    sel = batch.loss_mask.bool()
    with torch.no_grad():
        t_logp = torch.log_softmax(base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 2, -1)
    s_logp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 2, -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)[:, :-1][sel[:, 1:]]  # position t - 1 predicts token t
    assert torch.allclose(out.loss, kl.sum() / sel.sum(), rtol=1e-4)
    assert out.loss > 0 and torch.isclose(out.metrics["skipper/kl"], out.loss)


def test_lm_is_cross_entropy_on_the_solutions_without_a_teacher_pass():
    algo, model, _, tok, task = setup(alpha=0.0, loss="lm")
    examples = task.train_examples()[:3]
    batch = algo.make_batch(examples, ctx(model, tok, task))
    assert batch.teacher is None
    row = tok(task.prompt(examples[0]), add_special_tokens=False).input_ids
    target = tok(examples[0].solution, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert batch.input_ids[0, : len(row) + len(target)].tolist() == row + target
    out = algo.loss(model, batch, batch.num_targets().float())
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = losses.token_logprobs(logits, batch.input_ids)
    assert torch.allclose(out.loss, -(logp * batch.loss_mask).sum() / batch.loss_mask.sum(), rtol=1e-5)


def test_base_completions_are_the_base_models_greedy_outputs():
    from inference import Engine, SamplingParams

    algo, model, base, tok, task = setup(completions="base")
    randomize_adapters(model)  # the skipper model would decode differently
    examples = task.train_examples()[:3]
    batch = algo.make_batch(examples, ctx(model, tok, task, max_new_tokens=12))
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in examples]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    expected = [p + list(o.tokens) for p, o in zip(prompts, Engine(base).generate(prompts, params))]
    for row, ids, mask in zip(expected, batch.input_ids.tolist(), batch.attention_mask.tolist()):
        assert ids[: sum(mask)] == row


# --- forced routing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["soft", "hard"])
def test_forced_run_is_the_base_model_exactly(gate):
    algo, model, base, tok, task = setup(gate=gate)
    randomize_adapters(model)
    ids = torch.tensor([[5, 9, 14, 3, 7, 22], [8, 4, 4, 11, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask).logits
        with forced(model, "run"):
            got = model(input_ids=ids, attention_mask=mask).logits
        free = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    assert not torch.allclose(free, want)  # the routers themselves do skip some tokens


def test_forced_skip_is_the_adapter_only_path_by_hand():
    model, _ = tiny(TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    apply_skipper(model, make_spec(model.config, [0, 1]))
    randomize_adapters(model)
    ids = torch.tensor([[5, 9, 14, 3, 7, 22]])
    with torch.no_grad(), forced(model, "skip"):
        got = model(input_ids=ids).logits
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers:  # both layers routed and skipped: only the adapter
            x = x + layer.skipper.adapter(layer.input_layernorm(x))
        want = model.lm_head(model.model.norm(x))
    assert torch.allclose(got, want, atol=1e-6)


# --- mechanics -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate,loss", [("soft", "kl"), ("hard", "lm")])
def test_two_steps_change_every_trainable_parameter_and_no_base_parameter(gate, loss):
    algo, model, _, tok, task = setup(gate=gate, loss=loss, alpha=1.0)
    base_state = {k: v.clone() for k, v in model.state_dict().items() if ".skipper." not in k}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    routed = {f"model.layers.{i}.skipper.{n}" for i, s in routed_layers(model).items() for n, _ in s.named_parameters()}
    assert set(trainable) == routed and len(routed) == 2 * 7  # enc, norm, dec, head + gate, up, down per layer
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.Adam(trainable.values(), lr=1e-2)
    for step in range(2):
        batch = algo.make_batch(task.train_examples()[step * 4: step * 4 + 4], ctx(model, tok, task))
        for micro in batch.micro_batches(2):
            algo.loss(model, micro, batch.num_targets().float()).loss.backward()
        opt.step()
        opt.zero_grad()
    unchanged = [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])]
    assert not unchanged, unchanged
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_state.items())


def test_gradient_accumulation_invariance():
    algo, model, _, tok, task = setup(loss="kl", alpha=3.0)
    randomize_adapters(model)
    batch = algo.make_batch(task.train_examples()[:6], ctx(model, tok, task))
    normaliser = batch.num_targets().float()

    def grads(size):
        model.zero_grad()
        micros = batch.micro_batches(size)
        for micro in micros:
            algo.loss(model, micro, normaliser).loss.backward()
        return len(micros), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (one, whole), (three, split) = grads(6), grads(2)
    assert (one, three) == (1, 3)
    assert whole.keys() == split.keys() and len(whole) == 14
    for n in whole:
        assert whole[n].abs().sum() > 0, n
        assert torch.allclose(whole[n], split[n], atol=1e-6, rtol=1e-5), n


# --- export and reload -------------------------------------------------------------------------------------


def test_export_is_the_base_plus_a_skipper_that_reloads_to_the_same_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    algo, model, base, tok, task = setup(alpha=1.0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):  # trained routers and adapters, not the init
        batch = algo.make_batch(task.train_examples()[step * 4: step * 4 + 4], ctx(model, tok, task))
        algo.loss(model, batch, batch.num_targets().float()).loss.backward()
        opt.step()
        opt.zero_grad()
    final = tmp_path / "final"
    algo.export(model, tok, str(final))
    assert sorted(p.name for p in (final / "skipper").iterdir()) == ["README.md", "skipper.json", "skipper.safetensors"]
    loaded, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    want = base.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    spec = json.loads((final / "skipper" / "skipper.json").read_text())
    assert spec["layers"] == [2, 3] and spec["num_layers"] == 4 and spec["hidden_size"] == 32
    load_skipper(loaded, str(final / "skipper"))
    ids = torch.tensor([[5, 9, 14, 3, 7, 22, 9, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("other,named", [
    (TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), "num_layers=4; this model has 2"),
    (TinySpec(hidden_size=48, num_layers=4, num_heads=2, intermediate_size=64), "hidden_size=32; this model has 48"),
])
def test_a_skipper_for_another_shape_of_model_is_refused(tmp_path, other, named):
    _, model, _, _, _ = setup()
    save_skipper(model, str(tmp_path / "skipper"))
    target, _ = tiny(other)
    with pytest.raises(SkipperError, match=named):
        load_skipper(target, str(tmp_path / "skipper"))


# --- bad input ----------------------------------------------------------------------------------------------

SKIPPER_TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
                "trainer.eval_max_new_tokens=16", "trainer.max_new_tokens=16"]

BAD_INPUT = [
    ("algo.target_skip=1.0", "algo.target_skip=1.0 must be in [0, 1)"),
    ("algo.target_skip=-0.1", "algo.target_skip=-0.1 must be in [0, 1)"),
    ("algo.layers=[7]", "algo.layers=[7]: [7] outside the model's 4 layers (0..3)"),
    ("algo.gate=nope", "algo.gate=nope is not one of soft, hard"),
]


def train(args, env):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.mark.parametrize("override,message", BAD_INPUT + [
    ("algo.alpha=-1", "algo.alpha=-1.0 must be >= 0"),
    ("algo.loss=mse", "algo.loss=mse is not one of kl, lm"),
    ("algo.completions=teacher", "algo.completions=teacher is not one of solutions, base"),
    ("algo.kd_temperature=0", "algo.kd_temperature=0.0 must be > 0"),
    ("algo.layers=[1,1]", "algo.layers=[1, 1] names a layer twice"),
])
def test_bad_input_is_one_config_error_naming_it(tmp_path, override, message):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(tiny_overrides(tmp_path / "run", *SKIPPER_TINY, override, algo="skipper"), config_schemas())
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow  # train.py / evaluate.py subprocesses or several CLI runs
def test_bad_layers_exit_from_train_py_with_one_line(tmp_path, subprocess_env):
    """train.py itself: one stderr line, exit code 2, output_dir never created. algo.layers is checked
    against a meta-device build of the model (ChecksRun); the other bad values fail in validate() and
    are run through train.py with the other config errors in tests/test_config.py."""
    out = tmp_path / "run"
    override, message = BAD_INPUT[2]
    proc = train(tiny_overrides(out, *SKIPPER_TINY, override, algo="skipper"), subprocess_env)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == f"config error: {message}", lines[0]
    assert not out.exists()


# --- train.py ------------------------------------------------------------------------------------------------


def records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # train.py / evaluate.py subprocesses or several CLI runs
def test_train_end_to_end_exports_and_resumes(tmp_path, subprocess_env):
    """4 steps (base completions), checkpoints at 2 and 4; then steps 3-4 again from the step-2
    checkpoint equal the uninterrupted run (the routers and adapters travel in the model checkpoint)."""
    from safetensors.torch import load_file

    from trainer import checkpoint

    out = tmp_path / "run"
    args = tiny_overrides(out, *SKIPPER_TINY, "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=4",
                          "algo.completions=base", "algo.alpha=2.0", algo="skipper")

    def run():
        proc = train(args, subprocess_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout, records(out)

    stdout, whole = run()
    evals = [r for r in whole if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4]
    for r in evals:
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["skipper/skip_ratio"] <= 1.0
        assert r["skipper/layer_skip_ratio"] == pytest.approx(r["skipper/skip_ratio"] * 2 / 4)
        assert r["skipper/skip_ratio"] == pytest.approx((r["skipper/skip/2"] + r["skipper/skip/3"]) / 2)
    assert "skipped routed layer-tokens (greedy completions): step 0" in stdout
    train_rows = {r["step"]: r for r in whole if r["split"] == "train"}
    assert {"skipper/kl", "skipper/penalty", "skipper/skip_ratio", "skipper/skip/2", "skipper/gate_mean"} <= set(
        train_rows[1])
    assert json.loads((out / "final" / "skipper" / "skipper.json").read_text())["layers"] == [2, 3]
    assert not any(".skipper." in k for k in load_file(str(out / "final" / "model.safetensors")))
    for step, path in checkpoint.complete_checkpoints(str(out)):
        if step > 2:
            shutil.rmtree(path)
    metrics = out / "metrics.jsonl"  # keep steps <= 2: steps 3-4 can only come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 2))
    shutil.rmtree(out / "final")
    _, resumed = run()
    again = {r["step"]: r for r in resumed if r["split"] == "train"}
    for step in (3, 4):
        for key in ("loss", "skipper/kl", "skipper/skip_ratio", "skipper/gate_mean"):
            assert again[step][key] == pytest.approx(train_rows[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow  # torchrun, 2 ranks
def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env):
    out = tmp_path / "run"
    rows = torchrun_train(out, subprocess_env, *SKIPPER_TINY, "trainer.max_steps=3", "trainer.eval_every=3",
                          "algo.gate=hard", algo="skipper")
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(0.0 <= r["skipper/skip_ratio"] <= 1.0 and r["skipper/kl"] >= 0 for r in train_rows)
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3] and "skipper/skip_ratio" in evals[-1]
    assert json.loads((out / "final" / "skipper" / "skipper.json").read_text())["gate"] == "hard"
