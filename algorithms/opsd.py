"""On-policy self-distillation (OPSD): the model, shown the question, learns from itself shown the
question plus a verified reference solution.

Paper: "Self-Distilled Reasoner: On-Policy Self-Distillation for LLMs" (reference code
siyan-zhao/OPSD, built on TRL's GOLD/GKD trainers). The base of MASS (algorithms/mass.py) and TESD
(algorithms/tesd.py), which reuse the functions below.

Per step: the student samples one completion per question through the inference engine (on-policy,
temperature 1.1, top-p 0.95); the identical completion tokens are scored under the teacher prompt
(question + reference + transition line, the task's `teacher_prompt`) with no grad; the loss per
completion token is the generalized JSD(beta) over the vocabulary between the student and the
teacher, logits divided by the sampling temperature, summed over the vocabulary and averaged over
the global count of completion tokens. Options: per-token hard clip, teacher top-k, sampled-token form.

Teacher weights (`teacher`): `current` (same weights, stop-grad), `fixed` (the weights at the first
step; with LoRA the adapters disabled), `ema` (an exponential moving average, decay 0.999, kept
outside the optimizer). LoRA: `lora_rank > 0`.

Memory: the teacher pass keeps only final hidden states (B, T, K, H); teacher and student logits
are built a chunk of tokens at a time from them and the output head (losses.chunked_self_distill),
so [B, T, V] logits are never materialised (a 151k vocabulary and 2k-token completions fit).

    python train.py +algo=opsd trainer.max_steps=50
    torchrun --nproc_per_node=2 train.py +algo=opsd algo.teacher=ema algo.lora_rank=16
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, RolloutContext, StepOutput, pad_right

TEACHER_MODES = ("current", "fixed", "ema")
DIVERGENCES = ("full", "sampled")


@dataclass
class LoRAOptions:
    """LoRA keys shared by the algorithms that can train adapters only (apply_lora)."""

    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"])


@dataclass
class OPSDConfig(LoRAOptions):
    needs_reference: ClassVar[bool] = True  # the teacher prompt carries the reference solution
    name: str = "opsd"
    temperature: float = 1.1  # rollout sampling temperature; the divergence uses logits / temperature too
    top_p: float = 0.95
    teacher: str = "current"  # current | fixed | ema
    ema_decay: float = 0.999
    beta: float = 0.5  # generalized JSD mixture: 0 forward KL(teacher||student), 1 reverse KL
    divergence: str = "full"  # full (JSD over the vocabulary) | sampled (sampled-token form)
    token_clip: float = 0.0  # > 0: per-token hard clip of the divergence (clipped tokens get no gradient)
    teacher_top_k: int = 0  # > 0: both distributions restricted to the teacher's top-k, renormalised
    loss_chunk_tokens: int = 0  # tokens per logits chunk in the loss; 0 = from the vocabulary size (~256 MiB of logits)
    teacher_batch_size: int = 32  # rows per no-grad teacher forward
    seed: int = 0

    def validate(self) -> None:
        check_self_distill_config(self)


def check_self_distill_config(cfg: Any) -> None:
    """Value checks shared by OPSD, MASS and TESD; raises ValueError naming the key."""
    if cfg.teacher not in TEACHER_MODES:
        raise ValueError(f"algo.teacher={cfg.teacher} is not one of {', '.join(TEACHER_MODES)}")
    if cfg.divergence not in DIVERGENCES:
        raise ValueError(f"algo.divergence={cfg.divergence} is not one of {', '.join(DIVERGENCES)}")
    if not 0.0 <= cfg.beta <= 1.0:
        raise ValueError(f"algo.beta={cfg.beta} must be in [0, 1]")
    if cfg.temperature <= 0:
        raise ValueError(f"algo.temperature={cfg.temperature} must be > 0 (on-policy rollouts sample)")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"algo.top_p={cfg.top_p} must be in (0, 1]")
    if not 0.0 <= cfg.ema_decay < 1.0:
        raise ValueError(f"algo.ema_decay={cfg.ema_decay} must be in [0, 1)")
    if cfg.teacher_batch_size <= 0:
        raise ValueError(f"algo.teacher_batch_size={cfg.teacher_batch_size} must be > 0")
    if cfg.lora_rank < 0 or cfg.loss_chunk_tokens < 0 or cfg.teacher_top_k < 0 or cfg.token_clip < 0:
        raise ValueError("algo.lora_rank, algo.loss_chunk_tokens, algo.teacher_top_k and algo.token_clip must be >= 0")


# --- model plumbing -----------------------------------------------------------------------------


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DeepSpeed wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM inside wrappers (DDP / DeepSpeed, then PEFT)."""
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner


def _decoder(model: nn.Module) -> nn.Module:
    return causal_lm(model).get_decoder()


def output_head(model: nn.Module) -> Optional[losses.Head]:
    """(weight (V, H), bias) of the output layer when it can be applied directly to final hidden
    states; None when not (sharded FSDP2 / ZeRO-3 weights, logit soft-capping or scaling): then the
    loss falls back to the model's own logits."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    config = getattr(inner, "config", None)
    if not isinstance(head, nn.Linear) or getattr(config, "final_logit_softcapping", None) or \
            getattr(config, "logit_scale", None):
        return None
    weight = head.weight
    if type(weight.data) is not torch.Tensor or weight.numel() == 0:  # DTensor shard or ZeRO-3 partition
        return None
    return weight, head.bias


def final_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states (B, T, H) through any wrapper, without the full logits: a hook on
    the decoder captures them and the forward keeps the logits of one position only."""
    store: dict[str, torch.Tensor] = {}

    def hook(module, args, out):
        store["hidden"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    handle = _decoder(model).register_forward_hook(hook)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1)
    finally:
        handle.remove()
    return store["hidden"]


def student_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, Optional[losses.Head]]:
    """(features predicting token t at [:, t], head): hidden states + head, or logits + None."""
    head = output_head(model)
    if head is not None:
        feats = final_hidden(model, input_ids, attention_mask)  # (B, T, H)
    else:
        feats = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return predicting(feats), head


def predicting(states: torch.Tensor) -> torch.Tensor:
    """Shift (B, T, D) states so [:, t] is the state that predicts token t (zeros at t = 0)."""
    return torch.nn.functional.pad(states[:, :-1], (0, 0, 1, 0))


def apply_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """LoRA adapters on `cfg.lora_targets` (rank `lora_rank`); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def prepare_model(model: nn.Module, cfg: Any) -> nn.Module:
    if cfg.lora_rank > 0:
        return apply_lora(model, cfg)
    model.requires_grad_(True)
    return model


def export_model(model: nn.Module, tokenizer: Any, out_dir: str, algo_name: str) -> None:
    """Full model in HF format, or with LoRA the PEFT adapter (plus a README saying how to load it)."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if hasattr(model, "peft_config"):
        base = getattr(model.peft_config["default"], "base_model_name_or_path", None)
        with open(f"{out_dir}/README.md", "w") as fh:  # out_dir is a temp dir renamed later: name no path of it
            fh.write(f"# {algo_name} LoRA adapter\n\nLoad: `PeftModel.from_pretrained(AutoModelForCausalLM."
                     f"from_pretrained({base!r}), \"<this directory>\")`, or "
                     f"`python -m inference {base} --adapter <this directory>`.\n")


