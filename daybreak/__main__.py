"""``python -m daybreak`` runs the console script."""

import sys

from daybreak.cli import main

sys.exit(main())
