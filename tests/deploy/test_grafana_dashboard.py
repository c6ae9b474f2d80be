"""duet's Grafana dashboard: one file in deploy/grafana and the same bytes in the chart, which
installs it as a ConfigMap for the Grafana sidecar when asked (and not by default)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm

from tests.deploy.chart_render import CHART_DIR, render

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "duet.json"


def dashboard_metric_names() -> set[str]:
    """Every duet: metric the dashboard's queries read (sample names, as in /metrics)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"duet:\w+", e)}


def test_the_chart_ships_the_same_dashboard() -> None:
    assert (CHART_DIR / "dashboards" / "duet.json").read_bytes() == DASHBOARD.read_bytes()
    dash = json.loads(DASHBOARD.read_text())
    assert len(dash["panels"]) == 20
    assert len(dashboard_metric_names()) == 31


def test_the_chart_installs_it_for_the_sidecar_when_asked() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        default = render(chart)
        enabled = render(chart, {"grafanaDashboard": {"enabled": True,
                                                      "annotations": {"grafana_folder": "duet"}}})  # fmt: skip
    assert not [o for o in default.of_kind("ConfigMap") if "grafana" in o["metadata"]["name"]]
    config_map = enabled.get("ConfigMap", "duet-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "duet"}
    assert json.loads(config_map["data"]["duet.json"]) == json.loads(DASHBOARD.read_text())
