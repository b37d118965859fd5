"""CLM: the advantage by hand, episodes over the session engine, stepwise rows under their own contexts."""
from __future__ import annotations

import pytest
import torch

from algorithms.advantages import group_advantages
from algorithms.base import RolloutContext
from algorithms.clm import CLM, CLMConfig, call_advantages, efficiency_advantages, play_episodes
from algorithms.rollouts import encode
from inference import SamplingParams
from inference.suffix import ReuseConfig, SessionEngine
from models.loading import TinySpec, build_tiny
from tasks.clm import ClmTask, ContextEnv, Episode


def test_efficiency_advantage_by_hand():
    # one group: successes at 100, 300, 80 -> mean 160; the failure gets 0
    a = efficiency_advantages(torch.tensor([100.0, 300.0, 50.0, 80.0]), torch.tensor([True, True, False, True]), 4)
    assert a.tolist() == pytest.approx([60 / 160, -140 / 160, 0.0, 80 / 160])
    # clipped at -1: 1000 against a mean of (10 + 1000) / 2 = 505 -> (505 - 1000) / 505 = -0.98; 10 -> +0.98
    a = efficiency_advantages(torch.tensor([10.0, 1000.0]), torch.tensor([True, True]), 2)
    assert a.tolist() == pytest.approx([495 / 505, -495 / 505])
    a = efficiency_advantages(torch.tensor([10.0, 10.0, 1000.0]), torch.tensor([True, True, True]), 3)
    assert a[2].item() == -1.0  # (340 - 1000) / 340 = -1.94 -> clipped
    # fewer than 2 successes in a group: 0 for all of it; groups are independent
    a = efficiency_advantages(torch.tensor([100.0, 50.0, 100.0, 300.0]), torch.tensor([True, False, True, True]), 2)
    assert a.tolist() == pytest.approx([0.0, 0.0, 0.5, -0.5])


def test_call_advantage_adds_efficiency_on_edit_calls_only():
    task_adv = torch.tensor([0.5, -0.5])
    eff = torch.tensor([0.4, 0.0])
    episode_of = torch.tensor([0, 0, 0, 1, 1])
    edit = torch.tensor([False, True, False, True, False])
    a = call_advantages(task_adv, eff, episode_of, edit, 0.25)
    assert a.tolist() == pytest.approx([0.5, 0.6, 0.5, -0.5, -0.5])
    # w_eff = 0 is plain GRPO: every call of an episode carries its group-normalised reward
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, _ = group_advantages(rewards, torch.ones(4, dtype=torch.bool), 4)
    plain = call_advantages(adv, torch.ones(4), torch.tensor([0, 0, 1, 2, 3]), torch.ones(5, dtype=torch.bool), 0.0)
    assert plain.tolist() == pytest.approx([0.8658754, 0.8658754, -0.8658754, -0.8658754, 0.8658754], abs=1e-6)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny(TinySpec(64, 2, 4, 128), seed=0)
    return model, tokenizer


def _ctx(task, tokenizer, model, seed=0, max_new_tokens=24):
    gen = torch.Generator().manual_seed(seed)
    return RolloutContext(task, tokenizer, gen, torch.device("cpu"), max_new_tokens, policy_fn=lambda: model)


