"""TLS for every door: the certificate, key and client CA checked before anything is served, and
what uvicorn needs to serve them.

A missing, unreadable or mismatched file stops ``serve`` with a message naming it, rather than a
server that starts and then fails every handshake.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from serving.settings import Settings


class TlsError(ValueError):
    """The TLS files cannot serve: which file, and why."""


def tls_options(settings: Settings) -> dict:
    """uvicorn.Config keyword arguments for ``settings``' TLS files ({} when TLS is off)."""
    cert, key, client_ca = settings.security.tls_cert, settings.security.tls_key, settings.security.tls_client_ca
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked for in TLS")
        return {}
    if cert is None or key is None:
        raise TlsError("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        if path is not None and not Path(path).is_file():
            raise TlsError(f"{flag} {path}: file not found")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsError(f"--tls-cert {cert} / --tls-key {key}: {_reason(exc)}") from None
    except OSError as exc:
        raise TlsError(f"--tls-cert {cert} / --tls-key {key}: unreadable ({exc.strerror or exc})") from None
    options = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"--tls-client-ca {client_ca}: not a PEM CA bundle ({_reason(exc)})") from None
        options |= {"ssl_ca_certs": str(client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def scheme(settings: Settings) -> str:
    return "https" if settings.security.tls_cert is not None else "http"


def _reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None) or str(exc)
    if "KEY_VALUES_MISMATCH" in str(reason):
        return "the key does not belong to the certificate"
    if "PEM" in str(reason) or "NO_START_LINE" in str(reason):
        return f"not PEM ({reason})"
    return str(reason)
