"""OPSD: hand-computed loss, the teacher prompt is used whole, teacher modes (current / fixed /
EMA, full and LoRA), every trainable parameter changes, gradient-accumulation invariance, and a
clear failure without reference solutions."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from algorithms.base import Batch, TeacherTerms
from algorithms.opsd import OPSD, OPSDConfig
from algorithms.scoring import teacher_hidden
from models.anatomy import final_hidden, output_head
from tasks import DataError

from selfdistill_helpers import arith, ctx, grads, tiny, two_steps_change_every_trainable_parameter
from toy import ToyLM


def _toy_batch(teacher_logits):
    """One row [0, 1]; token 1 is the completion. The toy's hidden at position 0 is table[0] = [0, 0],
    so the student predicts [1/2, 1/2]; the teacher's stored hidden state is `teacher_logits`."""
    th = torch.zeros(1, 2, 1, 2)
    th[0, 1, 0] = torch.tensor(teacher_logits)
    return Batch(torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.long), torch.tensor([[0, 1]]),
                 teacher=TeacherTerms(th, (torch.eye(2), None)))  # the toy's output head is the identity


def _toy_algo(**kw):
    return OPSD(OPSDConfig(temperature=1.0, **kw))


def _same_rollouts(n: int, cfg: OPSDConfig) -> tuple[Batch, Batch]:
    """OPSD's batches of the first `n` arith questions with the default config and with `cfg`: the same
    rollouts (the same generator seed), each with its own loss mask."""
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()[:n]
    full = OPSD(OPSDConfig()).make_batch(examples, ctx(model, tok, task))
    other = OPSD(cfg).make_batch(examples, ctx(model, tok, task))
    assert torch.equal(other.input_ids, full.input_ids)
    return full, other


def test_loss_hand_computed_jsd_and_limits():
    model = ToyLM(torch.zeros(2, 2))
    batch = _toy_batch([0.0, math.log(3.0)])  # teacher [1/4, 3/4]
    # beta 0.5: M = [3/8, 5/8]; JSD = 0.5 KL(T||M) + 0.5 KL(S||M)
    kl_t = 0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)
    kl_s = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    out = _toy_algo().loss(model, batch, torch.tensor(2.0))  # normaliser 2 halves it
    assert math.isclose(out.loss.item(), (0.5 * kl_t + 0.5 * kl_s) / 2, rel_tol=1e-5)
    # beta 0: forward KL(T || S) = 0.25 ln(0.5) + 0.75 ln(1.5)
    out = _toy_algo(beta=0.0).loss(model, batch, torch.tensor(1.0))
    assert math.isclose(out.loss.item(), 0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel_tol=1e-5)
    # per-token clip at 0.01 caps it
    out = _toy_algo(beta=0.0, token_clip=0.01).loss(model, batch, torch.tensor(1.0))
    assert math.isclose(out.loss.item(), 0.01, rel_tol=1e-6)
    # sampled form: A = log(3/4) - log(1/2) = ln 1.5; loss = -A log p_S(1) = ln 1.5 * ln 2
    out = _toy_algo(divergence="sampled").loss(model, batch, torch.tensor(1.0))
    assert math.isclose(out.loss.item(), math.log(1.5) * math.log(2.0), rel_tol=1e-5)
    # the student's log-prob of the rollout token comes back for the gap check
    assert math.isclose(out.token_logprobs[0, 1].item(), math.log(0.5), rel_tol=1e-6)


