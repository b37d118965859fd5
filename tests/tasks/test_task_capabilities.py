"""Tasks declare their optional capabilities as typed protocols, read in one place
(`tasks.task_capabilities`): solution paths (arith, multipath), artifacts (artifacts), prompts that
are the whole input (clm). A malformed declaration fails at setup, naming the task."""
from __future__ import annotations

import pytest

from tasks import ArithTask, ArtifactTask, ClmTask, MultiPathTask, task_capabilities
from tasks.chat_template import with_chat


def test_each_shipped_task_declares_what_it_has():
    arith = task_capabilities(ArithTask(n_train=20, n_test=5))
    assert arith.solution_path is not None and not arith.several_paths and arith.segments is None
    assert not arith.renders_own_prompts
    assert arith.solution_path("3+4=7\n7*2=14\n#### 14") == ArithTask(n_train=20, n_test=5).solution_path(
        "3+4=7\n7*2=14\n#### 14")
    multi = task_capabilities(MultiPathTask(n_train=20, n_test=5))
    assert multi.solution_path is not None and multi.several_paths
    art = task_capabilities(ArtifactTask(n_train=40, n_test=5, n_library=60, n_library_ood=20))
    assert art.segments is not None and art.solution_path is None and not art.renders_own_prompts
    clm = task_capabilities(ClmTask(seed=0, n_train=12, n_test=3))
    assert clm.renders_own_prompts and clm.segments is None and clm.solution_path is None


def test_a_chat_wrapped_task_keeps_its_capabilities():
    from tests.tasks.test_chat_template import chat_tokenizer
    from tasks.chat_template import TemplatedTask

    wrapped = with_chat(MultiPathTask(n_train=20, n_test=5), chat_tokenizer(), "true")
    assert isinstance(wrapped, TemplatedTask)
    caps = task_capabilities(wrapped)
    assert caps.several_paths and caps.solution_path is not None and caps.segments is None
    art = with_chat(ArtifactTask(n_train=40, n_test=5, n_library=60, n_library_ood=20), chat_tokenizer(), "true")
    assert isinstance(art, TemplatedTask) and task_capabilities(art).segments is not None


def test_a_malformed_declaration_is_refused_by_name():
    class Odd(ArithTask):
        several_paths = "yes"

    with pytest.raises(TypeError, match="task Odd: several_paths must be True or False"):
        task_capabilities(Odd(n_train=20, n_test=5))
