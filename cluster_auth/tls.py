"""Optional mTLS on the internal gRPC plane (the workers' services and the router's clients).

On when every process has `DUET_INTERNAL_TLS_CERT`, `DUET_INTERNAL_TLS_KEY` and
`DUET_INTERNAL_TLS_CA` (PEM files: this process's certificate and key, and the CA that signed
every peer's, e.g. cert-manager's `tls.crt`, `tls.key`, `ca.crt`); off when none is set. Both
sides present certificates signed by the CA; workers are dialed by IP, so every certificate
carries the DNS name `SERVER_NAME`, which clients verify instead of the address. The cluster
secret's per-call credentials still apply on top (grpc_auth.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ENV_CERT = "DUET_INTERNAL_TLS_CERT"
ENV_KEY = "DUET_INTERNAL_TLS_KEY"
ENV_CA = "DUET_INTERNAL_TLS_CA"
SERVER_NAME = "duet-internal"
"""The DNS name (subjectAltName) every internal certificate carries."""


@dataclass(frozen=True)
class InternalTLS:
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def load_internal_tls(environ: Mapping[str, str] | None = None) -> InternalTLS | None:
    """This process's internal TLS material, or None when none of the variables is set.
    Raises ValueError naming a variable that is missing (some set, not all) or unreadable."""
    env = os.environ if environ is None else environ
    paths = {name: env.get(name, "") for name in (ENV_CERT, ENV_KEY, ENV_CA)}
    if not any(paths.values()):
        return None
    missing = [name for name, path in paths.items() if not path]
    if missing:
        raise ValueError(f"{missing[0]}: internal TLS needs {ENV_CERT}, {ENV_KEY} and {ENV_CA}")
    data = {}
    for name, path in paths.items():
        try:
            data[name] = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: cannot read {path}: {e.strerror}") from None
    return InternalTLS(data[ENV_CERT], data[ENV_KEY], data[ENV_CA])


def add_internal_port(server: grpc.aio.Server, address: str) -> int:
    """Bind `server` on `address`: TLS with client certificates when this process has internal
    TLS, else plaintext. The bound port (0: failed)."""
    tls = load_internal_tls()
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def internal_channel(address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    """A channel to a worker at `address`, over TLS when this process has internal TLS."""
    tls = load_internal_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)],
    )
