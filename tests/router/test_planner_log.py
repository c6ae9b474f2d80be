"""The planner's decisions on a router: the planner's control loop reports each decision to
the routers it scraped (`POST /v1/planner/decisions`, behind the API key), the router keeps
the newest ones (bounded) and `/v1/dashboard` shows them (`planner`: null while none came);
a malformed report is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from duet.deploy.planner.controller import Controller, DecisionRecord, PoolTargets, RouterScraper
from duet.deploy.planner.policy import Decision, PoolSizes
from duet.engine import AsyncEngine
from duet.router.planner_log import PlannerDecision, PlannerLog
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def server(rest_engine: AsyncEngine) -> Iterator[LiveServer]:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY])).start()
    yield live
    live.stop()


class _Scraper(RouterScraper):
    """Reads nothing (the policy then holds the pools) but reports to `url`'s router."""

    def __init__(self, url: str) -> None:
        super().__init__(lambda: [], API_KEY)
        self._url = url

    def scrape(self):  # type: ignore[no-untyped-def]
        self._scraped = [self._url]
        return {}


class _Policy:
    def __init__(self) -> None:
        self.num_calls = 0

    def decide(self, signals, current, now):  # type: ignore[no-untyped-def]
        self.num_calls += 1
        sizes = PoolSizes(prefill=current.prefill + self.num_calls, decode=current.decode)
        return Decision(sizes, {"prefill": f"step {self.num_calls}", "decode": "on target"})


class _Scaler:
    def __init__(self) -> None:
        self.replicas = {"duet-prefill": 1, "duet-decode": 2}

    def get_replicas(self, name: str) -> int:
        return self.replicas[name]

    def set_replicas(self, name: str, n: int) -> None:
        self.replicas[name] = n


def planner(url: str, dry_run: bool = False) -> Controller:
    """A planner whose policy grows the prefill pool by one more each step, reporting to the
    router at `url` (its REST base URL)."""
    return Controller(
        _Policy(), _Scaler(), _Scraper(f"{url}/metrics"),  # type: ignore[arg-type]
        PoolTargets("duet-prefill", "duet-decode"), dry_run=dry_run,
    )  # fmt: skip


def test_the_planners_decisions_reach_the_dashboard(server: LiveServer) -> None:
    dashboard = f"{server.url}/v1/dashboard"
    assert httpx2.get(dashboard, headers=AUTH).json()["planner"] is None
    controller = planner(server.url)
    controller.step()
    controller.step()
    assert len(controller.decisions) == 2

    shown = httpx2.get(dashboard, headers=AUTH).json()["planner"]
    first, second = reversed(shown["decisions"])  # newest first
    assert (first["current"], first["sizes"]) == (
        {"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 2},
    )  # fmt: skip
    assert (second["current"], second["sizes"]) == (
        {"prefill": 2, "decode": 2}, {"prefill": 4, "decode": 2},
    )  # fmt: skip
    assert second["reasons"] == {"prefill": "step 2", "decode": "on target"}
    assert (second["changed"], second["dry_run"]) == (["prefill"], False)
    assert shown["last_report"] >= second["time"]


def test_reports_need_the_key_and_name_a_bad_field(server: LiveServer) -> None:
    url = f"{server.url}/v1/planner/decisions"
    good = {"time": 1.0, "current": {"prefill": 1}, "sizes": {"prefill": 2}}
    assert httpx2.post(url, json=good).status_code == 401
    assert httpx2.post(url, json=good, headers=AUTH).status_code == 204
    bad = httpx2.post(url, json={**good, "sizes": {"embed": 2}}, headers=AUTH)
    assert bad.status_code == 400
    assert "sizes" in bad.text and "unknown pool 'embed'" in bad.text
    negative = httpx2.post(url, json={**good, "current": {"decode": -1}}, headers=AUTH)
    assert negative.status_code == 400 and "decode: replicas must be >= 0" in negative.text


def test_the_logs_are_bounded() -> None:
    log = PlannerLog(num_decisions=3)
    for i in range(5):
        log.add(PlannerDecision(time=float(i), current={}, sizes={}))
    shown = log.snapshot()
    assert shown is not None
    assert [d["time"] for d in shown["decisions"]] == [4.0, 3.0, 2.0]
    record = DecisionRecord.of(Decision(PoolSizes(1, 1), {}), PoolSizes(1, 1), dry_run=True)
    assert PlannerDecision(**record.__dict__).dry_run  # the planner's record is the router's body