def test_is_clip_weights_each_token_by_its_capped_importance_ratio():
    model = ToyLM(torch.zeros(2, 2))  # the student gives the rollout token 1 probability 1/2
    kl_t = 0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)
    kl_s = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    jsd = 0.5 * kl_t + 0.5 * kl_s  # teacher [1/4, 3/4], beta 0.5 (the hand-computed loss above)
    for sampler_prob, weight in ((1 / 6, 2.0), (1.0, 0.5), (0.5, 1.0)):  # ratios 3 (capped at 2), 1/2, 1
        batch = _toy_batch([0.0, math.log(3.0)])
        batch.rollout_logprobs = torch.tensor([[0.0, math.log(sampler_prob)]])
        out = _toy_algo(is_clip=2.0).loss(model, batch, torch.tensor(1.0))
        assert math.isclose(out.loss.item(), weight * jsd, rel_tol=1e-5), sampler_prob
        assert math.isclose(out.metrics["opsd/is_ratio"].item(), 0.5 / sampler_prob, rel_tol=1e-5)
        assert out.metrics["opsd/is_clipped"].item() == (1.0 if sampler_prob < 0.25 else 0.0)
    off = _toy_algo().loss(model, batch, torch.tensor(1.0))  # is_clip 0: no weighting, no metrics
    assert math.isclose(off.loss.item(), jsd, rel_tol=1e-5) and "opsd/is_ratio" not in off.metrics
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        _toy_algo(is_clip=2.0).loss(model, _toy_batch([0.0, 0.0]), torch.tensor(1.0))
    for bad in (-1.0, 0.5):
        with pytest.raises(ValueError, match=f"algo.is_clip={bad} must be 0"):
            OPSDConfig(is_clip=bad).validate()


def test_truncate_below_drops_each_rows_tokens_after_the_teachers_first_rejection():
    from algorithms.selfdistill import truncate_after_rejection

    # row 0: prompt 1 + 4 completion tokens, teacher probs [0.9, 0.2, 0.9, 0.9]; row 1: [0.9, 0.9, 0.9]
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    probs = torch.tensor([0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9])
    batch = Batch(torch.ones_like(mask), torch.ones_like(mask), mask.clone(), token_weights=mask.float())
    share = truncate_after_rejection(batch, probs.log(), 0.5)
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]  # the rejected token keeps its loss
    assert batch.token_weights.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert math.isclose(share.item(), 2 / 7, rel_tol=1e-6)
    # in OPSD's batch: the kept tokens are exactly those up to each row's first token whose teacher
    # probability (full logits of the teacher prompt's hidden states, at the training temperature) is < 0.3
    full, cut = _same_rollouts(4, OPSDConfig(truncate_below=0.3))
    weight, bias = full.teacher.head
    logits = full.teacher.hidden[:, :, 0] @ weight.T + (0 if bias is None else bias)
    p_tok = torch.softmax(logits / OPSDConfig().temperature, -1).gather(-1, full.input_ids.unsqueeze(-1)).squeeze(-1)
    for r in range(full.input_ids.shape[0]):
        positions = full.loss_mask[r].nonzero().flatten().tolist()
        first = next((i for i, t in enumerate(positions) if p_tok[r, t] < 0.3), len(positions))
        assert cut.loss_mask[r].nonzero().flatten().tolist() == positions[: first + 1]
    assert 0 < cut.metrics["opsd/truncated"].item() < 1  # some rows were cut, not all of every row
    assert math.isclose(cut.metrics["opsd/truncated"].item(), 1 - cut.loss_mask.sum().item() / full.loss_mask.sum().item(),
                        rel_tol=1e-5)
    with pytest.raises(ValueError, match="algo.truncate_below=1.0 must be in"):
        OPSDConfig(truncate_below=1.0).validate()


def test_clipped_tokens_get_no_gradient():
    model = ToyLM(torch.zeros(2, 2))
    out = _toy_algo(beta=0.0, token_clip=0.01).loss(model, _toy_batch([0.0, math.log(3.0)]), torch.tensor(1.0))
    out.loss.backward()
    assert model.model.embed.weight.grad.abs().sum() == 0


def test_teacher_prompt_is_used_whole_with_a_long_reference():
    model, tok = tiny()
    task = arith()
    ex = task.train_examples()[0]
    long_ref = ex.solution + "\n" + "1+1=2\n" * 60  # ~360 tokens, far longer than the student row
    ex = dataclasses.replace(ex, solution=long_ref)
    algo = OPSD(OPSDConfig())
    batch = algo.make_batch([ex], ctx(model, tok, task))
    prompt = tok(task.teacher_prompt(ex, long_ref), add_special_tokens=False).input_ids
    assert len(prompt) > batch.input_ids.shape[1]
    start = int(batch.loss_mask[0].nonzero()[0])
    n = int(batch.loss_mask[0].sum())
    completion = batch.input_ids[0, start: start + n].tolist()
    full = torch.tensor([prompt + completion])
    with torch.no_grad():
        direct = final_hidden(model, full, torch.ones_like(full))[0, len(prompt) - 1: len(prompt) - 1 + n]
    assert torch.allclose(batch.teacher.hidden[0, start: start + n, 0], direct, atol=1e-5)
    assert tok.decode(prompt).count("1+1=2") == 60


