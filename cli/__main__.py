"""`python -m duet.cli ...` is `duet ...`."""

from __future__ import annotations

import sys

from duet.cli.main import main

sys.exit(main())
