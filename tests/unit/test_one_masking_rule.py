"""One rule for what is a secret, wherever it is looked for: settings, Redis URLs, messages.

A URL or a header name that the settings mask must be masked alike by the
Redis backend's repr and scrubbed alike from error messages: two rules that
disagree leave one path that shows the secret.
"""

from __future__ import annotations

import pytest

from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.urls import secrets_of
from polygateway.config.masking import mask_headers, mask_url
from polygateway.transport.http import secrets_in

URLS = (
    "redis://tok3n-Secret-1@cache.internal:6379/0",
    "redis://user:pa55-Secret-2@cache.internal:6379/0",
    "redis://cache.internal:6379/0?password=pa55-Secret-3",
    "rediss://:pa55-Secret-4@cache.internal:6380/1",
)


@pytest.mark.parametrize("url", URLS)
async def test_redis_backend_masks_what_the_settings_mask(url: str) -> None:
    """The backend's repr shows the URL exactly as the settings print it: no secret."""
    backend = RedisBackend(url)
    try:
        shown = repr(backend)
    finally:
        await backend.aclose()
    assert "Secret" not in shown
    assert mask_url(url) in shown


@pytest.mark.parametrize("url", URLS)
def test_every_secret_of_a_redis_url_is_known_for_scrubbing(url: str) -> None:
    """A foreign error quoting any spelling of the credential is scrubbed."""
    secrets = secrets_of(url)
    assert secrets
    assert all("Secret" in secret for secret in secrets)


@pytest.mark.parametrize("name", ["X-Auth", "X-Api-Key", "Authorization", "Cookie", "X-Token"])
def test_a_header_masked_in_settings_is_scrubbed_from_messages(name: str) -> None:
    """Any header name the settings mask is a credential to the transports' scrubber too."""
    value = "v4lue-Secret-0123"
    assert mask_headers({name: value})[name] == "***"
    assert value in secrets_in({name: value})
