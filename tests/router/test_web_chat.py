"""The web chat at `/` in a real browser (headless Chromium): the API-key prompt, a streamed
reply with its TTFT and tokens/s, stop mid-reply (the server aborts the request), reload and
resume from the session, safe rendering of a reply holding HTML, and `--no-ui`."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from duet.engine import AsyncEngine, RequestOutput
from duet.session_store import SqliteSessionStore
from tests.browser import chromium
from tests.router.rest_server import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    closing,
    make_app,
    wait_until_idle,
)
from tests.waiting import wait_for

OUTPUT_DELAY_S = 0.03
"""Each output is held this long, so a reply lasts long enough to be stopped mid-way."""


class SlowEngine:
    """The real engine, streaming at a human pace; closing a stream closes the engine's (which
    aborts the request there)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        outputs = self._engine.generate(*args, **kwargs)
        try:
            async for out in outputs:
                await asyncio.sleep(OUTPUT_DELAY_S)
                yield out
        finally:
            await outputs.aclose()


@pytest.fixture(scope="module")
def sessions_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("web-chat") / "sessions.db"


@pytest.fixture(scope="module")
def chat_server(rest_engine: AsyncEngine, sessions_db: Path) -> Iterator[LiveServer]:
    store = SqliteSessionStore(sessions_db)
    app = make_app(
        SlowEngine(rest_engine),  # type: ignore[arg-type]
        MODEL_NAME,
        api_keys=[API_KEY],
        session_store=store,
        lifespan=closing(store),
    )
    live = LiveServer(app).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with chromium() as driver:
        yield driver


def _open_with_key(browser: WebDriver, url: str) -> None:
    browser.get(url)
    wait_for(lambda: browser.find_element(By.ID, "key-dialog").get_attribute("open") is not None,
             10, "the API-key prompt")  # fmt: skip
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "key-save").click()
    wait_for(lambda: browser.find_element(By.ID, "model").text == MODEL_NAME, 10, "the model")


def _set(browser: WebDriver, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _send(browser: WebDriver, text: str) -> None:
    _set(browser, "prompt", text)
    browser.find_element(By.ID, "send").click()


def _replies(browser: WebDriver) -> list[Any]:
    return browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def _reply_stats(browser: WebDriver, index: int) -> str:
    """The numbers under reply `index` ("" until it ended); fails on an error the page shows."""
    error = browser.find_element(By.ID, "error")
    assert not error.is_displayed(), f"the page shows an error: {error.text}"
    replies = _replies(browser)
    return replies[index].find_element(By.CLASS_NAME, "stats").text if len(replies) > index else ""


def _aborted(server: LiveServer) -> float:
    metrics = httpx2.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    ).text
    m = re.search(
        r'^duet:request_success_total\{.*finished_reason="abort".*\} (\S+)$', metrics, re.M
    )
    return float(m.group(1)) if m else 0.0


