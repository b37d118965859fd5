"""A layer skipper trained over a low-bit base (`+algo=skipper model.path=QAD_EXPORT`) and served
with all three fast paths composed: the low-bit linears, the skipper's routes, SEED speculation."""
from __future__ import annotations

import pytest
import torch

from algorithms import config_schemas
from trainer.config import ConfigError, load_config

FLAGS = ["trainer.max_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=1000",
         "trainer.eval_examples=4", "trainer.eval_max_new_tokens=12", "trainer.max_new_tokens=12", "data.digits=2",
         "data.steps=1", "data.n_train=64", "data.n_test=8", "logging.wandb=false", "logging.progress=false"]


@pytest.fixture(scope="module")
def qad_export(tmp_path_factory):
    """A W4A8 compressed-tensors export of a 4-layer tiny Qwen3 (what +algo=qad writes)."""
    from models.loading import random_qwen3
    from models.quant import QuantScheme, apply_fake_quant
    from models.quant_export import export_compressed
    from models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), hidden_size=64, num_layers=4, kv_heads=2, initializer_range=0.2).eval()
    apply_fake_quant(model, QuantScheme.parse("W4A8", 16))
    path = tmp_path_factory.mktemp("qad")
    export_compressed(model, tok, str(path))
    return path


def _config(out, qad_export, *extra, algo="skipper"):
    return load_config([f"+algo={algo}", "model=hf", f"model.path={qad_export}", *FLAGS, f"output_dir={out}", *extra],
                       config_schemas())


def test_only_algorithms_that_train_new_modules_take_a_low_bit_base(tmp_path, qad_export):
    with pytest.raises(ConfigError, match=f"model.path={qad_export} is a low-bit .*algo sft trains the base's weights"):
        _config(tmp_path, qad_export, algo="sft")
    with pytest.raises(ConfigError, match="backend=fsdp: a low-bit base .* runs under backend=single or backend=ddp"):
        _config(tmp_path, qad_export, "backend=fsdp")


def test_skipper_over_a_low_bit_base_trains_exports_and_serves_composed(tmp_path, qad_export):
    from inference import Engine, EngineConfig, SamplingParams
    from inference.lowbit import LowBitLinear
    from inference.quantized import load_quantized
    from inference.serving import ServeOptions, describe, load_served
    from models.skipper import skipper_parameters
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    session = build_session(_config(tmp_path / "run", qad_export), World())
    model = session.backend.full_model()
    assert isinstance(model.model.layers[0].self_attn.q_proj, LowBitLinear)  # the frozen base is low-bit
    before = [p.detach().clone() for p in skipper_parameters(model)]
    assert fit(session) == "done"
    final = export_final(session)
    session.tracker.close()
    trained = session.backend.full_model().eval()
    # gradients reached every router and adapter through the low-bit layers above them
    assert all(not torch.equal(a, b) for a, b in zip(before, skipper_parameters(trained)))

    # the export: the base written back as it was (every integer and scale), the skipper beside it
    manifest = describe(final)
    assert (manifest.kind, manifest.weights, manifest.scheme, manifest.skipper) == ("quantized", "compressed", "W4A8",
                                                                                   "skipper")
    base, _ = load_quantized(str(qad_export))
    served_base, _ = load_quantized(final)
    a, b = base.state_dict(), served_base.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # served through the door: low-bit + routes on the lean path, alone and under SEED speculation,
    # equal to the training-side forward of the quantized, routed model (its own HF forward)
    tok = session.tokenizer
    prompts = [tok(p).input_ids for p in ("q: 12+7?\na: ", "q: 31-4?\na: ", "q: 5+5?\na: ")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    reference = [c.tokens for c in Engine(trained, EngineConfig(use_lean=False)).generate(prompts, params)]
    routed = load_served(final, ServeOptions(engine=EngineConfig(skip_mode="routed")))
    assert routed.engine.lean_active() and routed.skipper is not None
    got = [c.tokens for c in routed.generate(prompts, params)]
    assert got == reference and any(got)
    decode = routed.stats.skip
    assert sum(decode.decode_run.values()) + sum(decode.decode_skip.values()) > 0


@pytest.mark.slow  # torchrun with 2 ranks: ~35 s
def test_two_ranks_train_a_skipper_over_a_low_bit_base(tmp_path, qad_export, subprocess_env):
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "+algo=skipper", "model=hf", f"model.path={qad_export}", *FLAGS, "trainer.micro_batch_size=2",
           "trainer.eval_every=2", f"output_dir={out}"]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]
    manifest = json.loads((out / "final" / "serving.json").read_text())
    assert (manifest["kind"], manifest["weights"], manifest["skipper"]) == ("quantized", "compressed", "skipper")


