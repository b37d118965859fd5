"""Suffix cache reuse (inference/suffix.py): plans checked by hand, and every reuse mode held to full
re-prefill of the same prompt (the plain engine), exactly where the answer is known (no edit, no
relocation, layer 0, a one-layer model) and with a measured bound where relocation is approximate."""
from __future__ import annotations

import pytest
import torch

from inference.engine import Engine, EngineConfig
from inference.lean import KEY, VALUE
from inference.sampling import SamplingParams
from inference.suffix import ReuseConfig, ReusePlan, SessionEngine, Span, plan_reuse
from models.loading import random_qwen3

V = 60
TOL = 1e-5
# Small blocks so short test prompts have spans to relocate.
SMALL = dict(min_span=8, reforward=3, min_gain=4)
# Next-token KL of suffix reuse against full prefill on the edited prompt below (3-layer random model):
# measured 7.8e-3 (keys copied without the rotation: 0.23).
KL_BOUND = 0.05
# As in conftest: large enough that the random model's next-token distributions are far from uniform.
INIT_RANGE = 0.2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _model(layers: int = 3):
    return random_qwen3(V, hidden_size=64, num_layers=layers, num_heads=4, intermediate_size=128, head_dim=16,
                        kv_heads=2, max_positions=512, initializer_range=INIT_RANGE).eval()


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _edit():
    """A session's first prompt and its rewrite: a middle block deleted, a long block moved up by it,
    new text at the end."""
    head, gone, moved, tail = _tokens(1, 40), _tokens(2, 30), _tokens(3, 80), _tokens(4, 10)
    return head + gone + moved, head + moved + tail


def _partition(plan: ReusePlan, n: int) -> None:
    assert plan.reused() + len(plan.forward) == n
    assert plan.forward == sorted(plan.forward) and plan.forward[-1] == n - 1


def _kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _replay_turns(engine: SessionEngine, first: list[int], second: list[int], session="s") -> torch.Tensor:
    """First prompt replayed with a 3-token output, then the second: the second's logits (1, V)."""
    engine.replay([first], [[5, 6, 7]], [session])
    return engine.replay([second], [[1]], [session])


# --- planning by hand --------------------------------------------------------------------------------------

A, X, B = list(range(100, 105)), list(range(200, 204)), list(range(300, 312))  # distinct ids: one diff


def test_identical_prompt_reuses_all_but_the_last_token():
    plan = plan_reuse(A + B, A + B, ReuseConfig(mode="suffix", **SMALL))
    assert plan == ReusePlan(16, [], [16])


def test_pure_append_is_a_prefix_with_no_spans():
    plan = plan_reuse(A + B, A + B + X, ReuseConfig(mode="suffix", **SMALL))
    assert plan == ReusePlan(17, [], [17, 18, 19, 20])


def test_deleted_middle_block_relocates_the_block_and_reforwards_its_tail():
    cfg = ReuseConfig(mode="suffix", min_span=8, reforward=3, min_gain=0)
    plan = plan_reuse(A + X + B, A + B, cfg)  # B: old [9, 21) -> new [5, 17); 12 - 3 relocated
    assert plan == ReusePlan(5, [Span(old_start=9, new_start=5, length=9)], [14, 15, 16])
    _partition(plan, 17)


def test_blocks_shorter_than_min_span_are_ignored():
    plan = plan_reuse(A + X + B, A + B, ReuseConfig(mode="suffix", min_span=13, reforward=3, min_gain=0))
    assert plan == ReusePlan(5, [], list(range(5, 17)))


def test_max_spans_keeps_the_largest_blocks_in_prompt_order():
    b1, b2, b3 = list(range(400, 410)), list(range(500, 514)), list(range(600, 612))
    old = A + [1] + b1 + [2] + b2 + [3] + b3
    cfg = ReuseConfig(mode="suffix", max_spans=2, min_span=8, reforward=2, min_gain=0)
    plan = plan_reuse(old, A + b1 + b2 + b3 + X, cfg)
    # b2 (14 tokens, old 17) and b3 (12 tokens, old 32) beat b1 (10); listed by new position.
    assert plan.spans == [Span(17, 15, 12), Span(32, 29, 10)]
    assert plan.forward == [5 + i for i in range(10)] + [27, 28, 39, 40] + [41, 42, 43, 44]
    _partition(plan, 45)


def test_min_gain_falls_back_to_the_prefix_plan():
    old, new = A + X + B, A + B  # 9 tokens would be relocated
    kept = plan_reuse(old, new, ReuseConfig(mode="suffix", min_span=8, reforward=3, min_gain=9))
    dropped = plan_reuse(old, new, ReuseConfig(mode="suffix", min_span=8, reforward=3, min_gain=10))
    assert kept.reused() == 14 and dropped == ReusePlan(5, [], list(range(5, 17)))


