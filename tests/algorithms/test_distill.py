"""+algo=distill and algo.teacher_path: the loss and its gradient equal TRL GKDTrainer's generalized JSD on the
same student and teacher logits; a named teacher's weights (not the policy's) score the tokens, for distill
and for opsd; lmbda picks on- and off-policy rows; a teacher with another tokenizer is refused at config
time in one line naming both models."""
from __future__ import annotations

import pytest
import torch

from algorithms.distill import Distill, DistillConfig
from algorithms.opsd import OPSD, OPSDConfig
from models.anatomy import final_hidden
from models.loading import TinySpec, build_tiny
from selfdistill_helpers import arith, ctx, tiny

SPEC = TinySpec(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=96)  # wider and deeper than the student


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher with the student's (char) tokenizer and weights of its own (another seed, another width)."""
    path = tmp_path_factory.mktemp("teacher")
    model, tok = build_tiny(SPEC, seed=7)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def loaded(path):
    from models.loading import load_pretrained

    return load_pretrained(path)[0].eval()


@pytest.mark.slow  # imports TRL's GKD trainer (~7 s)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradient_equal_trl_gkd_on_the_same_logits(teacher_dir, beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    model, tok = tiny()
    task = arith(steps=1)
    algo = Distill(DistillConfig(teacher_path=teacher_dir, beta=beta, teacher_dtype="float32"))
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    normaliser = batch.num_targets().float()
    model.zero_grad()
    ours = algo.loss(model, batch, normaliser).loss
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # TRL: logits at t - 1 predict token t; tokens outside the loss are labelled -100
    teacher = loaded(teacher_dir)
    ids, attn = batch.input_ids, batch.attention_mask
    labels = ids[:, 1:].masked_fill(batch.loss_mask[:, 1:] == 0, -100)
    model.zero_grad()
    student_logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=attn).logits[:, :-1]
    ref = gkd.GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta,
                                              temperature=algo.cfg.temperature)
    ref.backward()
    assert ours.item() > 0 and torch.allclose(ours, ref, atol=1e-6), (ours.item(), ref.item())
    for name, grad in ours_grads.items():
        assert torch.allclose(grad, dict(model.named_parameters())[name].grad, atol=1e-6), name


def test_the_named_teacher_scores_the_tokens_not_the_policy(teacher_dir):
    model, tok = tiny()
    task = arith(steps=1)
    teacher = loaded(teacher_dir)
    for algo in (Distill(DistillConfig(teacher_path=teacher_dir, teacher_dtype="float32")),
                 OPSD(OPSDConfig(teacher_path=teacher_dir, teacher_dtype="float32"))):
        batch = algo.make_batch(task.train_examples()[:2], ctx(model, tok, task))
        assert torch.equal(batch.teacher.head[0], teacher.lm_head.weight)  # the teacher's own head ...
        assert batch.teacher.hidden.shape[-1] == SPEC.hidden_size != model.config.hidden_size  # ... and states
        assert algo.teacher.model is not model and not any(p.requires_grad for p in algo.teacher.model.parameters())
    # distill's teacher sees the student's prompt: its states are the teacher's forward over the same row
    batch = Distill(DistillConfig(teacher_path=teacher_dir, teacher_dtype="float32")).make_batch(
        task.train_examples()[:1], ctx(model, tok, task))
    row = batch.input_ids[:, :int(batch.attention_mask.sum())]
    with torch.no_grad():
        expected = final_hidden(teacher, row, torch.ones_like(row))  # (1, T, H)
    sel = batch.loss_mask[:, :row.shape[1]].bool()
    got = batch.teacher.hidden[:, :row.shape[1], 0][sel]  # stored at token t: the state that predicts it ...
    shifted = torch.cat([torch.zeros_like(expected[:, :1]), expected[:, :-1]], dim=1)  # ... the teacher's at t - 1
    assert torch.allclose(got, shifted[sel], atol=1e-5)


def test_lmbda_mixes_on_policy_samples_with_the_datas_completions(teacher_dir):
    model, tok = tiny()
    task = arith(steps=1)
    examples = task.train_examples()[:8]
    off = Distill(DistillConfig(teacher_path=teacher_dir, lmbda=0.0, teacher_dtype="float32"))
    batch = off.make_batch(examples, ctx(model, tok, task))
    assert batch.metrics["distill/on_policy"].item() == 0.0
    for i, ex in enumerate(examples):  # every row is prompt + the reference solution + EOS
        tokens = batch.input_ids[i][batch.loss_mask[i].bool()].tolist()
        assert tokens == tok(ex.solution, add_special_tokens=False).input_ids + [tok.eos_token_id]
    half = Distill(DistillConfig(teacher_path=teacher_dir, lmbda=0.5, teacher_dtype="float32", seed=1))
    share = half.make_batch(examples, ctx(model, tok, task)).metrics["distill/on_policy"].item()
    assert 0.0 < share < 1.0


