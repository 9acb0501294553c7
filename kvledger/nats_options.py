"""Connection options for nats-py built from settings: auth and TLS in one place for every stage.

Pure: it builds keyword arguments and an SSL context; the stages open the connections.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvledger.settings import NatsSettings, SettingsError


def connect_options(settings: NatsSettings, *, name: str) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` (servers, credentials, TLS); secrets are never logged."""
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.url.split(",") if url.strip()],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
    }
    if settings.token:
        options["token"] = settings.token
    if settings.user or settings.password:
        options["user"] = settings.user
        options["password"] = settings.password
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    if settings.tls_ca or settings.tls_cert or any(url.startswith("tls://") for url in options["servers"]):
        options["tls"] = tls_context(settings)
    return options


def tls_context(settings: NatsSettings) -> ssl.SSLContext:
    """Verify the server against `tls_ca` (or the system store); present a client cert when given."""
    try:
        context = ssl.create_default_context(cafile=settings.tls_ca)
        if settings.tls_cert:
            context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as error:
        raise SettingsError(f"setting nats.tls_*: cannot load TLS files: {error}") from None
    return context


def describe_server(settings: NatsSettings) -> str:
    """The server list without any credentials embedded in URLs, for logs."""
    cleaned = []
    for url in settings.url.split(","):
        scheme, sep, rest = url.strip().partition("://")
        cleaned.append(f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url.strip())
    return ",".join(cleaned)
