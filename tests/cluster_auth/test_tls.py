"""Optional mTLS on the worker gRPC plane (cluster_auth/tls.py): with the three variables set,
a worker serves TLS only, asks for a client certificate, and the router's clients connect with
theirs; a plaintext client or one whose certificate another CA signed gets nothing; a partial
configuration is refused by name."""

from __future__ import annotations

import asyncio
import datetime

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from duet.cluster.decode_client import DecodeClient
from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.tls import SERVER_NAME, load_internal_tls
from duet.decode_worker.server import start_decode_server
from tests.cluster_auth.fake_worker import FakeWorker

SECRET = ClusterSecret("tls-" + "e" * 40)


def pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def issue(name: str, issuer_key=None, issuer_name=None, is_ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def write_pki(folder, tag):
    ca_key, ca = issue(f"{tag} CA", is_ca=True)
    key, cert = issue(f"{tag} member", ca_key, ca.subject)
    paths = {}
    for name, data in (
        ("cert", cert.public_bytes(serialization.Encoding.PEM)),
        ("key", pem_key(key)),
        ("ca", ca.public_bytes(serialization.Encoding.PEM)),
    ):
        paths[name] = folder / f"{tag}-{name}.pem"
        paths[name].write_bytes(data)
    return {
        "DUET_INTERNAL_TLS_CERT": str(paths["cert"]),
        "DUET_INTERNAL_TLS_KEY": str(paths["key"]),
        "DUET_INTERNAL_TLS_CA": str(paths["ca"]),
    }


def use(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_worker_grpc_over_mutual_tls(tmp_path, monkeypatch):
    ours, theirs = write_pki(tmp_path, "ours"), write_pki(tmp_path, "theirs")

    async def scenario():
        use(monkeypatch, ours)
        server, port = await start_decode_server(FakeWorker(), secret=SECRET)
        address = f"127.0.0.1:{port}"
        try:
            client = DecodeClient(address, SECRET)  # TLS with our certificate
            assert (await client.load()).num_blocks == 9
            await client.close()
            async with grpc.aio.insecure_channel(address) as plain:  # no TLS at all
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await plain.unary_unary("/duet.v1.DecodeWorker/GetLoad")(b"", timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            use(monkeypatch, theirs)  # a certificate from another CA
            stranger = DecodeClient(address, SECRET)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stranger.load(timeout_s=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            await stranger.close()
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_partial_tls_settings_are_refused_by_name(tmp_path):
    assert load_internal_tls({}) is None
    with pytest.raises(ValueError, match="DUET_INTERNAL_TLS_KEY: internal TLS needs"):
        load_internal_tls({"DUET_INTERNAL_TLS_CERT": "c", "DUET_INTERNAL_TLS_CA": "a"})
    env = write_pki(tmp_path, "x")
    env["DUET_INTERNAL_TLS_CA"] = str(tmp_path / "absent.pem")
    with pytest.raises(ValueError, match="DUET_INTERNAL_TLS_CA: cannot read"):
        load_internal_tls(env)
    assert "BEGIN" not in repr(load_internal_tls(write_pki(tmp_path, "y")))


def test_the_serve_flags_turn_tls_on_for_a_local_cluster_only(tmp_path):
    from duet.cli.main import build_parser
    from duet.cli.serve_cluster import internal_tls

    env = write_pki(tmp_path, "flags")
    files = [
        env["DUET_INTERNAL_TLS_CERT"],
        env["DUET_INTERNAL_TLS_KEY"],
        env["DUET_INTERNAL_TLS_CA"],
    ]
    flags = ["--internal-tls-cert", files[0], "--internal-tls-key", files[1]]
    parse = build_parser().parse_args
    assert internal_tls(parse(["serve", "--disaggregated"])) == {}
    assert (
        internal_tls(parse(["serve", "--disaggregated", *flags, "--internal-tls-ca", files[2]]))
        == env
    )
    with pytest.raises(ValueError, match="--internal-tls-ca: mTLS needs"):
        internal_tls(parse(["serve", "--disaggregated", *flags]))
    with pytest.raises(ValueError, match="--internal-tls-ca: cannot read"):
        internal_tls(parse(["serve", "--disaggregated", *flags, "--internal-tls-ca", "/absent"]))
    with pytest.raises(ValueError, match="--internal-tls-cert: with --ray-address, set"):
        internal_tls(
            parse(
                [
                    "serve",
                    "--disaggregated",
                    "--ray-address",
                    "auto",
                    *flags,
                    "--internal-tls-ca",
                    files[2],
                ]
            )
        )