@pytest.mark.parametrize("overrides, message", [
    (["algo.teacher_path=/nowhere/teacher"], r"algo.teacher_path=/nowhere/teacher: /nowhere/teacher does not exist"),
    ([], r"algo=distill needs algo.teacher_path=DIR"),
    (["algo.lmbda=1.5", "algo.teacher_path=TEACHER"], r"algo.lmbda=1.5 must be in \[0, 1\]"),
    (["algo.teacher_context=both", "algo.teacher_path=TEACHER"], r"algo.teacher_context=both is not one of"),
    (["algo.teacher_context=reference", "algo.teacher_path=TEACHER", "data=text", "data.path=x.jsonl",
      "data.solution_field=null"], r"algo distill reads reference solutions here .* but data.solution_field is empty"),
    (["algo.teacher_path=TEACHER", "data.max_length=100000"],
     r"algo.teacher_path=.* has \d+ positions, fewer than data.max_length=100000"),
])
def test_bad_distill_settings_are_one_config_line(tmp_path, teacher_dir, overrides, message):
    from tests.conftest import tiny_config
    from trainer.config import ConfigError

    overrides = [o.replace("TEACHER", teacher_dir) for o in overrides]
    with pytest.raises(ConfigError, match=message) as err:
        tiny_config(tmp_path / "run", *overrides, algo="distill")
    assert "\n" not in str(err.value)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, teacher_dir):
    from models.tokenizer import build_char_tokenizer
    from tests.conftest import tiny_config
    from trainer.config import ConfigError

    other = tmp_path / "other"
    model, _ = build_tiny(SPEC, seed=0)
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 \n.,:;?!'+-*/=()#_[]<>|@")  # one more char
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match=rf"algo.teacher_path={other} does not share the student's tokenizer "
                                          r"\(the embedded tiny model\): vocabulary sizes differ"):
        tiny_config(tmp_path / "run", f"algo.teacher_path={other}", algo="distill")
    cfg = tiny_config(tmp_path / "ok", f"algo.teacher_path={teacher_dir}", algo="opsd")  # the same tokenizer
    assert cfg.algo.teacher_dtype == cfg.model.dtype  # unset: the run's compute dtype


def test_the_teachers_held_out_accuracy_is_measured_once_as_the_ceiling(teacher_dir, monkeypatch):
    import inference.serving
    from inference.serving import ServeOptions, serve_model
    from models.prompts import prompt_ids

    model, tok = tiny()
    task = arith(steps=1)
    examples = task.test_examples()[:4]
    algo = Distill(DistillConfig(teacher_path=teacher_dir, teacher_dtype="float32"))
    seen, verify, served = [], task.verify, []
    task.verify = lambda ex, text: seen.append(text) or verify(ex, text)  # the texts the eval verifies
    monkeypatch.setattr(inference.serving, "serve_model", lambda m, *a: served.append(m) or serve_model(m, *a))
    first = algo.extra_eval(model, tok, task, examples, 16)["distill/teacher_accuracy"]
    task.verify = verify
    monkeypatch.undo()
    assert served == [algo.teacher.model] and served[0] is not model  # decoded by the teacher, not the student

    def greedy(m):
        server = serve_model(m, ServeOptions(), tok)
        outs = server.generate([prompt_ids(tok, task.prompt(ex)) for ex in examples],
                               server.params(max_new_tokens=16, temperature=0.0))
        return [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]

    teacher_texts = greedy(loaded(teacher_dir))  # the teacher decoded on its own
    assert seen == teacher_texts
    assert first == sum(task.verify(ex, t).correct for ex, t in zip(examples, teacher_texts)) / len(examples)
    algo.teacher.model.lm_head.weight.data.zero_()  # measured once: a later eval reports the same figure
    assert algo.extra_eval(model, tok, task, examples, 16)["distill/teacher_accuracy"] == first


@pytest.mark.slow  # four 2-step runs through the trainer: ~15 s
@pytest.mark.parametrize("algo, extra", [
    ("distill", ["algo.lmbda=0.5", "algo.teacher_dtype=bfloat16"]),  # mixed rows, a bf16 teacher under an fp32 student
    ("distill", ["model.dtype=bfloat16", "algo.teacher_context=reference"]),  # the teacher in the run's dtype
    ("opsd", ["algo.teacher_chat_template=teacher"]),  # the prompts rendered for the teacher's tokenizer
    ("mass", ["algo.num_views=2"]),
], ids=["distill-mixed-bf16-teacher", "distill-bf16-reference", "opsd-teacher-template", "mass"])
def test_a_named_teacher_trains_through_the_trainer_on_padded_batches(tmp_path, teacher_dir, algo, extra):
    import json

    from tests.conftest import tiny_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    cfg = tiny_config(tmp_path / "run", f"algo.teacher_path={teacher_dir}", "trainer.max_steps=2",
                      "trainer.batch_size=4", "trainer.micro_batch_size=2", "trainer.max_new_tokens=16",
                      "trainer.eval_max_new_tokens=16", "trainer.eval_every=2", *extra, algo=algo)
    session = build_session(cfg, World())
    assert fit(session) == "done"
    assert session.algo.teacher.model is not None  # the named model was loaded and used
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r[f"{algo}/divergence"] >= 0 and r["loss"] == r["loss"] and r["grad_norm"] > 0
    if "algo.lmbda=0.5" in extra:
        assert {r["distill/on_policy"] for r in train} != {1.0}  # some rows were the data's own


