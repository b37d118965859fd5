"""QAD: the Theseus schedule by hand, segment inputs against a spliced reference model, the losses by
hand, training mechanics (every parameter moves, gradient accumulation), and train.py runs."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
import torch

from algorithms import losses
from algorithms.qad import (
    CE, HIDDEN, KL, QAD, QADConfig, Stage, boundaries, equal_split, plan_stages, segment_hooks, stage_at,
    theseus_sizes,
)
from models.loading import TinySpec, build_tiny
from models.quant import FakeQuantLinear, fake_quant_modules
from tests.algorithms.selfdistill_helpers import arith, ctx
from tests.conftest import ROOT, tiny_overrides, torchrun_train

SPEC = TinySpec(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)


def tiny4():
    return build_tiny(SPEC, seed=0)


def setup(max_steps: int = 6, **keys):
    model, tok = tiny4()
    algo = QAD(QADConfig(**keys))
    model = algo.prepare_model(model)
    algo.plan(max_steps)
    return algo, model, tok, arith()


# --- the schedule by hand -------------------------------------------------------------------------------


def test_theseus_stages_on_a_four_block_model():
    assert theseus_sizes(4) == [1, 2] and theseus_sizes(6) == [1, 2, 4] and theseus_sizes(1) == []
    assert equal_split(10, 3) == [4, 3, 3]
    stages = plan_stages(QADConfig(), 4, 10)
    assert stages == [Stage(HIDDEN, 1, 4), Stage(HIDDEN, 2, 3), Stage(KL, 4, 3)]
    # 0-based steps 0-3 stage 0, 4-6 stage 1, 7-9 stage 2
    assert [stage_at(stages, s)[0] for s in range(10)] == [0] * 4 + [1] * 3 + [2] * 3
    assert boundaries(4, 1) == [0, 1, 2, 3, 4] and boundaries(4, 2) == [0, 2, 4] and boundaries(6, 4) == [0, 4, 6]


def test_other_schedules_and_explicit_stage_steps():
    assert plan_stages(QADConfig(schedule="theseus_qat"), 4, 10) == [
        Stage(HIDDEN, 1, 2), Stage(HIDDEN, 2, 2), Stage(KL, 4, 1), Stage(CE, 4, 5)]
    assert plan_stages(QADConfig(schedule="theseus_qat", stage_steps=[1, 1, 1]), 4, 10)[-1] == Stage(CE, 4, 7)
    assert plan_stages(QADConfig(schedule="theseus", stage_steps=[5, 0, 5]), 4, 10)[1].steps == 0
    assert plan_stages(QADConfig(schedule="qad"), 4, 10) == [Stage(KL, 4, 10)]
    assert plan_stages(QADConfig(schedule="qat"), 4, 10) == [Stage(CE, 4, 10)]
    with pytest.raises(ValueError, match=r"sums to 9, not trainer.max_steps=10"):
        plan_stages(QADConfig(stage_steps=[3, 3, 3]), 4, 10)
    with pytest.raises(ValueError, match="has 2 entries; a 4-block model has 3 Theseus stages"):
        plan_stages(QADConfig(stage_steps=[5, 5]), 4, 10)
    with pytest.raises(ValueError, match="more than trainer.max_steps=10"):
        plan_stages(QADConfig(schedule="theseus_qat", stage_steps=[4, 4, 4]), 4, 10)


def test_prepare_model_quantizes_the_blocks_and_freezes_the_boundary_modules():
    algo, model, _, _ = setup(format="W4A4")
    assert len(fake_quant_modules(model)) == 4 * 7
    assert not any(isinstance(m, FakeQuantLinear) for m in algo.teacher.modules())  # the teacher is full precision
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("model.layers.") for n in trainable)
    assert not model.model.embed_tokens.weight.requires_grad and not model.model.norm.weight.requires_grad


# --- segments -------------------------------------------------------------------------------------------


def spliced_output(model, layers: range, h_in, attention_mask):
    """Reference: a copy of `model` holding only `layers`, run on `h_in` as its input embeddings;
    the last kept block's output (captured before the final norm)."""
    ref = copy.deepcopy(model)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in layers])
    ref.config.num_hidden_layers = len(layers)
    ref.config.layer_types = ref.config.layer_types[: len(layers)]
    out = {}
    ref.model.layers[-1].register_forward_hook(lambda m, a, o: out.update(h=o[0] if isinstance(o, tuple) else o))
    ref(inputs_embeds=h_in, attention_mask=attention_mask, use_cache=False)
    return out["h"]


