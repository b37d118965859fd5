"""algo.teacher_path against the real model: SmolLM2's tokenizer is not the embedded tiny model's."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_smollm2_is_refused_as_a_teacher_of_the_tiny_model(tmp_path, smollm2_dir):
    """Another tokenizer: one config line naming both models, before any weights load."""
    from tests.conftest import tiny_config
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=rf"algo.teacher_path={smollm2_dir} does not share the student's tokenizer "
                                          r"\(the embedded tiny model\): vocabulary sizes differ") as err:
        tiny_config(tmp_path / "run", f"algo.teacher_path={smollm2_dir}", algo="distill")
    assert "\n" not in str(err.value)
