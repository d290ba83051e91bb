"""The kernel settings a direct data-plane socket gets (peerd/transport/connection.py ``tune``)."""

import socket

import pytest

from peerd.transport import connection

pytestmark = pytest.mark.timeout(30)


def _queued_into_a_peer_that_does_not_read(sender: socket.socket) -> int:
    """Bytes the kernel takes from ``sender`` (non-blocking) before a write would block."""
    sender.setblocking(False)
    queued, block = 0, b"x" * 65536
    try:
        while queued < 64 << 20:
            queued += sender.send(block)
    except BlockingIOError:
        pass
    return queued


def test_a_direct_socket_holds_little_unsent_so_an_upload_handed_over_has_nearly_left_the_host():
    """Dialed and accepted sockets (the listener's setting passes to them) take at most ~NOTSENT_LOWAT_BYTES plus
    the peer's receive window into a connection whose peer reads nothing; Linux's autotuned send buffer alone takes
    up to 4 MB, and the butterfly timing its uploads at hand-off then measured a 20 Mbit/s uplink at up to 43 MB/s."""
    assert connection.NOTSENT_LOWAT_BYTES == 128 * 1024
    listener = socket.socket()
    connection.tune(listener, 0)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    dialed = socket.socket()
    connection.tune(dialed, 0)
    dialed.connect(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        for sock in (dialed, accepted):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == connection.NOTSENT_LOWAT_BYTES
        assert _queued_into_a_peer_that_does_not_read(dialed) < 1 << 20
        assert _queued_into_a_peer_that_does_not_read(accepted) < 1 << 20
    finally:
        for sock in (dialed, accepted, listener):
            sock.close()