def test_segment_inputs_and_outputs_by_hand():
    algo, model, tok, task = setup()
    model.eval()
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    states, _ = algo.teacher_states(batch.input_ids, batch.attention_mask, torch.device("cpu"))
    assert states.shape[2] == 5  # inputs of blocks 0..3 and the last block's output
    teacher_in = {0: states[:, :, 0], 2: states[:, :, 2]}
    with segment_hooks(model, [0, 2], teacher_in) as (seen, outs):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    assert seen[0] is teacher_in[0] and seen[2] is teacher_in[2]  # segment starts take the teacher's state
    assert torch.equal(seen[1], outs[0]) and torch.equal(seen[3], outs[2])  # inside a segment: its own path
    for start, end in ((0, 2), (2, 4)):
        ref = spliced_output(model, range(start, end), states[:, :, start], batch.attention_mask)
        assert torch.allclose(outs[end - 1], ref, atol=1e-5)
    # the teacher's own states: block 0's input is the embedding, each later one the previous output
    assert torch.allclose(states[:, :, 0], algo.teacher.model.embed_tokens(batch.input_ids))


def test_no_gradient_crosses_a_segment_boundary():
    algo, model, tok, task = setup()
    algo.steps_done = 3  # 0-based step 3 of 6: stage 1, segments of 2 blocks
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    cut = boundaries(4, 2)
    teacher = batch.teacher.boundaries
    with segment_hooks(model, cut[:-1], {c: teacher[:, :, j] for j, c in enumerate(cut[:-1])}) as (_, outs):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    outs[3].square().sum().backward()  # the second segment's output only
    grads = {i: model.model.layers[i].mlp.down_proj.weight.grad for i in range(4)}
    assert grads[0] is None and grads[1] is None  # blocks of the first segment
    assert grads[2].abs().sum() > 0 and grads[3].abs().sum() > 0


def test_segment_input_student_feeds_the_students_own_state():
    algo, model, tok, task = setup(segment_input="student")
    with segment_hooks(model, [0, 2], None) as (seen, outs):
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    assert torch.equal(seen[2], outs[1]) and not seen[2].requires_grad  # detached at the boundary


# --- losses by hand -------------------------------------------------------------------------------------


def test_hidden_stage_loss_by_hand():
    algo, model, tok, task = setup()
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))  # stage 0: one-block segments
    sel = batch.loss_mask.bool()
    assert torch.equal(batch.loss_mask[:, 1:], batch.attention_mask[:, 1:]) and not sel[:, 0].any()
    out = algo.loss(model, batch, batch.num_targets().float())
    teacher = batch.teacher.boundaries  # (B, T, 5, H): every block is its own segment
    errors = []
    for i in range(4):
        ref = spliced_output(model, range(i, i + 1), teacher[:, :, i], batch.attention_mask)
        errors.append((ref - teacher[:, :, i + 1]).pow(2).sum(-1) / teacher[:, :, i + 1].pow(2).sum(-1))
    expected = torch.stack(errors).mean(0)[sel].sum() / sel.sum()
    assert torch.allclose(out.loss, expected, rtol=1e-4)


def test_kl_stage_is_forward_kl_from_the_full_precision_teacher():
    algo, model, tok, task = setup(schedule="qad")
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    sel = batch.loss_mask.bool()
    out = algo.loss(model, batch, batch.num_targets().float())
    with torch.no_grad():
        t_logp = torch.log_softmax(algo.teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, -1)
    s_logp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, -1)
    # position t - 1 predicts token t
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)[:, :-1][sel[:, 1:]]
    assert torch.allclose(out.loss, kl.sum() / sel.sum(), rtol=1e-4)
    assert out.loss > 0  # the fake-quant student differs from its teacher


def test_ce_stage_is_cross_entropy_on_the_solutions():
    algo, model, tok, task = setup(schedule="qat", block_error_every=0)
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    assert batch.teacher is None  # QAT needs no teacher pass
    out = algo.loss(model, batch, batch.num_targets().float())
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = losses.token_logprobs(logits, batch.input_ids)
    assert torch.allclose(out.loss, -(logp * batch.loss_mask).sum() / batch.loss_mask.sum(), rtol=1e-5)


# --- mechanics ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,start", [("theseus", 0), ("theseus", 2), ("theseus", 4), ("qat", 0)])
def test_every_trainable_parameter_changes_in_two_steps(schedule, start):
    algo, model, tok, task = setup(schedule=schedule)
    algo.steps_done = start  # theseus: stage 0 (blocks 1), 1 (blocks 2), 2 (KL)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    for step in range(2):
        batch = algo.make_batch(task.train_examples()[step * 4: step * 4 + 4], ctx(model, tok, task))
        for micro in batch.micro_batches(2):
            algo.loss(model, micro, batch.num_targets().float()).loss.backward()
        opt.step()
        opt.zero_grad()
    unchanged = [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])]
    assert not unchanged, unchanged


