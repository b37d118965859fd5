"""Routed execution of a layer skipper on the lean path, held to its references: the base model
(routers forced to run), the training forward (models/skipper.py: the HF layers with every branch
computed and mixed), the masked lean forward, and K/V computed by hand from the HF modules."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from inference import Engine, EngineConfig, SamplingParams
from inference.engine import left_pad
from inference.lean import KEY, VALUE, LeanBackend, read_dims, rope_tables
from inference.serving import ServeOptions, serve_model
from inference.skip_routing import CostGate, SkipRoute, _break_even, route_for
from models.loading import random_qwen3
from models.skipper import apply_skipper, forced, make_spec, record_gates

VOCAB = 64
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 9, [10, 11], [5, 6, 7, 8], [9, 9], [4, 4, 4], [20, 21, 22, 23, 24, 25]]


def decisive(model, scale: float = 300.0) -> None:
    """Make the routers' logits O(1) (fresh ones sit within ~1e-3 of the threshold), so a decision
    never hangs on the last bit of a float and the paths compared must agree exactly."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "skipper"):
                layer.skipper.router.head.weight.mul_(scale)
                layer.skipper.adapter.down_proj.weight.normal_(0, 0.05)  # a trained-looking adapter


@pytest.fixture(scope="module")
def models():
    base = random_qwen3(VOCAB, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128, kv_heads=2).eval()
    skip = random_qwen3(VOCAB, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128, kv_heads=2).eval()
    apply_skipper(skip, make_spec(skip.config, layers=[1, 2, 3]), seed=3)
    decisive(skip)
    return base, skip


def greedy(model, prompts, n=12, **config):
    """Greedy tokens through the serving door (`serve_model`), and the engine that ran them."""
    server = serve_model(model, ServeOptions(engine=EngineConfig(**config)))
    outs = server.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))
    return [list(o.tokens) for o in outs], server.engine


def lean_logits(model, ids, steps=4, mode="auto"):
    """Prefill + greedy decode steps on the lean backend directly: every step's logits, and the backend."""
    dims = read_dims(model)
    backend = LeanBackend(model, dims, rope_tables(model, 32), ids.shape[0], 32, route=route_for(model, mode))
    B, P = ids.shape
    with torch.inference_mode():
        out = [backend.prefill(ids, torch.arange(P).expand(B, P), torch.ones_like(ids, dtype=torch.bool))]
        for t in range(steps):
            out.append(backend.decode(out[-1].argmax(-1), torch.full((B,), P + t)))
    return out, backend


def test_routers_forced_to_run_serve_exactly_the_base_model(models):
    base, skip = models
    skip.load_state_dict({**skip.state_dict(), **base.state_dict()})  # same base weights, routers kept
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    expected, _ = lean_logits(base, ids)
    for mode in ("routed", "masked", "auto"):
        with forced(skip, "run"):
            got, backend = lean_logits(skip, ids, mode=mode)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), mode
        assert backend.route.stats.skip_ratio() == 0.0
    with forced(skip, "run"):
        assert greedy(skip, PROMPTS)[0] == greedy(base, PROMPTS)[0]


def test_routers_forced_to_skip_serve_the_adapter_only_path(models):
    _, skip = models
    ids = torch.tensor([[5, 9, 11, 3, 7, 2], [1, 4, 4, 8, 3, 3]])
    with forced(skip, "skip"):
        got, backend = lean_logits(skip, ids, mode="routed")
        with torch.no_grad():  # the training forward, teacher-forced over the tokens the lean path chose
            seq = torch.cat([ids] + [g.argmax(-1)[:, None] for g in got[:-1]], 1)
            ref = skip(seq).logits
    assert backend.route.stats.skip_ratio() == 1.0
    assert backend.route.stats.executed["uniform"] == 4 * 3  # decode steps x routed layers, no gather needed
    for t, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[:, ids.shape[1] - 1 + t], atol=2e-5, rtol=1e-5)


