"""Frozen or moving copies of the policy's weights: the self-teacher of the distillation algorithms
and the reference model of KL penalties (GRPO's starting weights); and a separate teacher model
(`algo.teacher_path`, `ModelTeacher`) with the same interface."""
from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

TEACHER_DTYPES = ("float32", "bfloat16", "float16")
TEACHER_TEMPLATES = ("student", "teacher")

import torch
from torch import nn


class SelfTeacher:
    """The no-grad teacher's weights.

    - `fixed`: the first step's weights, frozen (with LoRA, the policy with adapters disabled);
    - `refresh`: frozen like `fixed`, but replaced by the current weights at an eval where the held-out
      student accuracy has improved by at least `refresh_margin` since the teacher's weights were taken
      (never on a clock: a student that got worse never becomes the teacher);
    - `ema`: an exponential moving average of the policy (decay `decay`);
    - `current`: the policy itself, stop-grad.

    Frozen copies are plain modules with requires_grad off, built after the optimizer, so they never
    enter it. At every eval (`after_eval`) the teacher reports its drift from the step-0 weights
    (relative L2 distance; 0 for `fixed`) and warns when the policy's accuracy under the teacher prompt
    has fallen more than `warn_drop` below its value at the first eval.
    """

    def __init__(self, mode: str, decay: float, refresh_margin: float = 0.02, warn_drop: float = 0.05):
        self.mode, self.decay = mode, decay
        self.refresh_margin, self.warn_drop = refresh_margin, warn_drop
        self.copy: Optional[nn.Module] = None
        self._pending: Optional[dict] = None  # weights restored from a checkpoint before the first step
        self.origin: Optional[dict[str, torch.Tensor]] = None  # step-0 weights on CPU, for the drift
        self.baseline: Optional[float] = None  # refresh: held-out student accuracy when the weights were taken
        self.start_teacher_accuracy: Optional[float] = None  # the first eval's teacher-prompt accuracy
        self.refreshes = 0

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[nn.Module]:
        self._keep_origin(policy)
        if self.mode == "current":
            yield policy
        elif self.mode == "fixed" and hasattr(policy, "disable_adapter"):
            with policy.disable_adapter():
                yield policy
        else:
            self._refresh(policy)
            yield self.copy

    def view_task(self, task):
        """The task whose prompts the teacher reads: the student's own (the same weights, the same template)."""
        return task

    def place_frozen(self, place: Callable[[nn.Module], nn.Module]) -> None:
        """Copies of the policy stay whole (they are made from the full-weight replica); nothing to place."""

    def copies(self, policy: nn.Module) -> int:
        """Full copies of `policy`'s weights this teacher keeps: the frozen / EMA copy (none for `current`
        and for `fixed` over LoRA, whose adapters are disabled instead), plus the step-0 weights the drift
        is measured from where the teacher moves (`current`, `ema`, `refresh`)."""
        frozen = 0 if self.mode == "current" or (self.mode == "fixed" and hasattr(policy, "disable_adapter")) else 1
        return frozen + (0 if self.mode == "fixed" else 1)

    @torch.no_grad()
    def _keep_origin(self, policy: nn.Module) -> None:
        if self.origin is None and self.mode != "fixed":
            self.origin = {n: p.detach().float().cpu().clone() for n, p in policy.named_parameters()}

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

    @torch.no_grad()
    def drift(self, policy: nn.Module) -> float:
        """||teacher - step-0 weights|| / ||step-0 weights|| over the parameters (0 for `fixed`, and
        before the first step)."""
        if self.mode == "fixed" or self.origin is None:
            return 0.0
        teacher = policy if self.mode == "current" or self.copy is None else self.copy
        diff = total = 0.0
        for name, p in teacher.named_parameters():
            o = self.origin.get(name)
            if o is not None:
                diff += float((p.detach().float().cpu() - o).pow(2).sum())
                total += float(o.pow(2).sum())
        return math.sqrt(diff / total) if total > 0 else 0.0

    @torch.no_grad()
    def after_eval(self, result: dict, policy: nn.Module) -> tuple[dict, list[str]]:
        """At an eval (`result`: accuracy, teacher_accuracy of the policy): refresh the teacher when its gate
        passes; return the metrics to log and any warning."""
        accuracy, notes = result.get("accuracy"), []
        if self.mode == "refresh" and accuracy is not None:
            if self.baseline is None:
                self.baseline = accuracy  # the first eval: the student the frozen teacher was taken from
            elif accuracy >= self.baseline + self.refresh_margin - 1e-9 and self.copy is not None:
                self.copy.load_state_dict(policy.state_dict())
                self.baseline, self.refreshes = accuracy, self.refreshes + 1
        teacher_accuracy = result.get("teacher_accuracy")
        if teacher_accuracy is not None:
            if self.start_teacher_accuracy is None:
                self.start_teacher_accuracy = teacher_accuracy
            elif self.start_teacher_accuracy - teacher_accuracy > self.warn_drop:
                notes.append(f"teacher prompt accuracy {teacher_accuracy:.3f} is {self.start_teacher_accuracy - teacher_accuracy:.3f}"
                             f" below its first eval ({self.start_teacher_accuracy:.3f}): the model is losing what "
                             "the teacher reads from the reference (algo.teacher=fixed keeps a frozen teacher; a "
                             "lower trainer.lr drifts less)")
        metrics = {"teacher_drift": self.drift(policy)}
        if self.mode == "refresh":
            metrics["teacher_refreshes"] = self.refreshes
        return metrics, notes

    def state_dict(self) -> dict:
        weights = self._pending if self.copy is None else {
            k: v.detach().cpu().clone() for k, v in self.copy.state_dict().items()}
        return {"weights": weights, "origin": self.origin, "baseline": self.baseline,
                "start_teacher_accuracy": self.start_teacher_accuracy, "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        self._pending, self.copy = state.get("weights"), None
        self.origin = state.get("origin")
        self.baseline = state.get("baseline")
        self.start_teacher_accuracy = state.get("start_teacher_accuracy")
        self.refreshes = int(state.get("refreshes", 0))


@dataclass
class TeacherModelOptions:
    """The keys of a separate teacher model (an option group of distill, opsd and mass): `teacher_path` an HF
    model dir, one of our exports or a PEFT adapter dir with its base, with the student's tokenizer (checked
    at config time, trainer/config.py); `teacher_dtype` its weights' dtype (null: the run's model.dtype)."""

    teacher_path: Optional[str] = None
    teacher_dtype: Optional[str] = None  # float32 | bfloat16 | float16; null = model.dtype
    # whose chat template renders the prompts the teacher reads: student (the student's prompt ids, as it
    # sampled under them) | teacher (teacher_path's own template; the completion ids stay the student's)
    teacher_chat_template: str = "student"

    def teacher_reads_references(self) -> bool:
        """Whether the rows this config trains need the data's reference solutions beyond what its traits say
        (distill: off-policy rows, the privileged teacher prompt); checked against the data at config time."""
        return False

    def check_teacher_model(self) -> None:
        """The path exists and is a model dir, and the dtype is known (ValueError naming the key)."""
        if self.teacher_dtype is not None and self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"algo.teacher_dtype={self.teacher_dtype} is not one of {', '.join(TEACHER_DTYPES)}")
        if self.teacher_chat_template not in TEACHER_TEMPLATES:
            raise ValueError(f"algo.teacher_chat_template={self.teacher_chat_template} is not one of "
                             f"{', '.join(TEACHER_TEMPLATES)}")
        if self.teacher_path is None:
            if self.teacher_chat_template == "teacher":
                raise ValueError("algo.teacher_chat_template=teacher needs algo.teacher_path (the model whose "
                                 "template it is)")
            return
        from models.model_dir import model_dir_problem

        problem = model_dir_problem(os.path.expanduser(self.teacher_path))
        if problem is not None:
            raise ValueError(f"algo.teacher_path={self.teacher_path}: {problem}")


