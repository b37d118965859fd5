"""Speculative decoding (SEED self-drafting and an external drafter): exactness and losslessness."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from inference import Engine, SamplingParams
from inference.engine import left_pad, token_loop
from inference.lean import LeanBackend, read_dims, rope_tables
from inference.speculative import (
    SpeculativeDecoder, SpeculativeMode, accept_greedy, accept_sampled, target_probs,
)
from models.loading import random_qwen3

VOCAB = 62
NEW = 24
# Standard-normal quantile at 1 - 1e-3: the chi-square tests reject at alpha = 1e-3 (each test
# uses a fixed seed, so it is deterministic; the threshold only guards against a wrong law).
Z_1E3 = 3.090


def chi2_critical(dof: int) -> float:
    """Upper 1e-3 chi-square quantile, Wilson-Hilferty approximation (conservative, within 2% for dof >= 3;
    dof 4 -> 18.4 vs exact 18.47, dof 35 -> 66.6 vs 66.62)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + Z_1E3 * c ** 0.5) ** 3


def make(layers: int = 6, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny Qwen3 with a wide init, so a random model's greedy output is not one repeated token."""
    return random_qwen3(vocab, seed=seed, num_layers=layers, kv_heads=2, head_dim=16, initializer_range=0.2).eval()


def perturbed(model: torch.nn.Module, scale: float = 0.03, seed: int = 5) -> torch.nn.Module:
    """A drafter close to the target: partial acceptance, rows accept different lengths."""
    near = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return near


@pytest.fixture(scope="module")
def target():
    return make()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 9, 4, 7, 3, 11, 6)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor, total: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected mass; cells with zero mass must be empty."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() * total
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


# ----------------------------------------------------------------------------- greedy exactness


DRAFTERS = {
    "seed": lambda m: dict(mode="seed", decoder_layers=2),
    "seed1": lambda m: dict(mode="seed", decoder_layers=1),
    "external_other": lambda m: dict(mode="external", drafter=make(layers=2, seed=1)),
    "external_near": lambda m: dict(mode="external", drafter=perturbed(m)),
    "external_same": lambda m: dict(mode="external", drafter=m),
}


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_equals_plain_decoding(target, prompts, drafter, adaptive):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    reference = Engine(target).generate(prompts, params)
    spec = SpeculativeDecoder(target, adaptive=adaptive, draft_len=3, **DRAFTERS[drafter](target))
    for batch in (1, 3, 8):
        outs = spec.generate(prompts[:batch], params)
        stats = spec.stats
        for out, ref in zip(outs, reference):
            assert out.tokens == ref.tokens
            assert out.finish_reason == ref.finish_reason
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs),
                                       atol=1e-4, rtol=0)
        assert stats.emitted == batch * NEW and stats.accepted <= stats.drafted


