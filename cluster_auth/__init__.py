"""The internal plane's authentication: the cluster secret every duet process holds, gRPC call
credentials derived from it (`grpc_auth`), and the challenge-response that opens a KV channel
(`handshake`). docs/security.md has the threat model."""

from duet.cluster_auth.secret import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    ClusterSecret,
    MissingSecretError,
    load_cluster_secret,
    write_secret_file,
)

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "ClusterSecret",
    "MissingSecretError",
    "load_cluster_secret",
    "write_secret_file",
]
