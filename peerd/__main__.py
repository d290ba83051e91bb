"""``python -m peerd ...``: the same command line as the ``peerd`` entry point (for a virtualenv whose scripts
are not on PATH)."""
import sys

from peerd.commands.main import main

sys.exit(main())