def test_each_call_is_trained_under_its_own_context(tiny):
    """Row k of a batch is exactly (the context call k saw) + (what it generated), and the loss is the
    sum over calls of the clipped objective under those contexts; the final context would differ."""
    model, tok = tiny
    task = ClmTask(seed=0, n_train=4, n_test=2)
    algo = CLM(CLMConfig(num_generations=2, max_calls=3))
    batch = algo.make_batch(task.train_examples()[:2], _ctx(task, tok, model))
    assert len(batch) >= 4  # 2 tasks x 2 episodes, at least one call each
    # Replay every episode's recorded outputs through a fresh environment: each row's prompt is the
    # context the environment showed at that call.
    by_episode: dict[str, list[int]] = {}
    for r, uid in enumerate(batch.uids):
        by_episode.setdefault(uid.rsplit("/call", 1)[0], []).append(r)
    examples = {ex.uid: ex for ex in task.train_examples()[:2]}
    finals = {}
    for key, rs in by_episode.items():
        env = ContextEnv(examples[key.rsplit("/", 1)[0]], fmt=task.fmt, count_tokens=lambda s: len(encode(tok, s)),
                         budget=task.budget, max_calls=3)
        for r in rs:
            ids = batch.input_ids[r][batch.attention_mask[r].bool()].tolist()
            n_prompt = int(batch.policy.prompt_lengths[r])
            assert ids[:n_prompt] == encode(tok, env.prompt())
            completion = ids[n_prompt:]
            assert batch.loss_mask[r].sum().item() == len(completion)
            env.step(tok.decode(completion, skip_special_tokens=True))
        finals[key] = env.prompt()
    # The loss against a slow reference: one plain forward per row under its own prompt. (A random
    # model never succeeds, so every advantage is 0; nonzero ones make the comparison able to fail.)
    batch.policy.advantages = torch.linspace(-1.0, 1.0, len(batch))
    model.zero_grad()
    out = algo.loss(model, batch, normaliser=batch.num_targets().float())
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total, n_tokens = 0.0, batch.num_targets().float()
    for r in range(len(batch)):
        ids = batch.input_ids[r][batch.attention_mask[r].bool()]
        n_prompt = int(batch.policy.prompt_lengths[r])
        logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        token_logp = logp.gather(1, ids[1:, None])[:, 0][n_prompt - 1:]
        total = total + (-(batch.policy.advantages[r] * token_logp)).sum()  # rho = 1 on a single pass
    (total / n_tokens).backward()
    for n, p in model.named_parameters():
        if n in got:
            assert torch.allclose(got[n], p.grad, atol=1e-6, rtol=1e-4), n
    # on a single pass rho = 1, so the loss value is -sum(A x tokens) / N; the gradient is -A dlogp
    value = -(batch.policy.advantages * batch.loss_mask.sum(1).float()).sum() / n_tokens
    assert out.loss.item() == pytest.approx(value.item(), abs=1e-6)
    # Negative control: the same objective with every call under its episode's final context has
    # another gradient.
    model.zero_grad()
    wrong = 0.0
    for key, rs in by_episode.items():
        for r in rs:
            ids = batch.input_ids[r][batch.attention_mask[r].bool()]
            n_prompt = int(batch.policy.prompt_lengths[r])
            final = torch.tensor(encode(tok, finals[key]) + ids[n_prompt:].tolist())
            logp = torch.log_softmax(model(final[None]).logits[0, :-1].float(), -1)
            token_logp = logp.gather(1, final[1:, None])[:, 0][len(final) - 1 - (len(ids) - n_prompt):]
            wrong = wrong + (-(batch.policy.advantages[r] * token_logp)).sum()
    (wrong / n_tokens).backward()
    assert max((got[n] - p.grad).abs().max().item() for n, p in model.named_parameters() if n in got) > 1e-4
    model.zero_grad()


def test_engine_compute_and_metrics_are_logged(tiny):
    model, tok = tiny
    task = ClmTask(seed=1, n_train=4, n_test=2)
    algo = CLM(CLMConfig(num_generations=2, max_calls=2))
    batch = algo.make_batch(task.train_examples()[:2], _ctx(task, tok, model, seed=3))
    m = batch.metrics
    for key in ("clm/success", "clm/compute", "clm/edits", "clm/context_tokens", "clm/calls", "clm/overflow",
                "clm/call_cap", "clm/frac_zero_std"):
        assert key in m, key
    assert m["clm/compute"].item() > 0
    # a random model never answers within 2 calls: every episode is a failure, no advantage
    assert m["clm/success"].item() == 0.0 and batch.policy.advantages.abs().max().item() == 0.0


def test_budget_below_the_prefix_is_a_logged_invalid_episode(tiny):
    model, tok = tiny
    task = ClmTask(seed=0, n_train=4, n_test=2)
    ep = task.train_examples()[0]
    tight = Episode(**{**ep.__dict__, "budget": 3, "uid": "tight"})
    algo = CLM(CLMConfig(num_generations=2, max_calls=2))
    with pytest.warns(UserWarning, match="tight"):
        batch = algo.make_batch([tight, ep], _ctx(task, tok, model))
    assert batch.metrics["clm/invalid"].item() == pytest.approx(0.5)
    assert all(not u.startswith("tight/") for u in batch.uids)


def test_a_batch_of_only_invalid_episodes_still_trains_a_zero_row(tiny):
    model, tok = tiny
    task = ClmTask(seed=0, n_train=4, n_test=2)
    tight = Episode(**{**task.train_examples()[0].__dict__, "budget": 3, "uid": "tight"})
    algo = CLM(CLMConfig(num_generations=2, max_calls=2))
    with pytest.warns(UserWarning, match="tight"):
        batch = algo.make_batch([tight], _ctx(task, tok, model))
    assert len(batch) == 1 and batch.loss_mask.sum().item() == 0
    out = algo.loss(model, batch, normaliser=torch.tensor(1.0))
    out.loss.backward()  # joins the backward (a rank with nothing to train must not skip it)
    assert out.loss.item() == 0.0
    model.zero_grad()


