"""State snapshots (pack/validate) and serve/download between in-process peers (no sockets)."""

import asyncio

import pytest
import torch

from peerd.transport.inprocess import Hub
from protocols.state_transfer import StateServer, StateSnapshot, StateTransferFailed, download_state
from protocols.wire import ProtocolViolation, write_frame

pytestmark = pytest.mark.timeout(60)

PREFIX = "run"


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "theta": torch.randn(1000, generator=g),
        "momentum": torch.randn(10, 10, generator=g).half(),  # 2-D: comes back flat
        "bf": torch.randn(7, generator=g).bfloat16(),
        "step": torch.tensor([5, -3, 2**40], dtype=torch.int64),
    }


def expected_of(ts):
    return {name: (t.dtype, t.numel()) for name, t in ts.items()}


def snapshot():
    return StateSnapshot.from_tensors(tensors(), {"outer_round": 4, "digest": "abc"})


def with_header(snap, **changes):
    return StateSnapshot({**snap.header, **changes}, snap.payload)


# ------------------------------------------------------------------------------------------------------------- snapshot


def test_round_trip():
    ts = tensors()
    snap = StateSnapshot.from_tensors(ts, {"outer_round": 4})
    assert snap.metadata == {"outer_round": 4}
    assert len(snap.payload) == sum(t.numel() * t.element_size() for t in ts.values())
    out = snap.tensors(expected_of(ts))
    assert list(out) == list(ts)
    for name, t in ts.items():
        assert out[name].dtype == t.dtype and out[name].shape == (t.numel(),)
        assert torch.equal(out[name], t.reshape(-1)), name


def test_round_trip_of_a_strided_tensor_and_expected_in_another_order():
    base = torch.arange(12.0).reshape(3, 4)
    ts = {"b": base.t(), "a": torch.ones(2)}  # non-contiguous view
    snap = StateSnapshot.from_tensors(ts, {})
    out = snap.tensors({"a": (torch.float32, 2), "b": (torch.float32, 12)})
    assert torch.equal(out["b"], base.t().reshape(-1)) and torch.equal(out["a"], torch.ones(2))


def test_unpacked_tensors_do_not_alias_the_payload():
    snap = StateSnapshot.from_tensors({"a": torch.zeros(4)}, {})
    out = snap.tensors({"a": (torch.float32, 4)})
    out["a"] += 1  # must be writable and must not change the snapshot
    assert snap.tensors({"a": (torch.float32, 4)})["a"].sum().item() == 0.0


def test_unsupported_dtype_is_refused_when_packing():
    with pytest.raises(ValueError, match="float64"):
        StateSnapshot.from_tensors({"a": torch.zeros(2, dtype=torch.float64)}, {})


@pytest.mark.parametrize(
    "expected",
    [
        {"theta": (torch.float32, 1000)},  # one missing
        {**expected_of(tensors()), "extra": (torch.float32, 1)},  # one extra
        {"theta_": (torch.float32, 1000), "momentum": (torch.float16, 100), "bf": (torch.bfloat16, 7),
         "step": (torch.int64, 3)},  # renamed
    ],
    ids=["missing", "extra", "renamed"],
)
def test_mismatched_names(expected):
    with pytest.raises(ProtocolViolation, match="tensors"):
        snapshot().tensors(expected)


def test_mismatched_dtype():
    expected = {**expected_of(tensors()), "momentum": (torch.float32, 100)}
    with pytest.raises(ProtocolViolation, match="momentum"):
        snapshot().tensors(expected)


def test_mismatched_numel():
    expected = {**expected_of(tensors()), "theta": (torch.float32, 999)}
    with pytest.raises(ProtocolViolation, match="theta"):
        snapshot().tensors(expected)


def test_header_lying_about_numel_to_match_payload():
    """A header that changes dtype *and* numel so the byte count still adds up is still refused."""
    snap = StateSnapshot.from_tensors({"a": torch.ones(4)}, {})
    lying = with_header(snap, tensors=[["a", "float16", 8]])
    with pytest.raises(ProtocolViolation):
        lying.tensors({"a": (torch.float32, 4)})


