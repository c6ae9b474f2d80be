"""Screenshots of the web chat (1280 and 400 px wide) and the cluster dashboard for the docs
(docs/img/), taken in
headless Chromium against a disaggregated server on a tiny random test model (one prefill and
two decode workers, no Ray): `python -m tests.router.make_screenshots docs/img`."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
from selenium.webdriver.common.by import By

from duet.session_store import SqliteSessionStore
from tests.browser import chromium
from tests.conftest import build_tiny_model
from tests.router.cluster_server import ClusterServer
from tests.router.rest_server import API_KEY, MODEL_NAME, closing
from tests.waiting import wait_for

LOAD_S = 40.0


def _load(url: str, stop: threading.Event) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
        i = 0
        while not stop.is_set():
            i += 1
            stream = client.completions.create(
                model=MODEL_NAME, prompt=list(range(3, 40 + (i * 37) % 200)),
                max_tokens=16 + i % 24, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                pass


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="duet-screens-"))
    model = build_tiny_model(str(tmp / "model"), "llama")
    store = SqliteSessionStore(tmp / "sessions.db")
    server = ClusterServer(
        model, app_args={"session_store": store, "lifespan": closing(store)},
        num_decode=2, threshold=0,
    ).start()  # fmt: skip
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(server.url, stop)) for _ in range(2)]
    try:
        with chromium() as browser:
            browser.get(server.url + "/")
            wait_for(lambda: browser.find_element(By.ID, "key-dialog").get_attribute("open")
                     is not None, 10, "the key prompt")  # fmt: skip
            browser.find_element(By.ID, "api-key").send_keys(API_KEY)
            browser.find_element(By.ID, "key-save").click()
            browser.find_element(By.ID, "settings-toggle").click()
            for field, value in (("temperature", "0"), ("max-tokens", "48")):
                browser.find_element(By.ID, field).clear()
                browser.find_element(By.ID, field).send_keys(value)
            browser.find_element(By.ID, "system-prompt").send_keys("You are a helpful assistant.")
            for prompt in ("Hello! What can you do?", "Write a haiku about KV caches."):
                n = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
                browser.find_element(By.ID, "prompt").send_keys(prompt)
                browser.find_element(By.ID, "send").click()
                wait_for(lambda n=n: "tokens" in (browser.find_elements(
                    By.CSS_SELECTOR, ".msg.assistant .stats")[n:] or [None])[0].text
                    if len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) > n
                    else False, 30, "the reply")  # fmt: skip
            browser.save_screenshot(str(out / "web_chat.png"))
            # The same conversation on a phone-sized screen, the settings closed.
            browser.find_element(By.ID, "settings-toggle").click()
            browser.set_window_size(400, 860)
            time.sleep(0.5)
            browser.save_screenshot(str(out / "web_chat_phone.png"))
            browser.set_window_size(1280, 860)

            for t in loaders:
                t.start()
            browser.get(server.url + "/dashboard")
            time.sleep(LOAD_S)
            browser.set_window_size(1280, 1500)
            time.sleep(2.5)
            browser.save_screenshot(str(out / "dashboard.png"))
    finally:
        stop.set()
        for t in loaders:
            if t.is_alive():
                t.join(30)
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img")
