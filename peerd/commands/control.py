"""The commands that talk to the local daemon through its control socket: ``pause``, ``resume``, ``snooze``,
``health``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

from peerd.commands.common import UsageError, node_config


def _control(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    from peerd.service.control import request

    node = node_config(args)
    path = node.control_socket_path
    if not node.control_socket and not path.exists():  # no worker here: a bootstrap node may be
        bootstrap = node.control_socket_path_for("bootstrap")
        path = bootstrap if bootstrap.exists() else path
    return request(path, payload)


def cmd_pause_resume(args: argparse.Namespace) -> int:
    reply = _control_reply(args, {"cmd": args.command}, f"peerd {args.command}")
    if reply is None:
        return 1
    if not args.json:
        reasons = "; ".join(reply.get("pause_reasons", {}).values())
        if args.command == "pause":
            print("paused: the peer leaves its round (a running all-reduce finishes first) and trains no more"
                  if reply.get("changed") else f"already paused ({reasons})")
        elif reply.get("paused"):
            print(f"still paused: {reasons}")
        else:
            print("resumed: the peer catches up with the run and trains again" if reply.get("changed")
                  else "not paused: nothing to resume")
    return 0


def cmd_snooze(args: argparse.Namespace) -> int:
    from peerd.service.rules import snooze_deadline

    try:
        snooze_deadline(args.duration, time.time())  # a typo is a usage error, before asking the daemon
    except ValueError as e:
        raise UsageError(f"peerd snooze: {e}") from None
    reply = _control_reply(args, {"cmd": "snooze", "for": args.duration}, f"peerd snooze")
    if reply is None:
        return 1
    if not args.json:
        until = reply.get("snoozed_until")
        print(f"snoozed until {time.strftime('%a %H:%M', time.localtime(until))}: the peer trains again then"
              if until else "snooze lifted" + (f"; still paused: {'; '.join(reply['pause_reasons'].values())}"
                                               if reply.get("paused") else ""))
    return 0


def _control_reply(args: argparse.Namespace, request: dict, failure: str) -> Optional[dict]:
    """The daemon's reply to ``request`` over its control socket, printed as JSON with ``--json``; None when the
    daemon refused it (then ``failure: <its error>`` is on stderr and the command exits 1)."""
    reply = _control(args, request)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    if not reply.get("ok"):
        print(f"{failure}: {reply.get('error')}", file=sys.stderr)
        return None
    return reply


def cmd_health(args: argparse.Namespace) -> int:
    if args.max_age_s is not None and not args.max_age_s > 0:
        raise UsageError("peerd health: --max-age-s must be > 0")
    reply = _control_reply(args, {"cmd": "health", "max_age_s": args.max_age_s}, f"unhealthy")
    if reply is None:
        return 1
    healthy = bool(reply.get("healthy"))
    if not args.json:
        print(f"{'healthy' if healthy else 'unhealthy'}: {reply.get('message')}",
              file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