class ModelTeacher:
    """A separate, frozen teacher model (`algo.teacher_path`): loaded once per rank at the first teacher pass,
    in `dtype`, on the policy's device, in eval mode with requires_grad off -- so it never enters the optimizer
    and holds no optimizer state. The trainer hands it the backend's placement (`place_frozen`): under FSDP and
    ZeRO-3 the teacher is sharded like the student (each rank keeps 1/world of its weights, and every teacher
    forward is a collective of all ranks); whole on each rank otherwise. The same interface as `SelfTeacher`
    (weights, copies, after_eval, state)."""

    def __init__(self, path: str, dtype: str = "float32", chat_template: str = "student"):
        self.path, self.dtype, self.chat_template = os.path.expanduser(path), dtype, chat_template
        self.model: Optional[nn.Module] = None
        self.place: Callable[[nn.Module], nn.Module] = lambda model: model
        self._views: Optional[tuple] = None  # (the student's task, the same task under the teacher's template)

    def view_task(self, task):
        """The task whose `prompt` / `teacher_prompt` render what the teacher reads: the student's (`student`,
        the default: the prompt ids the student sampled under), or the same examples rendered by the teacher
        tokenizer's chat template (`teacher`). Either way the completion ids scored are the student's."""
        if self.chat_template == "student":
            return task
        if self._views is None or self._views[0] is not task:
            from transformers import AutoTokenizer

            from tasks.chat_template import TemplatedTask, with_chat

            base = task.task if isinstance(task, TemplatedTask) else task
            self._views = (task, with_chat(base, AutoTokenizer.from_pretrained(self.path), "auto"))
        return self._views[1]

    def place_frozen(self, place: Callable[[nn.Module], nn.Module]) -> None:
        self.place = place

    @property
    def sharded(self) -> bool:
        """Whether the loaded teacher's weights are split over the ranks (FSDP2 DTensors, ZeRO-3 partitions)."""
        return self.model is not None and any(is_sharded(p) for p in self.model.parameters())

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.model is None:
            from models.loading import load_pretrained

            device = next(policy.parameters()).device
            model, _ = load_pretrained(self.path, self.dtype)  # on the CPU
            # placed before it moves: FSDP2 shards it onto the device a layer at a time, so the device never
            # holds the whole teacher; ZeRO-3 partitions it as its engine starts
            self.model = self.place(model.requires_grad_(False).eval())
            if not self.sharded:
                self.model = self.model.to(device)
        yield self.model

    def copies(self, policy: nn.Module) -> float:
        """The teacher's weights as a multiple of the policy's (its parameter count from its config, in its
        dtype, over the policy's parameter bytes), for the memory check -- which divides it by the ranks where
        the layout shards parameters (FSDP, ZeRO-3), as it does the student's. One copy when the teacher's
        size cannot be read before loading it."""
        numel = teacher_numel(self.path)
        policy_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
        if numel is None or policy_bytes == 0:
            return 1.0
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size() / policy_bytes

    def after_eval(self, result: dict, policy: nn.Module) -> tuple[dict, list[str]]:
        return {}, []

    def state_dict(self) -> dict:
        return {"teacher_path": self.path}  # the weights stay on disk: nothing of them is checkpointed

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("teacher_path")
        if saved is not None and os.path.realpath(saved) != os.path.realpath(self.path):
            raise ValueError(f"the checkpoint was trained with algo.teacher_path={saved}, this run names {self.path}")


