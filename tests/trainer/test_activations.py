"""HiLoRe activation management (trainer/activations/manager.py): exactness of recompute, compression
of saved tensors, profiling and re-planning, composition with other layer wrappers; and the settings
(trainer/activations/options.py): validation, the trainer.activation* keys, the torch-free config import.
The quantiser and the planner have their own files (test_activations_quantize.py, _planner.py)."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.layer_wrap import wrap_layers, wrapped_names
from models.loading import TinySpec, build_tiny
from tests.conftest import ROOT
from trainer.activations import COMPRESS, RECOMPUTE, ActivationConfig, install

SPEC = TinySpec(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128)


def _model(dropout: float = 0.0):
    model, tok = build_tiny(SPEC, seed=0)
    if dropout:
        model.config.attention_dropout = dropout
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = dropout
    model.train()
    return model


def _ids(b=2, t=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (b, t), generator=g)


def _step(model, ids, mgr=None, coef=None, rng_seed=None):
    model.zero_grad(set_to_none=True)
    if mgr is not None:
        mgr.set_exposure(coef)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    logp = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    adv = torch.linspace(-1, 1, ids.shape[0])[:, None]
    loss = -(adv * logp).sum() / logp.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _flat(gs):
    return torch.cat([g.reshape(-1) for g in gs])


def test_checkpoint_mode_is_exact():
    model, ids = _model(), _ids()
    loss0, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    assert mgr.plan() == [RECOMPUTE] * 3
    loss1, g1 = _step(model, ids, mgr)
    assert torch.allclose(loss0, loss1, atol=1e-6)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    mgr.remove()


def test_recompute_with_dropout_preserves_rng():
    model, ids = _model(dropout=0.1), _ids()
    loss0, g0 = _step(model, ids, rng_seed=123)
    loss_other, _ = _step(model, ids, rng_seed=7)
    assert not torch.allclose(loss0, loss_other)  # dropout is active
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    loss1, g1 = _step(model, ids, mgr, rng_seed=123)
    assert torch.allclose(loss0, loss1, atol=1e-6)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    mgr.remove()


def test_compress_all_close_but_not_exact():
    model, ids = _model(), _ids(b=2, t=64)
    _, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1024))
    mgr.force_plan([COMPRESS] * 3)
    _, g1 = _step(model, ids, mgr)
    cos = F.cosine_similarity(_flat(g0).double(), _flat(g1).double(), dim=0).item()
    assert cos >= 0.99
    assert not torch.equal(_flat(g0), _flat(g1))
    assert mgr.metrics()["activations/compressed_bytes"].item() > 0
    mgr.remove()


def test_parameters_are_never_compressed():
    model, ids = _model(), _ids()
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1))  # everything big enough
    mgr.force_plan([COMPRESS] * 3)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    pack, _ = mgr._hooks(0, {})
    seen = []
    for p in model.model.layers[0].parameters():
        out = pack(p)
        seen.append(out is p)
        view = p.t() if p.dim() == 2 else p.view(-1)
        assert pack(view) is view  # a view of a parameter (what F.linear saves) is kept as is
    assert all(seen)
    # whole run under compress: the linears' saved weights come back as the very parameters
    seen_ptrs = []
    orig_unpack = mgr._hooks

    def spy(i, kwargs):
        pk, up = orig_unpack(i, kwargs)

        def pk2(t):
            r = pk(t)
            if t.untyped_storage().data_ptr() in params:
                seen_ptrs.append(r is t)
            return r
        return pk2, up
    mgr._hooks = spy
    _step(model, ids, mgr)
    assert seen_ptrs and all(seen_ptrs)
    mgr.remove()


def test_install_remove_restores_forward():
    model = _model()
    before = [type(layer).forward for layer in model.model.layers]
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert install(model, ActivationConfig(mode="none")) is None
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    with pytest.raises(ValueError, match="already installed"):
        install(model, ActivationConfig(mode="checkpoint"))
    mgr.remove()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert [type(layer).forward for layer in model.model.layers] == before
    # the model still trains exactly after removal
    ids = _ids()
    _step(model, ids)


@pytest.mark.parametrize("key,kwargs,match", [
    ("mode", {"mode": "fast"}, "trainer.activations="),
    ("budget", {"memory_budget": 0.5}, r"trainer.activation_memory_budget=0.5 must be >= 1.0"),
    ("risk", {"risk_budget": -1.0}, "trainer.activation_risk_budget"),
    ("compress", {"compress": "int4"}, "trainer.activation_compress"),
])
def test_config_validation(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationConfig(**kwargs).validate()


def test_hilore_profiles_plans_and_replans():
    model = _model()
    ids = _ids(b=2, t=48)
    _, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="hilore", memory_budget=1.3))
    coef = torch.ones(2, 47)
    _, g1 = _step(model, ids, mgr, coef)  # profiling step: recompute, exact
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    assert mgr.profile is not None and len(mgr.profile.units) == 3
    u = mgr.profile.units[0]
    assert u.full_bytes > u.comp_bytes > 0 and u.in_bytes == 64 * 4 and u.input_saved
    assert 0 < u.err < 0.02 and u.fwd_s > 0 and u.comp_s > 0
    _step(model, ids, mgr, coef)
    est = mgr.estimate()
    assert est.tokens == 2 * 48 and est.ratio <= 1.3 + 1e-9
    m = mgr.metrics()
    assert m["activations/recompute_units"] + m["activations/compressed_units"] + m["activations/full_units"] == 3
    # zero exposure (all advantages 0): no risk
    _step(model, ids, mgr, torch.zeros(2, 47))
    assert mgr.metrics()["activations/risk"].item() == 0.0
    assert mgr.metrics()["activations/exposure"].item() == 0.0
    # a longer micro-batch gets a plan made for its own length
    _step(model, _ids(b=4, t=48), mgr, torch.ones(4, 47))
    assert mgr.estimate().tokens == 4 * 48
    mgr.replan()
    assert mgr.profile is None
    mgr.remove()


def test_saved_tensors_with_inf_are_kept_exactly():
    """Shared-prompt replay saves attention masks filled with -inf inside the layers: compressing them
    would give an inf scale and nan gradients; they are kept as they are, the rest compressed."""
    from trainer.prompt_sharing import shared_prompt_logprobs

    model = _model()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (12,), generator=g)
    ids = torch.stack([torch.cat([prompt, torch.randint(3, 60, (n,), generator=g), torch.zeros(20 - n, dtype=torch.long)])
                       for n in (20, 9, 14)])
    attn = (ids != 0).long()
    attn[:, :12] = 1
    lengths = torch.full((3,), 12)

    def grads():
        model.zero_grad(set_to_none=True)
        shared_prompt_logprobs(model, ids, attn, lengths).sum().backward()
        return _flat([p.grad for p in model.parameters()])

    exact = grads()
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=256))
    mgr.force_plan([COMPRESS] * 3)
    approx = grads()
    assert torch.isfinite(approx).all() and mgr.metrics()["activations/compressed_bytes"].item() > 0
    assert F.cosine_similarity(exact.double(), approx.double(), dim=0).item() >= 0.99
    mgr.force_plan(None)
    mgr.replan()  # profiling sees the same tensors: their error must not turn the risk into nan
    grads()
    grads()
    assert all(math.isfinite(u.err) for u in mgr.profile.units)
    assert all(math.isfinite(v.item()) for v in mgr.metrics().values())
    mgr.remove()


def test_manager_plans_for_the_gradients_it_finds():
    from trainer.activations import ACCUMULATED, FRESH

    model, ids = _model(), _ids(b=2, t=64)
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1024))
    _step(model, ids, mgr)  # profiling micro-batch
    _step(model, ids, mgr)  # zero_grad(set_to_none) first: a step's first micro-batch
    assert mgr._scenario == FRESH
    mgr.set_exposure(None)
    model(input_ids=ids).logits.sum().backward()  # grads now held: the next micro-batch accumulates
    mgr.set_exposure(None)
    model(input_ids=ids).logits.sum().backward()
    assert mgr._scenario == ACCUMULATED
    mgr.remove()


def test_manager_composes_with_another_layer_wrapper():
    """The manager is one link of the layers' wrapper chain: a wrapper installed before it keeps
    running (inside it, so once per forward and again in each recompute), checkpointing stays exact,
    and taking the manager off leaves the other wrapper in place."""
    model, ids = _model(), _ids()
    loss0, g0 = _step(model, ids)
    runs = []

    def count(i, inner, *args, **kwargs):
        runs.append(i)
        return inner(*args, **kwargs)

    other = wrap_layers(model, "count", count)
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    assert wrapped_names(model.model.layers[0]) == ["trainer.activations", "count"]
    loss1, g1 = _step(model, ids, mgr)
    assert torch.allclose(loss0, loss1, atol=1e-6)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    assert runs == [0, 1, 2] + [2, 1, 0]  # forward, then each unit recomputed in backward
    mgr.remove()
    assert wrapped_names(model.model.layers[0]) == ["count"]
    runs.clear()
    _step(model, ids)
    assert runs == [0, 1, 2]
    other.remove()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_config_import_loads_no_torch():
    """trainer/config.py validates before torch is imported: the settings it validates the
    trainer.activation* keys with (options) and the planner import no torch."""
    code = ("import sys, trainer.config, trainer.activations, trainer.activations.planner; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_trainer_keys_map_by_name_with_defaults_declared_once():
    from trainer.activations.options import trainer_key
    from trainer.config import TrainerConfig

    t = TrainerConfig()
    keys = [f.name for f in dataclasses.fields(t) if f.name.startswith("activation")]
    defaults = ActivationConfig()
    assert ActivationConfig.from_trainer(t) == defaults  # TrainerConfig's defaults are ActivationConfig's
    fields = {f.name for f in dataclasses.fields(ActivationConfig)}
    for key in keys:  # each trainer key reaches its field, and only it
        name = next(n for n in fields if trainer_key(n) == key)
        value = {"activations": "hilore", "activation_compress": "fp8",
                 "activation_stochastic_rounding": True}.get(key, 3)
        got = ActivationConfig.from_trainer(dataclasses.replace(t, **{key: value}))
        assert got == dataclasses.replace(defaults, **{name: value}), key
    assert len(keys) == 9


def test_trainer_config_validation_is_activation_config_validation():
    from trainer.config import ConfigError, TrainConfig, TrainerConfig, validate

    for key, value, message in [
        ("activation_group_size", 0, "trainer.activation_group_size=0 must be an integer >= 1"),
        ("activation_profile_steps", 0, "trainer.activation_profile_steps=0 must be an integer >= 1"),
        ("activation_replan_tolerance", -1.0, "trainer.activation_replan_tolerance=-1.0 must be >= 0"),
        ("activation_risk_budget", -1.0, "trainer.activation_risk_budget=-1.0 must be >= 0"),
        ("activation_optimizer_bytes_per_param", -1.0,
         "trainer.activation_optimizer_bytes_per_param=-1.0 must be >= 0"),
        ("activations", "fast", "trainer.activations=fast is not one of none, checkpoint, hilore"),
    ]:
        cfg = TrainConfig(trainer=TrainerConfig(**{key: value}))
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value) == message
        with pytest.raises(ValueError) as err2:
            ActivationConfig.from_trainer(cfg.trainer).validate()
        assert str(err2.value) == message  # the same check, the same words
