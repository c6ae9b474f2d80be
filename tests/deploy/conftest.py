"""The chart fixtures of tests/deploy: helm/duet loaded once per module, rendered with the
default and with production-like values."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.chart_render import CHART_DIR, Rendered, production_values, render


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def default(chart) -> Rendered:
    return render(chart)


@pytest.fixture(scope="module")
def prod(chart) -> Rendered:
    return render(chart, production_values())
