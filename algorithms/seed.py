"""SEED: train the model's own top layers to draft for it (self-speculative encoder-decoder drafter).

The model (L decoder layers) is split at `decoder_layers` = k: the top k layers are the *decoder*
that drafts, with weights tied to the model (it is the same model). At inference
(inference/speculative.py, mode "seed") a block of draft tokens is produced by feeding each token's
embedding through the top k layers only, attending to the full model's cached K/V of the verified
prefix and to the drafter's own K/V of the tokens drafted so far in the block; one full forward then
verifies the block and its K/V becomes the new cache.

Training (full fine-tuning) mimics that per sequence (prompt + target tokens):

  * L_full: the normal next-token CE of the full forward over the target tokens.
  * L_dec: the decoder pass. The target part of the row is cut into consecutive blocks of
    `block_size` B tokens aligned at the first target token P (the token the full model itself
    produces before drafting starts): blocks [P, P+B), [P+B, P+2B), ... A position t in the block
    starting at s = block_start(t) takes the token EMBEDDING of x_t (no lower layers) at its true
    position t (RoPE) through layers L-k..L-1; in layer l it attends to the full forward's K/V of
    layer l at positions < s and to the decoder pass's own K/V of layer l at positions s..t
    (causal within the block); final norm + lm_head predict x_{t+1}. Trained wherever x_{t+1} is
    a target token, i.e. every target but the first of the row (the full model predicts that one).
    All positions of all blocks run in ONE batched pass: each top layer's attention reads the
    concatenation [full-model input states of the row (T) ; decoder states of the row (T)] with a
    4-D mask -- query t sees full key j iff j < block_start(t) and decoder key j iff
    block_start(t) <= j <= t. The full K/V come from the same (grad-carrying) full forward, so
    L_dec also trains the full model's top-layer K/V of the prefix (which the drafter reads).
  * loss = (L_full + lam * L_dec) / (1 + lam); both sums are divided by the trainer's normaliser
    (the global count of target tokens), so gradient accumulation is exact.

Data (`data_source`): `solutions` (the task's worked solution + EOS after the student prompt, like
SFT) or `self` (completions sampled from the current model at `self_temperature`, 0 = greedy, so
the drafter learns what the model will actually say). With self data, CE on the model's own tokens
only sharpens it (measured: held-out accuracy 0.64 -> 0.00 in 40 steps), so by default
(`self_anchor`) L_full is instead the forward KL(p_start || p_model) over the completion tokens, to
the starting weights (a frozen copy, checkpointed; the same full-vocabulary chunked loss as OPSD):
it pulls the full model back toward where it started while the tied top layers learn to draft
(measured: accuracy 0.64 -> 0.52 in 80 steps, acceptance 3.63 -> 3.90; worked solutions, where a
task has them, did better: 0.71 and 3.91).

Export: the fine-tuned model + tokenizer and `seed_drafter.json` (decoder_layers, block_size,
draft_len, confidence, adaptive) for the runtime.

    python train.py +algo=seed trainer.max_steps=200
    python train.py +algo=seed algo.data_source=self algo.decoder_layers=4
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, RolloutContext, StepOutput, TeacherTerms, Traits, pad_right
from algorithms.rollouts import completion_mask, encode, encode_prompt, sample
from algorithms.scoring import detached_head, teacher_hidden
from algorithms.teacher import SelfTeacher
from inference.artifacts import DRAFTER_DEFAULTS as DRAFTER, SEED_DRAFTER_FILE, DrafterSpec, write_drafter_spec
from inference.lean import lean_unsupported_reason
from models.anatomy import UnsupportedModel, causal_lm, decoder_layers as decoder_layers_of, final_hidden, output_head
from models.export import export_model
from models.prompts import generation_eos, stop_ids

log = logging.getLogger(__name__)

DATA_SOURCES = ("solutions", "self")
DRAFTER_FILE = SEED_DRAFTER_FILE  # name and defaults are defined once, in inference/artifacts.py
SELF_DATA_WARNING = (
    "SEED with algo.data_source=self and algo.self_anchor=false fine-tunes the whole model with CE on its own "
    "completions; measured on the tiny 12-layer benchmark model at lr 3e-4 this destroyed held-out accuracy "
    "within 40 steps (0.64 -> 0.00 greedy, -> 0.07 at self_temperature=1). Keep self_anchor=true.")


@dataclass
class SEEDConfig:
    name: str = "seed"
    decoder_layers: int = DRAFTER.decoder_layers  # k: the top k layers draft (1 <= k < the model's layer count)
    block_size: int = DRAFTER.block_size  # B: tokens per training block (the draft length the decoder pass mimics)
    lam: float = 1.0  # weight of the decoder loss: (L_full + lam L_dec) / (1 + lam)
    data_source: str = "solutions"  # solutions | self
    self_temperature: float = 0.0  # data_source=self: sampling temperature (0 = greedy)
    self_anchor: bool = True  # data_source=self: L_full = KL(p_start || p_model), not CE on own tokens
    # The decoder pass calls the top layers' modules directly, outside FSDP2's unshard hooks.
    traits: ClassVar[Traits] = Traits(fsdp=False, tiny_lr=3e-4)
    draft_len: int = DRAFTER.draft_len  # runtime: max drafted tokens per verify (written to seed_drafter.json, used in eval)
    confidence: float = DRAFTER.confidence  # runtime: stop drafting when the drafter's top probability falls below this
    adaptive: bool = DRAFTER.adaptive  # runtime: confidence-based draft length; False = always draft_len drafts

    def validate(self) -> None:
        if self.decoder_layers < 1:
            raise ValueError(f"algo.decoder_layers={self.decoder_layers} must be >= 1")
        if self.block_size < 1:
            raise ValueError(f"algo.block_size={self.block_size} must be >= 1")
        if self.lam < 0:
            raise ValueError(f"algo.lam={self.lam} must be >= 0")
        if self.data_source not in DATA_SOURCES:
            raise ValueError(f"algo.data_source={self.data_source} is not one of {', '.join(DATA_SOURCES)}")
        if self.self_temperature < 0:
            raise ValueError(f"algo.self_temperature={self.self_temperature} must be >= 0 (0 = greedy)")
        if self.draft_len < 1:
            raise ValueError(f"algo.draft_len={self.draft_len} must be >= 1")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"algo.confidence={self.confidence} must be in [0, 1]")

    def check_run(self, max_steps: int, skeleton: Optional[Callable[[], nn.Module]]) -> None:
        """At config validation: the split against the model's depth and the architecture against
        what the runtime serves (`check_split`), on the meta-device skeleton; skipped when the layout
        is not known before loading (a hub id, an adapter dir), where prepare_model checks instead."""
        if skeleton is not None:
            check_split(skeleton(), self.decoder_layers)


# --- model plumbing ---------------------------------------------------------------------------------


def serving_problem(model: nn.Module) -> str | None:
    """Why `python -m inference DIR --speculative seed` could not serve a SEED drafter of this model's
    architecture, or None. The predicate is the runtime's own: speculative decoding runs on the lean
    decoder and refuses any model `inference.lean.lean_unsupported_reason` names a reason for (an
    architecture other than Llama / Qwen2 / Qwen3, sliding-window or other non-full attention,
    scaled or partial RoPE, another activation, ...)."""
    lm = causal_lm(model)
    reason = lean_unsupported_reason(lm)
    if reason is None:
        return None
    return (f"algo=seed cannot train a drafter for {type(lm).__name__}: `python -m inference --speculative seed` "
            f"could not serve it ({reason})")


def check_split(model: nn.Module, decoder_layers: int) -> None:
    """The split and the architecture, checked before any work: at config validation on the model's
    meta-device skeleton (SEEDConfig.check_run) and again in prepare_model on the loaded model."""
    n = len(decoder_layers_of(model, user="SEED"))
    if not 1 <= decoder_layers < n:
        raise ValueError(f"algo.decoder_layers={decoder_layers} must be >= 1 and < the model's {n} layers")
    problem = serving_problem(model)
    if problem is not None:
        raise UnsupportedModel(problem)


def block_starts(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, T) long: the start of the block holding each position. Blocks of `block_size` tokens are
    aligned at each row's first target token P (blocks [P, P+B), [P+B, P+2B), ...); positions before
    P (the prompt), and whole rows without targets, form blocks of one token (start = t).

    Example: P = 3, B = 2, T = 8 -> [0, 1, 2, 3, 3, 5, 5, 7].
    """
    T = loss_mask.shape[1]
    t = torch.arange(T, device=loss_mask.device)[None, :].expand_as(loss_mask)  # (B, T)
    has = loss_mask.bool().any(1)  # (B,)
    first = torch.where(has, loss_mask.bool().float().argmax(1), torch.full_like(has, T, dtype=torch.long))  # (B,)
    rel = t - first[:, None]
    inside = rel >= 0
    starts = first[:, None] + torch.div(rel.clamp(min=0), block_size, rounding_mode="floor") * block_size
    return torch.where(inside, starts, t)


