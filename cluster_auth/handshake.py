"""The challenge-response that opens every KV connection, before any frame is read.

    receiver -> sender:  MAGIC (8 bytes) + nonce_r (32 random bytes)
    sender -> receiver:  nonce_s (32 random bytes) + HMAC(secret, "kv-sender", nonce_r, nonce_s)
    receiver -> sender:  HMAC(secret, "kv-receiver", nonce_r, nonce_s)

Both sides prove they hold the cluster secret without sending it; each proof covers the
other side's fresh nonce, so none can be replayed, and the two are keyed for their direction,
so a proof the receiver asks for is never one a sender could be tricked into giving back. A
receiver that is not convinced closes the connection without answering. Every message has a
fixed size: garbage cannot make either side allocate or wait for more than 64 bytes, and the
caller's socket timeouts bound every read."""

from __future__ import annotations

import hmac
import os
import socket

from duet.cluster_auth.secret import ClusterSecret

MAGIC = b"DUETKV\x01\x00"
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthenticationError(ConnectionError):
    """The peer did not prove the cluster secret (or is not a duet KV peer)."""


def challenge(sock: socket.socket, secret: ClusterSecret) -> None:
    """The receiver's side, on a connection it accepted. Raises AuthenticationError (or the
    socket's OSError) unless the sender proved the secret; the caller closes the socket then."""
    nonce_r = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_r)
    try:
        answer = _read_exact(sock, NONCE_BYTES + MAC_BYTES)
    except ConnectionError as e:
        raise AuthenticationError(f"no answer to the challenge: {e}") from None
    nonce_s, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, secret.mac("kv-sender", nonce_r, nonce_s)):
        raise AuthenticationError("the sender did not prove the cluster secret")
    sock.sendall(secret.mac("kv-receiver", nonce_r, nonce_s))


def respond(sock: socket.socket, secret: ClusterSecret, peer: str) -> None:
    """The sender's side, on a connection it opened to receiver `peer`. Raises
    AuthenticationError unless the receiver proved the secret too."""
    try:
        opening = _read_exact(sock, len(MAGIC) + NONCE_BYTES)
    except ConnectionError as e:
        raise AuthenticationError(f"KV receiver {peer} sent no challenge: {e}") from None
    if opening[: len(MAGIC)] != MAGIC:
        raise AuthenticationError(f"{peer} is not a duet KV receiver (or runs another version)")
    nonce_r, nonce_s = opening[len(MAGIC) :], os.urandom(NONCE_BYTES)
    sock.sendall(nonce_s + secret.mac("kv-sender", nonce_r, nonce_s))
    try:
        proof = _read_exact(sock, MAC_BYTES)
    except ConnectionError:
        raise AuthenticationError(
            f"KV receiver {peer} refused this sender: it holds a different cluster secret"
        ) from None
    if not hmac.compare_digest(proof, secret.mac("kv-receiver", nonce_r, nonce_s)):
        raise AuthenticationError(f"KV receiver {peer} did not prove the cluster secret")


def _read_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buf = bytearray()
    while len(buf) < num_bytes:
        chunk = sock.recv(num_bytes - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


# -- over a rendezvous store (torch_dist's TCPStore), where both sides read and write keys --


def store_challenge() -> str:
    """The receiver's fresh nonce for one channel, as the store holds it."""
    return os.urandom(NONCE_BYTES).hex()


def store_proof(secret: ClusterSecret, role: str, channel: str, challenge_hex: str) -> str:
    """`role` ("sender" or "receiver")'s proof for `channel` against the receiver's challenge."""
    return secret.mac(f"kv-store-{role}", channel.encode(), challenge_hex.encode()).hex()


def check_store_proof(
    secret: ClusterSecret, role: str, channel: str, challenge_hex: str, proof: object
) -> bool:
    """Constant-time: `proof` is `role`'s proof for `channel` and `challenge_hex`."""
    want = store_proof(secret, role, channel, challenge_hex)
    return isinstance(proof, str) and hmac.compare_digest(want.encode(), proof.encode())
