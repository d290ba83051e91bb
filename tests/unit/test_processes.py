"""peerd.runtime.processes in one process: a stop abandons a start-up, a signal interrupts a waiting command after its
clean-up ran. (The real-process behaviour, signals to a process group: tests/integration/test_group_signals.py.)"""

import asyncio
import signal

import pytest

from peerd.runtime import processes
from peerd.runtime.processes import Interrupted, install_stop_handlers, interruptible, unless_stopped

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


def _recording_exits(monkeypatch) -> tuple[list[int], asyncio.Event]:
    """Replace ``exit_now`` (which would end this process) by a recorder: the signals it was called with, and an event
    set at each call."""
    exits, exited = [], asyncio.Event()

    def record(signum: int) -> None:
        exits.append(signum)
        exited.set()

    monkeypatch.setattr(processes, "exit_now", record)
    return exits, exited


def test_the_same_signal_twice_at_once_is_one_stop_and_a_later_one_exits_now(monkeypatch):
    """GNU ``timeout`` sends SIGTERM to its child and then to its whole group: the daemon receives it twice within
    milliseconds, which must not count as the second signal (exit at once, 143). One sent after
    ``REPEAT_WINDOW_S`` does."""

    async def go():
        exits, exited = _recording_exits(monkeypatch)
        stop = asyncio.Event()
        install_stop_handlers(stop)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # timeout's second delivery
        await stop.wait()
        await asyncio.sleep(0)  # both wake-up bytes handled
        assert exits == []
        monkeypatch.setattr(processes, "REPEAT_WINDOW_S", 0.0)
        signal.raise_signal(signal.SIGTERM)  # a second request
        await asyncio.wait_for(exited.wait(), 10)
        return exits

    assert asyncio.run(go()) == [signal.SIGTERM]


def test_another_stop_signal_right_after_the_first_is_a_second_request(monkeypatch):
    async def go():
        exits, exited = _recording_exits(monkeypatch)
        install_stop_handlers(asyncio.Event())
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        await asyncio.wait_for(exited.wait(), 10)
        return exits

    assert asyncio.run(go()) == [signal.SIGINT]


# ------------------------------------------------------------------------------------ ending background tasks


def test_reap_cancels_waits_and_logs_a_failed_task_without_raising(caplog):
    from peerd.runtime.processes import reap

    ended = []

    async def loop_until_cancelled():
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("loop")

    async def failing():
        raise RuntimeError("evaluation broke")

    async def go():
        looping = asyncio.ensure_future(loop_until_cancelled())
        failed = asyncio.ensure_future(failing())
        await asyncio.sleep(0)
        await reap(looping, None, failed)
        return looping, failed

    with caplog.at_level("WARNING", logger="peerd.runtime.processes"):
        looping, failed = asyncio.run(go())
    assert ended == ["loop"] and looping.cancelled()
    assert failed.done() and not failed.cancelled()
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [failed.exception()]


def test_reap_without_cancel_waits_for_the_task_to_finish():
    from peerd.runtime.processes import reap

    async def go():
        release = asyncio.Event()
        task = asyncio.ensure_future(release.wait())
        asyncio.get_running_loop().call_soon(release.set)
        await reap(task, cancel=False)
        return task

    task = asyncio.run(go())
    assert task.done() and not task.cancelled() and task.result() is True


def test_reap_lets_the_callers_own_cancellation_through():
    """A cancellation of the task that reaps is not swallowed (it was, when each site suppressed BaseException)."""
    from peerd.runtime.processes import reap

    async def go():
        stubborn_started, may_end = asyncio.Event(), asyncio.Event()

        async def stubborn():
            stubborn_started.set()
            while not may_end.is_set():
                try:
                    await may_end.wait()
                except asyncio.CancelledError:
                    continue  # ignores cancellation: the reaper would wait on it until it ends by itself

        task = asyncio.ensure_future(stubborn())
        await stubborn_started.wait()
        reaper = asyncio.ensure_future(reap(task))
        await asyncio.sleep(0)
        reaper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reaper
        still_running = not task.done()
        may_end.set()
        await task
        return still_running

    assert asyncio.run(asyncio.wait_for(go(), 10)) is True  # the reaper returned before the task ended


def test_stop_all_stops_every_component_even_after_one_fails():
    from peerd.runtime.processes import stop_all

    stopped = []

    class Component:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        async def stop(self):
            stopped.append(self.name)
            if self.fails:
                raise ConnectionError("p2pd is gone")

    asyncio.run(stop_all([Component("matchmaker", fails=True), Component("allreduce")]))
    assert stopped == ["matchmaker", "allreduce"]
