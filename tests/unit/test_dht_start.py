"""Starting the DHT process: the error of a node that could not start reaches the caller."""

import asyncio

import pytest

from peerd.transport import hivemind_dht

pytestmark = pytest.mark.timeout(60)


class _ErrorAfterExit(hivemind_dht._TiedDHT):
    """A DHT process that fails to start as hivemind's does (it sends the node's error, then ends with code 0), and
    whose error reaches the starting process only after the process has ended: the order a loaded machine can give."""

    def run(self) -> None:
        self._ready.set_exception(ConnectionRefusedError("none of the initial_peers responded to a ping"))

    def start(self) -> None:
        super().start()
        loop = asyncio.get_running_loop()
        sent, late = self._ready, loop.create_future()
        self.delivered_after_exit = None

        async def deliver() -> None:
            await loop.run_in_executor(None, self.join)
            self.delivered_after_exit = self.exitcode
            try:
                await sent
            except Exception as e:  # noqa: BLE001 - whatever the node raised
                late.set_exception(e)

        self._deliver = loop.create_task(deliver())
        self._ready = late


def test_the_error_of_a_node_that_failed_to_start_is_raised_even_when_it_arrives_after_its_process_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class Recorded(_ErrorAfterExit):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(hivemind_dht, "_TiedDHT", Recorded)

    async def main() -> None:
        with pytest.raises(ConnectionRefusedError, match="initial_peers responded"):
            await hivemind_dht.start_dht_process(initial_peers=[])

    asyncio.run(main())
    assert made and made[0].delivered_after_exit == 0  # the error did arrive after the process had ended (code 0)
