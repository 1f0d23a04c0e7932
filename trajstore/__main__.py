"""``python -m trajstore`` runs the command line (see :mod:`trajstore.cli`)."""

import sys

from .cli import main

sys.exit(main())