@pytest.fixture
def float64():
    """Models built in float64: the hidden-state losses subtract nearly equal states, so in fp32 the
    matmul kernels' shape-dependent rounding (6 rows vs 2) shows in the gradients at ~4e-3 relative
    on an AVX-512 CPU; in float64 what is left is the accumulation itself."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("start", [0, 2, 4])  # hidden (1-block), hidden (2-block), KL
def test_gradient_accumulation_invariance(start, float64):
    algo, model, tok, task = setup()
    assert next(model.parameters()).dtype == torch.float64
    algo.steps_done = start
    batch = algo.make_batch(task.train_examples()[:6], ctx(model, tok, task))

    def grads(size):
        model.zero_grad()
        for micro in batch.micro_batches(size):
            algo.loss(model, micro, batch.num_targets().float()).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, split = grads(6), grads(2)
    assert whole.keys() == split.keys() and whole
    for n in whole:
        # float64 measures ~3e-7 of the largest gradient entry here; fp32 rounding gave up to 4e-3
        assert (whole[n] - split[n]).abs().max() <= 1e-5 * whole[n].abs().max(), n


def test_each_batch_trains_the_stage_it_was_made_for():
    """Two batches made before either loss: each loss follows its own batch's stage, not the counter."""
    algo, model, tok, task = setup()
    c = ctx(model, tok, task)
    algo.steps_done = 1  # step 1: stage 0 (1-block segments, hidden); step 2: stage 1 (2-block segments)
    first = algo.make_batch(task.train_examples()[:4], c)
    second = algo.make_batch(task.train_examples()[4:8], c)
    assert (first.step_state.kind, first.step_state.blocks) == ("hidden", 1)
    assert (second.step_state.kind, second.step_state.blocks) == ("hidden", 2)
    norm = first.num_targets().float()
    late = algo.loss(model, first, norm).loss  # after the second make_batch
    expected = algo.segment_error(model, first, 1)[first.loss_mask.bool()].sum() / norm
    assert torch.allclose(late, expected) and not torch.allclose(
        late, algo.segment_error(model, first, 2)[first.loss_mask.bool()].sum() / norm)


def test_block_errors_are_logged_and_the_step_counter_is_checkpointed():
    algo, model, tok, task = setup(block_error_every=2)
    first = algo.make_batch(task.train_examples()[:2], ctx(model, tok, task))
    second = algo.make_batch(task.train_examples()[2:4], ctx(model, tok, task))
    assert {f"qad/block_error/{i}" for i in range(4)} <= set(first.metrics) and "qad/path_error" in first.metrics
    assert "qad/block_error/0" not in second.metrics
    assert all(first.metrics[f"qad/block_error/{i}"] > 0 for i in range(4))
    assert algo.state_dict() == {"steps_done": 2}
    other = QAD(QADConfig())
    other.load_state_dict(algo.state_dict())
    assert other.steps_done == 2


# --- train.py ---------------------------------------------------------------------------------------------

QAD_TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
            "trainer.eval_max_new_tokens=16"]


def train(args, env):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


BAD_INPUT = [
    ("algo.format=W5A5", "algo.format / algo.group_size: quantization format 'W5A5' is not one of"),
    ("algo.group_size=24", "algo.group_size=24 does not divide the input width 32 of model.layers.0.self_attn.q_proj"),
    ("algo.keep=[lm_head,model.decoder.*]", "algo.keep pattern 'model.decoder.*' matches no module"),
    ("algo.stage_steps=[1,1,1]", "algo.stage_steps=[1, 1, 1] sums to 3, not trainer.max_steps=6"),
]


