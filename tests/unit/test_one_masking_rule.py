"""One rule for what is a secret, wherever it is looked for: settings, Redis URLs, messages.

A URL or a header name that the settings mask must be masked alike by the
Redis backend's repr and scrubbed alike from error messages: two rules that
disagree leave one path that shows the secret.
"""

from __future__ import annotations

import pytest

from polygateway.backends.redis import RedisBackend
from polygateway.config.masking import mask_headers, mask_url, scrub, secrets_in, url_secrets

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
    secrets = url_secrets(url)
    assert secrets
    assert all("Secret" in secret for secret in secrets)


@pytest.mark.parametrize("name", ["X-Auth", "X-Api-Key", "Authorization", "Cookie", "X-Token"])
def test_a_header_masked_in_settings_is_scrubbed_from_messages(name: str) -> None:
    """Any header name the settings mask is a credential to the transports' scrubber too."""
    value = "v4lue-Secret-0123"
    assert mask_headers({name: value})[name] == "***"
    assert value in secrets_in({name: value})


# --- one shared list of secret shapes, through every function of the one rule ---------------

SECRET = "s3cr3t-Value-42"

URL_SHAPES = (
    f"https://user:{SECRET}@api.example.com/v1",  # userinfo with a password
    f"https://{SECRET}@api.example.com/v1",  # a lone user part: a token
    f"https://api.example.com/v1?token={SECRET}",
    f"https://api.example.com/v1?key={SECRET}",
    f"https://api.example.com/v1?api-key={SECRET}",
    f"redis://:{SECRET}@cache.internal:6379/0",
    f"redis://cache.internal:6379/0?password={SECRET}",
)

HEADER_SHAPES = ("Authorization", "X-Api-Key", "X-Auth-Token", "X-Auth", "api-key", "Cookie")


@pytest.mark.parametrize("url", URL_SHAPES)
def test_a_url_secret_is_masked_when_shown_and_scrubbed_from_messages(url: str) -> None:
    """Every URL shape: masked for display, and a message quoting it is scrubbed clean."""
    assert SECRET not in mask_url(url)
    message = f"connect to {url} failed: {SECRET} rejected"
    assert SECRET not in scrub(message, url_secrets(url))


@pytest.mark.parametrize("name", HEADER_SHAPES)
def test_a_header_secret_is_masked_when_shown_and_scrubbed_from_messages(name: str) -> None:
    """Every header shape: masked for display; its value (and a bearer's token) scrubbed."""
    value = f"Bearer {SECRET}" if name == "Authorization" else SECRET
    assert mask_headers({name: value})[name] == "***"
    message = f"upstream said: invalid credential {SECRET} ({value})"
    assert SECRET not in scrub(message, secrets_in({name: value}))


def test_a_plain_header_is_neither_masked_nor_scrubbed() -> None:
    """The rule is not everything: a header that carries no credential shows as it is."""
    assert mask_headers({"X-Request-Id": "abc-123"}) == {"X-Request-Id": "abc-123"}
    assert secrets_in({"X-Request-Id": "abc-123"}) == ()
