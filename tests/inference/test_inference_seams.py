"""The engine's seams, where a change there can break them: one stop rule for every mode, the linear
op every projection goes through, per-layer routing, K/V written into the cache from outside, the
engine config, and the exported drafter file shared by trainer and runtime."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from inference import Engine, EngineConfig, SamplingParams
from inference import lean, rollout
from inference.artifacts import DRAFTER_DEFAULTS, SEED_DRAFTER_FILE, DrafterSpec, read_drafter_spec, write_drafter_spec
from inference.lean import KVCache, LeanBackend, Route, dense, read_dims, rope_tables
from inference.rollout import NO_TOKEN, Emitted, Rollout, StopRule
from inference.speculative import SpeculativeDecoder

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def backend(model, batch: int, max_len: int, **kwargs) -> LeanBackend:
    return LeanBackend(model, read_dims(model), rope_tables(model, max_len), batch, max_len, **kwargs)


def prefill_and_decode(b: LeanBackend, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill all but the last token of ids (1, T), then decode the last: both logits."""
    T = ids.shape[1]
    with torch.inference_mode():
        first = b.prefill(ids[:, :-1], torch.arange(T - 1)[None], torch.ones(1, T - 1, dtype=torch.bool))
        second = b.decode(ids[:, -1], torch.tensor([T - 1]))
    return [first, second]


# ----------------------------------------------------------------------------- one stop rule


def test_stop_rule_matches_across_the_chunk_boundary():
    rule = StopRule(SamplingParams(stop_token_ids=(9,), stop_sequences=((1, 2, 3), (5,))), torch.device("cpu"))
    assert rule.history == 2
    # Rows: history (2 tokens) then a chunk of 3. Row 0: the sequence 1 2 | 3 spans the boundary;
    # row 1: a stop id inside the chunk; row 2: a short output (NO_TOKEN history) with no stop;
    # row 3: a one-token sequence at the chunk's end.
    window = torch.tensor([[1, 2, 3, 4, 4], [0, 0, 7, 9, 7], [NO_TOKEN, NO_TOKEN, 2, 3, 4], [0, 0, 4, 4, 5]])
    assert rule.hits(window).tolist() == [[True, False, False], [False, True, False],
                                          [False, False, False], [False, False, True]]


def test_rollout_truncates_a_chunk_at_its_first_stop():
    params = SamplingParams(max_new_tokens=4, stop_sequences=((3, 4),))
    run = Rollout(3, 4, params, torch.device("cpu"))
    assert run.record(Emitted(torch.tensor([[3], [3], [1]]), torch.zeros(3, 1))) is None
    assert run.room() == 3
    # Row 0 completes 3 4 with its chunk's first token (the rest is dropped); row 1's chunk holds
    # 2 real tokens of 3 (the third, 4, is filler and must not stop it); row 2 fills its budget.
    tokens = torch.tensor([[4, 4, 4], [1, 2, 4], [1, 1, 1]])
    live = run.record(Emitted(tokens, torch.arange(9.0).view(3, 3), torch.tensor([3, 2, 3])))
    assert live.tolist() == [1] and run.room().tolist() == [1] and not run.done
    assert run.record(Emitted(torch.tensor([[2, 2, 2]]), torch.zeros(1, 3), torch.tensor([1]))).numel() == 0
    assert run.done
    outs = run.completions()
    assert [o.tokens for o in outs] == [[3, 4], [3, 1, 2, 2], [1, 1, 1, 1]]
    assert [o.finish_reason for o in outs] == ["stop", "length", "length"]
    assert outs[0].logprobs == [0.0, 0.0] and outs[1].logprobs == [0.0, 3.0, 4.0, 0.0]


def test_both_modes_stop_through_the_one_rule(qwen3, prompts, monkeypatch):
    calls = []
    original = rollout.StopRule.hits

    def spy(self, window):
        calls.append(window.shape[1])
        return original(self, window)

    monkeypatch.setattr(rollout.StopRule, "hits", spy)
    free = Engine(qwen3).generate(prompts, GREEDY)
    seq = tuple(free[0].tokens[4:6])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_sequences=(seq,))
    plain = Engine(qwen3).generate(prompts, params)
    plain_calls, calls[:] = len(calls), []
    spec = SpeculativeDecoder(qwen3, mode="external", drafter=qwen3, adaptive=False, draft_len=3)
    outs = spec.generate(prompts, params)
    assert plain_calls > 0 and calls and max(calls) > 2  # speculative chunks go through it too
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert plain[0].finish_reason == "stop" and tuple(plain[0].tokens[-2:]) == seq


# ----------------------------------------------------------------------------- the linear op


