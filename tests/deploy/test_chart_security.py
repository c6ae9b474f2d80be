"""helm/duet's fences around the internal plane: NetworkPolicies (which pods may reach which)
and the optional mTLS Secret mounted in every Ray pod (docs/security.md). The cluster secret's
Secret and mounts are checked with the other secrets in test_chart.py."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate

from tests.deploy.chart_render import KUBE_VERSION, env_values, production_values, render


def test_internal_tls_mounts_its_secret_in_every_ray_pod(chart, default):
    assert "DUET_INTERNAL_TLS_CERT" not in json.dumps(default.objects)  # off by default
    tls = render(chart, {**production_values(), "internalTLS": {"secretName": "duet-internal-tls"}})
    for name, spec in tls.pod_specs().items():
        env = dict(env_values(spec))
        volumes = {v["name"]: v for v in spec["volumes"]}
        if name == "duet-planner":
            assert "internal-tls" not in volumes and "DUET_INTERNAL_TLS_CA" not in env
            continue
        assert volumes["internal-tls"]["secret"]["secretName"] == "duet-internal-tls"
        assert [env[f"DUET_INTERNAL_TLS_{k}"] for k in ("CERT", "KEY", "CA")] == [
            "/etc/duet/internal-tls/tls.crt",
            "/etc/duet/internal-tls/tls.key",
            "/etc/duet/internal-tls/ca.crt",
        ]
    for obj in tls.objects:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            assert kubernetes_validate.validate(obj, KUBE_VERSION, strict=True) == KUBE_VERSION


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and `In` matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _allowed_from(policy: dict[str, Any], labels: dict[str, str]) -> list[Any]:
    """The ports (None: every port) `policy` lets a pod of `labels` in this namespace reach."""
    allowed = []
    for rule in policy["spec"].get("ingress", []):
        sources = rule.get("from")
        if sources is None or any(_selects(s["podSelector"], labels) for s in sources):
            allowed.append(rule.get("ports"))
    return allowed


def test_network_policies_fence_the_internal_plane(prod, chart):
    pods = {
        name: obj["spec"]["template"]["metadata"]["labels"]
        for obj in prod.of_kind("Deployment")
        for name in [obj["metadata"]["name"].removeprefix("duet-")]
    }
    stranger = {"app": "someone-else"}
    policies = prod.of_kind("NetworkPolicy")
    workers = prod.get("NetworkPolicy", "duet-workers")
    routers = prod.get("NetworkPolicy", "duet-routers")
    # which policies select which pods
    assert {
        name: sorted(p["metadata"]["name"] for p in policies if _selects(p["spec"]["podSelector"], labels))
        for name, labels in pods.items()
    } == {
        "decode": ["duet-workers"], "prefill": ["duet-workers"], "head": ["duet-routers"],
        "router": ["duet-routers"], "planner": ["duet-planner"],
    }  # fmt: skip
    # workers: the release's Ray pods only (routers and peers); nobody else, not the planner
    for peer in ("head", "router", "prefill", "decode"):
        assert _allowed_from(workers, pods[peer]) == [None], peer
    assert _allowed_from(workers, pods["planner"]) == []
    assert _allowed_from(workers, stranger) == []
    # routers: the public ports from anywhere, the rest from Ray pods
    public = [{"port": 8000, "protocol": "TCP"}, {"port": 50051, "protocol": "TCP"}]
    assert _allowed_from(routers, stranger) == [public]
    assert _allowed_from(routers, pods["prefill"]) == [public, None]
    # the planner: nothing in; out only to the API server, DNS and the routers' metrics
    planner = prod.get("NetworkPolicy", "duet-planner")["spec"]
    assert planner["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in planner
    assert [[p["port"] for p in rule["ports"]] for rule in planner["egress"]] == [
        [443, 6443], [53, 53], [8000],
    ]  # fmt: skip
    # off: only the bundled Redis keeps its own
    off = render(
        chart, {**production_values(), "networkPolicy": {"enabled": False, "apiServerPorts": [443]}}
    )
    assert off.of_kind("NetworkPolicy") == []
