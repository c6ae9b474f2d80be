"""The planner's control loop: scrape every router, turn two scrape rounds into load
signals, ask the policy, patch the pools that change (or only log them in dry-run), and
report the decision to the routers it scraped (their dashboards show the last ones)."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from duet.deploy.planner.kube import DeploymentScaler
from duet.deploy.planner.metrics import MetricsError, RouterScrape, interval_signals, parse_scrape
from duet.deploy.planner.policy import POOLS, Decision, PoolSizes, ScalingPolicy
from duet.deploy.stop_signal import Stopper

log = logging.getLogger("duet.planner")

NUM_DECISIONS = 50
"""Decisions the controller keeps (`Controller.decisions`)."""


class RouterScraper:
    """GETs /metrics from each router URL (with the API key, since duet guards /metrics
    like every route but /health and /ready). A router that fails is left out this round."""

    def __init__(
        self, urls: Callable[[], list[str]], api_key: str | None = None, timeout_s: float = 5.0
    ) -> None:
        self._urls = urls
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._scraped: list[str] = []  # the URLs the last round read

    def scrape(self) -> dict[str, RouterScrape]:
        out: dict[str, RouterScrape] = {}
        for url in self._urls():
            request = urllib.request.Request(url)
            if self._api_key:
                request.add_header("Authorization", f"Bearer {self._api_key}")
            try:
                with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                    out[url] = parse_scrape(response.read().decode("utf-8"))
            except (OSError, urllib.error.URLError, MetricsError) as e:
                log.warning("scrape %s failed: %s", url, e)
        self._scraped = list(out)
        return out

    def report(self, record: DecisionRecord) -> None:
        """POST `record` to `/v1/planner/decisions` of each router the last round read (a
        router that fails only misses it: the dashboard is not the planner's concern)."""
        body = json.dumps(asdict(record)).encode()
        for url in self._scraped:
            target = url.removesuffix("/metrics") + "/v1/planner/decisions"
            request = urllib.request.Request(target, data=body, method="POST")
            request.add_header("Content-Type", "application/json")
            if self._api_key:
                request.add_header("Authorization", f"Bearer {self._api_key}")
            try:
                urllib.request.urlopen(request, timeout=self._timeout_s).close()
            except (OSError, urllib.error.URLError) as e:
                log.debug("reporting the decision to %s failed: %s", target, e)


@dataclass(frozen=True)
class DecisionRecord:
    """One control step, as the routers' dashboards show it (router/planner_log.py)."""

    time: float  # wall clock
    current: dict[str, int]
    sizes: dict[str, int]
    reasons: dict[str, str]
    dry_run: bool

    @classmethod
    def of(cls, decision: Decision, current: PoolSizes, dry_run: bool) -> DecisionRecord:
        return cls(
            time.time(),
            {pool: current.get(pool) for pool in POOLS},
            {pool: decision.sizes.get(pool) for pool in POOLS},
            dict(decision.reasons),
            dry_run,
        )


@dataclass(frozen=True)
class PoolTargets:
    """The Deployment names of the two pools."""

    prefill: str
    decode: str

    def get(self, pool: str) -> str:
        return str(getattr(self, pool))


class Controller:
    """One planner. `step` is one control interval; `run` loops until stopped."""

    def __init__(
        self,
        policy: ScalingPolicy,
        scaler: DeploymentScaler,
        scraper: RouterScraper,
        targets: PoolTargets,
        *,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._scaler = scaler
        self._scraper = scraper
        self._targets = targets
        self._dry_run = dry_run
        self.clock = clock
        self._previous: Mapping[str, RouterScrape] = {}
        self.last_step_s: float | None = None
        self.decisions: deque[DecisionRecord] = deque(maxlen=NUM_DECISIONS)
        """The last control steps' decisions, newest last."""

    def step(self) -> Decision:
        scrapes = self._scraper.scrape()
        signals = None
        try:
            signals = interval_signals(self._previous, scrapes)
        except MetricsError as e:
            log.warning("no load signals this interval: %s", e)
        # A router that failed this round starts over (its next scrape has no baseline).
        self._previous = scrapes
        current = PoolSizes(
            prefill=self._scaler.get_replicas(self._targets.prefill),
            decode=self._scaler.get_replicas(self._targets.decode),
        )
        decision = self.policy.decide(signals, current, self.clock())
        for pool in POOLS:
            old, new = current.get(pool), decision.sizes.get(pool)
            if old == new:
                log.debug("%s: stays at %d (%s)", pool, old, decision.reasons[pool])
                continue
            verb = "would scale" if self._dry_run else "scaling"
            log.info("%s: %s %d -> %d (%s)", pool, verb, old, new, decision.reasons[pool])
            if not self._dry_run:
                self._scaler.set_replicas(self._targets.get(pool), new)
        record = DecisionRecord.of(decision, current, self._dry_run)
        self.decisions.append(record)
        self._scraper.report(record)
        self.last_step_s = self.clock()
        return decision

    def run(self, interval_s: float, stop: Stopper) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                self.step()
            except Exception:  # the loop outlives API hiccups; /healthz reports a stuck loop
                log.exception("control step failed")
            stop.wait(max(0.0, interval_s - (self.clock() - started)))


def serve_health(
    controller: Controller, port: int, max_age_s: float, host: str = "0.0.0.0"
) -> ThreadingHTTPServer:
    """GET /healthz: 200 while a control step finished within `max_age_s`, else 503."""
    started_s = controller.clock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/healthz":
                self.send_error(404)
                return
            last = controller.last_step_s
            age = controller.clock() - (last if last is not None else started_s)
            ok = age <= max_age_s
            body = f"{'ok' if ok else 'stale'}: last step {age:.0f}s ago\n".encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every 30 s would drown the decisions

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="planner-health", daemon=True).start()
    return server