@pytest.mark.parametrize("cut", [1, 4, 100])
def test_truncated_payload(cut):
    snap = snapshot()
    with pytest.raises(ProtocolViolation, match="shorter"):
        StateSnapshot(snap.header, snap.payload[:-cut]).tensors(expected_of(tensors()))


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 4, b"\x00" * 4000])
def test_extra_payload_bytes(extra):
    snap = snapshot()
    with pytest.raises(ProtocolViolation, match="longer"):
        StateSnapshot(snap.header, snap.payload + extra).tensors(expected_of(tensors()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_values(bad, dtype):
    x = torch.zeros(8, dtype=dtype)
    x[5] = bad
    snap = StateSnapshot.from_tensors({"ok": torch.ones(3), "x": x}, {})
    with pytest.raises(ProtocolViolation, match="non-finite"):
        snap.tensors({"ok": (torch.float32, 3), "x": (dtype, 8)})


def test_int64_tensors_are_not_checked_for_finiteness():
    snap = StateSnapshot.from_tensors({"i": torch.tensor([-1, 2**62])}, {})
    assert snap.tensors({"i": (torch.int64, 2)})["i"].tolist() == [-1, 2**62]


@pytest.mark.parametrize(
    "spec",
    [
        "not a list",
        None,
        [["a", "float32"]],  # too short
        [["a", "float32", 4, "x"]],  # too long
        [["a", "float32", "4"]],  # numel not an int
        [["a", "float32", 4.0]],
        [["a", "float64", 2]],  # dtype we do not accept, right byte count
        [["a", "int64", 2]],  # dtype mismatch, right byte count
        [["a", ["float32"], 4]],  # dtype not a string
        [["a", {"dtype": "float32"}, 4]],
        [["a", None, 4]],
        [["a", "float32", 4], ["a", "float32", 4]],  # duplicated name
        [("a", "float32", 4)],  # entries must be lists (msgpack arrays), as the unpacker yields them
        [["a", "float32", -4]],
        [],
    ],
    ids=lambda s: repr(s)[:40],
)
def test_malformed_specs_are_protocol_violations(spec):
    """Whatever a peer puts in the header, validation raises ProtocolViolation and nothing else."""
    payload = torch.ones(4).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ProtocolViolation):
        StateSnapshot({"tensors": spec, "metadata": {}}, payload).tensors({"a": (torch.float32, 4)})


def test_a_name_that_is_not_a_string_is_a_protocol_violation():
    """Names are compared as str(): an int 1 matches the expected "1" there, and must still be refused cleanly."""
    payload = torch.ones(4).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ProtocolViolation):
        StateSnapshot({"tensors": [[1, "float32", 4]], "metadata": {}}, payload).tensors({"1": (torch.float32, 4)})


def test_zero_element_tensor_round_trip():
    """from_tensors accepts an empty tensor, so tensors() must give it back (or at least raise ProtocolViolation)."""
    snap = StateSnapshot.from_tensors({"empty": torch.empty(0), "x": torch.ones(2)}, {})
    out = snap.tensors({"empty": (torch.float32, 0), "x": (torch.float32, 2)})
    assert out["empty"].numel() == 0 and out["empty"].dtype == torch.float32
    assert torch.equal(out["x"], torch.ones(2))


@pytest.mark.parametrize("header", [{"tensors": []}, {"tensors": [], "metadata": [1]}, {"tensors": [], "metadata": None}])
def test_missing_or_malformed_metadata(header):
    with pytest.raises(ProtocolViolation, match="metadata"):
        StateSnapshot(header, b"").metadata


# ------------------------------------------------------------------------------------------------ serve and download


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def serving_pair(get_snapshot):
    hub = Hub()
    server_transport, client_transport = hub.transport("server"), hub.transport("client")
    server = StateServer(server_transport, PREFIX, get_snapshot)
    await server.start()
    return hub, server, client_transport


def test_download_succeeds():
    snap = snapshot()

    async def main():
        hub, server, client = await serving_pair(lambda: snap)
        got = await download_state(client, PREFIX, "server", max_bytes=len(snap.payload), timeout_s=5)
        again = await download_state(client, PREFIX, "server", max_bytes=1 << 20, timeout_s=5)
        await server.stop()
        return server, got, again

    server, got, again = run(main())
    assert server.served == 2
    assert got.header == snap.header and got.payload == snap.payload and again.payload == snap.payload
    assert "status" not in got.header
    assert got.metadata == {"outer_round": 4, "digest": "abc"}
    out = got.tensors(expected_of(tensors()))
    for name, t in tensors().items():
        assert torch.equal(out[name], t.reshape(-1))


def test_server_serves_the_latest_snapshot():
    current = {"snap": StateSnapshot.from_tensors({"a": torch.zeros(2)}, {"outer_round": 1})}

    async def main():
        hub, server, client = await serving_pair(lambda: current["snap"])
        first = await download_state(client, PREFIX, "server", 1 << 10, 5)
        current["snap"] = StateSnapshot.from_tensors({"a": torch.ones(2)}, {"outer_round": 2})
        second = await download_state(client, PREFIX, "server", 1 << 10, 5)
        return first, second

    first, second = run(main())
    assert first.metadata["outer_round"] == 1 and second.metadata["outer_round"] == 2
    assert torch.equal(second.tensors({"a": (torch.float32, 2)})["a"], torch.ones(2))


def test_server_without_snapshot():
    async def main():
        hub, server, client = await serving_pair(lambda: None)
        with pytest.raises(StateTransferFailed, match="no state"):
            await download_state(client, PREFIX, "server", 1 << 20, 5)
        return server

    assert run(main()).served == 0


