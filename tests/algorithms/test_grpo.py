"""GRPO: the worked example of docs/grpo.md, TRL's loss on identical tensors, exact aggregation under
grad accumulation and data parallelism, rollouts and rewards, and the bad inputs (G = 1, equal
rewards, empty completions, reward functions returning None)."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from algorithms.base import Batch, PolicyTerms
from trainer.prompt_sharing import shared_prompt_logprobs
from algorithms.grpo import GRPO, GRPOConfig, group_advantages, k3_kl
from selfdistill_helpers import arith, ctx, grads, tiny

# docs/grpo.md worked example: 2 sequences of 3 and 1 completion tokens (columns 1..3 of width 4).
LOGP = torch.tensor([[0.0, -0.2, -0.4, -0.1], [0.0, -0.7, 0.0, 0.0]])
OLD = torch.tensor([[0.0, -0.5, -0.3, -0.1], [0.0, -0.2, 0.0, 0.0]])
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
ADV = torch.tensor([1.0, -1.0])
EXPECTED = {"seq-mean-token-mean": -0.1174729, "token-mean": -0.5762094, "dr_grpo": -0.2881047}


def example_batch(loss_type: str, max_len: int = 4) -> Batch:
    b = Batch(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), MASK.clone(),
              policy=PolicyTerms(ADV.clone(), old_logprobs=OLD.clone()))
    if loss_type == "seq-mean-token-mean":
        b.row_units = torch.ones(2)
    elif loss_type == "dr_grpo":
        b.row_units = torch.full((2,), float(max_len))
    return b


def stub_logprobs(algo: GRPO, logp: torch.Tensor) -> torch.Tensor:
    """Route GRPO's log-prob computation to a leaf tensor so the loss alone is tested."""
    leaf = logp.clone().requires_grad_(True)
    algo.token_logprobs = lambda model, micro: leaf[micro.loss_mask.bool()]
    return leaf


@pytest.mark.parametrize("loss_type", list(EXPECTED))
def test_worked_example_from_algorithms_md(loss_type):
    algo = GRPO(GRPOConfig(loss_type=loss_type))
    leaf = stub_logprobs(algo, LOGP)
    batch = example_batch(loss_type)
    out = algo.loss(None, batch, batch.num_targets().float())
    assert out.loss.item() == pytest.approx(EXPECTED[loss_type], abs=1e-6)
    out.loss.backward()
    # token (0, 1): rho = e^0.3 = 1.35 > 1.2 with A > 0, and token (1, 1): rho = e^-0.5 = 0.61 < 0.8 with
    # A < 0 -> clipped, no gradient; the two unclipped tokens get one
    assert leaf.grad[0, 1] == 0 and leaf.grad[1, 1] == 0 and (leaf.grad[0, 2:] != 0).all()
    # unclipped token (0, 2): d/dlogp of -rho*A = -rho*A = -e^-0.1, then the aggregation weight
    weight = {"token-mean": 1 / 4, "seq-mean-token-mean": 1 / 3 / 2, "dr_grpo": 1 / 8}[loss_type]
    assert leaf.grad[0, 2].item() == pytest.approx(-math.exp(-0.1) * weight, rel=1e-5)


def test_worked_example_per_token_values():
    from algorithms.losses import clipped_policy_gradient

    per_token = clipped_policy_gradient(LOGP, OLD, ADV)[MASK.bool()]
    assert per_token.tolist() == pytest.approx([-1.2, -0.9048374, -1.0, 0.8], abs=1e-6)


def test_advantages_hand_computed():
    adv, zero = group_advantages(torch.tensor([1.0, 0, 0, 1]), torch.ones(4, dtype=torch.bool), 4)
    assert adv.tolist() == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754], abs=1e-6)
    assert zero.tolist() == [False]
    # two groups of 2: [1, 0] -> std 0.7071 -> +-0.70700; [0.5, 0.5] all equal -> 0, flagged
    adv, zero = group_advantages(torch.tensor([1.0, 0, 0.5, 0.5]), torch.ones(4, dtype=torch.bool), 2)
    assert adv.tolist() == pytest.approx([0.5 / (2 ** -0.5 + 1e-4), -0.5 / (2 ** -0.5 + 1e-4), 0, 0], abs=1e-6)
    assert zero.tolist() == [False, True]
    # Dr. GRPO: centred only
    adv, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), torch.ones(4, dtype=torch.bool), 4, scale="none")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # batch scale: group means, std over all 4 rewards [1, 0, 1, 1] (mean .75, unbiased var .25 -> std .5)
    adv, _ = group_advantages(torch.tensor([1.0, 0, 1, 1]), torch.ones(4, dtype=torch.bool), 2, scale="batch")
    assert adv.tolist() == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0, 0], abs=1e-6)


