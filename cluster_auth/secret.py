"""`ClusterSecret`: the key every process of one duet cluster shares, and where it comes from.

A process reads it from `DUET_CLUSTER_SECRET_FILE` (a file holding it: what the Helm chart
mounts from its Secret and what `duet serve --disaggregated` writes for a local cluster), else
from `DUET_CLUSTER_SECRET`. The secret is never logged, never put in a repr, and never sent:
peers prove they know it with HMACs over fresh values (`grpc_auth`, `handshake`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

ENV_SECRET = "DUET_CLUSTER_SECRET"
ENV_SECRET_FILE = "DUET_CLUSTER_SECRET_FILE"
MIN_SECRET_CHARS = 32
"""A shorter secret is refused: 32 random characters is what an attacker must guess."""


class MissingSecretError(RuntimeError):
    """No cluster secret in this process's environment."""


class ClusterSecret:
    """The shared key. `mac` derives every proof from it, separated by purpose, so a proof made
    for one use (a gRPC call, a KV sender's answer) is never valid for another."""

    __slots__ = ("_key",)

    def __init__(self, text: str, source: str = "the cluster secret") -> None:
        text = text.strip()
        if len(text) < MIN_SECRET_CHARS:
            raise ValueError(
                f"{source}: a cluster secret needs at least {MIN_SECRET_CHARS} characters; "
                f"got {len(text)}"
            )
        self._key = text.encode()

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32))

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 over `purpose` and `parts`, each length-prefixed (no two different
        lists of parts hash the same bytes)."""
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (purpose.encode(), *parts):
            h.update(struct.pack("!I", len(part)))
            h.update(part)
        return h.digest()

    def text(self) -> str:
        """The secret itself: only for writing it to a private file."""
        return self._key.decode()

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    def __reduce__(self) -> None:  # type: ignore[override]
        # NOTE: never pickled: Ray would carry it in the clear to another process.
        raise TypeError("a ClusterSecret is not sent between processes; each one loads it")


def load_cluster_secret(environ: Mapping[str, str] | None = None) -> ClusterSecret:
    """This process's cluster secret: `DUET_CLUSTER_SECRET_FILE`'s content, else
    `DUET_CLUSTER_SECRET`. Raises MissingSecretError naming both when neither is set."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_SECRET_FILE)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise MissingSecretError(
                f"{ENV_SECRET_FILE}: cannot read {path}: {e.strerror}"
            ) from None
        return ClusterSecret(text, f"{ENV_SECRET_FILE} ({path})")
    value = env.get(ENV_SECRET)
    if value:
        return ClusterSecret(value, ENV_SECRET)
    raise MissingSecretError(
        f"no cluster secret: set {ENV_SECRET_FILE} (a file holding it) or {ENV_SECRET} for every "
        "duet process; `duet serve --disaggregated` makes one for a local cluster and the Helm "
        "chart mounts one from a Secret (docs/security.md)"
    )


SECRET_DIR_PREFIX = "duet-secret-"
OWNER_FILE = "owner-pid"
"""In each secret directory: the process that made it, so the next start can tell a
directory left by a process that was killed (hard, no clean-up) from one still in use."""


def write_secret_file(secret: ClusterSecret, directory: str | None = None) -> Path:
    """Write `secret` to a new file only this user can read, in a new private directory (under
    `directory`, default the system's temporary one) that names this process as its owner.
    The caller removes it (`remove_secret_file`)."""
    folder = Path(tempfile.mkdtemp(prefix=SECRET_DIR_PREFIX, dir=directory))  # mode 0700
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    path = folder / "cluster-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.text())
    return path


def remove_secret_file(path: Path) -> None:
    """Remove the secret and the private directory `write_secret_file` made for it."""
    path.unlink(missing_ok=True)
    if path.parent.name.startswith(SECRET_DIR_PREFIX):
        shutil.rmtree(path.parent, ignore_errors=True)


def remove_stale_secret_dirs(directory: str | None = None) -> list[Path]:
    """Remove this user's secret directories (under `directory`, default the system's
    temporary one) whose owner process is gone: a `duet serve` killed with SIGKILL never
    removes its own. A directory without an owner file, or whose owner runs, is left alone.
    Returns the directories removed."""
    removed = []
    for folder in Path(directory or tempfile.gettempdir()).glob(SECRET_DIR_PREFIX + "*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner == os.getpid() or _is_running(owner):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid: running
        return True
    return True
