"""Connection options for nats-py built from settings: auth and TLS in one place for every stage.

Pure: it builds keyword arguments and an SSL context; the stages open the connections.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvledger.core.settings import NatsSettings, SettingsError


def connect_options(settings: NatsSettings, *, name: str) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` (servers, credentials, TLS); secrets are never logged."""
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.url.split(",") if url.strip()],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "ping_interval": settings.ping_interval_s,
        "max_outstanding_pings": settings.max_outstanding_pings,
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


class NatsAuthError(RuntimeError):
    """The NATS server refused our credentials: retrying cannot help, so services stop with this."""


_AUTH_MARKERS = ("authorization violation", "authentication", "user authentication expired", "permissions violation")


def is_auth_error(error: BaseException) -> bool:
    """Whether a nats-py error means the server rejected who we are (not that it is unreachable)."""
    if isinstance(error, BaseExceptionGroup):  # from a TaskGroup of services
        return any(is_auth_error(inner) for inner in error.exceptions)
    return is_refusal(str(error))


def is_refusal(text: str) -> bool:
    """Whether a server's words (e.g. an `-ERR` line) refuse who we are or what we may do."""
    text = text.lower()
    return any(marker in text for marker in _AUTH_MARKERS)


def auth_failure(settings: NatsSettings, error: BaseException) -> NatsAuthError:
    """A clear, secret-free message for a refused login."""
    used = [
        name for name, value in (
            ("nats.token", settings.token), ("nats.user/nats.password", settings.user or settings.password),
            ("nats.creds_file", settings.creds_file),
        ) if value
    ]
    credentials = ", ".join(used) if used else "no credentials (set nats.user/nats.password, nats.token or nats.creds_file)"
    while isinstance(error, BaseExceptionGroup):
        error = next(inner for inner in error.exceptions if is_auth_error(inner))
    refused = "a publish or subscription" if "permissions violation" in str(error).lower() else "the login"
    return NatsAuthError(f"NATS at {describe_server(settings)} refused {refused} ({error}); credentials used: {credentials}")