def test_teacher_hidden_alignment_matches_full_logits():
    """Stored teacher states + the head reproduce the teacher's own logits for every completion token."""
    model, tok = tiny()
    views = [[[5, 6, 7]], [[8, 9]]]
    completions = [[10, 11, 12], [13]]
    hidden = teacher_hidden(model, views, completions, starts=[2, 4], width=7, rows_per_pass=1,
                            device=torch.device("cpu"))
    head, _ = output_head(model)
    for b, (view, comp, start) in enumerate(zip(views, completions, [2, 4])):
        ids = torch.tensor([view[0] + comp])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(view[0]) - 1: len(view[0]) - 1 + len(comp)]
        assert torch.allclose(hidden[b, start: start + len(comp), 0] @ head.T, logits, atol=1e-4)


def test_two_steps_change_every_parameter_full_finetuning():
    model, tok = tiny()
    unchanged, _ = two_steps_change_every_trainable_parameter(OPSD(OPSDConfig()), model, tok, arith())
    assert not unchanged, unchanged


def test_lora_trains_adapters_only_and_fixed_teacher_disables_them():
    model, tok = tiny()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    algo = OPSD(OPSDConfig(lora_rank=4, teacher="fixed"))
    unchanged, peft_model = two_steps_change_every_trainable_parameter(algo, model, tok, arith(), lr=5e-2)
    assert not unchanged, unchanged
    frozen_changed = [n for n, p in peft_model.get_base_model().named_parameters()
                      if "lora_" not in n and not torch.equal(p, base[n.replace(".base_layer", "")])]
    assert not frozen_changed, frozen_changed
    # the fixed teacher is the base model: its hidden states equal a fresh untrained model's
    fresh, _ = tiny()
    ids = torch.tensor([[3, 4, 5, 6]])
    with algo.teacher.weights(peft_model) as teacher, torch.no_grad():
        assert torch.allclose(final_hidden(teacher, ids, torch.ones_like(ids)),
                              final_hidden(fresh, ids, torch.ones_like(ids)), atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(final_hidden(peft_model, ids, torch.ones_like(ids)),
                                  final_hidden(fresh, ids, torch.ones_like(ids)), atol=1e-5)


def test_ema_teacher_tracks_the_policy_outside_the_optimizer():
    model, tok = tiny()
    algo = OPSD(OPSDConfig(teacher="ema", ema_decay=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w0 = model.lm_head.weight.detach().clone()
    with algo.teacher.weights(model) as t:
        assert torch.equal(t.lm_head.weight, w0)  # first value: the current weights
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with algo.teacher.weights(model) as t:
        assert torch.allclose(t.lm_head.weight, w0 + 0.5)  # 0.5 old + 0.5 new
        ema_ids = {id(p) for p in t.parameters()}
        assert not any(p.requires_grad for p in t.parameters())
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not ema_ids & in_optimizer
    # checkpoint round trip
    restored = OPSD(OPSDConfig(teacher="ema", ema_decay=0.5))
    restored.load_state_dict(algo.state_dict())
    with restored.teacher.weights(model) as t:  # restored value, then one more EMA step toward w0 + 1
        assert torch.allclose(t.lm_head.weight, 0.5 * (w0 + 0.5) + 0.5 * (w0 + 1.0))


def test_grad_accumulation_invariance():
    model, tok = tiny()
    task = arith()
    algo = OPSD(OPSDConfig())
    batch = algo.make_batch(task.train_examples()[:6], ctx(model, tok, task))
    full, accumulated = grads(model, algo, batch, 6), grads(model, algo, batch, 2)
    for name in full:
        assert torch.allclose(full[name], accumulated[name], atol=1e-6, rtol=1e-4), name


def test_rollout_logprobs_match_the_trainer():
    model, tok = tiny()
    task = arith()
    algo = OPSD(OPSDConfig())
    batch = algo.make_batch(task.train_examples()[:4], ctx(model, tok, task))
    out = algo.loss(model, batch, batch.num_targets().float())
    mask = batch.loss_mask.bool()
    assert torch.allclose(out.token_logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4)


def test_missing_reference_solutions_fail_naming_the_field():
    model, tok = tiny()
    task = arith()
    bad = dataclasses.replace(task.train_examples()[0], solution="")
    task._splits = ([bad] + task.train_examples()[1:], task.test_examples())
    with pytest.raises(DataError, match="solution_field"):
        OPSD(OPSDConfig()).check_task(task)


def test_lora_export_is_an_adapter_that_loads_merged(tmp_path):
    from models.loading import load_pretrained

    model, tok = tiny()
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    base, _ = load_pretrained(str(base_dir))
    algo = OPSD(OPSDConfig(lora_rank=4))
    peft_model = algo.prepare_model(base)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a non-trivial adapter
    algo.export(peft_model, tok, str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_config.json").exists() and (tmp_path / "final" / "README.md").exists()
    merged, _ = load_pretrained(str(tmp_path / "final"))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-4)


def test_a_teacher_row_past_the_models_positions_is_refused_naming_the_example():
    from algorithms.scoring import teacher_hidden

    model, tok = tiny()
    positions = model.config.max_position_embeddings
    prompt, completion = [1] * (positions - 10), [2] * 10
    hidden = teacher_hidden(model, [[prompt]], [completion], [3], 13, 4, torch.device("cpu"), ["q7"])  # fits exactly
    assert hidden.shape[:3] == (1, 13, 1)
    with pytest.raises(ValueError, match=r"teacher row of example q7: .* > the model's \d+ positions"):
        teacher_hidden(model, [[prompt]], [completion + [2]], [3], 14, 4, torch.device("cpu"), ["q7"])


def test_skip_first_tokens_drops_each_rows_leading_completion_tokens_from_the_loss():
    from algorithms.selfdistill import skip_leading_tokens

    # rows: prompt 2 tokens + 3 completion tokens; prompt 1 + 4 completion
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    batch = Batch(torch.ones_like(mask), torch.ones_like(mask), mask.clone(), token_weights=mask.float() * 0.5)
    skip_leading_tokens(batch, 2)
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 1, 1]]
    assert batch.token_weights.tolist() == [[0, 0, 0, 0, 0.5], [0, 0, 0, 0.5, 0.5]]
    only = Batch(torch.ones_like(mask), torch.ones_like(mask), mask.clone())
    skip_leading_tokens(only, 1, rows=torch.tensor([False, True]))  # TESD: student rows only
    assert only.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    # in OPSD's batch: the normaliser counts N fewer tokens per row, and the loss equals the unskipped
    # batch's loss with those tokens' weights set to 0 (up to the normaliser)
    full, skipped = _same_rollouts(3, OPSDConfig(skip_first_tokens=3))
    model, _ = tiny()
    lengths = full.loss_mask.sum(1)
    assert torch.equal(skipped.loss_mask.sum(1), (lengths - 3).clamp(min=0))
    algo = OPSD(OPSDConfig())
    out = algo.loss(model, skipped, skipped.num_targets().float())
    weighted = dataclasses.replace(full, token_weights=skipped.loss_mask.float())
    ref = algo.loss(model, weighted, skipped.num_targets().float())
    assert torch.allclose(out.loss, ref.loss, atol=1e-6)
    with pytest.raises(ValueError, match="algo.skip_first_tokens=-1 must be >= 0"):
        OPSDConfig(skip_first_tokens=-1).validate()
    with pytest.raises(ValueError, match="top_k_tail=true needs algo.teacher_top_k > 0"):
        OPSDConfig(top_k_tail=True).validate()
