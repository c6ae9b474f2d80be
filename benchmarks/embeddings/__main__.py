"""`python -m benchmarks.embeddings`: embeddings per second, duet's engine against HF
transformers."""

from __future__ import annotations

import sys

from benchmarks.embeddings.throughput import main

sys.exit(main())
