"""``python -m trajstore`` runs the command line (see :mod:`trajstore.cli`)."""

import sys

from trajstore.cli import main

sys.exit(main())