@pytest.mark.parametrize("drafter", ["seed", "external_near"])
def test_adaptive_drafting_without_host_reads_is_the_same(target, prompts, drafter, monkeypatch):
    """On an accelerator the confidence rule runs without a host read per draft step (every round
    drafts K steps; the rule only sets what is proposed): the same tokens, proposed drafts and
    acceptance as stopping early on the CPU, and no draft loop exits before K."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    spec = SpeculativeDecoder(target, adaptive=True, draft_len=4, confidence=0.6, **DRAFTERS[drafter](target))
    steps = []
    original_init, original_logits = SpeculativeMode.__init__, SpeculativeMode._draft_logits

    def count(self, token, positions, slot):
        steps.append(slot)
        return original_logits(self, token, positions, slot)

    def read_free(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.stop_early = False

    monkeypatch.setattr(SpeculativeMode, "_draft_logits", count)
    early = spec.generate(prompts, params)
    early_stats = spec.stats
    early_steps = len(steps)
    monkeypatch.setattr(SpeculativeMode, "__init__", read_free)
    late = spec.generate(prompts, params)
    late_stats = spec.stats
    assert [c.tokens for c in late] == [c.tokens for c in early]
    for name in ("steps", "drafted", "accepted", "emitted", "rounds"):
        assert getattr(late_stats, name) == getattr(early_stats, name), name
    assert early_stats.drafted < 4 * early_stats.steps  # the rule stopped some drafts early
    assert len(steps) - early_steps > early_steps  # ... and the read-free loop drafted past them
    assert late_stats.rounds > 0 and late_stats.mean_round_ms > 0


def test_long_batch_with_compaction_equals_plain(target, prompts, monkeypatch):
    """Rows accept different lengths for many rounds, so the masked cache must compact."""
    from inference import speculative

    compactions = []
    original = speculative.MaskedCache.ensure_room

    def spy(self, needed):
        compactions.append(self.slot + needed > self.capacity)
        return original(self, needed)

    monkeypatch.setattr(speculative.MaskedCache, "ensure_room", spy)
    params = SamplingParams(max_new_tokens=60, temperature=0.0)
    reference = Engine(target).generate(prompts, params)
    spec = SpeculativeDecoder(target, mode="external", drafter=perturbed(target))
    outs = spec.generate(prompts, params)
    stats = spec.stats
    assert [o.tokens for o in outs] == [r.tokens for r in reference]
    assert any(compactions) and 0 < stats.accepted < stats.drafted


# ----------------------------------------------------------------------------- stopping


def test_stop_token_inside_accepted_drafts_truncates(target, prompts):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    [plain] = Engine(target).generate([prompts[0]], params)
    index = 7
    stop = plain.tokens[index]
    cut = plain.tokens.index(stop) + 1  # first occurrence
    stop_params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(stop,))
    spec = SpeculativeDecoder(target, mode="external", drafter=target, adaptive=False, draft_len=4)
    [out] = spec.generate([prompts[0]], stop_params)
    stats = spec.stats
    assert out.tokens == plain.tokens[:cut] and out.finish_reason == "stop"
    assert stats.emitted == cut
    # A stop sequence that completes inside a run of accepted drafts.
    seq = tuple(plain.tokens[5:8])
    seq_params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_sequences=(seq,))
    [plain_seq] = Engine(target).generate([prompts[0]], seq_params)
    [out_seq] = spec.generate([prompts[0]], seq_params)
    assert out_seq.tokens == plain_seq.tokens and out_seq.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 6, 11])
def test_max_new_tokens_is_exact(target, prompts, max_new):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    reference = Engine(target).generate(prompts[:3], params)
    spec = SpeculativeDecoder(target, mode="external", drafter=target, adaptive=False, draft_len=4)
    outs = spec.generate(prompts[:3], params)
    stats = spec.stats
    assert [o.tokens for o in outs] == [r.tokens for r in reference]
    assert all(len(o.tokens) == len(o.logprobs) == max_new and o.finish_reason == "length" for o in outs)
    assert stats.emitted == 3 * max_new


# ----------------------------------------------------------------------------- acceptance length


def test_same_model_drafter_accepts_everything(target, prompts):
    draft_len, rounds = 4, 5
    params = SamplingParams(max_new_tokens=1 + rounds * (draft_len + 1), temperature=0.0)
    spec = SpeculativeDecoder(target, mode="external", drafter=target, adaptive=False, draft_len=draft_len)
    outs = spec.generate(prompts[:3], params)
    stats = spec.stats
    assert stats.steps == 3 * rounds and stats.accepted == stats.drafted == 3 * rounds * draft_len
    assert stats.mean_accepted == draft_len + 1
    # With a tail: the last verify of each row is budget-limited.
    outs = spec.generate(prompts[:1], SamplingParams(max_new_tokens=13, temperature=0.0))
    stats = spec.stats
    assert stats.steps == 3 and stats.accepted == 4 + 4 + 1 and len(outs[0].tokens) == 13  # 1 + 5 + 5 + 2


# ----------------------------------------------------------------------------- KV rollback / sync


def plain_cache(model, tokens: list[int]) -> torch.Tensor:
    """Full-model K/V of `tokens` at positions 0.. from a plain prefill: (L, 2, H_kv, T, D)."""
    dims = read_dims(model)
    T = len(tokens)
    backend = LeanBackend(model, dims, rope_tables(model, T), 1, T)
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        backend.prefill(ids, torch.arange(T)[None], torch.ones_like(ids, dtype=torch.bool))
    return backend.kv[:, :, 0]


def valid_cache(cache, row: int) -> torch.Tensor:
    ok = cache.key_ok[row, 0, 0, : cache.slot]
    return cache.kv[:, :, row, :, : cache.slot][:, :, :, ok]  # (L, 2, H_kv, T, D)


@pytest.mark.parametrize("mode", ["seed", "external_near", "external_same"])
def test_rollback_leaves_plain_decoding_cache(target, prompts, mode):
    """After rounds with rejections, each row's valid cache slots equal plain decoding's K/V of
    prompt + emitted tokens (all but the last emitted, which is not cached yet); the external
    drafter's cache holds exactly the same tokens (sync on full acceptance)."""
    kwargs = DRAFTERS[mode](target)
    spec = SpeculativeDecoder(target, draft_len=3, **kwargs)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    rows = prompts[:3]
    with torch.inference_mode():
        batch = left_pad(rows, torch.device("cpu"))
        run = SpeculativeMode(spec, batch, params, 40, None)
        rollout = token_loop(run, batch, params, 40, None, max_rounds=4)
    assert len(rollout.rows) == 3
    if mode != "external_same":
        assert run.stats.accepted < run.stats.drafted  # some rejection happened
    for r, prompt in enumerate(rows):
        seen = prompt + rollout.emitted_tokens(r)[:-1]
        torch.testing.assert_close(valid_cache(run.target, r), plain_cache(target, seen), atol=1e-5, rtol=0)
        if run.draft_cache is not None:
            torch.testing.assert_close(valid_cache(run.draft_cache, r),
                                       plain_cache(kwargs["drafter"], seen), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- lossless sampling


@pytest.mark.parametrize("m", [1, 3])
def test_accept_sampled_first_token_follows_p(m):
    V, N = 6, 40000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(m + 1, V, generator=g) * 1.5, -1)
    p[0, 2] = 0.0  # a token the target forbids (e.g. filtered by top-k) ...
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(m, V, generator=g) * 1.5, -1)  # ... but the drafter likes
    drafts = torch.multinomial(q.repeat(N, 1), 1, generator=g).view(N, m)
    limit = torch.full((N,), m)
    accepted, nxt = accept_sampled(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, limit, g)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    stat, dof = chi_square(torch.bincount(first, minlength=V), p[0], N)
    assert stat < chi2_critical(dof), (stat, dof)
    if m > 1:  # the second token, given the first draft accepted, follows p_1
        second = torch.where(accepted > 1, drafts[:, 1], nxt)[accepted > 0]
        stat, dof = chi_square(torch.bincount(second, minlength=V), p[1], second.numel())
        assert stat < chi2_critical(dof), (stat, dof)


