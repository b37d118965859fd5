"""Distributed backends behind one small interface: single, DDP, FSDP2, DeepSpeed ZeRO.

The loop only ever calls:
    backend.train_model            the module to run the loss forward through (wrapped)
    backend.accumulate(last)       context: skip gradient sync on all but the last micro-batch
    backend.backward(loss) / backend.step(max_norm) -> grad norm
    backend.full_model()           a module holding full weights, for rollouts, eval and export
    backend.save(dir) / backend.load(dir)   model + optimizer + scheduler state (all ranks call)
    backend.shard_frozen(model)    a frozen model beside the trained one (a separate teacher), placed as
                                   the trained one is: sharded under FSDP and ZeRO-3, whole otherwise

Every backend averages gradients over data-parallel ranks, so the trainer divides losses by
global tokens / world size to get exact global-token normalisation.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
from typing import Any, ContextManager, Iterator, Protocol

import torch
from torch import nn

from models.anatomy import decoder_layers
from trainer.checkpoint import (CheckpointError, agree, apply_part, deepspeed_files, guard_deepspeed, has_part,
                                read_part, vet_deepspeed, write_part)
from trainer.distributed import World
from trainer.precision import Precision, check_masters

# the backend's parts of a checkpoint, each written by trainer.state_io as NAME.json (+ NAME.safetensors):
# data only, so loading a checkpoint runs no code (trainer/checkpoint.py)
OPTIM_FILE, MODEL_FILE, SCHED_FILE, SCALER_FILE = "optimizer", "model", "scheduler", "scaler"


class Backend(Protocol):
    """The interface the loop and checkpoints use (see the module docstring)."""

    train_model: nn.Module

    @property
    def lr(self) -> float: ...

    def accumulate(self, last: bool) -> ContextManager[None]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, max_grad_norm: float) -> float: ...

    def full_model(self) -> nn.Module: ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...

    def shard_frozen(self, model: nn.Module) -> nn.Module: ...


def lr_lambda(warmup_steps: int, max_steps: int, min_ratio: float):
    """Linear warm-up to the peak, then cosine decay to min_ratio x peak at max_steps."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def make_optimizer(params: list[nn.Parameter], tcfg: Any) -> torch.optim.Optimizer:
    check_masters(params)  # fp32 master weights only: AdamW on bf16 parameters silently drops small updates
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, tcfg: Any):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tcfg.warmup_steps, tcfg.max_steps, tcfg.min_lr_ratio)
    )


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class SingleBackend:
    """One process; also the base of DDP, which only adds the wrapper and the sync context. With
    model.dtype=float16 the loss is scaled (torch.amp.GradScaler): gradients are unscaled before
    clipping, and a step whose gradients overflowed is skipped (the scale then halves)."""

    def __init__(self, model: nn.Module, tcfg: Any, world: World, precision: Precision = Precision()):
        self.world = world
        self.model = model
        self.train_model: nn.Module = model
        self.optimizer = make_optimizer(_trainable(model), tcfg)
        self.scheduler = make_scheduler(self.optimizer, tcfg)
        self.scaler = precision.grad_scaler(world.device)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, max_norm: float) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(_trainable(self.model), max_norm)
        if self.scaler is None:
            self.optimizer.step()
        else:  # skips the step when a gradient is inf/NaN (DDP: the same all-reduced gradients on every rank)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_model(self) -> nn.Module:
        return self.model

    def shard_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model is a whole copy on each rank here (DDP replicates, it does not shard)."""
        return model

    def save(self, path: str) -> None:
        if self.world.is_main:
            write_part(self.model.state_dict(), path, MODEL_FILE)
            write_part(self.optimizer.state_dict(), path, OPTIM_FILE)
            write_part(self.scheduler.state_dict(), path, SCHED_FILE)
            if self.scaler is not None:
                write_part(self.scaler.state_dict(), path, SCALER_FILE)

    def load(self, path: str) -> None:
        # every part is read (and checked) before any is applied: a bad file leaves the run untouched
        device = self.world.device
        parts = {name: read_part(path, name, device) for name in (MODEL_FILE, OPTIM_FILE, SCHED_FILE)}
        if self.scaler is not None and has_part(path, SCALER_FILE):
            parts[SCALER_FILE] = read_part(path, SCALER_FILE)
        apply_part(path, MODEL_FILE, self.model.load_state_dict, parts[MODEL_FILE])
        apply_part(path, OPTIM_FILE, self.optimizer.load_state_dict, parts[OPTIM_FILE])
        apply_part(path, SCHED_FILE, self.scheduler.load_state_dict, parts[SCHED_FILE])
        if SCALER_FILE in parts:
            apply_part(path, SCALER_FILE, self.scaler.load_state_dict, parts[SCALER_FILE])


class DDPBackend(SingleBackend):
    """Full replicas; gradients averaged in backward (bucketed all-reduce)."""

    def __init__(self, model: nn.Module, tcfg: Any, world: World, precision: Precision = Precision()):
        super().__init__(model, tcfg, world, precision)
        from torch.nn.parallel import DistributedDataParallel

        ids = [world.device.index] if world.device.type == "cuda" else None
        self.train_model = DistributedDataParallel(model, device_ids=ids, process_group=world.group)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.train_model.no_sync()


class FSDPBackend:
    """FSDP2: `fully_shard` each decoder layer, then the root. Params, grads and optimizer state
    are sharded; rollouts/eval/export read a full-weight replica refreshed from the shards.
    Mixed precision: the sharded parameters stay fp32 (the masters) and the loop's autocast casts at
    each matmul, as on every backend; no MixedPrecisionPolicy, whose bf16 param_dtype would also run
    the norms in bf16 and so differ from the other backends (its all-gathers would be half the bytes).
    float16 (loss scaling over sharded gradients) is refused at config loading."""

    def __init__(self, model: nn.Module, tcfg: Any, world: World):
        from torch.distributed.fsdp import fully_shard

        self.world = world
        self._replica = copy.deepcopy(model)  # full weights for the engine; refreshed on demand
        self._replica.requires_grad_(False)
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        self.model = self.train_model = model
        self.optimizer = make_optimizer(_trainable(model), tcfg)
        self.scheduler = make_scheduler(self.optimizer, tcfg)
        self.scaler = None  # SingleBackend's backward / step without loss scaling (float16 is refused here)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return _fsdp_sync(self.model, last)

    backward = SingleBackend.backward
    step = SingleBackend.step
    lr = SingleBackend.lr

    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def shard_frozen(self, model: nn.Module) -> nn.Module:
        """`fully_shard` each decoder layer and the root of a frozen model, as the trained one: each rank
        keeps 1/world of its weights; a forward (every rank together) all-gathers one layer at a time and
        frees it after (reshard_after_forward also on the root, which has no backward to keep it for)."""
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        return model

    def full_model(self) -> nn.Module:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=self._options())  # all ranks get full tensors
        self._replica.load_state_dict(state)
        return self._replica

    def save(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        opts = self._options(cpu_offload=True)  # full tensors on rank 0 only
        model_state = get_model_state_dict(self.model, options=opts)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.world.is_main:
            write_part(model_state, path, MODEL_FILE)
            write_part(optim_state, path, OPTIM_FILE)
            write_part(self.scheduler.state_dict(), path, SCHED_FILE)

    def load(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        opts = self._options(broadcast_from_rank0=True)
        # rank 0 reads the full states (broadcast below); every rank learns whether that worked before any
        # collective, so a bad file is one error on every rank, not a hang
        problem, model_state, optim_state = None, {}, {}
        try:
            if self.world.is_main:
                model_state, optim_state = read_part(path, MODEL_FILE), read_part(path, OPTIM_FILE)
            sched_state = read_part(path, SCHED_FILE)
        except CheckpointError as err:
            problem = err
        agree(self.world, problem)
        apply_part(path, MODEL_FILE, lambda s: set_model_state_dict(self.model, s, options=opts), model_state)
        apply_part(path, OPTIM_FILE, lambda s: set_optimizer_state_dict(self.model, self.optimizer, s, options=opts),
                   optim_state)
        apply_part(path, SCHED_FILE, self.scheduler.load_state_dict, sched_state)


@contextlib.contextmanager
def _fsdp_sync(model: nn.Module, last: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(last)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (model.model.layers for Llama/Qwen)."""
    return list(decoder_layers(model, user="backend=fsdp"))