def decoder_mask(starts: torch.Tensor, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask (B, 1, 2T, 2T) over [full states (T) ; decoder states (T)].

    Rows 0..T-1 (full-state queries, whose outputs are discarded) see full keys causally; row T+t
    (decoder query t) sees full key j iff j < starts[t] (and j is a real token), decoder key j iff
    starts[t] <= j <= t. Every row sees at least its own key, so no softmax row is empty.
    """
    B, T = starts.shape
    device = starts.device
    j = torch.arange(T, device=device)
    valid = attention_mask.bool()[:, None, :]  # (B, 1, T) keys that are real tokens
    causal = (j[None, :] <= j[:, None])[None] & valid | torch.eye(T, dtype=torch.bool, device=device)[None]  # (B, T, T)
    s = starts[:, :, None]  # (B, T, 1)
    t = j[None, :, None]  # (1, T, 1)
    see_full = (j[None, None, :] < s) & valid  # (B, T, T)
    see_dec = (j[None, None, :] >= s) & (j[None, None, :] <= t)  # (B, T, T)
    allowed = torch.cat([torch.cat([causal, torch.zeros_like(causal)], 2), torch.cat([see_full, see_dec], 2)], 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # (B, 1, 2T, 2T)


def full_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_layers: int
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One full forward (through any wrapper, with grad): (final normed hidden (B, T, H), the input
    hidden states of each of the top `decoder_layers` layers, bottom first)."""
    layers = decoder_layers_of(model, user="SEED")
    inputs: list[torch.Tensor] = []

    def pre_hook(module, args, kwargs):
        inputs.append(args[0] if args else kwargs["hidden_states"])

    top = layers[len(layers) - decoder_layers:]
    handles = [layer.register_forward_pre_hook(pre_hook, with_kwargs=True) for layer in top]
    try:
        hidden = final_hidden(model, input_ids, attention_mask)
    finally:
        for h in handles:
            h.remove()
    assert len(inputs) == decoder_layers
    return hidden, inputs


def decoder_pass(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 full_inputs: Sequence[torch.Tensor], starts: torch.Tensor) -> torch.Tensor:
    """The batched drafter pass: final normed hidden states (B, T, H) of the top-k layers run on the
    token embeddings, each position t attending to `full_inputs`' K/V before its block start and to
    its own block's decoder K/V up to t (see `decoder_mask`). full_inputs[i]: the full forward's
    input states (B, T, H) of the i-th top layer (the layer projects them to its K/V itself).

    Each top layer runs with its own modules: input norm, then its attention module over the
    concatenated [full ; decoder] states (positions [0..T) twice, for RoPE) under the block mask,
    keeping the decoder half; residual, post-attention norm, MLP, residual."""
    lm = causal_lm(model)
    layers = lm.model.layers[len(lm.model.layers) - len(full_inputs):]
    B, T = input_ids.shape
    x = lm.model.embed_tokens(input_ids)  # (B, T, H)
    positions = torch.arange(T, device=input_ids.device)[None, :].expand(B, T)
    pos2 = torch.cat([positions, positions], 1)  # (B, 2T)
    rope = lm.model.rotary_emb(x, pos2)  # (cos, sin) each (B, 2T, D)
    mask = decoder_mask(starts, attention_mask, x.dtype)
    config = lm.config
    kernel = config._attn_implementation
    if kernel not in ("sdpa", "eager"):  # kernels that take no arbitrary 4-D mask (flash attention)
        config._attn_implementation = "sdpa"
    try:
        for layer, full in zip(layers, full_inputs):
            both = layer.input_layernorm(torch.cat([full, x], 1))  # (B, 2T, H)
            attn, _ = layer.self_attn(hidden_states=both, position_embeddings=rope, attention_mask=mask)
            x = x + attn[:, T:]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    finally:
        config._attn_implementation = kernel
    return lm.model.norm(x)


def target_logprobs(features: torch.Tensor, model: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row of features (N, H) under the output head (chunked) -> (N,) fp32."""
    head = output_head(model)
    if head is None:
        return losses.chunked_token_logprobs(causal_lm(model).lm_head(features), None, targets)
    return losses.chunked_token_logprobs(features, head, targets)


@torch.no_grad()
def target_argmax(features: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Top-1 token per row of features (N, H), a chunk of rows at a time (no (N, V) logits at once)."""
    head = causal_lm(model).lm_head
    chunk = losses.auto_chunk(head.out_features, 0)
    features = features.detach()
    parts = [head(features[i: i + chunk]).argmax(-1) for i in range(0, features.shape[0], chunk)]
    return torch.cat(parts) if parts else features.new_zeros(0, dtype=torch.long)


# --- the algorithm ----------------------------------------------------------------------------------


class SEED:
    name = "seed"
    # eval metric -> its line in train.py's before -> after summary
    summary_metrics = {"seed/mean_accepted": "mean accepted length (greedy, tokens per verify forward)"}

    def __init__(self, cfg: SEEDConfig):
        self.cfg = cfg
        self.reference = SelfTeacher("fixed", 0.0)  # the starting weights (data_source=self anchor)

    @property
    def anchored(self) -> bool:
        return self.cfg.data_source == "self" and self.cfg.self_anchor

    def prepare_model(self, model: nn.Module) -> nn.Module:
        check_split(model, self.cfg.decoder_layers)
        if self.cfg.data_source == "self" and not self.cfg.self_anchor:
            log.warning(SELF_DATA_WARNING)
        model.requires_grad_(True)
        return model

    def weight_copies(self, model: nn.Module) -> int:
        """The anchor's copy of the starting weights (data_source=self with self_anchor; trainer/memory.py)."""
        return self.reference.copies(model) if self.anchored else 0

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        tok, task = ctx.tokenizer, ctx.task
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        metrics: dict[str, torch.Tensor] = {}
        if self.cfg.data_source == "self":
            outs = sample(ctx, prompts, self.cfg.self_temperature, 1.0)
            targets = [list(o.tokens) for o in outs]
            metrics["seed/sample_length"] = torch.tensor(sum(map(len, targets)) / max(len(targets), 1))
        else:
            targets = [encode(tok, ex.solution) + [tok.eos_token_id] for ex in examples]
        ids, attn = pad_right([p + c for p, c in zip(prompts, targets)], tok.pad_token_id, ctx.device)
        loss_mask = completion_mask(prompts, targets, ids)
        batch = Batch(ids, attn, loss_mask, uids=[ex.uid for ex in examples], metrics=metrics)
        if self.anchored:
            with torch.no_grad(), self.reference.weights(ctx.policy) as ref:
                # [b, t] = the starting model's state predicting token t (the completion's positions).
                hidden = teacher_hidden(ref, [[p] for p in prompts], targets, [len(p) for p in prompts],
                                        ids.shape[1], len(prompts), ctx.device)
                batch.teacher = TeacherTerms(hidden, detached_head(ref))
        return batch

    def terms(self, model: nn.Module, micro: Batch) -> dict[str, torch.Tensor]:
        """Summed (not normalised) CE of both passes, their token counts and the decoder's top-1 hits."""
        k = self.cfg.decoder_layers
        hidden, full_inputs = full_forward(model, micro.input_ids, micro.attention_mask, k)
        target = micro.loss_mask.bool()  # (B, T) token t is trained
        full_sel = torch.zeros_like(target)
        full_sel[:, :-1] = target[:, 1:]  # position t predicts token t+1
        starts = block_starts(micro.loss_mask, self.cfg.block_size)
        dec_sel = full_sel & target  # query t is itself a target (inside a block) and predicts target t+1
        next_ids = torch.nn.functional.pad(micro.input_ids[:, 1:], (0, 1))  # (B, T) token t+1
        if self.anchored:
            full = self.anchor_terms(model, micro, hidden, full_sel, next_ids)
        else:
            full = -target_logprobs(hidden[full_sel], model, next_ids[full_sel]).sum()
        dec_hidden = decoder_pass(model, micro.input_ids, micro.attention_mask, full_inputs, starts)
        dec_feats = dec_hidden[dec_sel]
        dec_logp = target_logprobs(dec_feats, model, next_ids[dec_sel])  # (N_dec,)
        hits = (target_argmax(dec_feats, model) == next_ids[dec_sel]).sum()
        return {"full": full, "dec": -dec_logp.sum(), "n_full": full_sel.sum(), "n_dec": dec_sel.sum(),
                "hits": hits}

    def anchor_terms(self, model: nn.Module, micro: Batch, hidden: torch.Tensor, full_sel: torch.Tensor,
                     next_ids: torch.Tensor) -> torch.Tensor:
        """sum over the full model's trained positions of KL(p_start || p_model) (full vocabulary)."""
        if micro.teacher is None:
            raise ValueError("algo.self_anchor: the batch has no reference states (make_batch fills them)")
        feats, head = hidden[full_sel], output_head(model)
        if head is None:  # sharded head (ZeRO-3): the model's own module computes the logits
            feats = causal_lm(model).lm_head(feats)  # (N_full, V)
        # teacher_hidden[:, t] predicts token t; hidden[:, t] predicts token t + 1: shift by one.
        ref = torch.nn.functional.pad(micro.teacher.hidden[:, 1:], (0, 0, 0, 0, 0, 1))  # (B, T, 1, H)
        ref_head = micro.teacher.head
        div, _ = losses.chunked_self_distill(
            feats, head, ref[full_sel], ref_head, next_ids[full_sel], beta=0.0,
            chunk=losses.auto_chunk(ref_head[0].shape[0], 1))  # (N_full,) forward KL
        return div.sum()

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        lam = self.cfg.lam
        t = self.terms(model, micro)
        loss = (t["full"] + lam * t["dec"]) / ((1.0 + lam) * normaliser)
        n_full, n_dec = t["n_full"].clamp(min=1).float(), t["n_dec"].clamp(min=1).float()
        metrics = {"seed/loss_full": t["full"].detach() / n_full, "seed/loss_dec": t["dec"].detach() / n_dec,
                   "seed/dec_accuracy": t["hits"].float() / n_dec}
        return StepOutput(loss, metrics)

    @torch.no_grad()
    def extra_eval(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict:
        """Greedy self-speculative decoding of held-out prompts with the trained drafter:
        {"seed/mean_accepted": tokens emitted per verify forward}. Empty (with a warning) when the
        runtime (inference.speculative) is not available or cannot run this model."""
        try:
            from inference import SamplingParams
            from inference.serving import ServeOptions, serve_model
            from inference.speculative import SpeculativeDecoder  # noqa: F401 -- the door's speculative path
        except ImportError as err:
            log.warning("SEED drafter eval skipped: inference.speculative is not available (%s)", err)
            return {}
        lm = causal_lm(model)
        if any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules()):
            # A training engine's hooks (DeepSpeed ZeRO-1/2) on whole weights: decode a hook-free copy.
            weight = next(lm.parameters())
            plain = type(lm)(lm.config).to(device=weight.device, dtype=weight.dtype)
            plain.load_state_dict(lm.state_dict())
            lm = plain
        reason = lean_unsupported_reason(lm)
        if reason is not None:
            log.warning("SEED drafter eval skipped: speculative decoding cannot run this model (%s)", reason)
            return {}
        was_training = lm.training
        lm.eval()
        try:
            server = serve_model(lm, ServeOptions(  # the live model behind the door, as its export will be served
                speculative="seed", decoder_layers=self.cfg.decoder_layers, draft_len=self.cfg.draft_len,
                confidence=self.cfg.confidence, adaptive=self.cfg.adaptive), tokenizer)
            prompts = [encode_prompt(tokenizer, task.prompt(ex)) for ex in examples]
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                    stop_token_ids=stop_ids(tokenizer, generation_eos(lm)))
            server.generate(prompts, params)
        finally:
            lm.train(was_training)
        return {"seed/mean_accepted": float(server.stats.mean_accepted)}

    def drafter_spec(self) -> dict:
        return {"decoder_layers": self.cfg.decoder_layers, "block_size": self.cfg.block_size,
                "draft_len": self.cfg.draft_len, "confidence": self.cfg.confidence,
                "adaptive": self.cfg.adaptive}

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)
        write_drafter_spec(out_dir, DrafterSpec(**self.drafter_spec()))

    def state_dict(self) -> dict:
        return {"reference": self.reference.state_dict()} if self.anchored else {}

    def load_state_dict(self, state: dict) -> None:
        if "reference" in state:
            self.reference.load_state_dict(state["reference"])
