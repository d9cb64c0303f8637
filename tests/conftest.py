"""Shared fixtures: tiny models covering the architecture matrix of the design."""

from __future__ import annotations

import pytest
from support.megatron_fixtures import TinyModel
from support.tiny_models import MODELS


@pytest.fixture(params=sorted(MODELS), ids=sorted(MODELS))
def tiny_model(request: pytest.FixtureRequest) -> TinyModel:
    return MODELS[request.param]
