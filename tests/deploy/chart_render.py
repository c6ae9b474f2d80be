"""Renders helm/duet offline through Helm's Go SDK (helm-python-sdk) for the chart tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

KUBE_VERSION = "1.34"  # the Kubernetes schemas manifests are validated against

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "duet"
PRODUCTION_VALUES = CHART_DIR / "ci" / "production-values.yaml"
RELEASE = "duet"
NAMESPACE = "serving"


def production_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(PRODUCTION_VALUES.read_text())
    return values


class Rendered:
    """One rendering: the manifests as objects, plus NOTES.txt."""

    def __init__(self, files: dict[str, str]) -> None:
        self.notes = ""
        self.objects: list[dict[str, Any]] = []
        for path, text in sorted(files.items()):
            if path.endswith("NOTES.txt"):
                self.notes = text
                continue
            self.objects.extend(doc for doc in yaml.safe_load_all(text) if doc)

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in self.objects)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
        return found[0]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def pod_specs(self) -> dict[str, dict[str, Any]]:
        """Pod specs of every workload, keyed by workload name."""
        return {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in self.objects
            if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
        }


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def env_values(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of every env entry of a pod spec's containers (value None: a reference)."""
    return [(e["name"], e.get("value")) for c in spec["containers"] for e in c.get("env", [])]