def test_every_projection_goes_through_the_linear_op(qwen3):
    calls = []

    def recording(x, weight, bias):
        calls.append(weight)
        return F.linear(x, weight, bias)

    ids = torch.tensor([[5, 9, 11, 3, 7]])
    recorded = backend(qwen3, 1, 8, linear=recording)
    expected = prefill_and_decode(backend(qwen3, 1, 8), ids)
    got = prefill_and_decode(recorded, ids)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    layers = qwen3.config.num_hidden_layers
    assert len(calls) == 2 * (4 * layers + 1)  # q|k|v, o, gate|up, down per layer + lm_head; 2 forwards
    w = recorded.weights
    projections = [p for lw in w.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [w.lm_head]
    assert {id(p.weight) for p in projections} == {id(t) for t in calls}
    assert all(p.op is recording for p in projections)
    attn = qwen3.model.layers[0].self_attn
    assert torch.equal(w.layers[0].qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                           attn.v_proj.weight]))


# ----------------------------------------------------------------------------- routing


def test_route_runs_every_layer_and_dense_changes_nothing(qwen3):
    seen, attached, begun = [], [], []

    class DenseRecording(Route):
        def attach(self, model, weights, dims):
            attached.append(len(weights.layers))

        def begin(self, valid):
            begun.append(tuple(valid.shape))

        def __call__(self, layer, x, *rest):
            seen.append((layer, tuple(x.shape)))
            return dense(layer, x, *rest)

    ids = torch.tensor([[5, 9, 11, 3, 7]])
    got = prefill_and_decode(backend(qwen3, 1, 8, route=DenseRecording()), ids)
    for a, b in zip(got, prefill_and_decode(backend(qwen3, 1, 8), ids)):
        assert torch.equal(a, b)
    assert seen == [(0, (1, 4, 64)), (1, (1, 4, 64)), (0, (1, 1, 64)), (1, (1, 1, 64))]
    assert attached == [2] and begun == [(1, 4)]  # handed the weights once, told the prompt's real tokens

    class ZeroLayerOne(Route):  # a route decides what a layer computes
        def __call__(self, layer, x, *rest):
            out = dense(layer, x, *rest)
            return out * 0 if layer == 1 else out

    logits = prefill_and_decode(backend(qwen3, 1, 8, route=ZeroLayerOne()), ids)
    assert not torch.equal(logits[0], got[0])


# ----------------------------------------------------------------------------- cache contents


def test_row_writes_cast_to_the_cache_dtype_as_slice_writes_do(qwen3):
    """Under bf16 autocast K/V come in bf16 into an fp32 cache: writing a subset of rows (a skip route's
    gathered rows) stores what writing every row stores (it raised before: advanced indexing does not cast)."""
    dims = read_dims(qwen3)
    every, some = KVCache(dims, 3, 8, torch.float32, "cpu"), KVCache(dims, 3, 8, torch.float32, "cpu")
    k = torch.randn(3, 2, dims.kv_heads, dims.head_dim).to(torch.bfloat16)
    v = torch.randn(3, 2, dims.kv_heads, dims.head_dim).to(torch.bfloat16)
    every.write(0, 1, k, v)
    rows = torch.tensor([0, 2])
    some.write_rows(0, 1, rows, k[rows], v[rows])
    assert torch.equal(some.kv[0, :, rows, :, 1:3], every.kv[0, :, rows, :, 1:3])


def test_kv_written_from_outside_is_attended_like_a_prefill(qwen3):
    """K/V of a prefix copied in with KVCache.write, then a forward over only the new tokens, gives
    the logits of prefilling the whole sequence."""
    ids = torch.tensor([[5, 9, 11, 3, 7, 20, 14]])
    T, P = ids.shape[1], 4
    full = backend(qwen3, 1, T)
    part = backend(qwen3, 1, T)
    with torch.inference_mode():
        expected = full.prefill(ids, torch.arange(T)[None], torch.ones_like(ids, dtype=torch.bool))
        for layer in range(qwen3.config.num_hidden_layers):
            keys, values = full.cache.read(layer, P)  # (1, H_kv, P, D) each
            part.cache.write(layer, 0, keys.transpose(1, 2), values.transpose(1, 2))
        # A forward over several new tokens after slot 0 needs its own causal mask (SDPA's
        # is_causal aligns the query block to key 0).
        causal = torch.arange(T)[None, :] <= torch.arange(P, T)[:, None]  # (T - P, T)
        got = lean.forward(part.weights, part.dims, part.blocks, part.rope, ids[:, P:], torch.arange(P, T)[None],
                           part.cache, P, causal[None, None])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(part.kv, full.kv, atol=1e-5, rtol=0)


