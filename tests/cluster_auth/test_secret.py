"""Where a process's cluster secret comes from, and a disaggregated `duet serve` joining a Ray
cluster without one failing at once, naming the variables."""

from __future__ import annotations

import os

import pytest

from duet.cli.main import main as duet_main
from duet.cluster_auth import (
    ClusterSecret,
    MissingSecretError,
    load_cluster_secret,
    write_secret_file,
)
from duet.cluster_auth.secret import remove_secret_file

A, B = "a" * 40, "b" * 40


def test_the_file_wins_over_the_variable(tmp_path):
    path = tmp_path / "s"
    path.write_text(A + "\n")
    from_file = load_cluster_secret(
        {"DUET_CLUSTER_SECRET_FILE": str(path), "DUET_CLUSTER_SECRET": B}
    )
    assert from_file.mac("x") == ClusterSecret(A).mac("x") != ClusterSecret(B).mac("x")
    assert load_cluster_secret({"DUET_CLUSTER_SECRET": B}).mac("x") == ClusterSecret(B).mac("x")


def test_missing_unreadable_and_short_secrets_are_named(tmp_path):
    with pytest.raises(
        MissingSecretError, match=r"DUET_CLUSTER_SECRET_FILE .* or DUET_CLUSTER_SECRET"
    ):
        load_cluster_secret({})
    with pytest.raises(MissingSecretError, match="DUET_CLUSTER_SECRET_FILE: cannot read"):
        load_cluster_secret({"DUET_CLUSTER_SECRET_FILE": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match=r"DUET_CLUSTER_SECRET: .*at least 32 characters; got 5"):
        load_cluster_secret({"DUET_CLUSTER_SECRET": "short"})


def test_a_generated_secret_file_is_private_and_removed():
    secret = ClusterSecret.generate()
    path = write_secret_file(secret)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(path.parent).st_mode & 0o777 == 0o700
        loaded = load_cluster_secret({"DUET_CLUSTER_SECRET_FILE": str(path)})
        assert loaded.mac("x") == secret.mac("x")
        assert ClusterSecret.generate().mac("x") != secret.mac("x")  # one per cluster
    finally:
        remove_secret_file(path)
    assert not path.exists() and not path.parent.exists()


def test_joining_a_ray_cluster_without_a_secret_fails_at_once(tiny_llama, monkeypatch, capsys):
    monkeypatch.delenv("DUET_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("DUET_CLUSTER_SECRET_FILE", raising=False)
    code = duet_main(
        ["serve", "--disaggregated", "--model", tiny_llama, "--ray-address", "127.0.0.1:1"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "duet: error: no cluster secret: set DUET_CLUSTER_SECRET_FILE" in err
