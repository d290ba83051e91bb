"""The commands about this machine: ``doctor``, ``config show`` and ``install-service``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from peerd.commands.common import FLAG_NAMES, UsageError, node_config, node_overrides, require_run_id
from peerd.config import load_node_config, load_node_config_with_sources


def cmd_doctor(args: argparse.Namespace) -> int:
    from peerd.commands.doctor import run_doctor

    require_run_id(args)
    node = node_config(args)
    checks = run_doctor(node, args.run_id)
    for check in checks:
        print(check.line(), flush=True)
    return 0 if all(c.ok for c in checks) else 1


def cmd_config(args: argparse.Namespace) -> int:
    import dataclasses

    node, sources = load_node_config_with_sources(args.config, overrides=node_overrides(args), flag_names=FLAG_NAMES)
    out: dict[str, Any] = {"node": dataclasses.asdict(node), "sources": sources}
    out["node"]["identity"] = str(node.identity_path)  # the default follows checkpoint_dir: show where it lands
    if node.dashboard_token:
        out["node"]["dashboard_token"] = "(set, not shown)"  # a secret: never in logs or pasted configs
    if args.run_config:
        from peerd.run_config import load_run_config

        out["run"] = load_run_config(args.run_config).to_dict()
        out["run_source"] = f"file {args.run_config}"
    print(json.dumps(out, indent=2))
    return 0


def cmd_install_service(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from peerd.service.systemd import needs_home, render_unit

    run_id = require_run_id(args)
    peerd = args.peerd or _own_executable() or shutil.which("peerd")
    if not peerd or not os.path.isabs(peerd):
        raise UsageError("peerd install-service: cannot tell where the peerd executable is: pass --peerd PATH")
    exec_args = [peerd, "join", "--run-id", str(run_id)]
    files = [peerd]
    if args.config:
        load_node_config(args.config, environ={})  # refuse a broken file now, not at the service's first start
        exec_args += ["--config", os.path.abspath(args.config)]
        files.append(os.path.abspath(args.config))
    if args.run_config:
        from peerd.run_config import load_run_config

        load_run_config(args.run_config)
        exec_args += ["--run-config", os.path.abspath(args.run_config)]
        files.append(os.path.abspath(args.run_config))
    if args.initial_peers:
        from peerd.multiaddrs import check_multiaddr

        for maddr in args.initial_peers:  # refuse a typo now, not at the service's first start
            try:
                check_multiaddr(maddr, require_peer_id=True)
            except ValueError as e:
                raise UsageError(f"peerd install-service: --initial-peers: {e}") from None
        exec_args += ["--initial-peers", *args.initial_peers]
    try:
        unit = render_unit(exec_args, user=args.user, watchdog_s=args.watchdog_s,
                           protect_home="read-only" if needs_home(files) else "yes")
    except ValueError as e:
        raise UsageError(f"peerd install-service: {e}") from None
    if args.print_only:
        print(unit, end="")
        return 0
    target = Path(args.unit_dir) / "peerd.service"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(unit)
    except OSError as e:
        print(f"peerd install-service: cannot write {target}: {e.strerror or e} (run as root, or pass --unit-dir "
              "or --print)", file=sys.stderr)
        return 1
    state = "/var/lib/peerd/checkpoints"
    print(f"wrote {target}\n"
          f"as root, once:\n"
          f"  useradd --system --home-dir /var/lib/peerd --shell /usr/sbin/nologin {args.user}\n"
          f"  usermod -aG video,render {args.user}    # GPUs only\n"
          f"  systemctl daemon-reload\n"
          f"  systemctl enable --now peerd.service\n"
          f"then:\n"
          f"  systemctl status peerd.service\n"
          f"  journalctl -u peerd.service -f\n"
          f"  sudo -u {args.user} {peerd} pause --checkpoint-dir {state}     # resume, health likewise")
    return 0


def _own_executable() -> Optional[str]:
    """The ``peerd`` script beside this interpreter (a virtualenv's bin/), if there is one."""
    candidate = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "peerd")
    return candidate if os.access(candidate, os.X_OK) else None
