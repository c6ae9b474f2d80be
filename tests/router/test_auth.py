"""APIKeyChecker: Bearer keys only, any configured key accepted, none configured: open."""

from __future__ import annotations

import pytest

from duet.router.auth import APIKeyChecker
from duet.router.errors import AuthenticationError


def test_accepts_any_configured_key() -> None:
    checker = APIKeyChecker(["k1", "k2"])
    assert checker.enabled
    checker.check("Bearer k1")
    checker.check("bearer k2")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic k1", "Bearer k3", "k1"])
def test_rejects_missing_malformed_or_wrong(header: str | None) -> None:
    with pytest.raises(AuthenticationError) as info:
        APIKeyChecker(["k1", "k2"]).check(header)
    assert info.value.status_code == 401
    assert "k1" not in info.value.message  # never echo a key


def test_authenticate_names_the_caller_key() -> None:
    assert APIKeyChecker(["k1", "k2"]).authenticate("Bearer  k2 ") == "k2"
    assert APIKeyChecker([]).authenticate("Bearer anything") is None


def test_no_keys_means_open_and_empty_keys_are_refused() -> None:
    checker = APIKeyChecker([])
    assert not checker.enabled
    checker.check(None)
    with pytest.raises(ValueError, match="api_keys"):
        APIKeyChecker(["ok", " "])
