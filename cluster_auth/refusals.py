"""`RefusalLog`: refused peers, counted, and each address logged once (never a credential)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("cluster_auth")

MAX_LOGGED_PEERS = 1024
"""Distinct refused addresses logged; later ones are only counted (a scan does not flood the log)."""


class RefusalLog:
    """`num_refused` counts every refusal (the metric a worker reports); the first refusal of
    each address is logged at WARNING with the reason."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.num_refused = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def refused(self, address: str, reason: str) -> None:
        with self._lock:
            self.num_refused += 1
            first = address not in self._logged and len(self._logged) < MAX_LOGGED_PEERS
            if first:
                self._logged.add(address)
        if first:
            logger.warning(
                "%s: refused a peer at %s: %s (further refusals from it are counted, not logged)",
                self.what, address, reason,
            )  # fmt: skip
