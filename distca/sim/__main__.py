"""``python -m distca.sim``: the simulator's command line (:mod:`distca.sim.cli`)."""

import sys

from distca.sim.cli import main

sys.exit(main())
