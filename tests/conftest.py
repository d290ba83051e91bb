"""Shared fixtures: real peer processes on 127.0.0.1 that are always torn down, and a reaper for strays.

Marker ``netns``: the test creates network namespaces (scripts/wan_testbed), which needs root. It is skipped, with
the reason, only when the suite does not run as root; as root (CI, ``scripts/test``) it runs and a testbed failure
is a test failure.
"""

from __future__ import annotations

import gc
import logging
import os
import signal

import psutil
import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` first, the rest in collection order: xdist hands each worker the next tests in that
    order and keeps two queued ahead on each, so a minutes-long scenario collected late ran at the lane's end while
    the other worker had nothing left (the longest first is the classic makespan heuristic)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # --dist loadgroup keeps an xdist_group's tests on one worker (a module's shared daemon, the netns tests' link
    # rates) only through the @group suffix pytest-xdist appends to their node ids on the worker; pytest 9.2 drops
    # it (pytest-dev/pytest-xdist#1386) and the groups were spread over the workers without a word
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") is not None
            and "@" not in item.nodeid):
        pytest.fail("--dist loadgroup cannot keep this test's xdist_group on one worker with this pytest (no @group "
                    "suffix in its node id, pytest-dev/pytest-xdist#1386): install pytest<9.2 (scripts/setup)",
                    pytrace=False)
    if item.get_closest_marker("netns") is not None and os.geteuid() != 0:
        pytest.skip("netns: needs root to create network namespaces (run scripts/test as root, as CI does)")


@pytest.fixture(autouse=True)
def restore_root_logging():
    """Tests that run ``peerd.commands.main.main`` in-process install log handlers on the stream pytest captured for them;
    put the root logger back so later tests never write to (or flush) a closed stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def unfreeze_heap():
    """A role run in-process freezes the test process's heap (peerd.runtime.heap.freeze_heap); give it back to the
    collector afterwards, or a test's reference cycles that outlive it would never be collected."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(autouse=True, scope="session")
def reap_stray_children():
    """Kill any process a test left behind (peers, DHT children, p2pd daemons) when the session ends."""
    yield
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
