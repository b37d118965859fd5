"""Batch plumbing shared by every algorithm."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Batch, PolicyTerms, TeacherTerms, Traits, pad_right


def test_micro_batches_group_by_length_cover_every_row_once_and_trim():
    rows = [[1] * 5, [2] * 2, [3] * 4, [4] * 1]
    ids, attn = pad_right(rows, pad_id=0, device=torch.device("cpu"))
    batch = Batch(ids, attn, attn.clone(), policy=PolicyTerms(torch.tensor([0.5, 0.2, 0.4, 0.1])), uids=["a", "b", "c", "d"])
    micros = batch.micro_batches(2)
    assert [m.uids for m in micros] == [["d", "b"], ["c", "a"]]
    assert [tuple(m.input_ids.shape) for m in micros] == [(2, 2), (2, 5)]
    assert micros[0].input_ids.tolist() == [[4, 0], [2, 2]]
    assert torch.equal(micros[1].policy.advantages, torch.tensor([0.4, 0.5]))
    assert sum(int(m.num_targets()) for m in micros) == int(batch.num_targets())


def test_micro_batches_trim_token_axis_of_every_tensor_and_keep_groups():

    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 0]])
    attn = (ids != 0).long()
    hidden = torch.arange(3 * 4 * 2 * 5, dtype=torch.float32).view(3, 4, 2, 5)  # (B, T, K, H)
    batch = Batch(ids, attn, attn.clone(), teacher=TeacherTerms(hidden, (torch.eye(5), None)), row_group=torch.tensor([0, 1, 1]), num_groups=2,
                  uids=["a", "b", "c"])
    assert batch.num_targets().tolist() == [4, 5]
    micros = batch.micro_batches(2)
    assert [m.uids for m in micros] == [["b", "c"], ["a"]]  # grouped by length
    first = micros[0]
    assert first.input_ids.shape == (2, 3) and first.teacher.hidden.shape == (2, 3, 2, 5)
    assert torch.equal(first.teacher.hidden[1], hidden[2, :3]) and first.row_group.tolist() == [1, 1]
    assert sum(m.num_targets() for m in micros).tolist() == [4, 5]


def test_capabilities_are_resolved_from_the_typed_protocols():
    from algorithms import REGISTRY, build_algorithm
    from algorithms.base import capabilities

    caps = {name: capabilities(build_algorithm(cfg())) for name, (cfg, _) in REGISTRY.items()}
    assert {n for n, c in caps.items() if c.share_prompts is not None} == {"grpo"}
    assert {n for n, c in caps.items() if c.exposure is not None} == {"grpo"}
    assert {n for n, c in caps.items() if c.extra_eval is not None} == {"seed", "skipper", "attuner", "grpo",
                                                                              "distill"}
    assert {n for n, c in caps.items() if c.eval_completions is not None} == {"attuner", "clm"}
    assert {n for n, c in caps.items() if c.check_task is not None} == {"opsd", "mass", "tesd", "attuner", "clm", "distill",
                                                                          "sft", "grpo"}
    assert caps["grpo"].rows_per_prompt == 8 and caps["tesd"].rows_per_prompt == 5 and caps["sft"].rows_per_prompt == 1
    assert caps["seed"].summary_metrics == {"seed/mean_accepted": "mean accepted length (greedy, tokens per verify forward)"}
    assert {n for n, (cfg, _) in REGISTRY.items() if cfg.traits.needs_reference} == {"opsd", "mass", "tesd"}
    assert {n for n, (cfg, _) in REGISTRY.items() if cfg.traits.prompt_sharing} == {"grpo"}
    assert {n for n, (cfg, _) in REGISTRY.items() if not cfg.traits.fsdp} == {"seed", "attuner"}


def test_an_object_missing_part_of_the_contract_is_refused_by_name():
    from algorithms.base import capabilities

    class Half:
        name = "half"

        def make_batch(self, examples, ctx): ...

        def loss(self, model, micro, normaliser): ...

    with pytest.raises(TypeError, match="Half does not implement the Algorithm contract: missing prepare_model, export, "
                                        "state_dict, load_state_dict"):
        capabilities(Half())


def test_grouped_terms_are_split_by_row_and_the_teacher_head_is_shared():
    ids = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    attn = (ids > 0).long()
    head = (torch.randn(7, 4), None)
    batch = Batch(ids, attn, attn.clone(), teacher=TeacherTerms(torch.randn(3, 3, 1, 4), head),
                  policy=PolicyTerms(torch.tensor([1.0, 2.0, 3.0]), prompt_lengths=torch.tensor([1, 2, 1])))
    for micro in batch.micro_batches(2):
        assert micro.teacher.head is head  # one head for every row, never sliced
        assert micro.policy.advantages.shape == (len(micro),) == micro.policy.prompt_lengths.shape
        assert micro.teacher.hidden.shape[:2] == micro.input_ids.shape


def test_every_config_declares_traits_and_validates_its_values():
    from algorithms import REGISTRY

    required = {"distill": "algo=distill needs algo.teacher_path"}  # keys without a default
    for name, (cfg, _) in REGISTRY.items():
        assert isinstance(cfg.traits, Traits), name
        if name in required:
            with pytest.raises(ValueError, match=required[name]):
                cfg().validate()
            continue
        cfg().validate()  # the defaults are valid
    with pytest.raises(ValueError, match=r"algo.mask_ratio=1.5 must be in \[0, 1\]"):
        REGISTRY["sft"][0](mask_ratio=1.5).validate()


def declaring_classes(key: str) -> set[str]:
    """The classes that declare config field `key`, over every algorithm's config dataclass."""
    import dataclasses

    from algorithms import config_schemas

    owners = set()
    for cls in config_schemas().values():
        if key in {f.name for f in dataclasses.fields(cls)}:
            owners.add(next(k for k in cls.__mro__ if key in k.__dict__.get("__annotations__", {})).__qualname__)
    return owners


def test_shared_keys_are_declared_once():
    """Keys several algorithms share come from one option group each (composed by inheritance), so
    their default, meaning and check cannot drift between algorithms."""
    groups = {"loss_chunk_tokens": "LossChunking", "teacher_batch_size": "TeacherBatching",
              "lora_targets": "LoRAOptions", "dynamic_sampling": "DynamicSampling",
              "dynamic_max_rounds": "DynamicSampling", "retire_after": "DynamicSampling",
              "num_generations": "GroupRollouts", "scale_rewards": "GroupRollouts"}
    for key, group in groups.items():
        assert declaring_classes(key) == {group}, key


def test_an_option_group_checks_its_keys():
    from algorithms.base import LossChunking, TeacherBatching

    with pytest.raises(ValueError, match=r"algo.loss_chunk_tokens=-1 must be >= 0"):
        LossChunking(loss_chunk_tokens=-1).check_loss_chunking()
    with pytest.raises(ValueError, match=r"algo.teacher_batch_size=0 must be > 0"):
        TeacherBatching(teacher_batch_size=0).check_teacher_batching()
    LossChunking().check_loss_chunking()
    TeacherBatching().check_teacher_batching()