class SelfTeacher:
    """The no-grad teacher's weights: `current` (the policy itself), `fixed` (the first step's weights;
    with LoRA, the policy with adapters disabled) or `ema` (a moving average). Frozen copies are
    plain modules with requires_grad off, built after the optimizer, so they never enter it."""

    def __init__(self, mode: str, decay: float):
        self.mode, self.decay = mode, decay
        self.copy: Optional[nn.Module] = None
        self._pending: Optional[dict] = None  # weights restored from a checkpoint before the first step

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.mode == "current":
            yield policy
        elif self.mode == "fixed" and hasattr(policy, "disable_adapter"):
            with policy.disable_adapter():
                yield policy
        else:
            self._refresh(policy)
            yield self.copy

    @torch.no_grad()
    def _refresh(self, policy: nn.Module) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(policy).requires_grad_(False).eval()
            if self._pending is not None:
                self.copy.load_state_dict(self._pending)
                self._pending = None
            elif self.mode == "ema":
                return  # the first EMA value is the current weights
        if self.mode == "ema":
            live = dict(policy.named_parameters())
            for name, p in self.copy.named_parameters():
                p.lerp_(live[name].detach().to(p.dtype), 1.0 - self.decay)

    def state_dict(self) -> dict:
        if self.copy is None:
            return {"weights": self._pending}
        return {"weights": {k: v.detach().cpu().clone() for k, v in self.copy.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        self._pending, self.copy = state.get("weights"), None


# --- rollouts and teacher passes ------------------------------------------------------------------


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def sample(ctx: RolloutContext, prompts: list[list[int]], temperature: float, top_p: float) -> list[Any]:
    """On-policy completions through the engine (stop at EOS)."""
    from inference import SamplingParams

    params = SamplingParams(max_new_tokens=ctx.max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=(ctx.tokenizer.eos_token_id,))
    return ctx.engine.generate(prompts, params, generator=ctx.generator)


def rollout_batch(prompts: list[list[int]], completions: Sequence[Any], pad_id: int, device: torch.device,
                  uids: list[str]) -> Batch:
    """prompt + completion rows; loss on completion tokens; the sampler's log-probs kept for the gap check."""
    ids, attn = pad_right([p + c.tokens for p, c in zip(prompts, completions)], pad_id, device)
    loss_mask = completion_mask(prompts, [c.tokens for c in completions], ids)
    rollout_logprobs = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rollout_logprobs[i, len(p): len(p) + len(c.tokens)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return Batch(ids, attn, loss_mask, rollout_logprobs=rollout_logprobs.to(device), uids=uids)


def completion_mask(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], ids: torch.Tensor
                    ) -> torch.Tensor:
    """(B, T) 1 on the completion tokens of right-padded prompt + completion rows."""
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        mask[i, len(p): len(p) + len(c)] = 1
    return mask


@torch.no_grad()
def teacher_hidden(teacher: nn.Module, views: list[list[list[int]]], completions: list[list[int]],
                   starts: list[int], width: int, rows_per_pass: int, device: torch.device) -> torch.Tensor:
    """Final hidden states of the teacher over each row's completion, under K prompts per row.

    views[b][k]: the k-th teacher prompt of row b; completions[b]: its completion tokens, which sit
    at student positions starts[b] + j. Returns (B, width, K, H) aligned with the student row:
    [b, starts[b] + j, k] is the hidden state that predicts completion token j under prompt k.
    The teacher prompt is used whole, however long (it is never cut to the student's length).
    """
    flat = [(b, k, prompt) for b, row in enumerate(views) for k, prompt in enumerate(row)]
    k_views = len(views[0])
    out: Optional[torch.Tensor] = None
    for start in range(0, len(flat), rows_per_pass):
        part = flat[start: start + rows_per_pass]
        ids, attn = pad_right([prompt + completions[b] for b, _, prompt in part], 0, device)
        hidden = final_hidden(teacher, ids, attn)  # (n, T', H)
        if out is None:
            out = hidden.new_zeros(len(views), width, k_views, hidden.shape[-1])
        for i, (b, k, prompt) in enumerate(part):
            n = len(completions[b])
            out[b, starts[b]: starts[b] + n, k] = hidden[i, len(prompt) - 1: len(prompt) - 1 + n]
    assert out is not None
    return out


def rollout_metrics(task: Any, tokenizer: Any, examples: Sequence[Any], completions: Sequence[Any],
                    prefix: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Rewards of the rollouts (the task's verifier) and their mean length, as train metrics."""
    rewards = [task.verify(ex, tokenizer.decode(c.tokens, skip_special_tokens=True)).reward
               for ex, c in zip(examples, completions)]
    metrics = {f"{prefix}/reward": torch.tensor(sum(rewards) / max(len(rewards), 1)),
               f"{prefix}/length": torch.tensor(sum(len(c.tokens) for c in completions) / max(len(completions), 1))}
    return metrics, rewards


def require_references(examples: Sequence[Any], algo_name: str) -> None:
    from trainer.data import DataError

    for ex in examples:
        if not ex.solution or not ex.solution.strip():
            raise DataError(f"{algo_name} needs a reference solution for every question; example {ex.uid} "
                             "has an empty solution (set data.solution_field to the field holding worked solutions)")


# --- the loss ---------------------------------------------------------------------------------------


def distill_terms(feats: torch.Tensor, head: Optional[losses.Head], micro: Batch, sel: torch.Tensor, cfg: Any,
                  teacher_head: losses.Head) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (divergence, weight, student log-prob of the token) over the tokens `sel` (B, T).

    feats/head from `student_features`; weights are micro.token_weights (1 where unset).
    """
    assert micro.teacher_hidden is not None, "make_batch must fill teacher_hidden"
    div, token_logp = losses.chunked_self_distill(
        feats[sel], head, micro.teacher_hidden[sel], teacher_head, micro.input_ids[sel], beta=cfg.beta,
        temperature=cfg.temperature, top_k=cfg.teacher_top_k, form=cfg.divergence,
        aggregate=getattr(cfg, "aggregate", "mean"), chunk=chunk_size(cfg, teacher_head, micro))  # (N,), (N,)
    if cfg.token_clip > 0:
        div = div.clamp(max=cfg.token_clip)
    weights = torch.ones_like(div) if micro.token_weights is None else micro.token_weights[sel].to(div.dtype)
    return div, weights, token_logp


def chunk_size(cfg: Any, head: losses.Head, batch: Batch) -> int:
    """`loss_chunk_tokens`, or with 0 a size from the vocabulary and the number of teacher views."""
    views = batch.teacher_hidden.shape[2] if batch.teacher_hidden is not None else 1
    return cfg.loss_chunk_tokens or losses.auto_chunk(head[0].shape[0], views)


def distill_loss(model: nn.Module, micro: Batch, normaliser: torch.Tensor, cfg: Any, teacher_head: losses.Head,
                 prefix: str = "opsd") -> StepOutput:
    """sum_t w_t D(p_S || p_T)_t / normaliser over the completion tokens, and metrics."""
    feats, head = student_features(model, micro.input_ids, micro.attention_mask)  # (B, T, H|V)
    sel = micro.loss_mask.bool()  # (B, T)
    div, weights, token_logp = distill_terms(feats, head, micro, sel, cfg, teacher_head)
    loss = losses.weighted_token_loss(div, weights, normaliser)
    n = max(int(div.numel()), 1)
    metrics = {f"{prefix}/divergence": div.detach().sum() / n, f"{prefix}/weight": weights.detach().sum() / n}
    return StepOutput(loss, metrics, scatter_tokens(token_logp, sel))


def scatter_tokens(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """(N,) per selected token -> (B, T) detached, zeros elsewhere."""
    out = torch.zeros(sel.shape, dtype=torch.float32, device=values.device)
    out[sel] = values.detach().float()
    return out


class OPSD:
    name = "opsd"

    def __init__(self, cfg: OPSDConfig):
        self.cfg = cfg
        self.teacher = SelfTeacher(cfg.teacher, cfg.ema_decay)
        self.teacher_head: Optional[losses.Head] = None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return prepare_model(model, self.cfg)

    def check_task(self, task: Any) -> None:
        require_references(task.train_examples(), self.name)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        tok, task = ctx.tokenizer, ctx.task
        prompts = [encode(tok, task.prompt(ex)) for ex in examples]
        completions = sample(ctx, prompts, self.cfg.temperature, self.cfg.top_p)
        batch = rollout_batch(prompts, completions, tok.pad_token_id, ctx.device, [ex.uid for ex in examples])
        views = [[encode(tok, task.teacher_prompt(ex, ex.solution))] for ex in examples]
        with self.teacher.weights(ctx.policy) as teacher:
            batch.teacher_hidden = teacher_hidden(teacher, views, [c.tokens for c in completions],
                                                  [len(p) for p in prompts], batch.input_ids.shape[1],
                                                  self.cfg.teacher_batch_size, ctx.device)
            self.teacher_head = detached_head(teacher)
        batch.metrics, _ = rollout_metrics(task, tok, examples, completions, "rollout")
        return batch

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        return distill_loss(model, micro, normaliser, self.cfg, self.teacher_head, prefix=self.name)

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)

    def state_dict(self) -> dict:
        return {"teacher": self.teacher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state["teacher"])


def detached_head(teacher: nn.Module) -> losses.Head:
    head = output_head(teacher)
    if head is None:
        raise ValueError("self-distillation needs a plain linear output head on the teacher (models with logit "
                         "soft-capping or scaling are not supported)")
    return head[0].detach(), None if head[1] is None else head[1].detach()