def test_the_last_prompt_token_is_always_forwarded():
    plan = plan_reuse(A + X + B, A + B, ReuseConfig(mode="suffix", min_span=8, reforward=0, min_gain=0))
    assert plan.spans == [Span(9, 5, 11)] and plan.forward == [16]  # the block's last token is not reused
    assert plan_reuse(A + B + X, A + B, ReuseConfig()).forward == [16]  # a prefix of the old sequence


@pytest.mark.parametrize("cfg", [ReuseConfig(mode="suffix", relocate=False, **SMALL),
                                 ReuseConfig(mode="prefix", **SMALL)])
def test_without_relocation_the_plan_is_the_prefix_plan(cfg):
    assert plan_reuse(A + X + B, A + B, cfg) == ReusePlan(5, [], list(range(5, 17)))


def test_full_mode_and_a_new_session_forward_everything():
    assert plan_reuse(A + B, A + B, ReuseConfig(mode="full")) == ReusePlan(0, [], list(range(17)))
    assert plan_reuse((), A, ReuseConfig(mode="suffix")) == ReusePlan(0, [], list(range(5)))


# --- bad input ---------------------------------------------------------------------------------------------


def test_unknown_mode_and_bad_fields_name_themselves():
    with pytest.raises(ValueError, match="mode='lru'"):
        ReuseConfig(mode="lru")
    with pytest.raises(ValueError, match="min_span"):
        ReuseConfig(min_span=0)
    with pytest.raises(ValueError, match="reforward"):
        ReuseConfig(reforward=-1)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        plan_reuse(A, [], ReuseConfig())
    engine = SessionEngine(_model(1))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([A, []], GREEDY, sessions=["a", "b"])
    with pytest.raises(ValueError, match="twice"):
        engine.generate([A, B], GREEDY, sessions=["a", "a"])


# --- exact where nothing is approximated -------------------------------------------------------------------


def test_zero_edits_prefix_equals_suffix_exactly_and_full_prefill_within_rounding():
    model = _model()
    first = [_tokens(10, 30), _tokens(11, 21)]
    engines = {mode: SessionEngine(model, ReuseConfig(mode=mode, **SMALL)) for mode in ("full", "prefix", "suffix")}
    outs = {mode: e.generate(first, GREEDY, sessions=["a", "b"]) for mode, e in engines.items()}
    assert [o.tokens for o in outs["prefix"]] == [o.tokens for o in Engine(model).generate(first, GREEDY)]
    assert [o.tokens for o in outs["suffix"]] == [o.tokens for o in outs["full"]] == [o.tokens for o in outs["prefix"]]
    second = [p + o.tokens + _tokens(12 + i, 9) for i, (p, o) in enumerate(zip(first, outs["prefix"]))]
    logits = {mode: e.replay(second, [[1, 2]] * 2, ["a", "b"]) for mode, e in engines.items()}
    assert torch.equal(logits["prefix"], logits["suffix"])  # the same plan, the same arithmetic
    assert (logits["prefix"] - logits["full"]).abs().max() < TOL
    assert [s.prefix_tokens for s in engines["prefix"].stats] == [35, 26]  # the previous prompt + output - 1
    third = [p + [1, 2] + _tokens(20 + i, 5) for i, p in enumerate(second)]
    greedy = {mode: [o.tokens for o in e.generate(third, GREEDY, sessions=["a", "b"])] for mode, e in engines.items()}
    assert greedy["prefix"] == greedy["suffix"] == [o.tokens for o in Engine(model).generate(third, GREEDY)]


def test_relocation_off_equals_full_prefill_on_an_edited_prompt():
    model, (first, second) = _model(), _edit()
    exact = SessionEngine(model, ReuseConfig(mode="suffix", relocate=False, **SMALL))
    full = SessionEngine(model, ReuseConfig(mode="full"))
    got, ref = _replay_turns(exact, first, second), _replay_turns(full, first, second)
    assert exact.stats[0].prefix_tokens == 40 and exact.stats[0].relocated_tokens == 0
    assert (got - ref).abs().max() < TOL


