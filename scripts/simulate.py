"""The step-time simulator's command line; the same as ``python -m distca.sim`` (see
``distca/sim/cli.py`` and ``docs/guides/simulator.md``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from distca.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