def test_call_cap_ends_an_episode_without_crashing(tiny):
    model, tok = tiny
    task = ClmTask(seed=0, n_train=2, n_test=2)
    engine = SessionEngine(model, ReuseConfig(mode="prefix"))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    trajs = play_episodes(engine, tok, task, task.train_examples()[:2], params, max_calls=1,
                          generator=torch.Generator().manual_seed(0))
    assert [len(t.calls) for t in trajs] == [1, 1]
    assert {t.outcome for t in trajs} <= {"call_cap", "overflow", "answered"}
    assert len(engine) == 0  # sessions ended


def test_clm_refuses_a_task_without_episodes():
    from tasks import ArithTask, DataError

    with pytest.raises(DataError, match="algo clm plays context-file episodes"):
        CLM(CLMConfig()).check_task(ArithTask(n_train=8, n_test=4))


def test_reuse_modes_are_the_engine_modes():
    from algorithms.clm import REUSE_MODES
    from inference.suffix import MODES

    assert REUSE_MODES == MODES


def test_config_errors_name_the_key():
    for kwargs, key in (({"reuse": "lru"}, "algo.reuse"), ({"w_eff": -1.0}, "algo.w_eff"),
                        ({"max_calls": 0}, "algo.max_calls"), ({"reuse_min_span": -3}, "algo.reuse_")):
        with pytest.raises(ValueError, match=key):
            CLMConfig(**kwargs).validate()


def test_a_zero_weight_filler_micro_batch_adds_nothing(tiny):
    """Under torchrun a rank with fewer calls than another runs zero-weight fillers (trainer.loop), so
    every rank joins the same gradient syncs: the filler's loss and every gradient it makes are 0."""
    from trainer.loop import zero_weight

    model, tok = tiny
    task = ClmTask(seed=0, n_train=4, n_test=2)
    algo = CLM(CLMConfig(num_generations=2, max_calls=2))
    batch = algo.make_batch(task.train_examples()[:1], _ctx(task, tok, model))
    batch.policy.advantages.fill_(1.0)  # a real row would train
    filler = zero_weight(batch.micro_batches(8)[0])
    assert len(filler) == 1 and filler.loss_mask.sum().item() == 0
    assert torch.equal(filler.input_ids[0], batch.micro_batches(8)[0].input_ids[0])
    model.zero_grad()
    out = algo.loss(model, filler, normaliser=torch.tensor(1.0))
    out.loss.backward()
    assert out.loss.item() == 0.0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and all(g.abs().max().item() == 0.0 for g in grads)
    model.zero_grad()
    real = algo.loss(model, batch.micro_batches(8)[0], normaliser=torch.tensor(1.0))
    real.loss.backward()
    assert any(p.grad.abs().max().item() > 0 for p in model.parameters())  # the same row unmasked does train
    model.zero_grad()


def test_episode_groups_have_a_signal_when_success_or_the_successes_compute_differ():
    from types import SimpleNamespace

    from algorithms.clm import episode_groups

    def t(success, compute, valid=True):
        call = SimpleNamespace(completion=SimpleNamespace(tokens=[1, 2, 3]))
        return SimpleNamespace(success=success, compute=compute, valid=valid, calls=[call])

    trajs = [t(1, 10), t(0, 10),      # success differs
             t(1, 10), t(1, 30),      # both succeed, different compute: efficiency signal
             t(1, 10), t(1, 10),      # both succeed alike: nothing
             t(0, 10), t(1, 20, valid=False)]  # the success is an invalid episode
    groups = episode_groups(trajs, 2)
    assert [g.spread for g in groups] == [True, True, False, False]
    assert [g.generated_tokens for g in groups] == [6, 6, 6, 6]
    # dynamic_metric=success: the efficiency-only group has no spread
    assert [g.spread for g in episode_groups(trajs, 2, "success")] == [True, False, False, False]