def test_relocated_layer0_keys_equal_keys_computed_at_the_new_position():
    model, (first, second) = _model(), _edit()
    suffix = SessionEngine(model, ReuseConfig(mode="suffix", **SMALL))
    suffix.replay([first], [[5, 6, 7]], ["s"])
    before = suffix.sessions["s"]
    suffix.replay([second], [[1]], ["s"])
    span = suffix.sessions["s"]
    fresh = SessionEngine(model, ReuseConfig(mode="prefix"))
    fresh.replay([second], [[1]], ["new"])  # a new session: every token computed at its place
    ref = fresh.sessions["new"]
    assert suffix.stats[0].spans == 1 and suffix.stats[0].relocated_tokens == 80 - 3
    moved = slice(40, 40 + 77)  # the moved block's relocated tokens, now at positions 40..116 (were 70..146)
    for half in (KEY, VALUE):  # layer 0's K/V depend on the token and its position only
        assert (span.kv[0, half, :, moved] - ref.kv[0, half, :, moved]).abs().max() < TOL
    assert (before.kv[0, KEY, :, 70:147] - ref.kv[0, KEY, :, moved]).abs().max() > 0.1  # the rotation was needed
    # Later layers keep the old context's K/V: the approximation the plan accepts.
    assert (span.kv[1, KEY, :, moved] - ref.kv[1, KEY, :, moved]).abs().max() > 1e-3


def test_one_layer_model_suffix_reuse_is_exact():
    """With one layer every reused K/V depends only on token and position: relocation loses nothing."""
    model, (first, second) = _model(layers=1), _edit()
    suffix = SessionEngine(model, ReuseConfig(mode="suffix", **SMALL))
    got = _replay_turns(suffix, first, second)
    ref = _replay_turns(SessionEngine(model, ReuseConfig(mode="full")), first, second)
    assert suffix.stats[0].relocated_tokens == 77
    assert (got - ref).abs().max() < TOL


# --- approximate: relocation after an edit -----------------------------------------------------------------


def test_suffix_forwards_fewer_tokens_than_prefix_at_a_small_measured_kl():
    model, (first, second) = _model(), _edit()
    runs = {mode: SessionEngine(model, ReuseConfig(mode=mode, **SMALL)) for mode in ("full", "prefix", "suffix")}
    logits = {mode: _replay_turns(e, first, second) for mode, e in runs.items()}
    prefix, suffix = runs["prefix"].stats[0], runs["suffix"].stats[0]
    assert (prefix.prefill_tokens, suffix.prefill_tokens) == (90, 13)  # 130 prompt tokens; 40 prefix, 77 moved
    assert suffix.compute < prefix.compute < runs["full"].stats[0].compute
    assert (logits["prefix"] - logits["full"]).abs().max() < TOL
    kl = float(_kl(logits["full"], logits["suffix"]))
    assert 0 < kl < KL_BOUND, kl
    # Keys copied without the rotation are what relocation fixes: far worse than relocated ones.
    unrotated = _kl(logits["full"], _replay_unrotated(model, first, second))
    assert float(unrotated) > 5 * kl


def _replay_unrotated(model, first, second) -> torch.Tensor:
    import inference.suffix as suffix

    real = suffix.relocate_keys
    suffix.relocate_keys = lambda keys, old, new, layout: keys.clone()
    try:
        return _replay_turns(SessionEngine(model, ReuseConfig(mode="suffix", **SMALL)), first, second)
    finally:
        suffix.relocate_keys = real


# --- batches, sessions, state -------------------------------------------------------------------------------


def test_a_batch_of_different_plans_equals_each_row_alone():
    """Left padding with rows of different lengths and plans (relocated spans, pure append, a new session)."""
    model, (first, second) = _model(), _edit()
    short = _tokens(30, 12)
    batched = SessionEngine(model, ReuseConfig(mode="suffix", **SMALL))
    batched.replay([first, short], [[5, 6, 7], [8, 9]], ["edit", "append"])
    prompts = [second, short + [8] + _tokens(31, 4), _tokens(32, 20)]
    outs = [[1], [2, 3, 4], [5, 6]]
    got = batched.replay(prompts, outs, ["edit", "append", "new"])
    assert [s.spans for s in batched.stats] == [1, 0, 0]
    assert [s.prefix_tokens for s in batched.stats] == [40, 13, 0]
    for row, session in enumerate(["edit", "append", "new"]):
        alone = SessionEngine(model, ReuseConfig(mode="suffix", **SMALL))
        if row == 0:
            alone.replay([first], [[5, 6, 7]], [session])
        if row == 1:
            alone.replay([short], [[8, 9]], [session])
        ref = alone.replay([prompts[row]], [outs[row]], [session])
        assert (got[row] - ref[0]).abs().max() < TOL
        state, ref_state = batched.sessions[session], alone.sessions[session]
        assert state.tokens == ref_state.tokens == tuple(prompts[row] + outs[row][:-1])
        assert (state.kv - ref_state.kv).abs().max() < TOL