def test_payload_larger_than_max_bytes():
    snap = snapshot()

    async def main():
        hub, server, client = await serving_pair(lambda: snap)
        with pytest.raises(StateTransferFailed) as info:
            await download_state(client, PREFIX, "server", max_bytes=len(snap.payload) - 1, timeout_s=5)
        assert isinstance(info.value.__cause__, ProtocolViolation)

    run(main())


def test_unknown_peer():
    async def main():
        hub, server, client = await serving_pair(lambda: snapshot())
        with pytest.raises(StateTransferFailed, match="nobody"):
            await download_state(client, PREFIX, "nobody", 1 << 20, 5)
        # a live peer that does not serve this run's prefix is as good as unknown
        with pytest.raises(StateTransferFailed):
            await download_state(client, "other-run", "server", 1 << 20, 5)

    run(main())


def test_stopped_or_disconnected_server():
    async def main():
        hub, server, client = await serving_pair(lambda: snapshot())
        await server.stop()
        with pytest.raises(StateTransferFailed):
            await download_state(client, PREFIX, "server", 1 << 20, 5)
        await server.start()
        hub.disconnect("server")
        with pytest.raises(StateTransferFailed):
            await download_state(client, PREFIX, "server", 1 << 20, 5)

    run(main())


def test_silent_server_times_out():
    async def silent(peer, reader, writer):
        await asyncio.sleep(30)

    async def main():
        hub = Hub()
        await hub.transport("server").streams.add_handler(f"{PREFIX}.state", silent)
        client = hub.transport("client")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StateTransferFailed, match="within"):
            await download_state(client, PREFIX, "server", 1 << 20, timeout_s=0.2)
        return loop.time() - started

    assert run(main()) < 2.0


@pytest.mark.parametrize(
    "header, payload",
    [({"status": "busy"}, b""), ({"no": "status"}, b""), ({"status": "ok", "tensors": []}, b"\x00" * 8)],
)
def test_misbehaving_server(header, payload):
    async def handler(peer, reader, writer):
        await write_frame(writer, header, payload)

    async def main():
        hub = Hub()
        await hub.transport("server").streams.add_handler(f"{PREFIX}.state", handler)
        client = hub.transport("client")
        if header.get("status") != "ok":
            with pytest.raises(StateTransferFailed):
                await download_state(client, PREFIX, "server", 1 << 20, 5)
        else:
            # an "ok" answer comes back as is; validation is the caller's (and it fails here)
            snap = await download_state(client, PREFIX, "server", 1 << 20, 5)
            with pytest.raises(ProtocolViolation):
                snap.tensors({"a": (torch.float32, 2)})

    run(main())


def test_server_that_hangs_up_mid_frame():
    async def handler(peer, reader, writer):
        writer.write(b"\x00\x00\x00\x05\x00\x00")  # half a prefix, then the stream ends

    async def main():
        hub = Hub()
        await hub.transport("server").streams.add_handler(f"{PREFIX}.state", handler)
        with pytest.raises(StateTransferFailed):
            await download_state(hub.transport("client"), PREFIX, "server", 1 << 20, 5)

    run(main())


def test_a_state_larger_than_one_frame_arrives_chunked_and_bit_identical():
    theta = torch.randn(30_000, generator=torch.Generator().manual_seed(3))
    momentum = torch.randn(30_000, generator=torch.Generator().manual_seed(4))
    snap = StateSnapshot.from_tensors({"theta": theta, "momentum": momentum}, {"outer_round": 2})
    chunk = 1000  # 240 frames

    async def main():
        hub = Hub()
        frames = []
        server = hub.transport("server")
        await StateServer(server, PREFIX, lambda: snap, chunk_bytes=chunk).start()
        client = hub.transport("client")
        original = client.streams.open

        async def counting_open(peer, name):
            reader, writer = await original(peer, name)
            read = reader.readexactly

            async def readexactly(n):
                data = await read(n)
                if n == 8:
                    frames.append(data)
                return data

            reader.readexactly = readexactly
            return reader, writer

        client.streams.open = counting_open
        got = await download_state(client, PREFIX, "server", max_bytes=len(snap.payload), timeout_s=10)
        with pytest.raises(StateTransferFailed, match="exceeds the limit"):
            await download_state(client, PREFIX, "server", max_bytes=len(snap.payload) - 1, timeout_s=10)
        return got, frames

    got, frames = run(main())
    assert bytes(got.payload) == snap.payload and got.metadata == {"outer_round": 2}
    tensors = got.tensors({"theta": (torch.float32, 30_000), "momentum": (torch.float32, 30_000)})
    assert torch.equal(tensors["theta"].view(torch.int32), theta.view(torch.int32))
    assert torch.equal(tensors["momentum"].view(torch.int32), momentum.view(torch.int32))
    assert len(frames) >= len(snap.payload) // chunk  # the first download came in many frames
