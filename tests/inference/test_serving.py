"""The serving door (`inference/serving.py`): every export kind writes a `serving.json` that round-trips
and is what its files say; `load_served` serves each kind with its fast path, equal to an independent
load of the same export; an export without a manifest still serves; an impossible request is one
line naming the file and the field (a ServingError, and `error:` + exit 2 from the CLI)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from inference.artifacts import SERVING_FILE, ManifestError, ServingManifest, read_manifest
from inference.engine import EngineConfig
from inference.serving import ServeOptions, ServingError, describe, load_served, manifest_of
from models.tokenizer import build_char_tokenizer
from tests.conftest import tiny_config

PROMPTS = ["q: 12+7?\na: ", "q: 3-1?\na: "]
NEW = 12


def _ids(tok) -> list[list[int]]:
    return [tok(p).input_ids for p in PROMPTS]


def _greedy(tok, **fields):
    from inference import SamplingParams

    return SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(tok.eos_token_id,), **fields)


def _tokens(completions) -> list[list[int]]:
    return [c.tokens for c in completions]


def _reference(model, tok, use_lean: bool | None = False) -> list[list[int]]:
    """Greedy tokens of `model` through the plain engine (HF forward by default)."""
    from inference import Engine, EngineConfig

    return _tokens(Engine(model.eval(), EngineConfig(use_lean=use_lean)).generate(_ids(tok), _greedy(tok)))


def _over_http(server, tok) -> list[str]:
    """The greedy texts of PROMPTS from the HTTP server (inference/server.py) over `server`, asked with the
    official openai client (the app in process); skipped without the server's packages."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from inference.server import Backend, build_app

    with TestClient(build_app(Backend(server, "m"))) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        out = client.completions.create(model="m", prompt=_ids(tok), max_tokens=NEW, temperature=0)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def _texts(tok, tokens: list[list[int]]) -> list[str]:
    return [tok.decode(t, skip_special_tokens=True) for t in tokens]


# ----------------------------------------------------------------------------- the manifest itself


def test_manifest_round_trips_and_refuses_bad_fields_by_name(tmp_path):
    m = ServingManifest(kind="skipper", weights="bfloat16", skipper="skipper", stop_ids=(2,), vocab_size=40)
    assert ServingManifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert ServingManifest.from_dict({**m.to_dict(), "later_field": 1}) == m  # a newer minor field is ignored
    cases = {
        "kind": ({"kind": "mystery"}, "kind 'mystery' is not one of"),
        "weights": ({"kind": "model", "weights": ""}, "field weights is empty"),
        "version": ({"kind": "model", "version": 99}, "field version=99"),
        "missing kind": ({"weights": "float32"}, "field kind is missing"),
        "stop_ids": ({"kind": "model", "stop_ids": "eos"}, "field stop_ids must be a list"),
    }
    for case, (data, message) in cases.items():
        (tmp_path / SERVING_FILE).write_text(json.dumps(data))
        with pytest.raises(ManifestError, match=message) as err:
            read_manifest(tmp_path)
        assert str(tmp_path / SERVING_FILE) in str(err.value), case
    (tmp_path / SERVING_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)


def test_an_export_without_a_manifest_is_described_from_its_files_and_serves(model_dir):
    """Exports written before serving.json existed: no manifest, the same description, the same tokens."""
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    assert not (model_dir / SERVING_FILE).exists()
    m = manifest_of(model_dir)
    assert (m.kind, m.weights, m.base, m.skipper, m.drafter) == ("model", "float32", None, None, None)
    assert m.stop_ids == (tok.eos_token_id,) and m.vocab_size == len(tok)
    server = load_served(model_dir)
    got = _tokens(server.generate(_ids(tok), server.params(max_new_tokens=NEW, temperature=0.0)))
    assert got == _reference(AutoModelForCausalLM.from_pretrained(model_dir), tok) and any(got)
    assert server.stats.calls == 1 and server.stats.tokens == sum(map(len, got)) and server.stats.skip_ratio() == 0.0


