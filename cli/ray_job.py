"""`ray job submit ... -- python -m duet.cli.ray_job [duet serve flags]`: the entry point of a Ray
job that serves duet in disaggregated mode on the cluster the job runs in.

It takes `duet serve`'s flags; `--disaggregated` is implied and `--ray-address` defaults to
`auto` (the job's own cluster). The job runs until `ray job stop`, which ends it like Ctrl-C:
routers drain, then every actor is removed.

Every Ray node (and so every actor and this driver) must hold the cluster secret in its
environment, `DUET_CLUSTER_SECRET_FILE` or `DUET_CLUSTER_SECRET`, set before `ray start` (the
Helm chart mounts it from a Secret); without one the job exits naming them (docs/security.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from duet.cli.main import main as duet_main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--ray-address" or a.startswith("--ray-address=") for a in args):
        args = ["--ray-address", "auto", *args]
    return duet_main(["serve", "--disaggregated", *args])


if __name__ == "__main__":
    sys.exit(main())
