"""The model registry: every run-config model name builds, and parameter counts come from shapes."""

import pytest
import torch

from peerd.models import MODEL_PRESETS, build_model, count_parameters, get_preset
from peerd.run_config import MODEL_NAMES, RunConfig

pytestmark = pytest.mark.timeout(60)

#: README's table; the large presets are counted from shapes, never allocated here.
EXPECTED = {"tiny": 885_888, "small": 10_720_128, "125m": 127_627_008, "350m": 347_134_976,
            "1.1b": 1_130_981_376}


def test_registry_names_are_the_run_config_model_names():
    assert set(MODEL_PRESETS) == set(MODEL_NAMES)
    for name in MODEL_NAMES:
        assert RunConfig(model=name, parallelism="diloco").model == name


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-moe", "small-moe"])
def test_counts_from_shapes_match_built_models(name):
    assert get_preset(name).parameter_count() == count_parameters(build_model(name, 16, seed=0))


def test_llama_presets_have_the_documented_sizes():
    for name, count in EXPECTED.items():
        assert get_preset(name).parameter_count() == count
    assert 110e6 < EXPECTED["125m"] < 140e6 and 320e6 < EXPECTED["350m"] < 380e6
    assert 1.05e9 < EXPECTED["1.1b"] < 1.2e9
    assert get_preset("1.1b").train_state_bytes() == 16 * EXPECTED["1.1b"]


def test_large_preset_shapes_on_the_meta_device():
    # The formula and the module agree for a Llama-sized block too (built without memory on the meta device).
    preset = get_preset("125m")
    config = preset.config(seq_len=64)
    with torch.device("meta"):
        from peerd.models.transformer import Block
        block = Block(config)
    per_block = sum(p.numel() for p in block.parameters())
    assert preset.parameter_count() == 256 * config.d_model + config.n_layers * per_block + config.d_model


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="1.1b"):
        get_preset("7b")