# ----------------------------------------------------------------------------- impossible requests


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory) -> Path:
    """A model dir whose tokenizer has more tokens than the char tokenizer (a drafter for another tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = tmp_path_factory.mktemp("other_vocab")
    tok = build_char_tokenizer()
    tok.add_tokens(["<extra_a>", "<extra_b>"])
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_drafter_for_another_tokenizer_is_one_line_naming_file_and_field(model_dir, other_vocab_dir, capsys):
    from inference.__main__ import EXIT_USAGE, main

    with pytest.raises(ServingError, match=r"serving.json: field vocab_size is \d+, the target's is \d+"):
        load_served(model_dir, ServeOptions(speculative="external", drafter=str(other_vocab_dir)))
    assert main([str(model_dir), "--prompt", "1+1=", "--drafter", str(other_vocab_dir)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {other_vocab_dir / SERVING_FILE}: field vocab_size") and err.count("\n") == 1, err


def test_a_skipper_for_another_base_is_one_line(model_dir, make_model, tmp_path, capsys):
    from inference.__main__ import EXIT_USAGE, main
    from models.skipper import apply_skipper, make_spec, save_skipper

    big = make_model("qwen3", num_hidden_layers=4)  # the base in model_dir has 2 layers
    apply_skipper(big, make_spec(big.config, layers=[2, 3]))
    save_skipper(big, str(tmp_path / "skipper"))
    with pytest.raises(ServingError, match="skipper: ") as err:
        load_served(model_dir, ServeOptions(skipper=str(tmp_path / "skipper")))
    assert str(tmp_path / "skipper") in str(err.value)
    assert main([str(model_dir), "--prompt", "1+1=", "--skipper", str(tmp_path / "skipper")]) == EXIT_USAGE
    err_line = capsys.readouterr().err
    assert err_line.startswith("error: skipper: ") and err_line.count("\n") == 1, err_line


def test_unrunnable_weights_and_an_adapter_on_low_bit_weights_are_refused(model_dir, tmp_path, capsys):
    from inference.__main__ import EXIT_USAGE, main

    # a manifest naming a weight format this runtime does not know
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / SERVING_FILE).write_text(json.dumps({"kind": "model", "weights": "fp4"}))
    with pytest.raises(ServingError, match=f"{bad / SERVING_FILE}: weights 'fp4' is not one of"):
        load_served(bad)
    assert main([str(bad), "--prompt", "1+1="]) == EXIT_USAGE
    err = capsys.readouterr().err
    # (a toy format another test registers may follow in the list)
    assert err.startswith(f"error: {bad / SERVING_FILE}: weights 'fp4' is not one of float32, bfloat16, float16, "
                          "compressed") and err.count("\n") == 1
    # a compressed-tensors config with a scheme the low-bit path cannot run
    odd = tmp_path / "odd"
    shutil.copytree(model_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"targets": ["Linear"], "format": "float-quantized",
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}}}}
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServingError, match=r"config.json: unsupported quantization_config: .*cannot run its weights"):
        describe(odd)


# ----------------------------------------------------------------------------- every export kind, trained


def _train_and_export(out: Path, algo: str, *extra: str) -> tuple[Path, object]:
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    cfg = tiny_config(out, "trainer.max_steps=1", "trainer.eval_examples=4", "trainer.eval_max_new_tokens=8",
                      "trainer.max_new_tokens=8", *extra, algo=algo)
    session = build_session(cfg, World())
    assert fit(session) == "done"
    final = Path(export_final(session))
    session.tracker.close()
    return final, session


def _check_manifest(final: Path, kind: str) -> ServingManifest:
    """serving.json exists, round-trips, and says what the export's files say."""
    written = read_manifest(final)
    assert written is not None and written.kind == kind
    assert ServingManifest.from_dict(written.to_dict()) == written
    assert describe(final) == written
    tok = build_char_tokenizer()
    assert written.stop_ids == (tok.eos_token_id,) and written.vocab_size == len(tok)
    return written


FOUR = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64"]


def test_full_model_export(tmp_path):
    from transformers import AutoModelForCausalLM

    final, _ = _train_and_export(tmp_path / "run", "sft")
    m = _check_manifest(final, "model")
    assert (m.weights, m.base, m.adapter) == ("float32", None, None)
    tok = build_char_tokenizer()
    server = load_served(final)
    want = _reference(AutoModelForCausalLM.from_pretrained(final), tok)
    assert _tokens(server.generate(_ids(tok), _greedy(tok))) == want
    assert _over_http(server, tok) == _texts(tok, want)  # the HTTP server answers what the door decodes


def test_lora_adapter_export(tmp_path, model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final, _ = _train_and_export(tmp_path / "run", "opsd", "model=hf", f"model.path={model_dir}", "algo.lora_rank=4")
    m = _check_manifest(final, "lora")
    assert (m.adapter, m.base, m.weights) == ("lora", str(model_dir), "float32")
    tok = build_char_tokenizer()
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), final).merge_and_unload()
    assert _tokens(load_served(final).generate(_ids(tok), _greedy(tok))) == _reference(merged, tok)
    # the adapter served on its base by option equals the adapter dir served alone
    on_base = load_served(model_dir, ServeOptions(adapter=str(final)))
    assert _tokens(on_base.generate(_ids(tok), _greedy(tok))) == _reference(merged, tok)
    assert _over_http(load_served(final), tok) == _texts(tok, _reference(merged, tok))
    trained = _trainer_load(final)  # the trainer's loader opens the adapter dir through the same door: merged
    assert [k for k in trained.state_dict()] == [k for k in merged.state_dict()]
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), merged.state_dict().values()))


