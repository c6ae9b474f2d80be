"""`python -m duet.deploy.planner`: the same as `duet-planner`."""

from __future__ import annotations

import sys

from duet.deploy.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