def test_seed_then_qad_then_skipper_stack_all_three_fast_paths(tmp_path):
    """SEED trains the drafter, QAD quantizes that model, a skipper trains over the QAD export: the last
    export holds low-bit weights, a skipper and the SEED drafter spec (carried over by the two exports
    that keep their starting model's function), and serves all three composed, losslessly."""
    import json

    from inference import Engine, EngineConfig, SamplingParams
    from inference.serving import ServeOptions, describe, load_served
    from models.loading import random_qwen3
    from models.tokenizer import build_char_tokenizer
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    tok = build_char_tokenizer()
    start = tmp_path / "start"
    random_qwen3(len(tok), hidden_size=64, num_layers=4, kv_heads=2, initializer_range=0.2).save_pretrained(start)
    tok.save_pretrained(start)

    def stage(name, source, algo, *extra):
        session = build_session(load_config([f"+algo={algo}", "model=hf", f"model.path={source}", *FLAGS,
                                             f"output_dir={tmp_path / name}", *extra], config_schemas()), World())
        assert fit(session) == "done"
        final = export_final(session)
        session.tracker.close()
        return final, session

    seed_final, _ = stage("seed", start, "seed", "algo.decoder_layers=1")
    spec = json.loads((tmp_path / "seed" / "final" / "seed_drafter.json").read_text())
    # weight-only low-bit: continuous in the activations, so speculation stays exact (W4A8 is refused below)
    qad_final, _ = stage("qad", seed_final, "qad", "algo.format=W4A16", "algo.group_size=16")
    skip_final, session = stage("skip", qad_final, "skipper")
    for final, kind in ((qad_final, "quantized"), (skip_final, "quantized")):
        assert describe(final).drafter == "seed_drafter.json", final
        assert json.loads(open(f"{final}/seed_drafter.json").read()) == spec  # decoder_layers 1, as trained
    m = describe(skip_final)
    assert (m.weights, m.skipper, m.drafter) == ("compressed", "skipper", "seed_drafter.json")

    trained = session.backend.full_model().eval()
    prompts = [tok(p).input_ids for p in ("q: 12+7?\na: ", "q: 31-4?\na: ")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    reference = [c.tokens for c in Engine(trained, EngineConfig(use_lean=False)).generate(prompts, params)]
    triple = load_served(skip_final, ServeOptions(speculative="seed"))
    assert triple.decoder.decoder_layers == 1  # the carried spec configures the drafter
    assert [c.tokens for c in triple.generate(prompts, params)] == reference and any(reference)


def test_speculation_over_activation_quantized_weights_is_refused_in_one_line(qad_export, capsys):
    """W4A8 rounds every activation: verification over several tokens would not reproduce one-token
    decoding, so the serving door refuses it by name (weight-only schemes serve, test above)."""
    from inference.__main__ import EXIT_USAGE, main
    from inference.serving import ServeOptions, ServingError, load_served

    with pytest.raises(ServingError, match=f"{qad_export / 'serving.json'}: scheme W4A8 quantizes activations per "
                                           "token: .* speculative=seed would not be exact"):
        load_served(qad_export, ServeOptions(speculative="seed"))
    capsys.readouterr()
    assert main([str(qad_export), "--prompt", "1+1=", "--speculative", "seed"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {qad_export / 'serving.json'}: scheme W4A8") and err.count("\n") == 1, err
    # a live model with such linears is refused by the decoder itself
    from inference.quantized import load_quantized
    from inference.speculative import SpeculativeDecoder

    model, _ = load_quantized(str(qad_export))
    with pytest.raises(ValueError, match=r"cannot run the model exactly: .*quantizes its input per token \(W4A8\)"):
        SpeculativeDecoder(model)
