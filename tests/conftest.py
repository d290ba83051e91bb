"""Shared fixtures: real peer processes on 127.0.0.1 that are always torn down, and a reaper for strays."""

from __future__ import annotations

import os
import signal

import psutil
import pytest


@pytest.fixture(autouse=True, scope="session")
def reap_stray_children():
    """Kill any process a test left behind (peers, DHT children, p2pd daemons) when the session ends."""
    yield
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