def _trainer_load(path: Path):
    from trainer.config import ModelConfig
    from trainer.distributed import World
    from trainer.setup import load_model

    model, _ = load_model(ModelConfig(name="hf", path=str(path)), World())
    return model


def test_seed_drafter_export(tmp_path):
    final, _ = _train_and_export(tmp_path / "run", "seed", *FOUR)
    m = _check_manifest(final, "seed")
    assert m.drafter == "seed_drafter.json"
    tok = build_char_tokenizer()
    plain = load_served(final)
    spec = load_served(final, ServeOptions(speculative="seed"))
    want = _tokens(plain.generate(_ids(tok), _greedy(tok)))
    assert _tokens(spec.generate(_ids(tok), _greedy(tok))) == want and any(want)  # greedy speculation is lossless
    assert spec.stats.speculative.steps > 0 and spec.stats.mean_accepted >= 1.0 and plain.stats.speculative is None
    steps = spec.stats.speculative.steps
    assert _over_http(spec, tok) == _texts(tok, want) and spec.stats.speculative.steps > steps  # served speculatively


def test_skipper_export(tmp_path):
    from models.loading import load_pretrained
    from models.skipper import load_skipper

    final, _ = _train_and_export(tmp_path / "run", "skipper", *FOUR)
    m = _check_manifest(final, "skipper")
    assert m.skipper == "skipper"
    tok = build_char_tokenizer()
    server = load_served(final, ServeOptions(engine=EngineConfig(skip_mode="routed")))
    model, _ = load_pretrained(str(final))
    load_skipper(model, str(final / "skipper"))
    assert server.skipper == str(final / "skipper")
    assert _tokens(server.generate(_ids(tok), _greedy(tok))) == _reference(model, tok, use_lean=None)
    skip = server.stats.skip
    assert sum(skip.decode_run.values()) + sum(skip.decode_skip.values()) > 0
    assert _over_http(server, tok) == _texts(tok, _reference(model, tok, use_lean=None))
    bare = load_served(final, ServeOptions(use_skipper=False))
    assert bare.skipper is None and getattr(bare.model, "skipper_state", None) is None