class DeepSpeedBackend:
    """DeepSpeed ZeRO-1/2/3 with torch AdamW inside DeepSpeed and our warm-up/cosine schedule.
    DeepSpeed's own bf16 / fp16 modes stay off: they cast the module itself, so rollouts, eval and export
    would read low-precision weights, unlike the other backends. The module stays fp32 (the masters, and
    so the optimizer state) and the loop's autocast sets the compute dtype; float16 is refused at config
    loading (it would need DeepSpeed's loss scaling)."""

    TAG = "deepspeed"
    fixed_micro_steps = True  # the accumulation boundary is a count of backwards: the loop skips none

    def __init__(self, model: nn.Module, tcfg: Any, world: World, zero_stage: int, micro_steps: int):
        import deepspeed

        self.world, self.zero_stage = world, zero_stage
        self._frozen: list = []  # inference engines of frozen models (shard_frozen)
        self._replica = copy.deepcopy(model) if zero_stage == 3 else None
        config = {
            "train_micro_batch_size_per_gpu": tcfg.micro_batch_size,
            "gradient_accumulation_steps": micro_steps,
            "gradient_clipping": tcfg.max_grad_norm,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": False},  # fp32 module + the loop's autocast (see the class docstring)
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": tcfg.lr, "betas": list(tcfg.betas), "weight_decay": tcfg.weight_decay,
                           "torch_adam": True},
            },
            "steps_per_print": 10**9,
        }
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=_trainable(model), config=config,
            lr_scheduler=lambda opt: make_scheduler(opt, tcfg),
        )
        self.model = self.engine.module
        self.train_model = self.engine
        guard_deepspeed(self.engine)  # its checkpoint reads run no code (trainer/checkpoint.py)

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # DeepSpeed counts micro-steps to the accumulation boundary

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # our normaliser already covers accumulation
        self.engine.step()  # a no-op until the accumulation boundary

    def step(self, max_norm: float) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def shard_frozen(self, model: nn.Module) -> nn.Module:
        """ZeRO-3: the frozen model's weights partitioned over the ranks (a parameter at a time, so the device
        never holds the whole model) under an inference-only engine (no optimizer); its module's forward (every
        rank together) gathers each layer's weights as it runs.
        ZeRO-1 / 2 shard only optimizer state and gradients, which a frozen model has none of: whole."""
        if self.zero_stage != 3:
            return model
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": False}, "steps_per_print": 10**9}
        # partitioned a parameter at a time where it lies (the engine alone would first move the whole model
        # to the device), then the engine adds the hooks that gather each layer's weights for its forward
        deepspeed.zero.Init(module=model, config_dict_or_path=config, dtype=next(model.parameters()).dtype)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        self._frozen.append(engine)  # the engine owns the partitioning hooks: kept alive with the backend
        return engine.module

    def full_model(self) -> nn.Module:
        if self._replica is None:
            return self.model
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            self._replica.load_state_dict({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return self._replica

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag=self.TAG)

    def load(self, path: str) -> None:
        folder = os.path.join(path, self.TAG)
        problem = None
        try:
            # every file is there, opens and names only allowed types, before anything is applied
            vet_deepspeed(folder, deepspeed_files(self.zero_stage, self.world.size))
        except CheckpointError as err:
            problem = err
        agree(self.world, problem)
        try:
            loaded, _ = self.engine.load_checkpoint(path, tag=self.TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        except CheckpointError:
            raise
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError, AssertionError) as err:
            raise CheckpointError(f"{folder}: DeepSpeed could not resume from it ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:300]})") from None
        if loaded is None:  # DeepSpeed only warns when it finds no checkpoint
            raise CheckpointError(f"{folder}: DeepSpeed found no checkpoint in it")


def build_backend(name: str, model: nn.Module, tcfg: Any, world: World, zero_stage: int = 0, micro_steps: int = 1,
                  precision: Precision = Precision()):
    if name != "single" and not world.distributed and name != "deepspeed":
        name = "single"  # a world of one needs no wrapper; the result is identical
    if precision.scales_loss and name in ("fsdp", "deepspeed"):
        raise ValueError(f"model.dtype=float16 needs loss scaling, which backend={name} does not do here")
    check_masters(_trainable(model))  # before any wrapper: DeepSpeed builds its own optimizer
    if name == "single":
        return SingleBackend(model, tcfg, world, precision)
    if name == "ddp":
        return DDPBackend(model, tcfg, world, precision)
    if name == "fsdp":
        return FSDPBackend(model, tcfg, world)
    if name == "deepspeed":
        return DeepSpeedBackend(model, tcfg, world, zero_stage, micro_steps)
    raise ValueError(f"unknown backend '{name}'")
