"""`python -m benchmarks.structured`: tokens/s with and without a JSON-schema constraint."""

from __future__ import annotations

import sys

from benchmarks.structured.throughput import main

sys.exit(main())