def test_teacher_chat_template_picks_whose_template_renders_the_teachers_prompt(tmp_path):
    """`student` (the default): the teacher reads the prompt ids the student sampled under; `teacher`: the same
    question rendered by the teacher tokenizer's own template. The completion ids are the student's either way,
    and the teacher's states are its forward over [its prompt + those ids] (the independent truth)."""
    from tasks.chat_template import with_chat
    from tests.tasks.test_chat_template import TEMPLATE

    model, tok = tiny()
    tok.chat_template = TEMPLATE
    teacher_model, teacher_tok = build_tiny(SPEC, seed=7)
    teacher_tok.chat_template = TEMPLATE.replace("<{{ m['role'] }}>\n", "[{{ m['role'] }}]: ").replace(
        "<assistant>\n", "[assistant]: ")
    path = tmp_path / "teacher"
    teacher_model.save_pretrained(path)
    teacher_tok.save_pretrained(path)
    task = with_chat(arith(steps=1), tok, "auto")
    ex = task.train_examples()[0]
    for mode, rendered in (("student", tok.apply_chat_template([{"role": "user", "content": arith(steps=1).prompt(ex)}],
                                                                 tokenize=False, add_generation_prompt=True)),
                           ("teacher", teacher_tok.apply_chat_template(
                               [{"role": "user", "content": arith(steps=1).prompt(ex)}], tokenize=False,
                               add_generation_prompt=True))):
        algo = Distill(DistillConfig(teacher_path=str(path), teacher_dtype="float32", teacher_chat_template=mode))
        assert algo.teacher.view_task(task).prompt(ex) == rendered
        batch = algo.make_batch([ex], ctx(model, tok, task))
        start = int(batch.loss_mask[0].nonzero()[0])
        completion = batch.input_ids[0][batch.loss_mask[0].bool()]
        ids = torch.tensor([tok(rendered, add_special_tokens=False).input_ids + completion.tolist()])
        with torch.no_grad():
            expected = final_hidden(algo.teacher.model, ids, torch.ones_like(ids))[0]
        prompt_len = ids.shape[1] - len(completion)
        got = batch.teacher.hidden[0, start:start + len(completion), 0]
        assert torch.allclose(got, expected[prompt_len - 1: prompt_len - 1 + len(completion)], atol=1e-5), mode
    with pytest.raises(ValueError, match="algo.teacher_chat_template=teacher needs algo.teacher_path"):
        OPSDConfig(teacher_chat_template="teacher").validate()
    with pytest.raises(ValueError, match="algo.teacher_chat_template=mine is not one of student, teacher"):
        DistillConfig(teacher_path=str(path), teacher_chat_template="mine").validate()


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_a_bf16_teacher_gives_the_fp32_divergence_never_negative(beta):
    """A bf16 teacher (hidden states and head) next to an fp32 student: the divergence is computed in fp32 from the
    teacher's bf16 logits -- beta 0 the forward KL(teacher || student), 1 the reverse, both by hand here -- and no
    token's is negative, also where the two distributions are nearly equal (bf16 rounding would make a naive
    difference of log-probs dip below 0)."""
    from algorithms import losses

    torch.manual_seed(0)
    hidden, vocab, n = 16, 40, 64
    head = torch.randn(vocab, hidden)
    student = torch.randn(n, hidden)
    teacher_hidden = (student + 1e-3 * torch.randn(n, hidden)).to(torch.bfloat16)[:, None]  # nearly the student
    teacher_head = (head.to(torch.bfloat16),)
    targets = torch.randint(0, vocab, (n,))
    div, _ = losses.chunked_self_distill(student, (head, None), teacher_hidden, teacher_head + (None,), targets, beta=beta,
                                         temperature=1.1)
    assert div.dtype == torch.float32 and bool((div >= 0).all())
    log_s = torch.log_softmax(student @ head.T / 1.1, -1)
    log_t = torch.log_softmax((teacher_hidden[:, 0] @ teacher_head[0].T).float() / 1.1, -1)  # its logits as it makes them
    if beta == 0.0:
        expected = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        expected = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        mix = torch.logsumexp(torch.stack([log_s + torch.log(torch.tensor(0.5)), log_t + torch.log(torch.tensor(0.5))]), 0)
        expected = 0.5 * (log_t.exp() * (log_t - mix)).sum(-1) + 0.5 * (log_s.exp() * (log_s - mix)).sum(-1)
    assert torch.allclose(div, expected.clamp_min(0), atol=1e-6)
    if beta in (0.0, 1.0):
        assert float(div.sum()) > 0  # a KL, not a zero: the distributions differ a little
