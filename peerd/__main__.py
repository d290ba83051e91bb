"""``python -m peerd ...``: the same command line as the ``peerd`` entry point (for a virtualenv whose scripts
are not on PATH)."""
import sys

from peerd.cli import main

sys.exit(main())
