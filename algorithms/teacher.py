"""Frozen or moving copies of the policy's weights: the self-teacher of the distillation algorithms
and the reference model of KL penalties (GRPO's starting weights); and a separate teacher model
(`algo.teacher_path`, `ModelTeacher`) with the same interface."""
from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

TEACHER_DTYPES = ("float32", "bfloat16", "float16")

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

    def teacher_reads_references(self) -> bool:
        """Whether the rows this config trains need the data's reference solutions beyond what its traits say
        (distill: off-policy rows, the privileged teacher prompt); checked against the data at config time."""
        return False

    def check_teacher_model(self) -> None:
        """The path exists and is a model dir, and the dtype is known (ValueError naming the key)."""
        if self.teacher_dtype is not None and self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"algo.teacher_dtype={self.teacher_dtype} is not one of {', '.join(TEACHER_DTYPES)}")
        if self.teacher_path is None:
            return
        from models.model_dir import model_dir_problem

        problem = model_dir_problem(os.path.expanduser(self.teacher_path))
        if problem is not None:
            raise ValueError(f"algo.teacher_path={self.teacher_path}: {problem}")


class ModelTeacher:
    """A separate, frozen teacher model (`algo.teacher_path`): loaded once per rank at the first teacher pass,
    in `dtype`, on the policy's device, in eval mode with requires_grad off -- so it never enters the optimizer
    and holds no optimizer state. The same interface as `SelfTeacher` (weights, copies, after_eval, state)."""

    def __init__(self, path: str, dtype: str = "float32"):
        self.path, self.dtype = os.path.expanduser(path), dtype
        self.model: Optional[nn.Module] = None

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.model is None:
            from models.loading import load_pretrained

            device = next(policy.parameters()).device
            model, _ = load_pretrained(self.path, self.dtype)
            self.model = model.to(device).requires_grad_(False).eval()
        yield self.model

    def copies(self, policy: nn.Module) -> int:
        """Counted as one copy of the policy's weights by the memory check (a teacher of another size is
        measured once it is loaded)."""
        return 1

    def after_eval(self, result: dict, policy: nn.Module) -> tuple[dict, list[str]]:
        return {}, []

    def state_dict(self) -> dict:
        return {"teacher_path": self.path}  # the weights stay on disk: nothing of them is checkpointed

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("teacher_path")
        if saved is not None and os.path.realpath(saved) != os.path.realpath(self.path):
            raise ValueError(f"the checkpoint was trained with algo.teacher_path={saved}, this run names {self.path}")
