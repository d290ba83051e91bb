"""Local checkpoints: bit-exact round trip, corrupt files, and atomic replacement (a crash leaves the old file)."""

import json
import os

import pytest
import torch
from safetensors.torch import save as st_save

from peerd.worker.checkpoint_file import (FILENAME, Checkpoint, CheckpointError, check_checkpoint, checkpoint_path,
                                          load_checkpoint, save_checkpoint)

pytestmark = pytest.mark.timeout(60)


def sample(seed: int = 0) -> Checkpoint:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "theta_outer": torch.randn(1000, generator=g),
        "momentum": torch.randn(1000, generator=g) * 1e-30,  # subnormals must survive too
        "half": torch.randn(17, generator=g).half(),
        "bf16": torch.randn(4, 5, generator=g).bfloat16(),
        "step": torch.tensor(12.0),
        "ids": torch.randint(-(2**62), 2**62, (9,), generator=g),
        "special": torch.tensor([float("inf"), -float("inf"), -0.0, float("nan")]),
        "strided": torch.randn(6, 4, generator=g).t(),  # non-contiguous view
    }
    metadata = {"run_id": "demo", "outer_round": 3 + seed, "sampler": {"epoch": 1, "order": [3, 1, 2]},
                "loss": 2.5, "note": "ünïcode", "none": None}
    return Checkpoint(tensors, metadata)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert raw_bytes(x) == raw_bytes(y), name


def test_checkpoint_path_layout(tmp_path):
    assert checkpoint_path(tmp_path, "run-1") == tmp_path / "run-1" / FILENAME


def test_round_trip_is_bit_identical(tmp_path):
    path = checkpoint_path(tmp_path, "demo")  # the folder does not exist yet
    original = sample()
    size = save_checkpoint(path, original)
    assert size == path.stat().st_size > 0
    loaded = load_checkpoint(path)
    assert loaded is not None
    assert_bit_identical(original.tensors, loaded.tensors)
    assert loaded.metadata == original.metadata
    assert all(t.device.type == "cpu" for t in loaded.tensors.values())


def test_save_does_not_modify_the_caller_tensors(tmp_path):
    original = sample()
    before = {k: v.clone() for k, v in original.tensors.items()}
    save_checkpoint(tmp_path / FILENAME, original)
    assert_bit_identical(before, original.tensors)
    assert not original.tensors["strided"].is_contiguous()


def test_empty_checkpoint_round_trip(tmp_path):
    save_checkpoint(tmp_path / FILENAME, Checkpoint({}, {}))
    loaded = load_checkpoint(tmp_path / FILENAME)
    assert loaded.tensors == {} and loaded.metadata == {}


def test_missing_file_is_none(tmp_path):
    assert load_checkpoint(tmp_path / "nothing" / FILENAME) is None
    assert load_checkpoint(str(tmp_path / FILENAME)) is None


def test_every_truncation_is_a_checkpoint_error(tmp_path):
    path = tmp_path / FILENAME
    save_checkpoint(path, Checkpoint({"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)}, {"r": 1}))
    blob = path.read_bytes()
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(CheckpointError, match=FILENAME):
            load_checkpoint(path)
        with pytest.raises(CheckpointError, match="move it away"):  # the header-only check `join` makes first
            check_checkpoint(path)
    path.write_bytes(blob)
    check_checkpoint(path)


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"garbage" * 10,
        lambda: b"\xff" * 8 + b"{}",  # absurd header length
        lambda: (2).to_bytes(8, "little") + b"{]",  # header that is not JSON
        lambda: st_save({"a": torch.zeros(2)}),  # a valid safetensors file without our metadata
        lambda: st_save({"a": torch.zeros(2)}, metadata={"peerd": "{not json"}),
        lambda: st_save({"a": torch.zeros(2)}, metadata={"other": "{}"}),
    ],
    ids=["garbage", "huge-header-length", "bad-json", "no-metadata", "bad-metadata-json", "foreign-metadata"],
)
def test_corrupt_file_is_a_checkpoint_error(tmp_path, make):
    path = tmp_path / FILENAME
    path.write_bytes(make())
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_a_folder_in_place_of_the_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / FILENAME).mkdir()
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / FILENAME)


def test_overwrite_replaces_the_previous_checkpoint(tmp_path):
    path = tmp_path / "run" / FILENAME
    save_checkpoint(path, sample(0))
    second = sample(1)
    save_checkpoint(path, second)
    loaded = load_checkpoint(path)
    assert loaded.metadata["outer_round"] == 4
    assert_bit_identical(second.tensors, loaded.tensors)


def test_loaded_tensors_are_the_callers_to_change_and_outlive_the_file_they_came_from(tmp_path):
    """A load maps the file: its tensors must still hold the loaded values after the next checkpoint replaced the
    file and after the file is gone, and changing one in place must neither fail nor reach the file."""
    path = checkpoint_path(tmp_path, "demo")
    original = sample(0)
    save_checkpoint(path, original)
    loaded = load_checkpoint(path)
    save_checkpoint(path, sample(1))  # replaces the file the loaded tensors map
    assert_bit_identical(original.tensors, loaded.tensors)
    path.unlink()
    loaded.tensors["theta_outer"].add_(1.0)  # the resumed state is the worker's own
    assert torch.equal(loaded.tensors["theta_outer"], original.tensors["theta_outer"] + 1.0)
    save_checkpoint(path, original)
    assert_bit_identical(load_checkpoint(path).tensors, original.tensors)


def test_no_temporary_files_are_left_after_success(tmp_path):
    path = tmp_path / "run" / FILENAME
    for seed in range(3):
        save_checkpoint(path, sample(seed))
    assert [p.name for p in path.parent.iterdir()] == [FILENAME]


def test_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run" / FILENAME
    old = sample(0)
    save_checkpoint(path, old)
    old_bytes = path.read_bytes()
    new = sample(1)
    seen = {}

    def crash(src, dst):
        # the new checkpoint is fully written to a temporary file in the same folder, then the process "dies"
        src, dst = os.fspath(src), os.fspath(dst)
        seen["src"], seen["dst"] = src, dst
        seen["complete"] = load_checkpoint(src).metadata == new.metadata
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(path, new)
    monkeypatch.undo()

    assert seen["dst"] == str(path)
    assert os.path.dirname(seen["src"]) == str(path.parent) and seen["src"] != seen["dst"]
    assert seen["complete"]
    assert path.read_bytes() == old_bytes
    loaded = load_checkpoint(path)
    assert loaded.metadata == old.metadata
    assert_bit_identical(old.tensors, loaded.tensors)

    # the next save (after a restart) succeeds and replaces the old checkpoint
    save_checkpoint(path, new)
    assert load_checkpoint(path).metadata == new.metadata


def test_metadata_is_stored_as_json_in_the_header(tmp_path):
    """No pickle: the file is a plain safetensors file whose metadata is JSON."""
    path = tmp_path / FILENAME
    save_checkpoint(path, Checkpoint({"x": torch.ones(2)}, {"outer_round": 9}))
    blob = path.read_bytes()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    assert json.loads(header["__metadata__"]["peerd"]) == {"outer_round": 9}
    assert header["x"]["dtype"] == "F32" and header["x"]["shape"] == [2]


def test_non_json_metadata_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / FILENAME
    save_checkpoint(path, Checkpoint({"x": torch.ones(2)}, {"outer_round": 1}))
    before = path.read_bytes()
    with pytest.raises(TypeError):
        save_checkpoint(path, Checkpoint({"x": torch.ones(2)}, {"bad": object()}))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]
