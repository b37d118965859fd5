"""Layer skipper: train a router and an adapter per routed decoder layer so that tokens learn to skip
layers, with the base model frozen (the surgery and its arithmetic are `models/skipper.py`).

At each routed layer (`layers`; [] = the upper half of the stack) a router reads the layer's normed
input h and gives each token a gate g in [0, 1]; the token runs the layer when g > 0.5 and otherwise
takes only `x + adapter(h)` (its K/V are still written, so later tokens attend to it). `gate` says
how g scales the branches (`soft`: the MLP by g, the adapter by 1 - g; `hard`: the 0/1 decision
with a straight-through gradient; the default). `decision_grad` (default on) also trains each
router through its run/skip decision: straight through, d out / d g gains (run branch - skip
branch) for every token, so a router learns whether running its layer beats the adapter (measured
in docs/skipper.md: without it the routers skip real layers as readily as near-identity ones).
Only the routers and adapters train; every base weight stays as
it was, so the base is the teacher without a copy: the same model with every router forced to run
(`forced(model, "run")`) IS the frozen base.

Loss, per step (every term a SUM over the loss tokens -- the completion tokens -- divided by the
trainer's global normaliser, the global count of loss tokens; never a per-micro-batch mean, so the
gradient is the same for any split into micro-batches and ranks):

    loss = ( sum_t D_t + alpha * sum_t pen_t ) / normaliser
    D_t    `loss=kl`: forward KL(p_base || p_skipper) over the full vocabulary at `kd_temperature`
           (the chunked loss of QAD's KL stage, so no (B, T, V) logits are built);
           `loss=lm`: cross-entropy -log p_skipper(token t) (no teacher pass).
    skip_t = mean over the routed layers l of (1 - decision_l(t))      decision: straight-through 0/1
    pen_t  = (skip_t - target_skip) ** 2

skip_t is the token's actual share of skipped routed layers (the decision is exactly 0 or 1 in
value; its gradient is that of g). The budget is per token, not per batch: a per-token penalty is a
sum over tokens, so it decomposes exactly over micro-batches and ranks under the global normaliser;
a batch-level budget ((mean skip over the batch - target)^2) is not a sum over tokens and would
change with how the batch is split. Token t's skip_t is read at token t's own position (the pass
that feeds token t through the routed layers).

Data (`completions`): `solutions` (the task's worked solution + EOS after the prompt) or `base`
(the base model's greedy completions: generated with every router forced to run).

Logged per step: `skipper/kl` (or `skipper/ce`) and `skipper/penalty` per loss token,
`skipper/skip_ratio` (share of skipped routed-layer decisions over the loss tokens),
`skipper/skip/<layer>` per routed layer, `skipper/gate_mean`. The eval adds, on greedy completions
of held-out prompts (teacher-forced once to read the routers), `skipper/skip_ratio`,
`skipper/skip/<layer>` and `skipper/layer_skip_ratio` (skipped layer-tokens over ALL layers).

Export: `final/` is the unchanged base in Hugging Face format (no skipper keys) with its tokenizer,
and `final/skipper/` the routers and adapters (`models.skipper.save_skipper`).

    python train.py +algo=skipper trainer.max_steps=100
    python train.py +algo=skipper algo.target_skip=0.5 algo.gate=hard algo.layers=[1,2,3]
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from algorithms import losses
from algorithms.base import (Batch, LossChunking, RolloutContext, StepOutput, TeacherBatching, TeacherTerms, Traits,
                             pad_right)
from algorithms.rollouts import completion_mask, encode_prompt, training_completions
from algorithms.scoring import detached_head, predicting, sliced_final_hidden, student_features
from models.anatomy import causal_lm, decoder_layers, final_hidden
from models.prompts import generation_eos, stop_ids
from models.skipper import (
    GATES, SKIPPER_DIR, apply_skipper, base_state_dict, check_layers, check_supported, decisions, forced, make_spec,
    record_gates, save_skipper, skipper_parameters, skipper_state,
)

LOSSES = ("kl", "lm")
COMPLETIONS = ("solutions", "base")


@dataclass
class SkipperConfig(LossChunking, TeacherBatching):
    # lr: 3e-3 measured on the tiny default (docs/skipper.md). On a pretrained base only the new routers and
    # adapters train (the base is frozen), as with LoRA adapters: 1e-4, untuned.
    traits: ClassVar[Traits] = Traits(tiny_lr=3e-3, pretrained_lr=1e-4, low_bit_base=True, keeps_base=True)
    name: str = "skipper"
    layers: list[int] = field(default_factory=list)  # routed decoder layers; [] = the upper half
    gate: str = "hard"  # hard (straight-through 0/1 decision) | soft (s_run = g, s_skip = 1 - g)
    loss: str = "kl"  # kl (forward KL from the base, full vocabulary) | lm (cross-entropy on the targets)
    alpha: float = 1.0  # weight of the skip penalty (measured on the tiny default: docs/skipper.md)
    target_skip: float = 0.25  # per-token share of routed layers to skip, in [0, 1)
    decision_grad: bool = True  # also train the routers through the run/skip decision (straight through)
    kd_temperature: float = 1.0  # loss=kl: temperature of both distributions
    completions: str = "solutions"  # solutions (worked solutions + EOS) | base (the base's greedy completions)
    seed: int = 0  # seeds the router and adapter init

    def validate(self) -> None:
        for key, allowed in (("gate", GATES), ("loss", LOSSES), ("completions", COMPLETIONS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"algo.{key}={getattr(self, key)} is not one of {', '.join(allowed)}")
        if not 0.0 <= self.target_skip < 1.0:
            raise ValueError(f"algo.target_skip={self.target_skip} must be in [0, 1)")
        if self.alpha < 0:
            raise ValueError(f"algo.alpha={self.alpha} must be >= 0")
        if self.kd_temperature <= 0:
            raise ValueError(f"algo.kd_temperature={self.kd_temperature} must be > 0")
        self.check_teacher_batching()  # the teacher is the base: every router forced to run
        self.check_loss_chunking()

    def check_run(self, max_steps: int, skeleton: Optional[Callable[[], nn.Module]]) -> None:
        """The routed layers against the model's depth (a meta-device skeleton; None: not known
        before loading, then prepare_model checks them)."""
        if skeleton is None:
            return
        model = skeleton()
        routed_for(self.layers, len(decoder_layers(model, user="skipper")))
        check_supported(model)


def routed_for(layers: Sequence[int], num_layers: int) -> Optional[tuple[int, ...]]:
    """The checked `algo.layers` (None: the upper half, `models.skipper.default_layers`); ValueError
    naming algo.layers when they do not fit a model of `num_layers` layers."""
    if layers:
        return check_layers(layers, num_layers, key="algo.layers")
    if num_layers < 2:
        raise ValueError(f"algo.layers=[] routes the upper half of the stack, which a {num_layers}-layer "
                         "model does not have")
    return None


# --- the skip penalty ------------------------------------------------------------------------------------


def token_skips(gates: Mapping[int, Tensor], sel: Tensor) -> Tensor:
    """(N, L_routed): 1 - decision of each selected token at each routed layer (ascending layers),
    exactly 0 or 1 in value, with the straight-through gradient of g."""
    return torch.stack([1.0 - decisions(gates[i])[sel] for i in sorted(gates)], -1)


def skip_penalty(gates: Mapping[int, Tensor], sel: Tensor, target: float) -> tuple[Tensor, Tensor]:
    """(skip_t, pen_t), each (N,) over the selected tokens (sel (B, T) bool): skip_t = the token's
    share of skipped routed layers, pen_t = (skip_t - target) ** 2."""
    skip = token_skips(gates, sel).mean(-1)
    return skip, (skip - target) ** 2


# --- the algorithm -----------------------------------------------------------------------------------------


class Skipper:
    name = "skipper"
    # eval metric -> its line in train.py's before -> after summary
    summary_metrics = {"skipper/skip_ratio": "skipped routed layer-tokens (greedy completions)"}

    def __init__(self, cfg: SkipperConfig):
        self.cfg = cfg

    # setup

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Routers + adapters on the routed layers (init from `seed`); everything else frozen."""
        lm = causal_lm(model)
        check_supported(lm)
        layers = routed_for(self.cfg.layers, lm.config.num_hidden_layers)
        state = apply_skipper(model, make_spec(lm.config, layers, self.cfg.gate), seed=self.cfg.seed)
        state.decision_grad = self.cfg.decision_grad
        model.requires_grad_(False)
        for p in skipper_parameters(model):
            p.requires_grad_(True)
        return model

    def check_policy(self, policy: nn.Module) -> None:
        """The model rollouts, eval and export see must carry the skipper (a full-weight copy made
        by FSDP2 / ZeRO-3 does: the routing link is copied with the layers it routes)."""
        if skipper_state(policy) is None:
            raise RuntimeError("skipper: the model has no skipper (prepare_model applies it)")

    # batches

    def completions(self, examples: Sequence[Any], prompts: list[list[int]], ctx: RolloutContext) -> list[list[int]]:
        def base_greedy(prompts, params):  # every router forced to run: the frozen base, behind the serving door
            with forced(ctx.policy, "run"):
                return ctx.engine.generate(prompts, params)

        return training_completions(self.cfg.completions, examples, prompts, ctx, base_greedy)

    @torch.no_grad()
    def base_states(self, policy: nn.Module, ids: Tensor, attn: Tensor) -> Tensor:
        """Final normed states (B, T, H) of the base (every router forced to run), in slices of
        `teacher_batch_size` rows."""
        with forced(policy, "run"):
            return sliced_final_hidden(policy, ids, attn, self.cfg.teacher_batch_size)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        self.check_policy(ctx.policy)
        tok = ctx.tokenizer
        prompts = [encode_prompt(tok, ctx.task.prompt(ex)) for ex in examples]
        targets = self.completions(examples, prompts, ctx)
        ids, attn = pad_right([p + c for p, c in zip(prompts, targets)], tok.pad_token_id, ctx.device)
        batch = Batch(ids, attn, completion_mask(prompts, targets, ids), uids=[ex.uid for ex in examples])
        if self.cfg.loss == "kl":
            final = self.base_states(ctx.policy, ids, attn)
            batch.teacher = TeacherTerms(predicting(final)[:, :, None], detached_head(ctx.policy))
        return batch

    # loss

    def loss(self, model: nn.Module, micro: Batch, normaliser: Tensor) -> StepOutput:
        sel = micro.loss_mask.bool()
        n = sel.sum().clamp(min=1)
        with record_gates(model) as rec:
            feats, head = student_features(model, micro.input_ids, micro.attention_mask)  # (B, T, H|V)
        targets = micro.input_ids[sel]
        chunk = self.cfg.loss_chunk_tokens or losses.auto_chunk(causal_lm(model).config.vocab_size, 1)
        metrics: dict[str, Tensor] = {}
        if self.cfg.loss == "kl":
            assert micro.teacher is not None, "make_batch fills the base's states for loss=kl"
            div, _ = losses.chunked_self_distill(feats[sel], head, micro.teacher.hidden[sel], micro.teacher.head,
                                                 targets, beta=0.0, temperature=self.cfg.kd_temperature, chunk=chunk)
            fit = div.sum()
            metrics["skipper/kl"] = fit.detach() / n
        else:
            fit = -losses.chunked_token_logprobs(feats[sel], head, targets, chunk=chunk).sum()
            metrics["skipper/ce"] = fit.detach() / n
        gates = rec.gates
        skips = token_skips(gates, sel)  # (N, L_routed)
        skip = skips.mean(-1)
        penalty = ((skip - self.cfg.target_skip) ** 2).sum()
        metrics["skipper/penalty"] = penalty.detach() / n
        metrics["skipper/skip_ratio"] = skip.detach().sum() / n
        for j, layer in enumerate(sorted(gates)):
            metrics[f"skipper/skip/{layer}"] = skips[:, j].detach().sum() / n
        metrics["skipper/gate_mean"] = torch.stack([gates[i][sel] for i in sorted(gates)]).detach().sum() / (
            n * len(gates))
        return StepOutput((fit + self.cfg.alpha * penalty) / normaliser, metrics)

    # eval

    @torch.no_grad()
    def extra_eval(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict[str, float]:
        """Greedy completions of `examples` by the skipper model itself, then one teacher-forced
        forward of prompt + completion to read its routers: the share of skipped routed-layer
        decisions over the completion tokens (`skipper/skip_ratio`), per routed layer
        (`skipper/skip/<layer>`), and over all decoder layers (`skipper/layer_skip_ratio`)."""
        from inference import SamplingParams
        from inference.serving import serve_model

        self.check_policy(model)
        lm = causal_lm(model)
        device = next(lm.parameters()).device
        prompts = [encode_prompt(tokenizer, task.prompt(ex)) for ex in examples]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                stop_token_ids=stop_ids(tokenizer, generation_eos(lm)))
        was_training = lm.training
        lm.eval()
        try:
            outs = [list(o.tokens) for o in serve_model(lm).generate(prompts, params)]
            ids, attn = pad_right([p + c for p, c in zip(prompts, outs)], tokenizer.pad_token_id, device)
            sel = completion_mask(prompts, outs, ids).bool()
            with record_gates(lm) as rec:
                final_hidden(lm, ids, attn)
        finally:
            lm.train(was_training)
        skips = token_skips(rec.gates, sel)  # (N, L_routed)
        n = max(int(sel.sum()), 1)
        routed = sorted(rec.gates)
        ratio = float(skips.sum()) / (n * len(routed))
        out = {"skipper/skip_ratio": ratio,
               "skipper/layer_skip_ratio": ratio * len(routed) / lm.config.num_hidden_layers}
        out.update({f"skipper/skip/{layer}": float(skips[:, j].sum()) / n for j, layer in enumerate(routed)})
        return out

    # artifacts and state

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        """The unchanged base (no skipper keys) + tokenizer; the skipper in out_dir/skipper/. A low-bit base
        (model.path a QAD export) is written back as the compressed-tensors checkpoint it was, integers
        as stored; any other in HF format."""
        from inference.lowbit import lowbit_modules

        lm = causal_lm(model)
        if lowbit_modules(lm):
            from inference.quantized import save_quantized

            save_quantized(lm, tokenizer, out_dir, state=base_state_dict(lm))
        else:
            lm.save_pretrained(out_dir, state_dict=base_state_dict(lm))
            tokenizer.save_pretrained(out_dir)
        save_skipper(lm, os.path.join(out_dir, SKIPPER_DIR))

    def state_dict(self) -> dict:
        return {}  # the routers and adapters are submodules of the model: its checkpoint holds them

    def load_state_dict(self, state: dict) -> None:
        pass