def test_kv_cache_keep_and_gather_slots():
    dims = lean.Dims(layers=1, heads=2, kv_heads=1, head_dim=1, eps=1e-6, qk_norm=False)
    cache = KVCache(dims, 3, 4, torch.float32, torch.device("cpu"))
    k = torch.arange(12.0).view(3, 4, 1, 1)  # (n, T, H_kv, D): row r, slot t -> 4 r + t
    cache.write(0, 0, k, -k)
    cache.key_ok[1, 0, 0, 2] = False
    cache.keep(torch.tensor([2, 1]), used=4)
    keys, values = cache.read(0, 4)
    assert cache.n == 2 and keys[:, 0, :, 0].tolist() == [[8, 9, 10, 11], [4, 5, 6, 7]]
    assert torch.equal(values, -keys) and cache.key_ok[1, 0, 0].tolist() == [True, True, False, True]
    cache.gather_slots(torch.tensor([[0, 1, 3], [0, 1, 3]]), used=4)
    assert cache.read(0, 3)[0][:, 0, :, 0].tolist() == [[8, 9, 11], [4, 5, 7]]
    assert cache.key_ok[1, 0, 0, :3].tolist() == [True, True, True]


# ----------------------------------------------------------------------------- engine config


def test_engine_config_round_trip_and_use(qwen3, prompts):
    config = EngineConfig(max_seq_len=12, use_lean=False, compile=False)
    assert EngineConfig.from_dict(config.to_dict()) == config
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert EngineConfig().to_dict() == {"max_seq_len": None, "use_lean": None, "compile": False, "skip_mode": "auto"}
    with pytest.raises(ValueError, match="skip_mode=.fast. is not one of auto, routed, masked"):
        EngineConfig(skip_mode="fast")
    with pytest.raises(ValueError, match="max_seq"):
        EngineConfig.from_dict({"max_seq": 3})
    engine = Engine(qwen3, config)
    assert engine.max_seq_len == 12 and not engine.lean_active() and engine.config == config
    by_keywords = Engine(qwen3, max_seq_len=12, use_lean=False)
    assert by_keywords.config == config
    longest = max(map(len, prompts))
    assert [len(o.tokens) for o in engine.generate(prompts, GREEDY)] == [12 - longest] * len(prompts)
    overridden = Engine(qwen3, config, use_lean=None, max_seq_len=None)  # a passed keyword wins
    assert overridden.config == EngineConfig() and overridden.lean_active()
    assert overridden.max_seq_len == qwen3.config.max_position_embeddings


# ----------------------------------------------------------------------------- exported files


def test_drafter_spec_defaults_are_shared_by_trainer_and_runtime(tmp_path, qwen3):
    from algorithms.seed import DRAFTER_FILE, SEEDConfig

    cfg = SEEDConfig()
    assert DRAFTER_FILE == SEED_DRAFTER_FILE == "seed_drafter.json"
    assert DRAFTER_DEFAULTS == DrafterSpec(2, 4, 4, 0.7, True)
    assert (cfg.decoder_layers, cfg.block_size, cfg.draft_len, cfg.confidence, cfg.adaptive) == (2, 4, 4, 0.7, True)
    spec = SpeculativeDecoder(qwen3)
    assert (spec.decoder_layers, spec.draft_len, spec.confidence, spec.adaptive) == (2, 4, 0.7, True)
    assert read_drafter_spec(tmp_path) == DRAFTER_DEFAULTS


def test_drafter_spec_write_read(tmp_path):
    spec = DrafterSpec(decoder_layers=3, block_size=5, draft_len=6, confidence=0.5, adaptive=False)
    path = write_drafter_spec(tmp_path, spec)
    assert path == tmp_path / SEED_DRAFTER_FILE and sorted(p.name for p in tmp_path.iterdir()) == [SEED_DRAFTER_FILE]
    assert json.loads(path.read_text()) == spec.to_dict() and read_drafter_spec(tmp_path) == spec
    write_drafter_spec(tmp_path, DRAFTER_DEFAULTS)  # replaces the file
    assert read_drafter_spec(tmp_path) == DRAFTER_DEFAULTS
    # Older files without draft_len drafted one training block; unknown keys are ignored.
    path.write_text(json.dumps({"block_size": 6, "from_the_future": 1}))
    assert read_drafter_spec(tmp_path) == DrafterSpec(block_size=6, draft_len=6)


# ----------------------------------------------------------------------------- a new fast path plugs in


def test_a_toy_linear_op_plugs_in_by_one_registration(make_model, prompts):
    """CountingLinear (tests/inference/toy_fastpath.py) is unknown to the lean decoder until its module
    registers it; then every projection runs its op, with the tokens of the plain model."""
    import copy

    from inference.lean import lean_unsupported_reason
    from tests.inference import toy_fastpath

    plain = make_model("qwen3")
    toy = copy.deepcopy(plain)
    for module in toy.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = toy_fastpath.CountingLinear
    assert lean_unsupported_reason(toy) is None
    engine = Engine(toy)
    toy_fastpath.CALLS["linear"] = 0
    got = engine.generate(prompts, GREEDY)
    assert engine.lean_active() and [o.tokens for o in got] == [o.tokens for o in Engine(plain).generate(prompts, GREEDY)]
    forwards = 1 + max(len(o.tokens) for o in got) - 1  # the prefill, then one decode per later token
    layers = plain.config.num_hidden_layers
    assert toy_fastpath.CALLS["linear"] == forwards * (4 * layers + 1)  # q|k|v, o, gate|up, down; lm_head