@pytest.mark.parametrize("override,message", BAD_INPUT)
def test_bad_input_is_one_config_error_naming_it(tmp_path, override, message):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(tiny_overrides(tmp_path / "run", *QAD_TINY, "trainer.max_steps=6", override, algo="qad"),
                    config_schemas())
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow  # train.py subprocess: ~8 s
def test_bad_input_exits_before_any_work(tmp_path, subprocess_env):
    """train.py: one stderr line, exit code 2, output_dir never created (one case; the others are
    the same ConfigError path, checked in-process above)."""
    out = tmp_path / "run"
    override, message = BAD_INPUT[1]
    proc = train(tiny_overrides(out, *QAD_TINY, "trainer.max_steps=6", override, algo="qad"), subprocess_env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists()


@pytest.mark.slow  # train.py subprocesses: ~40 s
def test_resume_mid_stage_equals_an_uninterrupted_run(tmp_path, subprocess_env):
    from trainer import checkpoint

    out = tmp_path / "run"
    args = tiny_overrides(out, *QAD_TINY, "trainer.max_steps=6", "trainer.save_every=3", "algo.block_error_every=1",
                          algo="qad")

    def run():
        proc = train(args, subprocess_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if r["split"] == "train"}

    whole = run()
    assert [whole[s]["qad/stage"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    for step, path in checkpoint.complete_checkpoints(str(out)):
        if step > 3:
            shutil.rmtree(path)
    metrics = out / "metrics.jsonl"  # keep steps <= 3: steps 4-6 can only come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 3))
    shutil.rmtree(out / "final")
    resumed = run()
    for step in (4, 5, 6):  # step 4 is mid-stage (stage 1 began at step 3)
        for key in ("loss", "qad/stage", "qad/block_error/0", "qad/path_error"):
            assert resumed[step][key] == pytest.approx(whole[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow  # train.py subprocess: ~15 s
def test_ptq_with_zero_steps_evaluates_and_exports_round_to_nearest(tmp_path, subprocess_env):
    from models.loading import build_tiny as build
    from models.quant import quantize_weight
    from models.quant_export import read_compressed

    out = tmp_path / "run"
    proc = train(tiny_overrides(out, *QAD_TINY, "trainer.max_steps=0", "algo.schedule=ptq", "algo.format=W4A4",
                                "algo.group_size=16", "model.seed=3", algo="qad"), subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 0 steps" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in rows] == ["eval"]  # the RTN student's accuracy, no training
    ckpt = read_compressed(str(out / "final"))
    start, _ = build(SPEC, seed=3)  # model=tiny_init: the random-init tiny model of model.seed
    for name, (q, scale) in ckpt.quantized.items():
        ref_q, ref_scale = quantize_weight(start.get_submodule(name).weight, 4, 16)
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale), name
    assert len(ckpt.quantized) == 4 * 7
    # evaluate.py serves the export on the low-bit path
    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), f"model.path={out / 'final'}", "data.n_test=8",
                           "trainer.eval_examples=8", "trainer.eval_max_new_tokens=8", "logging.wandb=false"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["n"] == 8


@pytest.mark.slow  # torchrun, 2 ranks: ~60 s
def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env):
    from models.quant_export import is_compressed, read_compressed

    out = tmp_path / "run"
    records = torchrun_train(out, subprocess_env, *QAD_TINY, "trainer.max_steps=6", "algo.format=W8A8",
                             "algo.block_error_every=3", algo="qad")
    train_rows = [r for r in records if r["split"] == "train"]
    assert [r["qad/stage"] for r in train_rows] == [0, 0, 1, 1, 2, 2]
    assert "qad/kl" in train_rows[-1] and "qad/hidden_error" in train_rows[0]
    assert "qad/block_error/3" in train_rows[0] and "qad/block_error/3" in train_rows[3]
    assert is_compressed(str(out / "final"))
    assert read_compressed(str(out / "final")).scheme.name == "W8A8"


def test_teacher_completions_are_the_teachers_greedy_outputs():
    from inference import Engine, SamplingParams

    algo, model, tok, task = setup(completions="teacher", block_error_every=0)
    examples = task.train_examples()[:3]
    batch = algo.make_batch(examples, ctx(model, tok, task, max_new_tokens=12))
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in examples]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    expected = [p + list(o.tokens) for p, o in zip(prompts, Engine(algo.teacher).generate(prompts, params))]
    for row, ids, mask in zip(expected, batch.input_ids.tolist(), batch.attention_mask.tolist()):
        assert ids[: sum(mask)] == row


@pytest.mark.slow  # train.py subprocess: ~20 s
def test_train_with_the_other_options_end_to_end(tmp_path, subprocess_env):
    """theseus_qat with teacher completions, student segment inputs, mse on completion tokens, grouped
    weight-only quantization and the dequantized export, through train.py."""
    from transformers import AutoModelForCausalLM

    from models.quant_export import read_compressed

    out = tmp_path / "run"
    proc = train(tiny_overrides(out, *QAD_TINY, "trainer.max_steps=6", "algo.schedule=theseus_qat",
                                "algo.completions=teacher", "algo.segment_input=student", "algo.hidden_loss=mse",
                                "algo.hidden_tokens=completion", "algo.format=W4A16", "algo.group_size=16",
                                "algo.export_dequantized=true", "trainer.max_new_tokens=16", algo="qad"),
                 subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["qad/stage"] for r in train_rows] == [0, 1, 2, 3, 3, 3]  # 3 Theseus stages, then QAT
    assert "qad/hidden_error" in train_rows[0] and "qad/kl" in train_rows[2] and "qad/ce" in train_rows[-1]
    ckpt = read_compressed(str(out / "final"))
    assert ckpt.scheme.name == "W4A16" and ckpt.scheme.group_size == 16
    plain = AutoModelForCausalLM.from_pretrained(out / "final" / "dequantized")
    q, scale = ckpt.quantized["model.layers.0.mlp.down_proj"]
    w = plain.model.layers[0].mlp.down_proj.weight.detach()
    assert torch.equal(w, q.float() * scale.repeat_interleave(16, dim=1))
