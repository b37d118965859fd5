"""The position-independent artifact cache (inference/pic.py) and the RoPE delta rotation
(inference/relocate.py), each held to an independent reference: keys computed by the HF model at
the new position, full prefill, and the HF forward of the query over the same K/V."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from inference.engine import Engine
from inference.pic import ArtifactCache, PICConfig, PICEngine, PICError, PICRequest, adapter_deltas
from inference.relocate import RelocationError, relocate_keys, rope_layout
from inference.sampling import SamplingParams
from models.loading import random_qwen3

V = 60


def _model(layers: int = 3, max_positions: int = 512):
    return random_qwen3(V, hidden_size=64, num_layers=layers, num_heads=4, intermediate_size=128, head_dim=16,
                        kv_heads=2, max_positions=max_positions).eval()


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=g).tolist()


def _requests(prefix=()):
    g = torch.Generator().manual_seed(1)
    return [PICRequest.make(prefix, [_tokens(g, 7), _tokens(g, 5), _tokens(g, 9)], _tokens(g, 4)),
            PICRequest.make(prefix, [_tokens(g, 3), _tokens(g, 11)], _tokens(g, 6)),
            PICRequest.make(prefix, [_tokens(g, 12)], _tokens(g, 2))]


def _hf_keys(model, ids: torch.Tensor, start: int) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], use_cache=True)
    return [layer.keys for layer in out.cache.layers]


# --- relocation ------------------------------------------------------------------------------------------


LAYOUTS = {
    "qwen3": lambda: tf.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama": lambda: tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2),
    "phi_partial_rotary": lambda: tf.PhiConfig(vocab_size=V, hidden_size=64, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_relocated_keys_equal_keys_computed_at_the_new_position(arch):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(LAYOUTS[arch]()).eval()
    layout = rope_layout(model)
    if arch == "phi_partial_rotary":
        assert layout.rotary_dim == 8 < 16  # only half of each head rotates
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    at_3, at_700 = _hf_keys(model, ids, 3), _hf_keys(model, ids, 700)
    for cached, direct in zip(at_3, at_700):  # every layer: an isolated sequence only sees relative positions
        moved = relocate_keys(cached, 3, 700, layout)
        assert (moved - direct).abs().max() < 2e-5
        assert (cached - direct).abs().max() > 0.1  # the rotation was needed
        # per-position form: the same move written as explicit positions
        explicit = relocate_keys(cached, torch.arange(3, 12), torch.arange(700, 709), layout)
        assert torch.allclose(explicit, moved, atol=1e-6)


def test_interleaved_layout_matches_a_hand_written_rotate_every_two():
    layout = rope_layout(_model())
    layout = dataclasses.replace(layout, layout="interleaved")
    k = torch.randn(2, 5, 16)
    freq = layout.inv_freq

    def rotate(x, positions):  # RoPE on pairs (2i, 2i+1), written out directly
        ang = positions[:, None].float() * freq[None]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1).flatten(-2)

    old, new = torch.arange(4, 9), torch.arange(40, 45)
    assert torch.allclose(relocate_keys(rotate(k, old), old, new, layout), rotate(k, new), atol=1e-5)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_by_name(rope_type):
    model = _model()
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": rope_type}
    with pytest.raises(RelocationError, match=rope_type):
        rope_layout(model)


# --- serving -----------------------------------------------------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0)


def _max_logprob_gap(a, b) -> float:
    return max(max(abs(x - y) for x, y in zip(o.logprobs, r.logprobs)) for o, r in zip(a, b))


def test_one_artifact_at_position_zero_is_full_prefill():
    model = _model()
    g = torch.Generator().manual_seed(3)
    req = [PICRequest.make([], [_tokens(g, 10)], _tokens(g, 5)), PICRequest.make([], [_tokens(g, 4)], _tokens(g, 7))]
    full = Engine(model).generate([r.tokens() for r in req], PARAMS)
    cache = ArtifactCache(model)
    for mode in ("pic", "ape", "epic", "cacheblend", "full_scores"):  # nothing to approximate: every mode is exact
        out = PICEngine(model, cache, PICConfig(mode=mode)).generate(req, PARAMS)
        assert [o.tokens for o in out] == [o.tokens for o in full], mode
        assert _max_logprob_gap(out, full) < 1e-5, mode


def test_full_scores_diagnostic_is_neither_pic_nor_full_prefill():
    """Several artifacts: the diagnostic reads PIC's values with full prefill's weights, a third
    computation (exact on one artifact, above); its greedy decode runs the twin in lockstep."""
    model = _model()
    requests = _requests()
    full = PICEngine(model, config=PICConfig(mode="full")).first_logits(requests)
    cache = ArtifactCache(model)
    pic = PICEngine(model, cache, PICConfig(mode="pic")).first_logits(requests)
    scores = PICEngine(model, cache, PICConfig(mode="full_scores")).first_logits(requests)
    assert (scores - full).abs().max() > 1e-4 and (scores - pic).abs().max() > 1e-4
    out = PICEngine(model, cache, PICConfig(mode="full_scores")).generate(requests, PARAMS)
    assert all(len(o.tokens) == PARAMS.max_new_tokens for o in out)


@pytest.mark.parametrize("prefix", [(), (5, 9, 11, 4)])
def test_recompute_everything_modes_equal_full_prefill(prefix):
    """EPIC recomputing every artifact token and CacheBlend recomputing 100% are full prefill."""
    model = _model()
    requests = _requests(prefix)
    full = Engine(model).generate([r.tokens() for r in requests], PARAMS)
    cache = ArtifactCache(model, prefix=prefix)
    for cfg in (PICConfig(mode="full"), PICConfig(mode="epic", epic_tokens=32), PICConfig(mode="cacheblend", blend_ratio=1.0)):
        out = PICEngine(model, cache, cfg).generate(requests, PARAMS)
        assert [o.tokens for o in out] == [o.tokens for o in full], cfg
        assert _max_logprob_gap(out, full) < 1e-5, cfg
    naive = PICEngine(model, cache, PICConfig(mode="pic")).generate(requests, PARAMS)
    assert _max_logprob_gap(naive, full) > 1e-3  # several artifacts: PIC is an approximation
    assert cache.stats.misses == 6 and cache.stats.hits == 12  # 3 cached calls x 6 artifacts, each encoded once


def _reference_first_logits(model, request: PICRequest, adapted=None) -> torch.Tensor:
    """One row, the slow way: every artifact encoded by the HF forward after the prefix, its keys
    relocated, all injected as an HF cache; the query through `adapted` (default: model) over it."""
    prefix = list(request.prefix)
    layout = rope_layout(model)
    layers = model.config.num_hidden_layers
    pre = None
    if prefix:
        with torch.no_grad():
            pre = model(torch.tensor([prefix]), use_cache=True).cache
    keys = [[] if pre is None else [pre.layers[i].keys] for i in range(layers)]
    values = [[] if pre is None else [pre.layers[i].values] for i in range(layers)]
    position = len(prefix)
    for art in request.artifacts:
        past = DynamicCache(config=model.config)
        if pre is not None:
            for i in range(layers):
                past.update(pre.layers[i].keys.clone(), pre.layers[i].values.clone(), i)
        ids = torch.tensor([art])
        with torch.no_grad():
            out = model(ids, position_ids=torch.arange(len(prefix), len(prefix) + len(art))[None],
                        cache=past if pre is not None else None, use_cache=True).cache
        for i in range(layers):
            k, v = out.layers[i].keys[:, :, len(prefix):], out.layers[i].values[:, :, len(prefix):]
            keys[i].append(relocate_keys(k, len(prefix), position, layout))
            values[i].append(v)
        position += len(art)
    cache = DynamicCache(config=model.config)
    for i in range(layers):
        cache.update(torch.cat(keys[i], 2), torch.cat(values[i], 2), i)
    q = torch.tensor([request.query])
    with torch.no_grad():
        logits = (adapted or model)(q, position_ids=torch.arange(position, position + q.shape[1])[None],
                                    cache=cache).logits
    return logits[0, -1]


@pytest.mark.parametrize("prefix", [(), (5, 9, 11, 4)])
def test_query_prefill_over_the_cache_equals_the_hf_forward_with_the_same_kv(prefix):
    model = _model()
    requests = _requests(prefix)
    engine = PICEngine(model, ArtifactCache(model, prefix=prefix), PICConfig(mode="pic"))
    batched = engine.first_logits(requests)  # padded rows of different layouts in one call
    for row, request in enumerate(requests):
        assert torch.allclose(batched[row], _reference_first_logits(model, request), atol=2e-5)


def _peft(model, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    torch.manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)
    return peft_model.eval()


def test_query_adapter_runs_on_new_tokens_only_and_never_touches_the_cache():
    requests = _requests((5, 9))
    base = _model()
    plain_cache = ArtifactCache(base, prefix=(5, 9))
    plain = PICEngine(base, plain_cache).first_logits(requests)
    plain_entries = {k: e.kv.clone() for k, e in plain_cache.entries.items()}
    adapted = _peft(_model())  # the same base weights (same seed) plus a nonzero adapter
    assert set(adapter_deltas(adapted)) == {0, 1, 2}
    cache = ArtifactCache(adapted, prefix=(5, 9))
    logits = PICEngine(adapted, cache).first_logits(requests)
    assert cache.entries.keys() == plain_entries.keys()
    for key, kv in plain_entries.items():  # the cache bytes do not depend on the adapter
        assert torch.equal(cache.entries[key].kv, kv)
    assert (logits - plain).abs().max() > 1e-2  # ... but the query reads them differently
    for row, request in enumerate(requests):  # base K/V, the adapted model on the query tokens only
        with adapted.disable_adapter():
            ref = _reference_first_logits_with(adapted, request)
        assert torch.allclose(logits[row], ref, atol=2e-5)


def _reference_first_logits_with(peft_model, request):
    """The reference above with the cache made by the base (adapter off) and the query through the
    adapter: called inside `disable_adapter()`, re-enabled for the query."""
    base = peft_model.get_base_model()

    class Adapted:
        def __call__(self, *args, **kwargs):
            peft_model.enable_adapter_layers()
            try:
                return peft_model(*args, **kwargs)
            finally:
                peft_model.disable_adapter_layers()

    return _reference_first_logits(base, request, adapted=Adapted())


def test_a_non_query_adapter_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(PICError, match="q_proj only"):
        adapter_deltas(model)


def test_relocation_gate_passes_a_right_layout_and_warns_on_a_misread_one():
    model = _model()
    cache = ArtifactCache(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.gate() < 1e-5
    cache.rope = dataclasses.replace(cache.rope, layout="interleaved")  # as if we misread the layout
    with pytest.warns(RuntimeWarning, match="relocation is wrong"):
        assert cache.gate() > 1e-4


def test_bad_requests_are_refused_with_a_clear_error():
    model = _model(max_positions=64)
    cache = ArtifactCache(model, check=False)
    with pytest.raises(PICError, match="does not fit the cache of 64 positions"):
        cache.get(list(range(3, 3 + 60)) + [3] * 10)
    with pytest.raises(PICError, match="empty query"):
        PICEngine(model, cache).generate([PICRequest.make([], [[4, 5]], [])], PARAMS)
    with pytest.raises(PICError, match="shared prefix"):
        PICEngine(model, cache).generate([PICRequest.make([7], [[4, 5]], [6])], PARAMS)
    with pytest.raises(PICError, match="mode"):
        PICConfig(mode="fast")
    with pytest.raises(PICError, match="epic_tokens"):
        PICConfig(mode="epic", epic_tokens=33)


# --- text in, the command line ----------------------------------------------------------------------------


def test_server_groups_prompts_by_prefix_and_matches_the_engine(tmp_path):
    from dataclasses import dataclass

    from models.tokenizer import build_char_tokenizer
    from inference.pic import PICServer, request_of

    @dataclass
    class Seg:
        prefix: str
        artifacts: tuple
        query: str

    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, head_dim=16,
                         max_positions=256).eval()
    segs = [Seg("", ("[ab]\nca=1\n", "[cd]\nca=2\n"), "q: ab ca?\na: "), Seg("t:\n", ("[ab]\nca=1\n",), "q: x\na: "),
            Seg("", ("[cd]\nca=2\n",), "q: cd ca?\na: ")]
    server = PICServer(model, tok)
    out = server.generate(segs, PARAMS)
    assert sorted(server.caches) == [(), tuple(tok("t:\n", add_special_tokens=False).input_ids)]
    for seg, completion in zip(segs, out):
        req = request_of(tok, seg)
        alone = PICEngine(model, ArtifactCache(model, prefix=req.prefix)).generate([req], PARAMS)[0]
        assert completion.tokens == alone.tokens
    assert "".join(tok.decode(request_of(tok, segs[0]).tokens())) == "[ab]\nca=1\n[cd]\nca=2\nq: ab ca?\na: "


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory):
    from models.loading import TinySpec, build_tiny

    out = tmp_path_factory.mktemp("base")
    model, tok = build_tiny(TinySpec(64, 2, 4, 128), 0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_cli_serves_a_prompt_over_artifact_files(saved_base, tmp_path, capsys):
    from inference.__main__ import main

    (tmp_path / "a.txt").write_text("[kiwo]\nca=17\n")
    (tmp_path / "b.jsonl").write_text('"[lema]\\nca=12\\n"\n{"text": "[zu]\\nfo=1\\n"}\n')
    args = [str(saved_base), "--artifacts", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
            "--prompt", "q: kiwo ca?\na: ", "--max-new-tokens", "4"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[pic pic] 3 artifacts" in err and "relocation check KL" in err
    assert main(args + ["--pic-mode", "full"]) == 0


@pytest.mark.parametrize("content, name, message", [
    (None, "missing.txt", "no such file"),
    ('"ok"\n{oops\n', "bad.jsonl", "row 2: invalid JSON"),
    ('["ok", 3]', "bad.json", "row 2: an artifact must be a non-empty string"),
])
def test_cli_bad_artifact_files_give_one_error_line(saved_base, tmp_path, capsys, content, name, message):
    from inference.__main__ import main

    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main([str(saved_base), "--artifacts", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0] and name in err[0]


def test_cli_refuses_an_artifact_longer_than_the_cache_and_an_adapter_for_another_base(saved_base, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from inference.__main__ import main
    from models.loading import TinySpec, build_tiny

    (tmp_path / "long.txt").write_text("a" * 2000)
    assert main([str(saved_base), "--artifacts", str(tmp_path / "long.txt"), "--prompt", "x"]) == 2
    assert "does not fit the cache" in capsys.readouterr().err
    other, _ = build_tiny(TinySpec(32, 2, 4, 64), 0)  # another width
    get_peft_model(other, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    (tmp_path / "a.txt").write_text("[kiwo]\nca=17\n")
    assert main([str(saved_base), "--adapter", str(tmp_path / "adapter"), "--artifacts", str(tmp_path / "a.txt"),
                 "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: adapter") and "does not match the base model" in err[-1]