def test_chat_streams_stops_and_resumes(
    chat_server: LiveServer, browser: WebDriver, rest_engine: AsyncEngine
) -> None:
    _open_with_key(browser, chat_server.url + "/")
    assert browser.execute_script("return sessionStorage.getItem('duet.apiKey')") == API_KEY
    assert browser.execute_script("return localStorage.length") == 0  # session storage only
    browser.find_element(By.ID, "settings-toggle").click()
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", "12")

    # A short reply, streamed to the end, with its numbers.
    _send(browser, "hello there")
    wait_for(lambda: "tokens" in _reply_stats(browser, 0), 30, "the first reply to finish")
    first = _replies(browser)[0]
    stats_first = stats = first.find_element(By.CLASS_NAME, "stats").text
    assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tok/s · 12 tokens", stats), stats
    first_text = first.find_element(By.CLASS_NAME, "body").text
    assert first_text.strip()

    # A long reply, stopped mid-way: the server aborts it and frees its blocks.
    aborted_before = _aborted(chat_server)
    _set(browser, "max-tokens", "600")
    _send(browser, "tell me more")
    wait_for(lambda: len(_replies(browser)) == 2 and
             len(_replies(browser)[1].find_element(By.CLASS_NAME, "body").text) > 20,
             30, "the second reply to stream some text")  # fmt: skip
    assert browser.find_element(By.ID, "stop").is_displayed()
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: _aborted(chat_server) == aborted_before + 1, 10, "the server-side abort")
    wait_until_idle(rest_engine)
    stats = _replies(browser)[1].find_element(By.CLASS_NAME, "stats").text
    assert stats.endswith("stopped"), stats
    assert browser.find_element(By.ID, "send").is_displayed()

    # Reload: the conversation resumes from its session (the stopped turn was not stored).
    session_id = browser.execute_script("return location.hash").removeprefix("#session=")
    browser.refresh()
    wait_for(lambda: len(_replies(browser)) == 1, 10, "the stored conversation to load")
    assert _replies(browser)[0].find_element(By.CLASS_NAME, "body").text == first_text
    # The reply's numbers and the settings were kept in this browser.
    assert _reply_stats(browser, 0) == stats_first
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == "600"
    # One read in the page: the list is rebuilt as the page loads (a found element goes stale).
    titles = "return [...document.querySelectorAll('#sessions li .open')].map(e => e.textContent)"
    wait_for(lambda: "hello there" in browser.execute_script(titles), 10, "the session's title")
    current = f'#sessions li[data-id="{session_id}"]'
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, current + ".current"), 10,
             "the open conversation to be marked in the list")  # fmt: skip

    # Delete it: gone from the list and from the server.
    browser.execute_script(f"document.querySelector('{current} .delete').click()")
    wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, current), 10,
             "the session to leave the list")  # fmt: skip
    assert not _replies(browser)  # the open conversation was the deleted one
    gone = httpx2.get(f"{chat_server.url}/v1/sessions/{session_id}",
                      headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert gone.status_code == 404


def _open(browser: WebDriver, url: str) -> None:
    """Open a page, giving the key when it asks (this tab may hold it already)."""
    browser.get("about:blank")  # from the same page, a new #fragment would not reload it
    browser.get(url)
    wait_for(lambda: browser.find_element(By.ID, "key-dialog").get_attribute("open") is not None
             or browser.find_element(By.ID, "model").text, 10, "the page to start")  # fmt: skip
    if browser.find_element(By.ID, "key-dialog").get_attribute("open") is not None:
        browser.find_element(By.ID, "api-key").send_keys(API_KEY)
        browser.find_element(By.ID, "key-save").click()
    wait_for(lambda: browser.find_element(By.ID, "model").text.startswith(MODEL_NAME), 10,
             "the model's name")  # fmt: skip


def test_settings_toggle_and_are_kept_across_a_reload(
    chat_server: LiveServer, browser: WebDriver
) -> None:
    browser.set_window_size(1280, 860)
    _open(browser, chat_server.url + "/")
    panel, toggle = (
        browser.find_element(By.ID, "settings"),
        browser.find_element(By.ID, "settings-toggle"),
    )
    assert not panel.is_displayed()
    toggle.click()
    assert panel.is_displayed() and toggle.get_attribute("aria-expanded") == "true"
    toggle.click()  # the panel's own display: flex once beat `hidden`: it never closed
    assert not panel.is_displayed() and toggle.get_attribute("aria-expanded") == "false"
    toggle.click()
    _set(browser, "temperature", "1.3")
    _set(browser, "max-tokens", "77")
    _set(browser, "system-prompt", "Answer in French.")
    browser.refresh()
    wait_for(lambda: browser.find_element(By.ID, "model").text == MODEL_NAME, 10, "the page")
    assert not browser.find_element(By.ID, "settings").is_displayed()  # closed, values kept
    values = {f: browser.find_element(By.ID, f).get_attribute("value")
              for f in ("temperature", "max-tokens", "system-prompt")}  # fmt: skip
    assert values == {
        "temperature": "1.3",
        "max-tokens": "77",
        "system-prompt": "Answer in French.",
    }
    stored = browser.execute_script("return localStorage.getItem('duet.chat.settings')")
    assert API_KEY not in stored  # the key stays in session storage only


NO_HORIZONTAL_SCROLL = """
const el = document.scrollingElement, messages = document.getElementById("messages");
return [el.scrollWidth - el.clientWidth, messages.scrollWidth - messages.clientWidth,
        document.querySelector("main").getBoundingClientRect().width,
        document.getElementById("sidebar").getBoundingClientRect().right, window.innerWidth];
"""


@pytest.mark.parametrize("width", [400, 1280])
def test_the_chat_fits_a_phone_and_a_desktop(
    chat_server: LiveServer, browser: WebDriver, tmp_path: Path, width: int
) -> None:
    """No horizontal scroll, the chat column the page's width (a phone: the conversations
    slide in over it), long unbroken words wrapped inside their message."""
    browser.set_window_size(width, 860)
    _open(browser, chat_server.url + "/")
    if width > 720:  # on a phone the button is in the list, which is off-screen
        browser.find_element(By.ID, "new-chat").click()
    long_word = "supercalifragilistic" * 6  # wider than a phone
    browser.execute_script(FAKE_STREAM, [f"A long word: {long_word} and a ", "`" + long_word + "`"])
    _send(browser, "words " * 40 + long_word)
    wait_for(lambda: "tokens" in _reply_stats(browser, 0), 10, "the reply")
    settings_toggle = browser.find_element(By.ID, "settings-toggle")
    settings_toggle.click()  # the settings open too
    extra_x, messages_x, main_w, sidebar_right, inner = browser.execute_script(NO_HORIZONTAL_SCROLL)
    browser.save_screenshot(str(tmp_path / f"chat-{width}.png"))
    assert (extra_x, messages_x) == (0, 0)
    sidebar = browser.find_element(By.ID, "sidebar-toggle")
    if width < 720:
        assert main_w == inner and sidebar_right <= 0  # the whole width; the list off-screen
        assert sidebar.is_displayed()
        sidebar.click()
        wait_for(lambda: browser.execute_script(
            "return document.getElementById('sidebar').getBoundingClientRect().left") == 0,
            5, "the conversations to slide in")  # fmt: skip
        browser.execute_script("document.getElementById('messages').click()")  # a tap beside
        assert "sidebar-open" not in browser.find_element(By.TAG_NAME, "body").get_attribute(
            "class"
        )
    else:
        assert not sidebar.is_displayed()
        assert sidebar_right == 240 and main_w == inner - 240
    settings_toggle.click()


def test_the_dashboard_of_an_aggregated_server_in_the_browser(
    chat_server: LiveServer, browser: WebDriver
) -> None:
    """One engine: no prefill groups or KV transfers to show; the plots' axes in round,
    even steps."""
    browser.set_window_size(1280, 860)
    _open(browser, chat_server.url + "/dashboard")
    wait_for(lambda: browser.find_element(By.ID, "plot-ttft").get_attribute("data-ticks"), 10,
             "the first poll")  # fmt: skip
    for hidden in ("prefill-section", "transfers-section", "bandwidth-plot"):
        assert not browser.find_element(By.ID, hidden).is_displayed(), hidden
    assert browser.find_element(By.ID, "decode-title").text == "Engine"
    for plot in ("plot-ttft", "plot-itl", "plot-throughput"):
        ticks = [
            float(t) for t in browser.find_element(By.ID, plot).get_attribute("data-ticks").split()
        ]
        steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
        assert ticks[0] == 0 and len(steps) == 1, ticks
        (step,) = steps
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert round(mantissa, 6) in (1, 2, 5), ticks
    browser.set_window_size(400, 860)  # a phone: tables scroll in their own box, not the page
    time.sleep(0.3)
    overflow = "const e = document.scrollingElement; return e.scrollWidth - e.clientWidth"
    assert browser.execute_script(overflow) == 0
    browser.set_window_size(1280, 860)
    axis = "return window.duetPlot.axis(arguments[0]).labels.join(' ')"
    assert browser.execute_script(axis, 19) == "0 5 10 15 20"  # once 0 6.3 13 19 25
    assert browser.execute_script(axis, 0.0042) == "0.000 0.002 0.004 0.006"


def test_the_favicon_is_served_without_a_key(chat_server: LiveServer) -> None:
    icon = httpx2.get(f"{chat_server.url}/favicon.ico")
    assert icon.status_code == 200
    assert icon.headers["content-type"] == "image/svg+xml"
    assert icon.text.startswith("<svg")


HOSTILE = (
    "Here is **bold** and `code`:\n\n```html\n<b>not bold</b>\n```\n\n"
    '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    "[link](javascript:window.pwned=3) and <b>a tail</b>"
)


def test_a_reply_holding_html_renders_as_text(
    chat_server: LiveServer, browser: WebDriver, sessions_db: Path
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    created = httpx2.post(f"{chat_server.url}/v1/sessions", headers=headers, json={})
    session_id = created.json()["id"]

    async def store_turn() -> None:
        store = SqliteSessionStore(sessions_db)
        try:
            await store.append_turn(
                session_id,
                [{"role": "user", "content": "show me html"},
                 {"role": "assistant", "content": HOSTILE}],
                expected_version=0,
            )  # fmt: skip
        finally:
            await store.close()

    asyncio.run(store_turn())
    browser.get("about:blank")  # from the same page, a new #fragment would not reload it
    browser.get(f"{chat_server.url}/#session={session_id}")
    if browser.find_element(By.ID, "key-dialog").get_attribute("open") is not None:
        _open_with_key(browser, f"{chat_server.url}/#session={session_id}")
    wait_for(lambda: len(_replies(browser)) == 1, 10, "the stored reply")
    body = _replies(browser)[0].find_element(By.CLASS_NAME, "body")
    assert "<script>window.pwned = 1</script>" in body.text
    assert '<img src=x onerror="window.pwned = 2">' in body.text
    assert body.text.endswith("and <b>a tail</b>")
    assert body.find_element(By.TAG_NAME, "strong").text == "bold"
    assert body.find_element(By.CSS_SELECTOR, "pre code").text == "<b>not bold</b>"
    assert not body.find_elements(By.CSS_SELECTOR, "script, img, b, a")
    assert browser.execute_script("return window.pwned === undefined")

    # The same reply streamed: the page's fetch of /v1/chat/completions answers with SSE chunks
    # carrying it, split mid-tag (the server's stream, as the page parses it).
    chunks = [HOSTILE[i : i + 7] for i in range(0, len(HOSTILE), 7)]
    browser.execute_script(FAKE_STREAM, chunks)
    browser.find_element(By.ID, "new-chat").click()
    _send(browser, "stream me html")
    wait_for(lambda: "tokens" in _reply_stats(browser, 0), 10, "the streamed reply")
    body = _replies(browser)[0].find_element(By.CLASS_NAME, "body")
    assert "<script>window.pwned = 1</script>" in body.text
    assert body.find_element(By.TAG_NAME, "strong").text == "bold"
    assert not body.find_elements(By.CSS_SELECTOR, "script, img, b, a")
    assert browser.execute_script("return window.pwned === undefined")
    assert _reply_stats(browser, 0).endswith(f"{len(chunks)} tokens")


FAKE_STREAM = r"""
const chunks = arguments[0];
const real = window.fetch;
window.fetch = (url, opts) => {
  if (!String(url).endsWith("/v1/chat/completions")) return real(url, opts);
  const enc = new TextEncoder();
  const body = new ReadableStream({
    start(c) {
      for (const t of chunks) {
        const chunk = {choices: [{index: 0, delta: {content: t}, finish_reason: null}]};
        c.enqueue(enc.encode("data: " + JSON.stringify(chunk) + "\n\n"));
      }
      c.enqueue(enc.encode("data: [DONE]\n\n"));
      c.close();
    }
  });
  return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
};
"""


def test_no_ui_serves_no_pages(rest_engine: AsyncEngine) -> None:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], web_ui=False))
    live.start()
    try:
        assert httpx2.get(f"{live.url}/").status_code == 401  # no open page: the key gate
        assert httpx2.get(f"{live.url}/ui/chat.js").status_code == 401
        keyed = httpx2.get(f"{live.url}/", headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 404
    finally:
        live.stop()


def test_pages_are_open_and_locked_down(chat_server: LiveServer) -> None:
    page = httpx2.get(f"{chat_server.url}/")
    assert page.status_code == 200
    assert page.headers["content-security-policy"].startswith(
        "default-src 'none'; script-src 'self'"
    )
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert src.startswith("/"), f"{src}: every asset must come from duet itself"
        assert httpx2.get(f"{chat_server.url}{src}").status_code == 200
    assert httpx2.get(f"{chat_server.url}/v1/models").status_code == 401  # data stays keyed
    assert httpx2.get(f"{chat_server.url}/ui/../api_server.py").status_code in (401, 404)


def test_the_dashboard_data_of_an_aggregated_server(
    chat_server: LiveServer, rest_engine: AsyncEngine
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx2.get(f"{chat_server.url}/v1/dashboard").status_code == 401
    # A reply left after its first token: the server aborts it (no engine step may follow).
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200, "stream": True}  # fmt: skip
    url = f"{chat_server.url}/v1/chat/completions"
    with httpx2.stream("POST", url, json=body, headers=headers, timeout=30) as stream:
        lines = stream.iter_lines()
        token = re.compile(r'"content":"[^"]')  # not the role chunk's empty content
        wait_for(lambda: token.search(next(lines)) is not None, 10, "a token")
    wait_until_idle(rest_engine)
    data = httpx2.get(f"{chat_server.url}/v1/dashboard", headers=headers).json()
    assert (data["model"], data["mode"]) == (MODEL_NAME, "aggregated")
    assert data["prefill"] == [] and data["transfers"] == []
    (engine,) = data["decode"]
    # Idle again after the aborted reply: no stale running request, no blocks in use.
    assert (engine["name"], engine["state"], engine["num_running"]) == ("engine", "healthy", 0)
    assert engine["kv_usage"] == 0.0
    assert data["queues"]["admitted"] == 0
    series = data["series"]
    assert len(series["t"]) == 60
    # The reply's first token, in one of the last two bins (the window may have moved on).
    assert [v for v in series["ttft_p50_ms"][-2:] if v is not None]
    assert sum(series["tokens_per_s"][-2:]) > 0
    assert series["transfer_gbps"] == [None] * 60
