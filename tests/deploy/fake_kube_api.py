"""A small real HTTP server speaking the part of the Kubernetes API the planner uses: GET and
PATCH (merge patch) of deployments/scale, and a list of EndpointSlices. It records every
request (method, path, query, headers, body) so tests can assert the exact calls."""

from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    authorization: str | None
    body: Any


@dataclass
class FakeKubeAPI:
    namespace: str
    replicas: dict[str, int]
    """Deployment name -> spec.replicas."""
    endpoint_slices: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Service name -> EndpointSlice objects."""
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def patches(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "PATCH"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scale(self, name: str) -> dict[str, Any]:
        n = self.replicas[name]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": "1"},
            "spec": {"replicas": n},
            "status": {"replicas": n, "selector": f"app.kubernetes.io/component={name}"},
        }

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: Any):
        """(status, JSON response) for one request."""
        for name in self.replicas:
            if path == SCALE_PATH.format(ns=self.namespace, name=name):
                if method == "GET":
                    return 200, self._scale(name)
                if method == "PATCH":
                    self.replicas[name] = int(body["spec"]["replicas"])
                    return 200, self._scale(name)
        if method == "GET" and path == SLICES_PATH.format(ns=self.namespace):
            (selector,) = query.get("labelSelector", [""])
            key, _, service = selector.partition("=")
            assert key == "kubernetes.io/service-name", selector
            return 200, {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": "1"},
                "items": self.endpoint_slices.get(service, []),
            }
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                query = urllib.parse.parse_qs(url.query)
                with api._lock:
                    api.requests.append(
                        Recorded(
                            method,
                            url.path,
                            query,
                            self.headers.get("Content-Type"),
                            self.headers.get("Authorization"),
                            body,
                        )
                    )
                    status, payload = api._route(method, url.path, query, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_PATCH(self) -> None:
                self._serve("PATCH")

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


def endpoint_slice(
    service: str, namespace: str, port: int, addresses: list[tuple[str, bool | None]]
) -> dict[str, Any]:
    """An EndpointSlice of `service` with one endpoint per (address, ready)."""
    ipv6 = any(":" in a for a, _ in addresses)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-{port}",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv6" if ipv6 else "IPv4",
        "endpoints": [
            {"addresses": [a], **({} if ready is None else {"conditions": {"ready": ready}})}
            for a, ready in addresses
        ],
        "ports": [
            {"name": "grpc", "port": 50051, "protocol": "TCP"},
            {"name": "http", "port": port, "protocol": "TCP"},
        ],
    }
