"""The cluster dashboard at `/dashboard` in a real browser against a disaggregated server
(real prefill and decode workers, no Ray): workers listed with their state, KV transfers with
their bandwidth, every live plot drawn, the planner's decisions once a planner reports ("no
planner" before); its data stays behind the API key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.browser import chromium
from tests.router.cluster_server import ClusterServer
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.router.test_planner_log import planner
from tests.waiting import wait_for

NUM_REQUESTS = 3


@pytest.fixture(scope="module")
def cluster_server(tiny_llama: str) -> Iterator[ClusterServer]:
    server = ClusterServer(tiny_llama, num_decode=2, threshold=0).start()
    yield server
    server.stop()


def _chat(server: ClusterServer) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        for i in range(NUM_REQUESTS):
            stream = client.chat.completions.create(
                model=MODEL_NAME, stream=True, max_tokens=8,
                messages=[{"role": "user", "content": f"request {i}: " + "tell me a story " * 8}],
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1


def test_dashboard_lists_workers_transfers_and_draws_plots(cluster_server: ClusterServer) -> None:
    _chat(cluster_server)
    assert httpx2.get(f"{cluster_server.url}/v1/dashboard").status_code == 401
    assert httpx2.get(f"{cluster_server.url}/dashboard").status_code == 200  # the page is open

    with chromium() as browser:
        browser.get(f"{cluster_server.url}/dashboard")
        wait_for(lambda: browser.find_element(By.ID, "key-dialog").get_attribute("open")
                 is not None, 10, "the API-key prompt")  # fmt: skip
        browser.find_element(By.ID, "api-key").send_keys(API_KEY)
        browser.find_element(By.ID, "key-save").click()
        wait_for(lambda: _names(browser, "decode") == ["d0", "d1"], 15, "the decode workers")
        _check_the_chat_streams(browser, cluster_server.url)
        browser.get(f"{cluster_server.url}/dashboard")  # the key stays in the tab
        wait_for(lambda: _names(browser, "decode") == ["d0", "d1"], 15, "the decode workers")
        assert _names(browser, "prefill") == ["p0"]
        for table in ("prefill", "decode"):
            states = [cells[1] for cells in _cells(browser, table)]
            assert states == ["healthy"] * len(states)
        # every stream ended: the router has none open on either decode worker
        assert [cells[5] for cells in _cells(browser, "decode")] == ["0", "0"]
        transfers = _cells(browser, "transfers")
        assert len(transfers) == NUM_REQUESTS + 1  # and the chat's
        for cells in transfers:
            assert cells[1] in ("p0 → d0", "p0 → d1")
            assert cells[2] == "done"
            assert cells[3].endswith("KiB")
            assert float(cells[5]) > 0  # GB/s
            # the link's probed rate: none on the first transfer to each decode worker
            assert cells[6] == "\u2013" or float(cells[6]) > 0
        first_to_each = {cells[1]: cells for cells in transfers}
        assert [cells[6] for cells in first_to_each.values()] == ["\u2013"] * len(first_to_each)
        assert _card(browser, "transfers_in_flight") == "0"
        for plot in ("ttft", "itl", "throughput", "bandwidth"):
            canvas = browser.find_element(By.ID, f"plot-{plot}")
            wait_for(lambda c=canvas: int(c.get_attribute("data-points") or 0) > 0, 10,
                     f"the {plot} plot to be drawn")  # fmt: skip
        # Pixels were painted, not just counted.
        painted = browser.execute_script(
            "const c = document.getElementById('plot-ttft');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;"
        )
        assert painted > 500
        assert not browser.find_element(By.ID, "error").is_displayed()

        # No planner has reported: the panel says so. Then one does, twice.
        assert browser.find_element(By.ID, "no-planner").is_displayed()
        assert not browser.find_element(By.ID, "planner").is_displayed()
        controller = planner(cluster_server.url)
        controller.step()
        controller.step()
        wait_for(lambda: len(_cells(browser, "planner-decisions")) == 2, 10, "the decisions")
        assert not browser.find_element(By.ID, "no-planner").is_displayed()
        newest = _cells(browser, "planner-decisions")[0]
        assert newest[1:] == ["2 → 4", "2", "prefill: step 2; decode: on target"]
        assert "dry run" not in browser.find_element(By.ID, "planner-updated").text


def _check_the_chat_streams(browser: WebDriver, url: str) -> None:
    """The web chat works against the disaggregated server too (no sessions here)."""
    browser.get(f"{url}/")
    wait_for(lambda: browser.find_element(By.ID, "model").text == MODEL_NAME, 10, "the chat")
    wait_for(lambda: browser.find_element(By.ID, "sessions-off").is_displayed(), 10,
             "the page to find no session store")  # fmt: skip
    browser.find_element(By.ID, "settings-toggle").click()
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("5")
    browser.find_element(By.ID, "prompt").send_keys("hello " * 20)
    browser.find_element(By.ID, "send").click()
    stats = (By.CSS_SELECTOR, ".msg.assistant .stats")
    wait_for(lambda: "5 tokens" in "".join(e.text for e in browser.find_elements(*stats)), 20,
             "the reply through prefill, transfer and decode")  # fmt: skip


# NOTE: the page redraws its tables every refresh, so elements found in one call may be gone
# by the next ("stale element reference"): each read takes the whole table in one script.
def _cells(browser: WebDriver, table: str) -> list[list[str]]:
    """The text of each cell of each row of `table`, as one snapshot."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(r => [...r.cells].map(c => c.innerText.trim()));",
        f"#{table} tbody tr",
    )


def _names(browser: WebDriver, table: str) -> list[str]:
    """Each row's `data-name`, as one snapshot."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(r => r.dataset.name);",
        f"#{table} tbody tr",
    )


def _card(browser: WebDriver, key: str) -> str:
    return browser.execute_script(
        "return document.querySelector(arguments[0]).innerText.trim();",
        f'.card[data-key="{key}"] .value',
    )
