"""The host-memory prediction of a DiLoCo peer: its terms, the line `peerd join` and `peerd doctor` print, and the
refusal of a run whose round boundary cannot fit the machine."""

import dataclasses

import pytest
import torch

from peerd.commands.doctor import check_memory
from peerd.config import ConfigError, NodeConfig
from peerd.hardware.host_memory import CUDA_CONTEXT_BYTES, PROCESS_BYTES, fit_host, host_estimate
from peerd.hardware.memory import GIB, Shape, estimate, format_bytes
from peerd.run_config import AveragingConfig, RunConfig
from protocols.codecs import get_codec
from protocols.diloco import DiLoCoHyperparams
from protocols.partition import CHUNK_ALIGN

pytestmark = pytest.mark.timeout(60)

P = 1_000_000


def test_the_terms_of_a_gpu_peer_with_background_checkpoints():
    est = host_estimate(P, device_type="cuda", codec="fp16", background_checkpoint=True, optimizer_state=8 * P)
    assert est.process == PROCESS_BYTES + CUDA_CONTEXT_BYTES and est.outer_state == 8 * P and est.model == 0
    assert est.snapshot == 8 * P
    # theta_local's copy (-> pseudo-gradient -> average -> new theta), the new momentum; a group of two's part
    assert est.round == 8 * P + (4 + 2 + 4 + 2) * P // 2
    assert est.checkpoint == 4 * P
    assert est.peak == est.process + 16 * P + 14 * P


def test_the_codec_fragments_and_the_delayed_overlap_change_the_round():
    fp32 = host_estimate(P, device_type="cuda", codec="none").round
    assert fp32 == 8 * P + 16 * P // 2
    # where theta_local cannot be taken again (fragments, the delayed overlap) or the error feedback reads the sent
    # vector (a sparse codec), the average has a buffer of its own
    fragmented = host_estimate(P, device_type="cuda", codec="none", fragments=4)
    assert fragmented.round == 20 * P // 4 and fragmented.checkpoint == 12 * P  # concatenated outer state
    assert host_estimate(P, device_type="cuda", codec="none", delayed=True).round == fp32 + 4 * P + 4 * P
    b = get_codec("topk").encoded_size(CHUNK_ALIGN) / CHUNK_ALIGN  # bytes a value on the wire
    assert host_estimate(P, device_type="cuda", codec="topk").round == 12 * P + int((8 + 2 * b) * P) // 2
    assert host_estimate(P, device_type="cuda", codec="none", group_size=4).round == 8 * P + 16 * P // 4
    # alone: the result is the pseudo-gradient's own buffer; theta_local's copy and the new momentum remain
    assert host_estimate(P, device_type="cuda", codec="fp16", group_size=1).round == 8 * P
    # no snapshot where checkpoints are written in the foreground, no model where a GPU trains
    assert host_estimate(P, device_type="cuda", optimizer_state=8 * P).snapshot == 0
    for bad in ({"parameters": 0}, {"fragments": 0}, {"group_size": 0}):
        with pytest.raises(ValueError):
            host_estimate(**{"parameters": P, "device_type": "cpu", **bad})


def _cpu_node(tmp_path):
    return NodeConfig(checkpoint_dir=str(tmp_path), device="cpu")


def test_a_cpu_peer_counts_its_model_and_prints_one_line(tmp_path):
    run = RunConfig(model="small", seq_len=128, batch_size=8)
    line, short = fit_host(_cpu_node(tmp_path), run, torch.device("cpu"), 256, budget=(64 * GIB, 0, 32 * GIB))
    shape = Shape.of("small", 256)
    inner = estimate(shape, seq_len=128, micro_batch_size=8, precision="fp32", device_type="cpu").peak
    expected = host_estimate(shape.parameters, device_type="cpu", codec=run.averaging.allreduce().compression,
                             inner_step=inner)
    assert expected.model == inner and not short and "\n" not in line
    assert line.startswith("small: host memory predicted peak ") and "of 64.0 GiB (32.0 GiB available now)" in line
    assert f"predicted peak {format_bytes(expected.peak)} of" in line


def test_a_billion_parameters_is_refused_on_a_small_machine_and_warned_where_memory_is_taken(tmp_path):
    """Refused with one line naming the override; with host_memory_check = "warn" a warning line instead; a bad
    value of that key is refused when the node config is read."""
    run = RunConfig(model="1.1b", seq_len=1024, batch_size=16,
                    averaging=AveragingConfig.from_flat(compression="fp16"))
    node = NodeConfig(checkpoint_dir=str(tmp_path))
    gpu = torch.device("cuda")  # only its type is read: no GPU needed
    with pytest.raises(ConfigError) as refused:  # predicted ~34.6 GiB: 8.4 outer state + 8.4 snapshot + 14.7 round
        fit_host(node, run, gpu, 256, budget=(28 * GIB, 4 * GIB, 26 * GIB))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("1.1b does not fit this machine's memory: needs ~")
    assert "this machine has 28.0 GiB (+4.0 GiB swap)" in message
    assert 'or set host_memory_check = "warn" to train anyway' in message
    line, short = fit_host(dataclasses.replace(node, host_memory_check="warn"), run, gpu, 256,
                           budget=(28 * GIB, 4 * GIB, 26 * GIB))
    assert short and "\n" not in line and line.startswith("1.1b: host memory predicted peak ")
    assert "of 28.0 GiB (26.0 GiB available now)" in line
    assert line.endswith("more than its memory and 4.0 GiB of swap: training anyway (host_memory_check = warn), the "
                         "kernel may stop this peer at a round boundary")
    with pytest.raises(ConfigError, match="host_memory_check must be one of refuse, warn"):
        NodeConfig(checkpoint_dir=str(tmp_path), host_memory_check="ignore")
    line, short = fit_host(node, run, gpu, 256, budget=(128 * GIB, 0, 16 * GIB))
    assert short and "of 128.0 GiB (16.0 GiB available now)" in line and "checkpoint snapshot" in line


def test_doctor_prints_both_predictions_and_fails_the_host_memory(tmp_path):
    node = _cpu_node(tmp_path)
    run = RunConfig(model="small", seq_len=128, batch_size=8, diloco=DiLoCoHyperparams())
    ok = check_memory(node, run, host=(64 * GIB, 0, 64 * GIB))
    assert [c.name for c in ok] == ["memory", "host memory"] and all(c.ok for c in ok)
    assert ok[1].line().startswith("OK    host memory  small: host memory predicted peak")
    bad = check_memory(node, run, host=(GIB // 4, 0, GIB // 4))
    assert [c.ok for c in bad] == [True, False]
    assert bad[1].line().startswith("FAIL  host memory  small does not fit this machine's memory")
    assert "; fix: join a run of a smaller model" in bad[1].line() and "\n" not in bad[1].line()


def test_the_host_memory_check_is_a_join_flag(tmp_path, capsys):
    """``--host-memory-check warn`` reaches the node config; a value it does not know exits 2 with one line."""
    from peerd.commands.common import node_config
    from peerd.commands.main import main
    from peerd.commands.parser import build_parser

    args = build_parser().parse_args(["join", "--run-id", "x", "--checkpoint-dir", str(tmp_path),
                                      "--host-memory-check", "warn"])
    assert node_config(args).host_memory_check == "warn"
    code = main(["join", "--run-id", "x", "--checkpoint-dir", str(tmp_path), "--host-memory-check", "ignore"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--host-memory-check" in err[0] and "'ignore'" in err[0]
