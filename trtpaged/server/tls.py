"""HTTPS for `serve` (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs): the settings checked
before the model loads, so that a wrong path or key fails at once and names its flag, and uvicorn's arguments."""

from __future__ import annotations

import os
import re
import ssl
from typing import Any, Optional

CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED


def _no_passphrase() -> str:
    # an encrypted key would make OpenSSL ask for its passphrase on the terminal; refused instead (vLLM has no
    # passphrase flag either)
    raise ValueError("the key is encrypted (give a key file without a passphrase)")


def check_tls(keyfile: Optional[str], certfile: Optional[str], ca_certs: Optional[str], cert_reqs: int) -> bool:
    """Whether the server speaks HTTPS (a certificate was given). Raises ValueError naming the setting (ssl_keyfile,
    ssl_certfile, ssl_ca_certs, ssl_cert_reqs) when the files cannot make a TLS server context as uvicorn makes it,
    or the settings do not fit together (a key or CA file without a certificate, client certificates asked for with
    no CA file to check them against)."""
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs: must be 0 (no client certificate), 1 (optional) or 2 (required), got "
                         f"{cert_reqs!r}")  # fmt: skip
    if certfile is None:
        for name, value in (("ssl_keyfile", keyfile), ("ssl_ca_certs", ca_certs)):
            if value is not None:
                raise ValueError(f"{name}: needs ssl_certfile (the server's certificate)")
        if cert_reqs:
            raise ValueError("ssl_cert_reqs: needs ssl_certfile (client certificates are asked for over TLS)")
        return False
    if cert_reqs and ca_certs is None:
        raise ValueError("ssl_cert_reqs: needs ssl_ca_certs (the CA certificates that clients' certificates are "
                         "checked against)")  # fmt: skip
    for name, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile), ("ssl_ca_certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{name}: no such file: {path!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the certificate alone first, so that a bad key is not blamed on it
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(certfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ssl_certfile: no PEM certificate in {certfile!r} ({_reason(exc)})") from None
    try:
        context.load_cert_chain(certfile, keyfile, _no_passphrase)
    except ValueError as exc:
        raise ValueError(f"ssl_keyfile: {exc}") from None
    except (OSError, ssl.SSLError) as exc:
        if keyfile is None:
            raise ValueError(f"ssl_certfile: {certfile!r} holds no private key for its certificate; give the key "
                             f"with ssl_keyfile ({_reason(exc)})") from None
        raise ValueError(f"ssl_keyfile: not a PEM private key of ssl_certfile's certificate: {_reason(exc)}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ssl_ca_certs: cannot load CA certificates from {ca_certs!r} ({_reason(exc)})") from None
    return True


def _reason(exc: BaseException) -> str:
    """OpenSSL's words without the source line: "[SSL] PEM lib (_ssl.c:3905)" -> "PEM lib"."""
    text = getattr(exc, "strerror", None) or str(exc)
    return re.sub(r"^\[[^\]]*\]\s*|\s*\(_ssl\.c:\d+\)$", "", text)[:200]


def uvicorn_tls(keyfile: Optional[str], certfile: Optional[str], ca_certs: Optional[str],
                cert_reqs: int) -> dict[str, Any]:  # fmt: skip
    """uvicorn.Config's keyword arguments for these settings ({} without a certificate)."""
    if certfile is None:
        return {}
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile, "ssl_ca_certs": ca_certs, "ssl_cert_reqs": cert_reqs}