def test_zero_loss_is_true_exactly_when_no_trained_token_has_an_advantage():
    from algorithms.base import Batch, PolicyTerms, capabilities
    from algorithms.clm import CLM, CLMConfig

    algo = CLM(CLMConfig())
    assert capabilities(algo).zero_loss is not None
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    micro = lambda adv: Batch(torch.ones_like(mask), torch.ones_like(mask), mask,  # noqa: E731
                              policy=PolicyTerms(torch.tensor(adv)))
    assert algo.zero_loss(micro([0.0, 0.0])) and not algo.zero_loss(micro([0.0, 0.3]))


def test_a_micro_batch_without_loss_tokens_gives_every_weight_a_zero_gradient():
    """A zero-weight filler (no loss token) still backpropagates into every parameter, so a rank with
    fewer rows joins the data-parallel gradient sync."""
    from algorithms.base import Batch, PolicyTerms
    from algorithms.clm import CLM, CLMConfig
    from models.loading import TinySpec, build_tiny

    model, _ = build_tiny(TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), seed=0)
    ids = torch.tensor([[1, 2, 3]])
    micro = Batch(ids, torch.ones_like(ids), torch.zeros_like(ids), policy=PolicyTerms(torch.zeros(1)))
    out = CLM(CLMConfig()).loss(model, micro, torch.tensor(1.0))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_kl_to_the_starting_weights_is_grpos_k3_on_every_call_token():
    """algo.beta > 0: each call token's log-prob under the weights the run started from is stored with the
    batch (a slow reference: a copy of those weights, one plain forward per row), the loss adds beta x the
    k3 estimate exp(ref - logp) - (ref - logp) - 1 on every token, and no micro-batch is skipped."""
    import copy

    model, tok = build_tiny(TinySpec(64, 2, 4, 128), seed=0)
    start = copy.deepcopy(model)
    task = ClmTask(seed=0, n_train=4, n_test=2)
    algo = CLM(CLMConfig(num_generations=2, max_calls=2, beta=0.1))
    ctx = _ctx(task, tok, model)
    algo.make_batch(task.train_examples()[:1], ctx)  # the reference is taken on first use
    with torch.no_grad():  # training moves the policy away from its start
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = algo.make_batch(task.train_examples()[1:2], ctx)
    sel = batch.loss_mask.bool()
    batch.policy.advantages = torch.zeros(len(batch))  # only the KL term is left
    assert not algo.zero_loss(batch)
    out = algo.loss(model, batch, normaliser=batch.num_targets().float())

    def row_logprobs(net, r):  # one plain forward of row r; its completion tokens' log-probs
        ids = batch.input_ids[r][batch.attention_mask[r].bool()]
        with torch.no_grad():
            logp = torch.log_softmax(net(ids[None]).logits[0, :-1].float(), -1)
        return logp.gather(1, ids[1:, None])[:, 0][int(batch.policy.prompt_lengths[r]) - 1:]

    total = 0.0
    for r in range(len(batch)):
        ref = batch.policy.ref_logprobs[r][sel[r]]
        assert torch.allclose(ref, row_logprobs(start, r), atol=1e-5)
        d = ref - row_logprobs(model, r)
        total += (torch.exp(d) - d - 1).sum().item()
    assert total > 0 and out.loss.item() == pytest.approx(0.1 * total / batch.num_targets().item(), rel=1e-4)
    assert out.metrics["clm/kl"].item() == pytest.approx(total / batch.num_targets().item(), rel=1e-4)
    assert "reference" in algo.state_dict()
    with pytest.raises(ValueError, match="algo.beta"):
        CLMConfig(beta=-0.1).validate()


def answer_length(prompts, completions, completion_ids, question, **columns):
    """A TRL-style reward over each episode's final output: its length (dense), reading the question column."""
    assert len(question) == len(completions)
    return [float(len(ids)) for ids in completion_ids]


def test_reward_functions_score_the_episodes_final_outputs(tiny):
    model, tok = tiny
    task = ClmTask(seed=0, n_train=4, n_test=2)
    algo = CLM(CLMConfig(num_generations=2, max_calls=2, reward_funcs=["test_clm:answer_length", "verifier"],
                         reward_weights=[0.5, 1.0]))
    batch = algo.make_batch(task.train_examples()[:2], _ctx(task, tok, model))
    # reward = 0.5 x the last call's length + success; the metrics hold each function's mean
    assert batch.metrics["rewards/answer_length/mean"].item() > 0
    expected = 0.5 * batch.metrics["rewards/answer_length/mean"] + batch.metrics["rewards/verifier/mean"]
    assert batch.metrics["rollout/reward"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert batch.metrics["rewards/verifier/mean"].item() == pytest.approx(batch.metrics["clm/success"].item())
