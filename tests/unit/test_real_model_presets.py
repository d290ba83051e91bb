"""The real-model run presets (node_configs/runs/125m.toml, 350m.toml, 1.1b.toml): H = 500, overlapped Streaming
DiLoCo fragments, fp4 pseudo-gradients, and timeouts that hold each transfer over a 100 Mbit/s home link."""

from pathlib import Path

import pytest

from peerd.models.registry import get_preset
from peerd.run_config import load_run_config
from protocols.codecs import get_codec

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
LINK_BYTES_S = 100e6 / 8
"""100 Mbit/s, each way."""
VOCAB = 32768


@pytest.mark.parametrize("name", ["125m", "350m", "1.1b"])
def test_a_real_model_preset_fits_a_100_mbit_link(name):
    run = load_run_config(REPO / "node_configs" / "runs" / f"{name}.toml")
    hp, allreduce = run.diloco, run.averaging.allreduce()
    assert run.model == name and hp.inner_steps == 500 and hp.fragments > 1 and hp.overlap == "delayed"
    assert allreduce.compression == "fp4" and run.tokenizer.startswith("bpe:")
    params = get_preset(name).parameter_count(VOCAB)
    fragment_bytes = get_codec("fp4").encoded_size(params // hp.fragments)
    assert fragment_bytes < params // hp.fragments * 2 / 3.5  # a quarter of fp16's bytes, and the scales
    transfer_s = fragment_bytes / LINK_BYTES_S  # a member's upload of its parts (at most the whole fragment)
    assert allreduce.sender_timeout_s >= 5 * transfer_s, (allreduce.sender_timeout_s, transfer_s)
    assert allreduce.reducer_timeout_s >= 2 * allreduce.sender_timeout_s
    state_s = params * 8 / LINK_BYTES_S  # a joiner's download of theta_outer and the momentum, fp32
    assert run.averaging.state_transfer().download_timeout_s >= 2 * state_s
