"""The ``peerd`` command line: parses arguments and runs the command (nothing else imports this package).

Exit codes: 0 clean stop (``join``, ``bootstrap`` and ``dashboard`` stopped by SIGINT/SIGTERM included), 1 runtime
failure, 2 usage or configuration error, 128 + the signal's number (130 SIGINT, 143 SIGTERM) for a command interrupted
before it was done, or stopped by a second signal (:mod:`peerd.runtime.processes`).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from peerd.commands.common import UsageError
from peerd.commands.corpus import cmd_corpus
from peerd.commands.control import cmd_health, cmd_pause_resume, cmd_snooze
from peerd.commands.model import cmd_eval, cmd_export, cmd_generate, cmd_tokenizer
from peerd.commands.node import cmd_config, cmd_doctor, cmd_install_service
from peerd.commands.parser import build_parser
from peerd.commands.serve import cmd_bootstrap, cmd_dashboard, cmd_join
from peerd.commands.status import cmd_status
from peerd.config import ConfigError
from peerd.identity.namespace import RunIdError
from peerd.runtime.processes import Interrupted
from peerd.service.control import ControlUnavailable

logger = logging.getLogger("peerd")


COMMANDS = {"join": cmd_join, "bootstrap": cmd_bootstrap, "status": cmd_status, "config": cmd_config,
            "dashboard": cmd_dashboard, "pause": cmd_pause_resume, "resume": cmd_pause_resume, "health": cmd_health,
            "snooze": cmd_snooze,
            "install-service": cmd_install_service, "export": cmd_export, "generate": cmd_generate,
            "eval": cmd_eval, "tokenizer": cmd_tokenizer, "corpus": cmd_corpus, "doctor": cmd_doctor}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from peerd.runtime.telemetry import setup_logging

    args = None
    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.log_format, args.log_level)
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError, RunIdError) as e:
        # usage errors: one line `peerd COMMAND: what is wrong`; runtime errors go through the log (README)
        print(f"{e}" if isinstance(e, UsageError) else f"peerd {args.command if args else ''}: {e}".replace(" :", ":"),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Interrupted as e:
        print(f"peerd {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except ControlUnavailable as e:  # pause/resume/health without a daemon: one line, and no heavy imports
        print(f"{'unhealthy' if args.command == 'health' else 'peerd ' + args.command}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from peerd.worker.checkpoint_file import CheckpointError
        from peerd.daemon import RunConfigConflict
        from peerd.data.corpus import DataError
        from peerd.hardware.devices import DeviceUnavailable
        from peerd.identity.key import IdentityError
        from peerd.service.volunteer import ServiceError

        if isinstance(e, (RunConfigConflict, CheckpointError, DataError, IdentityError, ConnectionError,
                          ServiceError, DeviceUnavailable)):
            logger.error("%s", e)
            return 1
        logger.exception("peerd failed: %s", e)
        return 1