def test_advantages_ignore_invalid_rewards_and_single_samples():
    valid = torch.tensor([True, True, False, True, False, False])
    adv, zero = group_advantages(torch.tensor([1.0, 0.0, 123.0, 1.0, 5.0, 0.0]), valid, 3)
    # group 1: valid [1, 0] -> +-0.7070, the invalid one 0; group 2: one valid sample -> all 0
    assert adv.tolist() == pytest.approx([0.5 / (2 ** -0.5 + 1e-4), -0.5 / (2 ** -0.5 + 1e-4), 0, 0, 0, 0], abs=1e-6)
    assert zero.tolist() == [False, True]
    adv, zero = group_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, dtype=torch.bool), 1)  # G = 1
    assert adv.tolist() == [0.0, 0.0] and zero.all()


def test_k3_kl_hand_computed():
    # ref - logp = -0.5: e^-0.5 + 0.5 - 1 = 0.1065307
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-0.5])).item() == pytest.approx(0.1065307, abs=1e-6)
    assert k3_kl(torch.tensor([-0.3]), torch.tensor([-0.3])).item() == 0.0


def trl_loss(loss_type: str, logp, old, ref, mask, adv, beta: float, eps_low: float, eps_high: float,
             max_len: int) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on the given per-token tensors (its model forward stubbed out)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    accel = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                            gather_for_metrics=lambda x: x, sync_gradients=True)
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, max_completion_length=max_len,
        accelerator=accel, model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None))
    b, t = logp.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.slow  # imports TRL: 3.9 s for the first case
@pytest.mark.parametrize("ours,theirs", [("seq-mean-token-mean", "grpo"), ("token-mean", "dapo"),
                                         ("dr_grpo", "dr_grpo")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_trl_on_identical_tensors(ours, theirs, beta):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    b, t, max_len = 6, 7, 9
    logp = -torch.rand(b, t, generator=g) * 2
    old = logp + 0.3 * torch.randn(b, t, generator=g)  # some ratios outside [0.8, 1.28]
    ref = logp + 0.2 * torch.randn(b, t, generator=g)
    lengths = torch.tensor([7, 5, 1, 3, 7, 2])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    adv = torch.randn(b, generator=g)
    theirs_logp = logp.clone().requires_grad_(True)
    expected = trl_loss(theirs, theirs_logp, old, ref, mask, adv, beta, 0.2, 0.28, max_len)
    expected.backward()

    algo = GRPO(GRPOConfig(loss_type=ours, beta=beta, epsilon_high=0.28))
    # our rows carry a one-token prompt in front of the completion: shift everything right by one
    pad = lambda x: torch.nn.functional.pad(x, (1, 0))  # noqa: E731
    leaf = stub_logprobs(algo, pad(logp))
    batch = Batch(torch.ones(b, t + 1, dtype=torch.long), torch.ones(b, t + 1, dtype=torch.long), pad(mask),
                  policy=PolicyTerms(adv, old_logprobs=pad(old), ref_logprobs=pad(ref)))
    if ours == "seq-mean-token-mean":
        batch.row_units = torch.ones(b)
    elif ours == "dr_grpo":
        batch.row_units = torch.full((b,), float(max_len))
    got = algo.loss(None, batch, batch.num_targets().float())
    got.loss.backward()
    assert got.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(leaf.grad[:, 1:] * mask, theirs_logp.grad * mask, atol=1e-7, rtol=1e-5)


def rollout(loss_type: str = "token-mean", **kw):
    model, tok = tiny()
    task = arith()
    algo = GRPO(GRPOConfig(num_generations=4, loss_type=loss_type, **kw))
    algo.prepare_model(model)
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task, max_new_tokens=16))
    return algo, model, tok, task, batch


