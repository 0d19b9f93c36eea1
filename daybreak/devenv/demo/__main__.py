"""``python -m daybreak.devenv.demo``: what ``make demo`` runs."""

import sys

from daybreak.devenv.demo import main

sys.exit(main())