def test_quantized_export(tmp_path, monkeypatch):
    from inference import lowbit

    final, session = _train_and_export(tmp_path / "run", "qad", *FOUR, "trainer.eval_max_new_tokens=8")
    m = _check_manifest(final, "quantized")
    assert (m.weights, m.scheme) == ("compressed", "W4A8")
    tok = build_char_tokenizer()
    calls = []
    real = lowbit.cpu_int_matmul
    monkeypatch.setattr(lowbit, "cpu_int_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _tokens(load_served(final).generate(_ids(tok), _greedy(tok)))
    assert calls, "the integer GEMM of the low-bit path ran"
    assert got == _reference(session.backend.full_model(), tok)  # the trained fake-quant student's HF forward
    calls.clear()
    assert _over_http(load_served(final), tok) == _texts(tok, got) and calls  # on the low-bit path
    with pytest.raises(ServingError, match="weights compressed .*cannot be merged into low-bit weights"):
        load_served(final, ServeOptions(adapter=str(final)))
    trained = _trainer_load(final)  # the trainer's loader follows the manifest too: the low-bit path, frozen
    assert any(isinstance(m, lowbit.LowBitLinear) for m in trained.modules())
    calls.clear()
    assert _reference(trained, tok, use_lean=None) == got and calls


def test_attuner_export(tmp_path, model_dir):
    from inference.pic import ArtifactCache, PICConfig, PICEngine, PICRequest, load_query_adapter
    from models.loading import load_pretrained

    final, _ = _train_and_export(tmp_path / "run", "attuner", "model=hf", f"model.path={model_dir}",
                                 "data=artifacts", "trainer.batch_size=4", "trainer.micro_batch_size=2")
    m = _check_manifest(final, "attuner")
    assert m.adapter == "attuner" and m.artifact_cache == {"mode": "pic", "adapter_on": "query"}
    assert m.base == str(model_dir)
    with pytest.raises(ServingError, match="kind attuner is a query-side adapter for an artifact cache"):
        load_served(final)
    # with artifacts: the base it names, unmerged, and the adapter's q deltas; the same completion as
    # the cache and engine built by hand from the same files
    server = load_served(final, ServeOptions(artifacts=True))
    assert server.adapter_dir == str(final) and server.query_adapter
    tok = build_char_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    request = PICRequest.make([], [ids("[kiwo]\nda=17\n"), ids("[lema]\nda=12\n")], ids("q: kiwo da?\na: "))
    got = server.artifact_engine((), PICConfig(mode="pic")).generate([request], _greedy(tok))
    base, _ = load_pretrained(str(model_dir))
    deltas = load_query_adapter(base.eval(), str(final))
    want = PICEngine(base, ArtifactCache(base), PICConfig(mode="pic"), adapter=deltas).generate([request], _greedy(tok))
    assert _tokens(got) == _tokens(want) and any(_tokens(got))
    with pytest.raises(ServingError, match="opened for artifacts"):
        server.generate(_ids(tok), _greedy(tok))


def test_manifest_of_a_missing_dir_names_it(tmp_path):
    from models.model_dir import ModelDirError

    with pytest.raises((ServingError, ModelDirError), match=str(tmp_path / "nowhere")):
        load_served(tmp_path / "nowhere")


def test_no_module_level_mutable_state_in_the_runtime():
    """Statistics and timing caches live in engines and servers. At module level, inference/ holds
    constants and the registries: the two fast-path ones and the door's weight formats (filled when the
    modules that register are imported)."""
    import ast

    from tests.conftest import ROOT

    allowed = {"__all__", "_LAZY", "LEAN_ARCHITECTURES", "LINEAR_KINDS", "ROUTE_KINDS", "WEIGHT_KINDS"}
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = []
    for path in sorted((ROOT / "inference").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any("cache" in ast.unparse(d) for d in node.decorator_list):
                found.append(f"{path.name}:{node.lineno} {node.name} (a process-wide cache)")
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            value = node.value
            call = isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "list", "set", "defaultdict")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (isinstance(value, mutable) or call) and ast.unparse(target) not in allowed:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    assert not found, found
    from inference import skip_routing

    assert not hasattr(skip_routing, "SHARED_STATS") and not hasattr(skip_routing, "_MEASURED")


def test_sessions_and_artifact_servers_open_through_the_door(make_model, prompts):
    """What clm and attuner decode with comes from a Server: its sessions equal the plain engine on a first
    turn, and a second turn reusing the prefix equals a fresh prefill; modes that cannot serve them say so."""
    from inference import Engine, SamplingParams
    from inference.pic import PICServer
    from inference.serving import serve_model
    from inference.suffix import ReuseConfig

    model = make_model("qwen3")
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = _tokens(Engine(model).generate(prompts, params))
    sessions = serve_model(model).sessions(ReuseConfig(mode="prefix"))
    names = [str(i) for i in range(len(prompts))]
    assert _tokens(sessions.generate(prompts, params, sessions=names)) == plain
    follow = [p + c + [5, 6] for p, c in zip(prompts, plain)]
    assert _tokens(sessions.generate(follow, params, sessions=names)) == _tokens(Engine(model).generate(follow, params))
    assert all(s.prefix_tokens > 0 for s in sessions.stats)  # the second turn reused its session's K/V
    with pytest.raises(ServingError, match="sessions serve plain decoding"):
        serve_model(model, ServeOptions(speculative="seed")).sessions()
    assert isinstance(serve_model(model, ServeOptions(artifacts=True)).artifact_server(), PICServer)
    with pytest.raises(ServingError, match="opened without artifacts=True"):
        serve_model(model).artifact_server()


def test_a_toy_weight_format_plugs_in_by_one_registration(model_dir, tmp_path):
    """An export in a format the door did not know serves once its module registers it: described from its
    files, loaded by the format's loader (the same tokens as the model it stores), refused by its own rule,
    and opened by the trainer's loader the same way."""
    from transformers import AutoModelForCausalLM

    from tests.inference import toy_weights

    original = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = build_char_tokenizer()
    out = tmp_path / "halved"
    toy_weights.save_halved(original, tok, str(out))
    manifest = describe(out)
    assert (manifest.kind, manifest.weights, manifest.scheme) == ("quantized", "halved", "half")
    want = _reference(original, tok)
    assert _tokens(load_served(out).generate(_ids(tok), _greedy(tok))) == want and any(want)
    with pytest.raises(ServingError, match="weights halved: no adapter merges into them"):
        load_served(out, ServeOptions(adapter=str(model_dir)))
    trained = _trainer_load(out)
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), original.state_dict().values()))
