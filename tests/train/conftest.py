"""The training tests' store: ``store`` is the session's squares store (tests/conftest.py), read by every module."""

import pytest


@pytest.fixture(scope="session")
def store(squares_store) -> str:
    return squares_store