def test_accept_greedy_rule():
    argmax = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = accept_greedy(argmax, drafts, torch.tensor([3, 3, 3, 1]))
    assert accepted.tolist() == [3, 1, 0, 1] and nxt.tolist() == [4, 9, 7, 2]


@pytest.mark.slow  # chi-square sampling runs: 1.8-2.5 s per case
@pytest.mark.parametrize("mode,params", [
    ("external", SamplingParams(max_new_tokens=3, temperature=1.0)),
    ("seed", SamplingParams(max_new_tokens=3, temperature=0.8, top_k=5)),
])
def test_end_to_end_sampling_is_lossless(mode, params):
    """Joint distribution of the first two tokens (the second is drafted and verified) equals
    the target's p(t1) p(t2 | t1) from plain forwards."""
    V, N = 6, 6000
    model = make(layers=4, seed=3, vocab=V)
    kwargs = {"drafter": make(layers=2, seed=4, vocab=V)} if mode == "external" else {}
    spec = SpeculativeDecoder(model, mode=mode, adaptive=False, draft_len=2, **kwargs)
    prompt = [1, 4, 2, 5]
    outs = spec.generate([prompt] * N, params, torch.Generator().manual_seed(0))
    stats = spec.stats
    assert 0 < stats.accepted < stats.drafted
    pairs = torch.tensor([o.tokens[0] * V + o.tokens[1] for o in outs])
    with torch.no_grad():
        p1 = target_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], params)  # (V,)
        ids = torch.tensor([prompt + [t] for t in range(V)])
        p2 = target_probs(model(input_ids=ids).logits[:, -1], params)  # (V, V)
    joint = (p1[:, None] * p2).flatten()
    stat, dof = chi_square(torch.bincount(pairs, minlength=V * V), joint, N)
    assert stat < chi2_critical(dof), (stat, dof)
    # Logprobs follow the Engine: log_softmax(logits / T) over the full vocabulary.
    with torch.no_grad():
        full = (model(input_ids=torch.tensor([prompt + outs[0].tokens])).logits[0].float()
                / params.temperature).log_softmax(-1)
    expected = full[len(prompt) - 1: -1].gather(-1, torch.tensor(outs[0].tokens)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(outs[0].logprobs), expected, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- config + CLI


def test_from_pretrained_dir_reads_seed_config(tmp_path, target):
    spec = SpeculativeDecoder.from_pretrained_dir(target, tmp_path)
    assert (spec.mode, spec.decoder_layers, spec.draft_len, spec.confidence, spec.adaptive) == ("seed", 2, 4, 0.7, True)
    (tmp_path / "seed_drafter.json").write_text(json.dumps(
        {"decoder_layers": 3, "block_size": 4, "draft_len": 5, "confidence": 0.5, "adaptive": False}))
    spec = SpeculativeDecoder.from_pretrained_dir(target, tmp_path)
    assert (spec.decoder_layers, spec.draft_len, spec.confidence, spec.adaptive) == (3, 5, 0.5, False)
    spec = SpeculativeDecoder.from_pretrained_dir(target, tmp_path, draft_len=2, adaptive=True)
    assert (spec.draft_len, spec.adaptive) == (2, True)
    with pytest.raises(ValueError, match="confidence"):
        SpeculativeDecoder(target, confidence=1.5)
    with pytest.raises(ValueError, match="decoder_layers"):
        SpeculativeDecoder(target, decoder_layers=7)
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeDecoder(target, mode="external")


def test_cli_speculative_matches_plain(tmp_path, capsys):
    from inference.__main__ import main
    from models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = random_qwen3(len(tokenizer), seed=0, num_layers=4, kv_heads=2, head_dim=16, initializer_range=0.2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "seed_drafter.json").write_text(json.dumps({"decoder_layers": 1, "draft_len": 3}))
    common = [str(tmp_path), "--prompt", "12+7=", "--max-new-tokens", "12", "--device", "cpu"]
    outputs = []
    for extra in ([], ["--speculative", "seed"], ["--drafter", str(tmp_path)],
                  ["--speculative", "external", "--drafter", str(tmp_path), "--draft-len", "2"],
                  ["--speculative", "seed", "--draft-len", "5", "--fixed-draft", "--confidence", "0.9"]):
        assert main(common + extra) == 0
        captured = capsys.readouterr()
        outputs.append(captured.out)
        if extra:
            assert "acceptance length" in captured.err and "tokens/s" in captured.err
    # The first in-process run may be preceded by a third-party import warning on stdout.
    assert len(set(outputs[1:])) == 1 and outputs[1].strip() and outputs[0].endswith(outputs[1]), outputs
    assert main(common + ["--speculative", "external"]) != 0
    assert "--drafter" in capsys.readouterr().err


def test_unsupported_model_raises_clearly(target):
    other = copy.deepcopy(target)
    other.model.layers[0].register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="cannot run the model exactly"):
        SpeculativeDecoder(other)
    with pytest.raises(ValueError, match="cannot run the drafter exactly"):
        SpeculativeDecoder(target, mode="external", drafter=other)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder(target, mode="external", drafter=make(layers=1, vocab=VOCAB + 1))


