"""Shared test configuration: make the repository importable without installing it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Tests in other folders reuse the service tests' modules (``from test_service_ownership
# import ...``):
# importable whatever order pytest collects the folders in, or when run one file alone.
SERVICE_TESTS = str(ROOT / "tests" / "service")
if SERVICE_TESTS not in sys.path:
    sys.path.append(SERVICE_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a CUDA device: skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Fixtures of the metrics tests (test_metrics*.py): a fresh registry, and both export modes.
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests check behaviour, not speed: on a shared 2-core machine one example can take
# longer than hypothesis's 200 ms deadline, or generation than its health check allows.
settings.register_profile("urc", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("urc")
from prometheus_client import CollectorRegistry  # noqa: E402

from metrics import ExportMode  # noqa: E402


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(params=[ExportMode.SCRAPE, ExportMode.DIRECT], ids=["scrape", "direct"])
def mode(request: pytest.FixtureRequest) -> ExportMode:
    """Both write paths: scrape-time collection (default) and direct writes (multiprocess)."""
    m: ExportMode = request.param
    return m


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Tests marked ``pytest.mark.anyio`` run once under each event loop anyio supports."""
    return str(request.param)
