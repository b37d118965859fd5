"""Attuner: query-side LoRA adapters trained to read a position-independent artifact cache the way
the base reads the full prompt.

The setting. An agent's prompt is a shared prefix, reusable artifacts (skills, documents, memory)
and a query (`tasks.base.Segments`). A position-independent cache (PIC) encodes each artifact once,
on its own (right after the shared prefix, or from position 0 when there is none), keeps its K/V,
and at use rotates the cached keys to the artifact's place in the new context (the RoPE delta
rotation, `inference.relocate.relocate_keys`; values stay as they are); only the query is then
prefilled against that cache. Artifacts never attend to each other, so PIC loses quality against a
full prefill -- most when the model has to pick among several artifacts. Our reading of where the
loss sits: the artifacts' K/V are what they are, and what goes wrong is how the new tokens attend
to them. So the fix here is on the query side only.

What trains (`models/query_adapter.py`): LoRA on every layer's `q_proj` and nothing else, active
only for the new tokens (query + answer). The artifact cache is always encoded by the frozen base
(the adapter disabled), so one cache serves the base and any adapter alike; an adapter on k/v, or
one active while artifacts are encoded, would make the cache depend on it.

The loss, per step (sums over the loss tokens -- the target tokens -- divided by the trainer's
global normaliser, the global count of loss tokens; the same gradient for any split into
micro-batches and ranks):

    loss = sum_t D(p_teacher(. | full prompt, y_<t) || p_student(. | PIC cache, query, y_<t)) / normaliser
    D      `beta=0`: forward KL(p_teacher || p_student) over the full vocabulary (the default);
           0 < beta <= 1: the generalized JSD of `losses.generalized_jsd`; both at `kd_temperature`
    teacher  the frozen base over prefix + artifacts + query + target prefilled jointly (no grad,
             made in make_batch; final hidden states + the output head, so no (B, T, V) logits)
    student  the adapted model over query + target only, reading the frozen context cache
             (`algorithms.pic_forward`: per-artifact encoding, relocation, batched assembly)

Data (`completions`): `solutions` (the task's worked solution + EOS; default) or `teacher` (the
full-prefill base's greedy completions, via `inference.Engine` with the adapter disabled).

Logged per step: `attuner/kl` (the trained divergence per loss token: forward KL at beta=0) and
`attuner/student_top1_agree` (share of target tokens where the student's and the teacher's argmax
agree, from the same hidden states).

Choices that are ours (no public code to follow), each a key or named here: q_proj only
(`models.query_adapter.QUERY_PROJECTIONS`); the adapter off for every token of the cache; the
artifacts encoded after the shared prefix, not from 0, when there is one; identical artifacts in a
batch encoded once; `teacher_batch_size` bounds both the teacher's rows per forward and the
artifacts per encoding forward; the query must be non-empty (its first token's state predicts the
first target); every training example must carry artifacts (`check_task`).

Export (`final/`): a standard PEFT adapter dir (`adapter_config.json`, `adapter_model.safetensors`)
+ the tokenizer + `attuner.json` (what it is, the rank, the base's shape fingerprint) + README.md;
`peft.PeftModel.from_pretrained(base, "final")` loads it.

Eval: held-out `accuracy` is measured as the export is served (`eval_completions`): greedy decoding
with the query prefilled over the relocated artifact cache of `inference.pic` (encoded by the base),
the adapter on the query and generated tokens only; at step 0 (a zero adapter) that is naive PIC.
Beside it, on the first held-out prompts, `attuner/full_prefill_accuracy` (the frozen base, full
prefill: the target) and `attuner/naive_pic_accuracy` (the base over the cache, no adapter).

    python train.py +algo=attuner data=artifacts               # the artifact task (being written)
    python train.py +algo=attuner algo.lora_rank=16 algo.beta=0.5
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import Tensor, nn

from algorithms import losses
from algorithms.base import (Batch, LossChunking, RolloutContext, SegmentTerms, StepOutput, TeacherBatching, TeacherTerms,
                             Traits, pad_right)
from algorithms.pic_forward import QUERY, SegmentIds, encode_context, segment_ids, split_rows, student_hidden
from algorithms.rollouts import completion_mask, training_completions
from algorithms.scoring import detached_head, predicting, sliced_final_hidden
from inference.artifacts import ATTUNER_FILE
from models.anatomy import UnsupportedModel, causal_lm, output_head, unwrap
from models.prompts import generation_eos, stop_ids
from models.query_adapter import (
    QUERY_PROJECTIONS, adapter_disabled, apply_query_lora, check_query_only, shape_fingerprint, trainable_fraction,
)
from tasks import DataError
from tasks.base import HasArtifacts

COMPLETIONS = ("solutions", "teacher")


@dataclass
class AttunerConfig(LossChunking, TeacherBatching):
    # FSDP2 untested: sharded weights and the cache encode. lr: 5e-3 measured on the tiny model; only q_proj
    # adapters train, and 5e-4 is what docs/attuner.md measured on SmolLM2-135M (100 steps: 58% of the KL removed).
    traits: ClassVar[Traits] = Traits(fsdp=False, tiny_lr=5e-3, pretrained_lr=5e-4)
    name: str = "attuner"
    lora_rank: int = 8  # rank of the q_proj adapters
    lora_alpha: float = 16.0  # LoRA scale alpha / rank
    lora_dropout: float = 0.0  # dropout on the adapter's input (query tokens only)
    beta: float = 0.0  # 0 = forward KL(teacher || student); (0, 1] = generalized JSD (1 = reverse KL)
    kd_temperature: float = 1.0  # temperature of both distributions
    completions: str = "solutions"  # solutions (worked solutions + EOS) | teacher (the full-prefill base's greedy completions)
    seed: int = 0  # seeds the adapter init (lora_A; lora_B starts at zero)

    def validate(self) -> None:
        if self.completions not in COMPLETIONS:
            raise ValueError(f"algo.completions={self.completions} is not one of {', '.join(COMPLETIONS)}")
        if self.lora_rank < 1:
            raise ValueError(f"algo.lora_rank={self.lora_rank} must be >= 1")
        if self.lora_alpha <= 0:
            raise ValueError(f"algo.lora_alpha={self.lora_alpha} must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"algo.lora_dropout={self.lora_dropout} must be in [0, 1)")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"algo.beta={self.beta} must be in [0, 1]")
        if self.kd_temperature <= 0:
            raise ValueError(f"algo.kd_temperature={self.kd_temperature} must be > 0")
        self.check_loss_chunking()
        self.check_teacher_batching()  # here also the artifacts per encoding forward

    def check_run(self, max_steps: int, skeleton: Optional[Callable[[], nn.Module]]) -> None:
        """At config validation, on the meta-device skeleton (None: not known before loading, then
        prepare_model checks): the model must be one the position-independent cache serves."""
        if skeleton is not None:
            check_servable(skeleton())


def check_servable(model: nn.Module) -> None:
    """ValueError naming the architecture when the position-independent cache, which an Attuner adapter
    is trained for and served over, cannot serve `model` (the runtime's own predicate)."""
    from inference.pic import pic_unsupported_reason  # the runtime loads transformers: not at config import

    lm = causal_lm(model)
    reason = pic_unsupported_reason(lm)
    if reason is not None:
        raise UnsupportedModel(f"algo=attuner cannot train query adapters for {type(lm).__name__}: {reason}")


class Attuner:
    name = "attuner"

    def __init__(self, cfg: AttunerConfig):
        self.cfg = cfg

    # setup

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """q_proj LoRA (init from `seed`); everything else frozen."""
        check_servable(model)
        model.requires_grad_(False)
        return apply_query_lora(model, self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.lora_dropout,
                                seed=self.cfg.seed)

    def check_task(self, task: Any) -> None:
        """The task must cut its prompts into segments (`tasks.base.HasArtifacts`) and every training
        example must carry artifacts."""
        name = getattr(task, "name", type(task).__name__)
        if not isinstance(task, HasArtifacts):
            raise DataError(f"attuner needs a task whose prompts hold artifacts (tasks.base.HasArtifacts.segments); "
                            f"task {name} has no segments (use data=artifacts)")
        examples = list(task.train_examples())
        bare = [ex.uid for ex in examples if not ex.artifacts]
        if not examples or bare:
            raise DataError(f"attuner trains on prompts with artifacts; task {name} has "
                            + (f"{len(bare)} of {len(examples)} training examples without any (e.g. {bare[0]})"
                               if bare else "no training examples"))

    # batches

    def segment_row(self, task: Any, tokenizer: Any, example: Any) -> SegmentIds:
        seg = task.segments(example)
        if seg.text() != task.prompt(example):
            raise DataError(f"task {task.name}: example {example.uid}: segments(ex).text() differs from prompt(ex)")
        row = segment_ids(tokenizer, seg)
        if not row.query:
            raise DataError(f"task {task.name}: example {example.uid} has an empty query after its artifacts")
        return row

    def completions(self, examples: Sequence[Any], prompts: list[list[int]], ctx: RolloutContext) -> list[list[int]]:
        def base_greedy(prompts, params):  # the frozen base with full prefill, behind the serving door
            with adapter_disabled(ctx.policy):
                return ctx.engine.generate(prompts, params)

        return training_completions(self.cfg.completions, examples, prompts, ctx, base_greedy)

    @torch.no_grad()
    def teacher_states(self, policy: nn.Module, ids: Tensor, attn: Tensor) -> Tensor:
        """Final normed states (B, T, H) of the frozen base over the joint rows, `teacher_batch_size`
        rows per forward."""
        with adapter_disabled(policy):
            return sliced_final_hidden(policy, ids, attn, self.cfg.teacher_batch_size)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        tok = ctx.tokenizer
        rows = [self.segment_row(ctx.task, tok, ex) for ex in examples]
        prompts = [r.prompt() for r in rows]
        targets = self.completions(examples, prompts, ctx)
        ids, attn = pad_right([p + c for p, c in zip(prompts, targets)], tok.pad_token_id, ctx.device)
        labels = torch.full(ids.shape, QUERY, dtype=torch.long)
        for b, r in enumerate(rows):
            labels[b, : len(prompts[b])] = torch.tensor(r.labels())
        batch = Batch(ids, attn, completion_mask(prompts, targets, ids), uids=[ex.uid for ex in examples],
                      segments=SegmentTerms(labels.to(ctx.device)))
        final = self.teacher_states(ctx.policy, ids, attn)
        batch.teacher = TeacherTerms(predicting(final)[:, :, None], detached_head(ctx.policy))
        return batch

    # loss

    def student_features(self, model: nn.Module, micro: Batch) -> tuple[Tensor, Tensor]:
        """(features (N, H) predicting the N loss tokens in row-major order, the (B, Q) mask of the
        loss tokens among the new ones): the student over each row's query + target against the row's
        PIC context."""
        assert micro.segments is not None, "make_batch labels the segments"
        contexts, news = split_rows(micro.input_ids, micro.segments.segment, micro.attention_mask)
        kv = encode_context(model, contexts, self.cfg.teacher_batch_size)
        device = micro.input_ids.device
        new_ids, new_mask = pad_right(news, 0, device)  # pads are masked: any id
        # the loss tokens among the new ones: full position lengths[b] + j
        cols = (kv.lengths[:, None].to(device) + torch.arange(new_ids.shape[1], device=device)[None]).clamp(
            max=micro.loss_mask.shape[1] - 1)
        sel = micro.loss_mask.gather(1, cols).bool() & new_mask.bool()
        hidden = student_hidden(model, kv, new_ids, new_mask)  # (B, Q, H)
        return predicting(hidden)[sel], sel

    def loss(self, model: nn.Module, micro: Batch, normaliser: Tensor) -> StepOutput:
        assert micro.teacher is not None, "make_batch fills the teacher's states"
        full_sel = micro.loss_mask.bool()
        feats, sel = self.student_features(model, micro)
        assert int(sel.sum()) == int(full_sel.sum()), "every loss token is a new token"
        head = output_head(model)
        if head is None:
            raise RuntimeError("attuner needs a plain linear output head on the model (no soft-capping, unsharded)")
        targets = micro.input_ids[full_sel]
        teacher = micro.teacher.hidden[full_sel]  # (N, 1, H)
        chunk = self.cfg.loss_chunk_tokens or losses.auto_chunk(causal_lm(model).config.vocab_size, 1)
        div, _ = losses.chunked_self_distill(feats, head, teacher, micro.teacher.head, targets, beta=self.cfg.beta,
                                             temperature=self.cfg.kd_temperature, chunk=chunk)
        fit = div.sum()
        n = full_sel.sum().clamp(min=1)
        metrics = {"attuner/kl": fit.detach() / n,
                   "attuner/student_top1_agree": top1_agreement(feats, head, teacher[:, 0], micro.teacher.head,
                                                                chunk) / n}
        return StepOutput(fit / normaliser, metrics)

    # eval: served the way the export is served

    summary_metrics = {"attuner/full_prefill_accuracy": "full-prefill accuracy of the frozen base (the target)",
                       "attuner/naive_pic_accuracy": "naive PIC accuracy of the base (no adapter)"}

    def _serve(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any], max_new_tokens: int,
               mode: str = "pic", adapter: Any = None) -> list[list[int]]:
        from inference.pic import PICConfig
        from inference.sampling import SamplingParams
        from inference.serving import ServeOptions, serve_model

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                stop_token_ids=stop_ids(tokenizer, generation_eos(model)))
        served = serve_model(unwrap(model), ServeOptions(artifacts=True), tokenizer)
        server = served.artifact_server(PICConfig(mode=mode), adapter)
        return [c.tokens for c in server.generate([task.segments(ex) for ex in examples], params)]

    def eval_completions(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                         max_new_tokens: int) -> list[list[int]]:
        """Held-out accuracy as served: the query prefilled over the relocated artifact cache (encoded
        by the base), the adapter on the query and generated tokens only (`inference.pic`)."""
        return self._serve(model, tokenizer, task, examples, max_new_tokens)

    def extra_eval(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict[str, float]:
        """The two references on the same prompts: the frozen base with full prefill (what the
        adapter distils) and the base with naive PIC (what it starts from)."""
        out = {}
        for key, mode, adapter in (("attuner/full_prefill_accuracy", "full", None),
                                   ("attuner/naive_pic_accuracy", "pic", {})):
            outs = self._serve(model, tokenizer, task, examples, max_new_tokens, mode, adapter)
            right = [task.verify(ex, tokenizer.decode(t, skip_special_tokens=True)).correct
                     for ex, t in zip(examples, outs)]
            out[key] = sum(right) / max(len(right), 1)
        return out

    # artifacts and state

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        """A PEFT adapter dir + tokenizer + attuner.json + README.md."""
        peft_model = unwrap(model)
        check_query_only(peft_model)
        peft_model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        config = causal_lm(model).config
        spec = {"kind": "attuner",
                "what": "query-side LoRA (q_proj only) for reading a position-independent artifact cache; "
                        "the cache is encoded by the base with the adapter off, the adapter runs on the query "
                        "and answer tokens only",
                "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha, "targets": list(QUERY_PROJECTIONS),
                "trainable_fraction": trainable_fraction(config, self.cfg.lora_rank),
                "base": shape_fingerprint(config)}
        with open(os.path.join(out_dir, ATTUNER_FILE), "w") as fh:
            json.dump(spec, fh, indent=2)
        with open(os.path.join(out_dir, "README.md"), "w") as fh:
            fh.write(README.format(rank=self.cfg.lora_rank, base=json.dumps(spec["base"])))

    def state_dict(self) -> dict:
        return {}  # the adapters are parameters of the model: its checkpoint holds them

    def load_state_dict(self, state: dict) -> None:
        pass


@torch.no_grad()
def top1_agreement(student: Tensor, head: Any, teacher: Tensor, teacher_head: Any, chunk: int) -> Tensor:
    """Number of tokens whose student and teacher argmax agree (student (N, H), teacher (N, H))."""
    agree = student.new_zeros((), dtype=torch.float32)
    for start in range(0, student.shape[0], chunk):
        s = losses.head_logp(student[start: start + chunk].detach(), head, 1.0).argmax(-1)
        t = losses.head_logp(teacher[start: start + chunk], teacher_head, 1.0).argmax(-1)
        agree = agree + (s == t).sum()
    return agree


README = """# Attuner adapter

A query-side LoRA adapter (rank {rank}, on every layer's `q_proj` only) trained to read a
position-independent artifact cache: each artifact's K/V are encoded once by the base model with
the adapter OFF, relocated to the artifact's position in the context (RoPE delta rotation), and the
query and answer tokens run through the base WITH this adapter against that cache. Trained by
distilling the base's full-prefill next-token distribution. `attuner.json` records the base it was
trained for: {base}.

Load it (a standard PEFT adapter dir):

    from peft import PeftModel
    model = PeftModel.from_pretrained(base_model, "THIS_DIR")

Serve it over an artifact cache:

    python -m inference BASE --adapter THIS_DIR --artifacts FILE...

Do not merge it into the base for cache-based serving: a merged q_proj would also change how the
artifacts are encoded, and the cache would no longer be the base's.
"""
