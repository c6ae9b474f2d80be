"""A router's /metrics for the planner tests: a real prometheus_client registry holding the
metrics of the runtime contract (names, label, bucket layout of router/metrics.py), served by
a real HTTP server that checks the API key like duet does."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

# router/metrics.py's layouts (copied so these tests need not import the engine).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class RouterMetrics:
    """The metrics one router exposes, for one served model name."""

    def __init__(self, model_name: str = "llama") -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.ttft_s = Histogram(
            "duet:time_to_first_token_seconds", "TTFT", labels, buckets=TTFT_BUCKETS_S,
            registry=reg,
        ).labels(model_name)  # fmt: skip
        self.itl_s = Histogram(
            "duet:inter_token_latency_seconds", "ITL", labels, buckets=ITL_BUCKETS_S,
            registry=reg,
        ).labels(model_name)  # fmt: skip
        self.e2e_s = Histogram(
            "duet:e2e_request_latency_seconds", "E2E", labels, registry=reg
        ).labels(model_name)
        gauge = lambda name: Gauge(name, name, labels, registry=reg).labels(model_name)  # noqa: E731
        self.prefill_queued_tokens = gauge("duet:prefill_queued_tokens")
        self.decode_batch_occupancy = gauge("duet:decode_batch_occupancy")
        self.num_prefill_workers = gauge("duet:num_prefill_workers")
        self.num_decode_workers = gauge("duet:num_decode_workers")
        self.num_requests_waiting = gauge("duet:num_requests_waiting")

    def observe_ttft(self, value_s: float, times: int) -> None:
        for _ in range(times):
            self.ttft_s.observe(value_s)

    def observe_itl(self, value_s: float, times: int) -> None:
        for _ in range(times):
            self.itl_s.observe(value_s)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class MetricsServer:
    """Serves `metrics.text()` at GET /metrics on 127.0.0.1, 401 without `api_key`."""

    def __init__(self, metrics: RouterMetrics, api_key: str | None = None) -> None:
        self.metrics = metrics
        self.auth_headers: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization")
                outer.auth_headers.append(auth)
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                if api_key is not None and auth != f"Bearer {api_key}":
                    self.send_error(401)
                    return
                body = outer.metrics.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