def test_caches_that_assume_dense_layers_ask_the_route_registry(make_model):
    """Suffix reuse and the position-independent cache refuse a routed model through the registry: a model
    the toy route claims (no layer skipper anywhere) is refused as a skipper model would be."""
    from inference.pic import pic_unsupported_reason
    from inference.suffix import ReuseConfig, SessionEngine
    from tests.inference import toy_fastpath  # noqa: F401 -- registers the toy route

    model = make_model("qwen3", num_hidden_layers=4)
    assert pic_unsupported_reason(model) is None
    assert SessionEngine(model, ReuseConfig(mode="prefix")).reusing()
    model.config.toy_every_other = True
    assert "routed layers" in pic_unsupported_reason(model)
    assert not SessionEngine(model, ReuseConfig(mode="prefix")).reusing()  # a full re-prefill instead


def test_a_toy_route_plugs_in_by_one_registration(make_model, prompts):
    """A model flagged for the toy route runs its even layers only: the same tokens as the model cut
    down to those layers, run by the HF forward."""
    import copy

    from tests.inference import toy_fastpath

    model = make_model("qwen3", num_hidden_layers=4)
    model.config.toy_every_other = True
    cut = copy.deepcopy(model)
    kept = [cut.model.layers[i] for i in (0, 2)]
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    cut.model.layers = torch.nn.ModuleList(kept)
    cut.config.num_hidden_layers = 2
    cut.config.layer_types = cut.config.layer_types[:2]
    cut.config.toy_every_other = False
    toy_fastpath.CALLS["layers"] = 0
    got = [o.tokens for o in Engine(model).generate(prompts, GREEDY)]
    assert toy_fastpath.CALLS["layers"] > 0  # the route ran
    want = [o.tokens for o in Engine(cut, EngineConfig(use_lean=False)).generate(prompts, GREEDY)]
    full = [o.tokens for o in Engine(make_model("qwen3", num_hidden_layers=4)).generate(prompts, GREEDY)]
    assert got == want and got != full


def test_fast_paths_register_without_the_engine_importing_them():
    """A fresh interpreter that imports only the engine has no fast-path module loaded; the first registry
    read loads them (lean.FAST_PATHS), so a fake-quant model runs on the lean path with the registered op."""
    import subprocess
    import sys

    script = """
import sys
import torch
import inference.engine
assert "inference.lowbit" not in sys.modules and "inference.skip_routing" not in sys.modules, "imported early"
from inference.lean import LINEAR_KINDS, lean_unsupported_reason
from models.quant import FakeQuantLinear, QuantScheme, apply_fake_quant
from models.loading import TinySpec, build_tiny
model, _ = build_tiny(TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), 0)
apply_fake_quant(model, QuantScheme(weight_bits=4, act_bits=None))
assert FakeQuantLinear not in LINEAR_KINDS
assert lean_unsupported_reason(model) is None, lean_unsupported_reason(model)
assert "inference.lowbit" in sys.modules and "inference.skip_routing" in sys.modules
out = inference.engine.Engine(model).generate([[1, 2, 3]], inference.engine.SamplingParams(max_new_tokens=3))
assert len(out[0].tokens) > 0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("speculative", [False, True])
def test_on_round_sees_every_token_and_ends_rows_early(make_model, prompts, speculative):
    """What `on_round` reads round by round joins to each row's completion; a row it ends stops there with
    finish reason `abort` and its place is freed, while the other rows' greedy tokens are unchanged."""
    model = make_model("qwen3", num_hidden_layers=4)
    params = SamplingParams(max_new_tokens=14, temperature=0.0)
    runner = SpeculativeDecoder(model, mode="seed", decoder_layers=2) if speculative else Engine(model)
    want = runner.generate(prompts, params)
    seen = {i: [] for i in range(len(prompts))}

    def watch(run):
        for i, n in enumerate(run.progress()):
            seen[i] += run.emitted(i, len(seen[i]), n)
        return {1} if len(seen[1]) >= 3 else None

    got = runner.generate(prompts, params, on_round=watch)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.tokens == seen[i][: len(g.tokens)]
        if i == 1:
            assert g.finish_reason == "abort" and 3 <= len(g.tokens) < len(w.tokens) and g.tokens == w.tokens[: len(g.tokens)]
        else:
            assert g.tokens == w.tokens and g.finish_reason == w.finish_reason and seen[i] == w.tokens
