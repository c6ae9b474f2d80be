"""The planner's Kubernetes calls, and nothing else: read and patch the scale subresource of
the two pool Deployments, and list the router Service's EndpointSlices to find each router.

These are exactly the verbs the chart's Role grants (deployments/scale get+patch on the two
names, endpointslices list). Every call carries a timeout.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kubernetes import client as k8s

# NOTE: the client's default Content-Type for a PATCH is json-patch, which a dict body is
# not; a merge patch says "set spec.replicas" and nothing else.
MERGE_PATCH = "application/merge-patch+json"


def api_client(host: str | None = None, token: str | None = None) -> k8s.ApiClient:
    """In the cluster (no `host`): the pod's service account. Otherwise `host` (and a bearer
    `token`) directly, as tests and out-of-cluster runs do."""
    if host is None:
        from kubernetes import config

        config.load_incluster_config()
        return k8s.ApiClient()
    configuration = k8s.Configuration(host=host)
    if token:
        # NOTE: "authorization" is the key both the older and the pydantic-based clients read.
        configuration.api_key = {"authorization": token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
    return k8s.ApiClient(configuration)


class DeploymentScaler:
    """Reads and sets `spec.replicas` of Deployments in one namespace via `/scale`."""

    def __init__(self, api: k8s.ApiClient, namespace: str, timeout_s: float = 10.0) -> None:
        self._apps = k8s.AppsV1Api(api)
        self._namespace = namespace
        self._timeout_s = timeout_s

    def get_replicas(self, name: str) -> int:
        scale = self._apps.read_namespaced_deployment_scale(
            name, self._namespace, _request_timeout=self._timeout_s
        )
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def set_replicas(self, name: str, replicas: int) -> None:
        self._apps.patch_namespaced_deployment_scale(
            name,
            self._namespace,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
            _request_timeout=self._timeout_s,
        )


@dataclass(frozen=True)
class RouterEndpoints:
    """The ready routers behind a Service, found through its EndpointSlices."""

    api: k8s.ApiClient
    namespace: str
    service: str
    port_name: str = "http"
    default_port: int = 8000
    timeout_s: float = 10.0

    def metrics_urls(self) -> list[str]:
        slices = k8s.DiscoveryV1Api(self.api).list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"kubernetes.io/service-name={self.service}",
            _request_timeout=self.timeout_s,
        )
        urls: set[str] = set()
        for eps in slices.items or []:
            port = next(
                (p.port for p in eps.ports or [] if p.name == self.port_name and p.port),
                self.default_port,
            )
            for endpoint in eps.endpoints or []:
                conditions = endpoint.conditions
                # An unset `ready` means ready (the API's documented default).
                if conditions is not None and conditions.ready is False:
                    continue
                for address in endpoint.addresses[:1]:
                    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
                    urls.add(f"http://{host}:{port}/metrics")
        return sorted(urls)
