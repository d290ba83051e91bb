"""Starting this peer's transport when its initial peers do not answer at once (peerd.transport.factory)."""

import asyncio
import logging
from types import SimpleNamespace

import pytest

from peerd.config import NodeConfig
from peerd.transport import factory
from peerd.transport.hivemind_backend import BootstrapUnreachable, dht_start_error

pytestmark = pytest.mark.timeout(30)

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtPz6XL3brK5mWeGxqXyUL4BxTNkRTntktMeg3eCo6LZ"


class _Flaky:
    """A transport class whose first ``failures`` starts raise ``error``; ``calls`` counts the starts."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    async def create(self, **options):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return SimpleNamespace(on_shutdown=[], discovery=SimpleNamespace(), options=options)


def _open(monkeypatch, tmp_path, flaky, **kwargs):
    monkeypatch.setattr(factory, "transport_class", lambda node, quiet=False: flaky)
    node = NodeConfig(initial_peers=(PEER,), checkpoint_dir=str(tmp_path))
    return asyncio.run(factory.open_transport(node, **kwargs))


def test_hivemind_s_unanswered_ping_is_a_bootstrap_failure():
    error = dht_start_error(RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping. "
                                         "(set ensure_bootstrap_success=False to ignore)"), [PEER])
    assert isinstance(error, BootstrapUnreachable) and "none of the 1 initial peer(s) answered" in str(error)
    assert not isinstance(dht_start_error(OSError("address already in use"), [PEER]), BootstrapUnreachable)


def test_a_peer_whose_initial_peers_answer_late_tries_again_and_starts(monkeypatch, tmp_path, caplog):
    """One of 64 workers started together on a loaded machine: its bootstrap node answered the first ping too late
    and the worker exited. It now waits and tries again, warning each time."""
    flaky = _Flaky(2, dht_start_error(TimeoutError("no answer"), [PEER]))
    with caplog.at_level(logging.WARNING, logger="peerd.transport.factory"):
        transport = _open(monkeypatch, tmp_path, flaky, bootstrap_retry_s=(0.01, 0.01))
    assert flaky.calls == 3 and transport.options["initial_peers"] == (PEER,)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "attempt 2 of 3" in warnings[0] and "attempt 3 of 3" in warnings[1]


def test_bootstrap_failures_past_the_last_try_and_other_start_errors_are_raised(monkeypatch, tmp_path):
    flaky = _Flaky(5, dht_start_error(TimeoutError("no answer"), [PEER]))
    with pytest.raises(BootstrapUnreachable):
        _open(monkeypatch, tmp_path, flaky, bootstrap_retry_s=(0.01,))
    assert flaky.calls == 2
    other = _Flaky(5, dht_start_error(OSError("address already in use"), [PEER]))  # not worth another try
    with pytest.raises(ConnectionError, match="address already in use"):
        _open(monkeypatch, tmp_path, other, bootstrap_retry_s=(0.01,))
    assert other.calls == 1