def test_make_batch_groups_rewards_and_logprobs():
    algo, model, tok, task, batch = rollout()
    assert len(batch) == 12 and batch.uids[:2] == [f"{task.train_examples()[0].uid}/0", f"{task.train_examples()[0].uid}/1"]
    assert batch.policy.prompt_lengths.tolist()[:4] == [batch.policy.prompt_lengths[0].item()] * 4
    # advantages sum to 0 in each group (group-relative)
    assert batch.policy.advantages.view(3, 4).sum(1).abs().max() < 1e-5
    assert {"rollout/reward", "grpo/frac_zero_std", "grpo/reward_none", "grpo/empty_completions"} <= set(batch.metrics)
    # trainer log-probs (logits / temperature) equal the engine's sampling log-probs
    algo.cfg.temperature = 1.0
    out = algo.loss(model, batch, batch.num_targets().float())
    mask = batch.loss_mask.bool()
    assert (out.token_logprobs[mask] - batch.rollout_logprobs[mask]).abs().max() < 1e-4


def test_logprobs_divide_logits_by_temperature():
    algo, model, tok, task, batch = rollout(temperature=0.7)
    mask = batch.loss_mask.bool()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    got = algo.token_logprobs(model, batch)
    torch.testing.assert_close(got, want[mask[:, 1:]], atol=1e-5, rtol=1e-5)
    # and the engine sampled at that temperature with the same log-probs
    assert (got - batch.rollout_logprobs[mask]).abs().max() < 1e-4


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "dr_grpo"])
def test_grad_accumulation_and_data_parallel_are_exact(loss_type):
    """One batch in one pass == micro-batches == two 'ranks' each with half the rows and the normaliser
    global/2, their gradients averaged (what DDP does)."""
    algo, model, tok, task, batch = rollout(loss_type)
    batch.policy.advantages = torch.linspace(-1, 1, len(batch))  # non-zero advantages on every row
    full = grads(model, algo, batch, len(batch))
    micro = grads(model, algo, batch, 5)
    halves = [batch._map(lambda t, r=r: t[r], r) for r in (torch.arange(0, 8), torch.arange(8, 12))]
    normaliser = batch.num_targets().float() / 2
    model.zero_grad()
    per_rank = []
    for half in halves:
        model.zero_grad()
        for m in half.micro_batches(3):
            algo.loss(model, m, normaliser).loss.backward()
        per_rank.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name, g in full.items():
        torch.testing.assert_close(micro[name], g, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close((per_rank[0][name] + per_rank[1][name]) / 2, g, atol=1e-7, rtol=1e-5)


def test_num_iterations_reuses_rollouts_with_stored_old_logprobs():
    algo, model, tok, task, batch = rollout(num_iterations=2)
    assert batch.policy.old_logprobs is not None
    mask = batch.loss_mask.bool()
    out = algo.loss(model, batch, batch.num_targets().float())
    assert (out.token_logprobs[mask] - batch.policy.old_logprobs[mask]).abs().max() < 1e-6  # rho = 1 at iteration 1
    again = algo.make_batch(task.train_examples()[3:6], ctx(model, tok, task))
    assert again is batch and again.metrics["grpo/iteration"].item() == 2.0
    fresh = algo.make_batch(task.train_examples()[3:6], ctx(model, tok, task))
    assert fresh is not batch


def test_kl_reference_is_the_starting_weights():
    algo, model, tok, task, batch = rollout(beta=0.1)
    mask = batch.loss_mask.bool()
    out = algo.loss(model, batch, batch.num_targets().float())
    assert (out.token_logprobs[mask] - batch.policy.ref_logprobs[mask]).abs().max() < 1e-5
    assert out.metrics["grpo/kl"].item() < 1e-6
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch2 = algo.make_batch(task.train_examples()[3:6], ctx(model, tok, task, seed=1))
    assert algo.loss(model, batch2, batch2.num_targets().float()).metrics["grpo/kl"].item() > 1e-4


def none_for_odd(prompts, completions, completion_ids, question, **columns):  # None = cannot judge
    return [None if sum(map(ord, q)) % 2 else float(len(c) % 2) for q, c in zip(question, completions)]


def test_bad_inputs_give_zero_advantage_never_nan():
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()[:4]
    # reward function returning None for half the prompts -> those rows get A = 0, logged
    algo = GRPO(GRPOConfig(num_generations=3, reward_funcs=["test_grpo:none_for_odd"]))
    batch = algo.make_batch(examples, ctx(model, tok, task))
    odd = torch.tensor([sum(map(ord, ex.question)) % 2 == 1 for ex in examples]).repeat_interleave(3)
    assert 0 < odd.sum() < len(odd)
    assert (batch.policy.advantages[odd] == 0).all() and batch.metrics["grpo/reward_none"].item() == odd.float().mean()
    # empty completions (a row with no completion token) and all-equal rewards
    batch.loss_mask[0] = 0
    batch.policy.advantages = torch.zeros(len(batch))
    for loss_type in ("token-mean", "seq-mean-token-mean", "dr_grpo"):
        algo.cfg.loss_type = loss_type
        out = algo.loss(model, batch, batch.num_targets().float().clamp(min=1))
        assert torch.isfinite(out.loss) and out.loss.item() == 0.0
        assert all(torch.isfinite(v) for v in out.metrics.values())
    # nothing to train on at all: still finite
    empty = Batch(batch.input_ids[:2], batch.attention_mask[:2], torch.zeros_like(batch.loss_mask[:2]),
                  policy=PolicyTerms(torch.zeros(2)))
    out = algo.loss(model, empty, torch.tensor(1.0))
    assert out.loss.item() == 0.0 and all(torch.isfinite(v) for v in out.metrics.values())


def test_group_of_one_warns_and_has_no_signal():
    model, tok = tiny()
    task = arith()
    with pytest.warns(UserWarning, match="num_generations=1"):
        algo = GRPO(GRPOConfig(num_generations=1))
    batch = algo.make_batch(task.train_examples()[:3], ctx(model, tok, task))
    assert (batch.policy.advantages == 0).all() and batch.metrics["grpo/frac_zero_std"].item() == 1.0


@pytest.mark.parametrize("key,value,message", [
    ("loss_type", "sum", "algo.loss_type=sum is not one of"),
    ("scale_rewards", "rank", "algo.scale_rewards=rank"),
    ("num_generations", 0, "algo.num_generations=0"),
    ("reward_funcs", ["justaname"], "algo.reward_funcs: 'justaname' must look like 'package.module:function'"),
    ("reward_weights", [1.0, 2.0], "algo.reward_weights has 2 values for 1 reward function"),
])
def test_config_errors_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GRPOConfig(**{key: value}).validate()


def test_two_steps_change_every_parameter():
    from selfdistill_helpers import two_steps_change_every_trainable_parameter

    model, tok = tiny()
    task = arith(steps=1)
    algo = GRPO(GRPOConfig(num_generations=4, reward_funcs=["test_grpo:length_reward"]))
    unchanged, _ = two_steps_change_every_trainable_parameter(algo, model, tok, task)
    assert unchanged == []


def length_reward(prompts, completions, completion_ids, **columns):  # dense: a random-init model gets a signal
    return [float(len(c)) for c in completions]


def test_prompt_sharing_gives_the_same_loss_and_gradients():
    algo, model, tok, task, batch = rollout("seq-mean-token-mean")
    batch.policy.advantages = torch.linspace(-1, 1, len(batch))
    flat_loss = algo.loss(model, batch, batch.num_targets().float()).loss.item()
    flat = grads(model, algo, batch, 8)
    algo.share_prompts(shared_prompt_logprobs)
    batch.share_group = torch.arange(3).repeat_interleave(4)
    micros = batch.micro_batches(8)
    assert [m.share_group.tolist() for m in micros] == [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2]]  # groups kept whole
    assert algo.loss(model, batch, batch.num_targets().float()).loss.item() == pytest.approx(flat_loss, rel=1e-5)
    shared = grads(model, algo, batch, 8)
    for name, g in flat.items():
        torch.testing.assert_close(shared[name], g, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("sharing", [False, True])
def test_loss_never_asks_the_model_for_full_logits(sharing):
    """Log-probs come from final hidden states + the head, chunked: the model is called with
    logits_to_keep=1, so [B, T, V] logits are never built (what lets a 151k vocabulary fit)."""
    algo, model, tok, task, batch = rollout()
    if sharing:
        algo.share_prompts(shared_prompt_logprobs)
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("logits_to_keep", 0))
        return forward(*args, **kwargs)

    model.forward = spy
    algo.loss(model, batch, batch.num_targets().float()).loss.backward()
    assert calls and all(k == 1 for k in calls)
