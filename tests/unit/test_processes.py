"""peerd.runtime.processes in one process: a stop abandons a start-up, a signal interrupts a waiting command after its
clean-up ran. (The real-process behaviour, signals to a process group: tests/integration/test_group_signals.py.)"""

import asyncio
import signal

import pytest

from peerd.runtime.processes import Interrupted, interruptible, unless_stopped

pytestmark = pytest.mark.timeout(30)


def test_a_stop_cancels_the_start_up_after_its_clean_up_and_yields_none():
    cleaned = []

    async def start_up() -> str:
        try:
            await asyncio.Event().wait()  # a bootstrap node that never answers
        finally:
            cleaned.append("start-up")
        return "transport"

    async def go():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_soon(stop.set)
        return await unless_stopped(stop, start_up())

    assert asyncio.run(go()) is None
    assert cleaned == ["start-up"]


def test_without_a_stop_the_start_up_result_is_returned():
    async def go():
        return await unless_stopped(asyncio.Event(), asyncio.sleep(0, result="transport"))

    assert asyncio.run(go()) == "transport"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_interrupts_a_waiting_command_after_its_clean_up(sig):
    cleaned, waiting = [], []

    async def wait_on_the_network() -> None:
        try:
            waiting.append(True)
            await asyncio.Event().wait()
        finally:
            cleaned.append("shutdown")

    async def go():
        loop = asyncio.get_running_loop()
        loop.call_later(0, signal.raise_signal, sig)  # the handler is installed before the loop runs this
        await interruptible(wait_on_the_network())

    with pytest.raises(Interrupted) as caught:
        asyncio.run(go())
    assert caught.value.signum == sig and 128 + caught.value.signum == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
    assert waiting and cleaned == ["shutdown"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers removed again