def is_sharded(p: torch.Tensor) -> bool:
    """A parameter split over ranks: an FSDP2 DTensor, or a ZeRO-3 partition (its `ds_tensor`)."""
    return hasattr(p, "ds_tensor") or hasattr(p, "to_local")


def local_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters this rank holds (its shards where sharded)."""
    total = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def teacher_numel(path: str) -> Optional[int]:
    """Parameters of the model dir at `path` (a PEFT adapter dir: its base's, which the adapter is merged into),
    counted on a skeleton built from its config on the meta device (nothing is read but the config); None when
    that cannot be built (remote code, a config transformers does not know)."""
    try:
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        adapter = os.path.join(path, "adapter_config.json")
        if os.path.exists(adapter):
            with open(adapter) as fh:
                path = os.path.expanduser(json.load(fh)["base_model_name_or_path"])
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in skeleton.parameters())
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None


@torch.no_grad()
def lockstep_greedy(model: nn.Module, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions (text) of `prompts` by a model sharded over the ranks, every rank calling with the
    same prompts: transformers' `generate` with `synced_gpus`, so a rank whose rows have all stopped keeps
    taking part in the others' forwards (each forward gathers the shards: a collective). Stops on the model's
    stop ids (models.prompts.stop_ids)."""
    from models.prompts import generation_eos, prompt_ids, stop_ids

    device = next(model.parameters()).device
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    width, pad = max(map(len, ids)), tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=list(stop_ids(tokenizer, generation_eos(model))),
                         synced_gpus=True)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out[:, width:]]