def test_routed_equals_masked_on_mixed_decisions_at_batch_8_with_padding(models):
    _, skip = models
    masked, masked_engine = greedy(skip, PROMPTS, skip_mode="masked")
    routed, routed_engine = greedy(skip, PROMPTS, skip_mode="routed")
    assert routed == masked
    stats = routed_engine.route.stats
    assert stats.executed["routed"] > 0 and stats.executed["masked"] == 0  # rows were gathered and scattered
    assert 0.2 < stats.skip_ratio() < 0.8 and 0.2 < stats.skip_ratio(decode=False) < 0.8
    assert masked_engine.route.stats.decode_skip == stats.decode_skip  # the same decisions
    # per-step logits too (tokens of a random model can survive small errors)
    padded = left_pad(PROMPTS, torch.device("cpu"))
    steps = {}
    for mode in ("masked", "routed"):
        dims = read_dims(skip)
        backend = LeanBackend(skip, dims, rope_tables(skip, 32), len(PROMPTS), 32, route=route_for(skip, mode))
        with torch.inference_mode():
            out = [backend.prefill(padded.ids, padded.positions, padded.valid)]
            for t in range(5):
                out.append(backend.decode(out[-1].argmax(-1), padded.lengths + t))
        steps[mode] = out
    for a, b in zip(steps["routed"], steps["masked"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    auto, _ = greedy(skip, PROMPTS, skip_mode="auto")
    assert auto == masked
    # the HF forward (the training arithmetic, cache written by the HF attention) serves the same tokens
    assert greedy(skip, PROMPTS, use_lean=False)[0] == masked


def test_batch_1_branches_and_matches_masked(models):
    _, skip = models
    for prompt in PROMPTS[:4]:
        routed, engine = greedy(skip, [prompt], skip_mode="routed")
        assert routed == greedy(skip, [prompt], skip_mode="masked")[0]
        executed = engine.route.stats.executed
        assert executed["branch"] == 11 * 3 and executed["routed"] == 0


def test_decode_statistics_equal_the_training_forward_decisions(models):
    """The engine's per-layer skip counts over decode steps equal the decisions the training forward
    makes on the same tokens (teacher-forced): serving routes exactly as training does."""
    _, skip = models
    prompt = [5, 9, 11, 3, 7, 2]
    [tokens], engine = greedy(skip, [prompt], n=10, skip_mode="routed")
    with torch.no_grad(), record_gates(skip) as rec:
        skip(torch.tensor([prompt + tokens]))
    fed = slice(len(prompt), len(prompt) + len(tokens) - 1)  # decode steps feed every completion token but the last
    for layer, g in rec.gates.items():
        assert engine.route.stats.decode_skip[layer] == int((g[0, fed] <= 0.5).sum())
        assert engine.route.stats.decode_run[layer] == int((g[0, fed] > 0.5).sum())


def test_a_skipped_token_writes_its_own_layers_kv(models):
    """In routed decode, a skipped row's cache slot holds that layer's k/v projection of its normed
    input (k-norm and RoPE for the key), computed here by hand with the HF modules."""
    _, skip = models
    ids = torch.tensor([[5, 9, 11, 3, 7, 2], [1, 4, 4, 8, 3, 3]])
    got, backend = lean_logits(skip, ids, steps=3, mode="routed")
    seq = torch.cat([ids] + [g.argmax(-1)[:, None] for g in got[:-1]], 1)  # (2, P + 3)
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, k, i=i: inputs.__setitem__(i, k.get("hidden_states", a[0] if a else None)), with_kwargs=True)
             for i, layer in enumerate(skip.model.layers)]
    try:
        with torch.no_grad(), record_gates(skip) as rec:
            skip(seq)
    finally:
        for h in hooks:
            h.remove()
    checked = 0
    P = ids.shape[1]
    for layer in (1, 2, 3):
        mod = skip.model.layers[layer]
        attn = mod.self_attn
        with torch.no_grad():
            h = mod.input_layernorm(inputs[layer])  # (2, T, C)
            B, T, _ = h.shape
            k = attn.k_norm(attn.k_proj(h).view(B, T, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(h).view(B, T, -1, attn.head_dim).transpose(1, 2)
            cos, sin = skip.model.rotary_emb(h, torch.arange(T)[None].expand(B, T))
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
        for row in range(2):
            for slot in range(P, P + 3):  # decode slots
                if rec.gates[layer][row, slot] <= 0.5:  # skipped at this layer
                    torch.testing.assert_close(backend.cache.kv[layer, KEY, row, :, slot], k[row, :, slot], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(backend.cache.kv[layer, VALUE, row, :, slot], v[row, :, slot], atol=1e-5, rtol=1e-5)
                    checked += 1
    assert checked >= 3


def test_cost_gate_break_even_by_hand_and_measured_once_per_shape_per_engine(models):
    # masked 10; routed 4 with no row running, 16 with all 8 running: linear -> 8 * (10 - 4) / (16 - 4) = 4
    assert _break_even(10.0, 4.0, 16.0, 8) == 4.0
    assert _break_even(10.0, 11.0, 16.0, 8) == -1.0  # routing never pays
    assert _break_even(10.0, 4.0, 9.0, 8) == 8.0  # always pays
    _, skip = models
    engine = Engine(skip, EngineConfig(skip_mode="auto"))
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    engine.generate(PROMPTS, params)
    measured = dict(engine.routes.timings["skip"])
    assert measured and all(-1.0 <= v <= key[1] for key, v in measured.items())
    engine.generate(PROMPTS, params)
    assert engine.routes.timings["skip"] == measured  # a second call of the same engine measures nothing new
    executed = engine.routes.stats["skip"].executed
    assert executed["routed"] + executed["masked"] > 0
    _, other = greedy(skip, PROMPTS, skip_mode="auto")
    assert other.routes.timings["skip"] and other.routes.timings["skip"] is not engine.routes.timings["skip"]  # kept per engine, not per process


def test_route_rejects_an_unknown_mode(models):
    _, skip = models
    with pytest.raises(ValueError, match="skip mode 'fast' is not one of auto, routed, masked"):
        SkipRoute(skip.skipper_state.spec, "fast")
    assert isinstance(SkipRoute(skip.skipper_state.spec).gate, CostGate)


# ----------------------------------------------------------------------------- export dirs and the CLI


def _export(tmp_path, layers: int, hidden: int = 64):
    """A saved base (char tokenizer) with a trained-looking skipper in base/skipper/."""
    from models.skipper import base_state_dict, save_skipper
    from models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=128).eval()
    apply_skipper(model, make_spec(model.config), seed=1)
    decisive(model)
    out = tmp_path / f"export-l{layers}-h{hidden}"
    model.save_pretrained(out, state_dict=base_state_dict(model))
    tok.save_pretrained(out)
    save_skipper(model, str(out / "skipper"))
    return model, tok, out


@pytest.mark.slow  # train.py / evaluate.py subprocesses or several CLI runs
def test_cli_serves_an_export_with_its_skipper_and_rejects_a_mismatched_one(tmp_path, capsys):
    from inference.__main__ import main

    model, tok, out = _export(tmp_path, layers=4)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    [expected] = Engine(model).generate([tok.encode("12+7=")], params)
    assert main([str(out), "--prompt", "12+7=", "--max-new-tokens", "10", "--skip-mode", "routed"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n").splitlines()[-1] == tok.decode(expected.tokens, skip_special_tokens=True)
    assert "skipped" in captured.err and "routed layer-tokens" in captured.err
    # --no-skipper serves the base alone, which differs from the skipper's output here
    with forced(model, "run"):
        [base] = Engine(model).generate([tok.encode("12+7=")], params)
    assert main([str(out), "--prompt", "12+7=", "--max-new-tokens", "10", "--no-skipper"]) == 0
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == tok.decode(base.tokens, skip_special_tokens=True)
    # a skipper trained for another depth / width: one line, non-zero exit
    _, _, deeper = _export(tmp_path, layers=6)
    _, _, wider = _export(tmp_path, layers=4, hidden=32)
    assert main([str(out), "--prompt", "1+1=", "--skipper", str(deeper / "skipper")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "num_layers=6" in err and "has 4" in err
    assert main([str(out), "--prompt", "1+1=", "--skipper", str(wider / "skipper")]) == 2
    assert "hidden_size=32" in capsys.readouterr().err
    assert main([str(out), "--prompt", "1+1=", "--skipper", str(tmp_path)]) == 2
    assert "not a skipper dir" in capsys.readouterr().err


@pytest.mark.slow  # train.py / evaluate.py subprocesses or several CLI runs
def test_evaluate_reports_the_skip_ratio_of_an_export(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    _, _, out = _export(tmp_path, layers=4)
    result = subprocess.run([sys.executable, "evaluate.py", f"model.path={out}", "model=hf", "trainer.eval_examples=8",
                             "trainer.eval_max_new_tokens=16"], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["n"] == 8 and 0.0 < line["skip_ratio"] < 1.0


def test_speculative_decoding_composes_with_a_skipper(models, monkeypatch):
    """SEED self-drafting over a skipper model (drafts through the top layers dense, as SEED trained
    them; verification runs the routes, masked) gives exactly the skipper model's own greedy output."""
    from inference import lean
    from inference.speculative import SpeculativeDecoder

    _, skip = models
    plain, _ = greedy(skip, PROMPTS, n=12)
    routes = []
    original = lean.LeanBackend.run

    def spy(self, x, positions, layers, start, mask, route=None):
        routes.append((len(layers), route if route is not None else self.route))
        return original(self, x, positions, layers, start, mask, route)

    monkeypatch.setattr(lean.LeanBackend, "run", spy)
    decoder = SpeculativeDecoder(skip, mode="seed", decoder_layers=2, draft_len=3, adaptive=False)
    outs = decoder.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    stats = decoder.stats
    assert [list(o.tokens) for o in outs] == plain and stats.mean_accepted > 1.0
    layers = skip.config.num_hidden_layers
    assert {route for n, route in routes if n == 2} == {lean.dense}  # every draft step
    verify = {route for n, route in routes if n == layers}
    assert len(verify) == 1 and lean.dense not in verify  # every verification: the model's skip route
