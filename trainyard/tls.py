"""TLS for gRPC channels, shared by the SDK, the CLI and the services' own calls to each other (docs/security.md).

Without a CA or a client certificate a channel is plain TCP, the default for a local single-user install. With a CA
file, the server's certificate must be signed by it (and name the address dialled); with a client certificate and
key as well, the channel presents them for mutual TLS.
"""
from __future__ import annotations

import os
from pathlib import Path

import grpc


def channel_credentials(ca_file: str | os.PathLike | None, cert_file: str | os.PathLike | None = None,
                        key_file: str | os.PathLike | None = None) -> grpc.ChannelCredentials | None:
    """grpc.ChannelCredentials from PEM files; None (plain TCP) when neither a CA nor a client certificate is set."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a TLS client certificate and its key go together: set both or neither")
    if not (ca_file or cert_file):
        return None

    def read(path) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(key_file),
                                        certificate_chain=read(cert_file))
