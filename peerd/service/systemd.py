"""systemd integration: the notify protocol (``Type=notify`` with a watchdog) and the unit file peerd installs.

The notify protocol is a datagram per message on the Unix socket named by ``$NOTIFY_SOCKET`` (a path, or an
abstract-namespace name when it starts with ``@``), each message newline-separated ``KEY=value`` lines: ``READY=1``
once the daemon serves, ``STATUS=...`` for `systemctl status`, ``WATCHDOG=1`` at least every ``$WATCHDOG_USEC``
microseconds (we send at half of it), ``STOPPING=1`` when shutting down. Without ``$NOTIFY_SOCKET`` every call is a
no-op, so the daemon behaves the same outside systemd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from typing import Mapping, Optional, Sequence

logger = logging.getLogger(__name__)


class Notifier:
    """Sends notify messages to ``address`` (``$NOTIFY_SOCKET``); does nothing when it is None."""

    def __init__(self, address: Optional[str]):
        self.address = address or None
        self._sock: Optional[socket.socket] = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Notifier":
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one message. True if sent; a failure is logged once and never raised."""
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), target)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("cannot notify systemd through %s: %s", self.address, e)
            return False

    def status(self, text: str) -> bool:
        return self.notify("STATUS=" + text.replace("\n", " ")[:200])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s(environ: Mapping[str, str] = os.environ, pid: Optional[int] = None) -> Optional[float]:
    """The watchdog timeout systemd expects (``$WATCHDOG_USEC``) in seconds, or None if no watchdog is asked of this
    process (unset, invalid, or ``$WATCHDOG_PID`` names another process)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return usec / 1e6


async def watchdog_loop(notifier: Notifier, timeout_s: float) -> None:
    """Send ``WATCHDOG=1`` every ``timeout_s / 2`` seconds, forever. It runs on the daemon's event loop, so a loop
    that hangs stops the pings and systemd restarts the service."""
    while True:
        notifier.notify("WATCHDOG=1")
        await asyncio.sleep(timeout_s / 2)


# ------------------------------------------------------------------------------------------------------------- unit

UNIT_TEMPLATE = """\
# peerd as a volunteer's service. Written by `peerd install-service`; docs/volunteer.md, "systemd".
[Unit]
Description=peerd volunteer compute (decentralized training peer)
Wants=network-online.target
After=network-online.target
# never give up restarting: RestartSteps below spaces the tries out instead
StartLimitIntervalSec=0

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
User={user}
Group={user}
# identity key, checkpoints and the control socket (peerd.sock, mode 0600) live in /var/lib/peerd
StateDirectory=peerd
StateDirectoryMode=0700
UMask=0077
Environment=HOME=/var/lib/peerd
Environment=PEERD_IDENTITY=/var/lib/peerd/identity.key
Environment=PEERD_CHECKPOINT_DIR=/var/lib/peerd/checkpoints
Environment=PYTHONUNBUFFERED=1
Restart=on-failure
# back-off: 15 s after the first failure, growing to 30 min over 8 restarts (systemd >= 254; older ones ignore the
# two keys with a warning and retry every 15 s); a run that trains again resets it
RestartSec=15
RestartSteps=8
RestartMaxDelaySec=30min
# exit 2 is a usage or configuration error: restarting cannot fix it (journalctl -u peerd says which)
RestartPreventExitStatus=2
# the daemon sends WATCHDOG=1 every WatchdogSec/2; a hung event loop is restarted
WatchdogSec={watchdog_s}
TimeoutStartSec=300
# SIGTERM: the peer abandons matchmaking (a running all-reduce gets at most 15 s), checkpoints and leaves
TimeoutStopSec=60
KillMode=mixed
Nice=10

# hardening
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome={protect_home}
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
CapabilityBoundingSet=
# GPUs: the peerd user needs the device nodes (e.g. `usermod -aG video,render peerd`); PrivateDevices stays off
# limits the kernel enforces on top of peerd's own (threads, bandwidth, active hours in the node config)
#CPUQuota=200%
#MemoryMax=16G

[Install]
WantedBy=multi-user.target
"""

_PLAIN = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def systemd_quote(arg: str) -> str:
    """Quote one ExecStart argument: ``%`` and ``$`` are escaped (no specifier or variable expansion)."""
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(exec_args: Sequence[str], user: str = "peerd", watchdog_s: int = 120,
                protect_home: str = "yes") -> str:
    """The unit file text for ``ExecStart=exec_args`` (the first an absolute path to ``peerd``).

    ``protect_home`` is ``yes`` (home folders invisible) or ``read-only`` (needed when peerd or its config files
    live under /home or /root). Raises ValueError on a relative executable, a bad user name or watchdog.
    """
    if not exec_args or not os.path.isabs(exec_args[0]):
        raise ValueError(f"ExecStart needs an absolute path to peerd, got {exec_args[:1]}")
    if not re.match(r"^[a-z_][a-z0-9_-]{0,31}$", user):
        raise ValueError(f"invalid user name {user!r}")
    if watchdog_s < 2:
        raise ValueError(f"WatchdogSec must be at least 2 s, got {watchdog_s}")
    if protect_home not in ("yes", "read-only"):
        raise ValueError(f"protect_home must be yes or read-only, got {protect_home!r}")
    return UNIT_TEMPLATE.format(exec_start=" ".join(systemd_quote(a) for a in exec_args), user=user,
                                watchdog_s=watchdog_s, protect_home=protect_home)


def needs_home(paths: Sequence[str]) -> bool:
    """True if any of ``paths`` lies under /home, /root or /run/user (hidden by ``ProtectHome=yes``)."""
    roots = ("/home/", "/root/", "/run/user/")
    return any(os.path.abspath(p).startswith(roots) or os.path.abspath(p) in ("/home", "/root") for p in paths)