def test_rows_finishing_early_leave_their_state_for_the_next_call():
    model = _model()
    prompts = [_tokens(40, 9), _tokens(41, 17), _tokens(42, 5)]
    plain = Engine(model).generate(prompts, GREEDY)
    stop = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(plain[0].tokens[1],))
    engine = SessionEngine(model, ReuseConfig(mode="prefix"))
    outs = engine.generate(prompts, stop, sessions=["a", "b", "c"])
    assert [o.tokens for o in outs] == [o.tokens for o in Engine(model).generate(prompts, stop)]
    assert len({len(o.tokens) for o in outs}) > 1  # rows left the live batch at different rounds
    fresh = SessionEngine(model, ReuseConfig(mode="prefix"))
    seqs = [p + o.tokens[:-1] for p, o in zip(prompts, outs)]
    fresh.replay(seqs, [[]] * 3, ["x", "y", "z"])  # the same tokens, every one computed now
    for session, ref, seq in zip("abc", "xyz", seqs):
        assert engine.sessions[session].tokens == tuple(seq)
        assert (engine.sessions[session].kv - fresh.sessions[ref].kv).abs().max() < TOL
    follow = [p + o.tokens + _tokens(43 + i, 4) for i, (p, o) in enumerate(zip(prompts, outs))]
    again = engine.generate(follow, GREEDY, sessions=["a", "b", "c"])
    assert [s.prefix_tokens for s in engine.stats] == [len(s) for s in seqs]
    assert [o.tokens for o in again] == [o.tokens for o in Engine(model).generate(follow, GREEDY)]


def test_replay_then_generate_equals_full_prefill_in_prefix_mode():
    model = _model()
    prompts, outputs = [_tokens(50, 14), _tokens(51, 6)], [[7, 8, 9, 10], [11]]
    engine = SessionEngine(model, ReuseConfig(mode="prefix"))
    logits = engine.replay(prompts, outputs, ["a", "b"])
    full = SessionEngine(model, ReuseConfig(mode="full")).replay(prompts, outputs, ["a", "b"])
    assert logits.dtype == torch.float32 and (logits - full).abs().max() < TOL
    assert [s.decode_tokens for s in engine.stats] == [4, 1]
    follow = [p + o + _tokens(52 + i, 3) for i, (p, o) in enumerate(zip(prompts, outputs))]
    outs = engine.generate(follow, GREEDY, sessions=["a", "b"])
    assert [s.prefix_tokens for s in engine.stats] == [17, 6]
    assert [o.tokens for o in outs] == [o.tokens for o in Engine(model).generate(follow, GREEDY)]


def test_a_weight_update_drops_the_stored_state():
    model = _model()
    engine = SessionEngine(model, ReuseConfig(mode="prefix"))
    prompt = _tokens(60, 12)
    engine.replay([prompt], [[3, 4]], ["a"])
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # what an optimizer step does: in place
    logits = engine.replay([prompt + [3, 4]], [[5]], ["a"])
    assert engine.stats[0].prefix_tokens == 0  # the old K/V came from other weights
    full = SessionEngine(model, ReuseConfig(mode="full")).replay([prompt + [3, 4]], [[5]], ["a"])
    assert (logits - full).abs().max() < TOL


def test_full_mode_and_the_plain_fallback_hold_no_state_and_match_the_engine():
    model = _model()
    prompts = [_tokens(70, 8), _tokens(71, 3)]
    ref = [o.tokens for o in Engine(model).generate(prompts, GREEDY)]
    for reuse, config in ((ReuseConfig(mode="full"), None), (ReuseConfig(mode="suffix"), EngineConfig(use_lean=False))):
        engine = SessionEngine(model, reuse, config)
        assert [o.tokens for o in engine.generate(prompts, GREEDY, sessions=["a", "b"])] == ref
        assert len(engine) == 0 and [s.prefill_tokens for s in engine.stats] == [8, 3]
        assert [s.decode_tokens for s in engine.stats] == [len(t) for t in ref]


def test_sessions_are_counted_ended_and_cleared():
    engine = SessionEngine(_model(1))
    engine.generate([_tokens(80, 5), _tokens(81, 7)], SamplingParams(temperature=0.0, max_new_tokens=2), sessions=["a", "b"])
    assert len(engine) == 2
    engine.end("a")
    engine.end("never")
    assert len(engine) == 1 and "b" in engine.sessions
    engine.clear()
    assert len(engine) == 0


@pytest.mark.parametrize("mode", ["prefix", "suffix"])
def test_replay_under_bf16_autocast_matches_full_prefill(mode):
    """Training runs rollouts under torch.autocast (model.dtype=bfloat16) while the cache holds the fp32
    weights' dtype: the replay's scattered K/V writes cast to it (they used to raise a dtype error)."""
    model, (first, second) = _model(), _edit()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reused = _replay_turns(SessionEngine(model, ReuseConfig(mode=mode, **SMALL)), first, second)
        full = _replay_turns(SessionEngine(model, ReuseConfig(mode="full")), first, second)
    assert torch.isfinite(reused).all()
    # measured: prefix 0 (the same arithmetic), suffix 8.0e-3 (7.8e-3 in fp32)
    assert _kl(full.float(), reused.float()).max() < KL_BOUND
