"""Training devices: names checked at config time (exit 2), a list of GPUs as one peer, and what a name means on this
machine with CUDA, ROCm and Apple's MPS present or not (torch's answers replaced, so every case runs here, with or
without a GPU)."""

import types

import pytest
import torch

from peerd.commands.main import main
from peerd.config import ConfigError, NodeConfig, load_node_config
from peerd.hardware.devices import DeviceUnavailable, describe_device, device_problem, gpu_backend, resolve_device
from peerd.commands.doctor import check_device

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def machine(monkeypatch):
    """``machine(gpus=N, mps=..., hip=...)``: torch's view of this machine for the test, whatever is really here."""

    def make(gpus: int = 0, mps: bool = False, mps_built: bool = True, hip: str = None, cuda: str = "12.4",
             name: str = "NVIDIA GeForce RTX 4090", total_gib: float = 24.0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: types.SimpleNamespace(name=name, total_memory=int(total_gib * 2**30)))
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.backends.mps, "is_built", lambda: mps_built)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None if hip else cuda)

    return make


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps", "mps:0"])
def test_device_names_that_are_accepted(name):
    assert device_problem(name) is None


@pytest.mark.parametrize("name, says", [
    ("tpu", "must be auto, cpu, cuda, cuda:N, mps"),
    ("cuda:x", "cuda:N takes a GPU index"),
    ("cuda:", "cuda:N takes a GPU index"),
    ("mps:1", "mps has one device"),
    ("gpu", "use cuda"),
    ("rocm", "ROCm builds of torch show AMD GPUs as cuda devices"),
    ("hip:0", "ROCm builds of torch show AMD GPUs as cuda devices"),
    ("metal", "Apple's GPU is mps"),
    (0, "must be auto"),
])
def test_impossible_device_names_are_refused_with_the_reason(name, says):
    assert says in device_problem(name)
    with pytest.raises(ConfigError, match="device"):
        NodeConfig(device=name)


def test_a_list_of_gpus_is_local_devices_from_the_file_the_variable_and_the_flag(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[node]\ndevice = ["cuda:0", "cuda:1"]\n')
    from_file = load_node_config(str(path), environ={})
    from_env = load_node_config(None, environ={"PEERD_DEVICE": "cuda:0, cuda:1"})
    from_flag = load_node_config(None, environ={}, overrides={"device": "cuda:0,cuda:1"})
    for node in (from_file, from_env, from_flag):
        assert node.device == "cuda:0" and node.local_devices == ("cuda:0", "cuda:1")
    one = load_node_config(None, environ={}, overrides={"device": "cuda:1"})
    assert one.device == "cuda:1" and one.local_devices == ()
    same = NodeConfig(device=("cuda:2", "cuda:3"), local_devices=("cuda:2", "cuda:3"))
    assert same.local_devices == ("cuda:2", "cuda:3")


@pytest.mark.parametrize("kwargs, says", [
    ({"device": ("cuda:0", "cuda:1"), "local_devices": ("cuda:2", "cuda:3")}, "contradicts local_devices"),
    ({"device": "cuda:0,cpu"}, "mixes CPUs and GPUs"),
    ({"device": "cuda:1,cuda:1"}, "names a GPU twice"),
    ({"device": "mps,cuda:0"}, "entries must be cpu or cuda:N"),
    ({"device": " , "}, "names no device"),
    ({"device": "mps", "gpu": False}, "contradicts gpu = false"),
])
def test_device_lists_and_gpu_off_that_cannot_work_are_refused(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        NodeConfig(**kwargs)


def test_a_bad_device_flag_exits_2_with_one_line(tmp_path, capsys):
    code = main(["join", "--run-id", "r", "--device", "cuda:first", "--checkpoint-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "--device" in err and "cuda:N takes a GPU index" in err


def test_auto_takes_a_cuda_gpu_then_mps_then_the_cpu(machine):
    machine(gpus=1, mps=True)
    assert resolve_device("auto") == torch.device("cuda")
    machine(gpus=0, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    machine(gpus=0, mps=False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_gpu_that_is_not_there_is_one_line_saying_what_is(machine):
    machine(gpus=2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(DeviceUnavailable, match=r"^device cuda:2: this machine has 2 GPUs \(cuda:0, cuda:1\)$"):
        resolve_device("cuda:2")
    machine(gpus=0)
    with pytest.raises(DeviceUnavailable, match="torch sees no CUDA or ROCm GPU") as info:
        resolve_device("cuda")
    assert "\n" not in str(info.value) and torch.__version__ in str(info.value)


def test_mps_works_where_torch_has_it_and_is_refused_where_not(machine):
    machine(mps=True)
    assert resolve_device("mps") == torch.device("mps")
    machine(mps=False, mps_built=True)
    with pytest.raises(DeviceUnavailable, match="MPS is not available on this machine"):
        resolve_device("mps")
    machine(mps=False, mps_built=False)
    with pytest.raises(DeviceUnavailable, match="this build of torch has no MPS support"):
        resolve_device("mps:0")
    with pytest.raises(ValueError, match="mps has one device"):
        resolve_device("mps:1")


def test_a_rocm_build_trains_on_cuda_devices_and_says_rocm(machine, tmp_path):
    machine(gpus=1, hip="6.2.41133", name="AMD Instinct MI300X", total_gib=192.0)
    assert gpu_backend() == "ROCm (HIP 6.2.41133)"
    assert resolve_device("auto") == torch.device("cuda")
    assert describe_device(resolve_device("cuda:0")) == "cuda:0 (AMD Instinct MI300X, 192.0 GiB, ROCm (HIP 6.2.41133))"
    check = check_device(NodeConfig(device="cuda", checkpoint_dir=str(tmp_path)))
    assert check.ok and "AMD Instinct MI300X" in check.detail and "ROCm" in check.detail
    machine(gpus=1)
    assert describe_device("cuda") == "cuda:0 (NVIDIA GeForce RTX 4090, 24.0 GiB, CUDA 12.4)"
    machine(gpus=0, mps=False)
    assert gpu_backend() == "CUDA 12.4" and describe_device("cpu") == "cpu"


def test_doctor_fails_the_device_check_in_one_line_when_the_gpu_is_missing(machine, tmp_path):
    machine(gpus=1)
    check = check_device(NodeConfig(device="cuda:3", checkpoint_dir=str(tmp_path)))
    assert not check.ok and check.detail == "device cuda:3: this machine has 1 GPU (cuda:0)"


def test_join_on_a_gpu_this_machine_lacks_stops_with_one_line_before_the_network(machine, tmp_path, capsys):
    machine(gpus=1)
    code = main(["join", "--run-id", "r", "--device", "cuda:5", "--checkpoint-dir", str(tmp_path),
                 "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDptq23arqsipaxkBVToiQZPCgYnmBUo2eYGMRa9FzXeq"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1
    assert [line for line in err if "cuda:5" in line] == [err[-1]] and "Traceback" not in "\n".join(err), err
    assert err[-1].endswith("device cuda:5: this machine has 1 GPU (cuda:0)")


def test_generate_takes_one_device_name_or_exits_2(capsys):
    for bad, says in (("tpu", "must be auto"), ("cuda:0,cuda:1", "takes one device")):
        assert main(["generate", "--checkpoint-dir", "/nonexistent", "--prompt", "x", "--device", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err