def test_benchmark_depth_upscaling_keeps_the_function(tmp_path):
    """benchmarks/speculative.py's deep target: source layer j -> layer (j + 1) r - 1, the rest
    identity blocks (zero output projections); same logits, 3x the layers."""
    from benchmarks.speculative import build_upscaled
    from models.loading import load_pretrained
    from models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    source = random_qwen3(len(tokenizer), seed=0, hidden_size=32, intermediate_size=64, kv_heads=2, head_dim=8,
                          max_positions=64, initializer_range=0.2, tie_word_embeddings=False)
    source.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    build_upscaled(str(tmp_path / "src"), 6, str(tmp_path / "deep"))
    deep, _ = load_pretrained(str(tmp_path / "deep"))
    assert deep.config.num_hidden_layers == 6 and not (tmp_path / "deep.tmp").exists()
    ids = torch.randint(0, len(tokenizer), (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(deep.eval()(ids).logits, source.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    for i, layer in enumerate(deep.model.layers):
        if i in (2, 5):
            torch.testing.assert_close(layer.mlp.up_proj.weight, source.model.layers[i // 3].mlp.up_proj.weight)
        else:
            assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
            assert layer.mlp.up_proj.weight.any()  # a fresh block, not a copy of nothing
    with pytest.raises(SystemExit, match="multiple"):
        build_upscaled(str(tmp_path / "src"), 5, str(tmp_path / "bad"))
