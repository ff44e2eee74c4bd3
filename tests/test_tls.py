"""Every door over HTTPS with certificates made here: the official MCP and A2A clients and plain
HTTPS reach them, plain HTTP fails cleanly, mutual TLS refuses a client without a certificate, and
bad TLS files stop `serve` with a message naming them."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server
from tests.helpers import a2a_v1_send


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_key=None, issuer_name: str | None = None, ca: bool = False, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer_name or subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(folder: Path, name: str, cert, key) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    pem = folder / f"{name}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = folder / f"{name}.key"
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pem, key_file


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _cert("test CA", ca_key, ca=True)
    ca_pem, _ = _write(folder, "ca", ca, ca_key)
    server_pem, server_key_file = _write(
        folder, "server", _cert("127.0.0.1", server_key, ca_key, "test CA", server=True), server_key
    )
    client_pem, client_key_file = _write(folder, "client", _cert("agent", client_key, ca_key, "test CA"), client_key)
    _, other_key = _write(folder, "other", _cert("other", _key()), _key())
    return {
        "ca": ca_pem,
        "cert": server_pem,
        "key": server_key_file,
        "client_cert": client_pem,
        "client_key": client_key_file,
        "other_key": other_key,
    }


def test_every_door_over_https_with_the_official_clients(index_dir, pki, tmp_path, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))  # httpx (and so both SDKs' clients) trust the test CA
    rest, a2a = free_port(), free_port()
    tls = ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
    server = start_server(
        serve_args(index_dir, rest, *tls, a2a_port=a2a), f"https://127.0.0.1:{rest}/health", tmp_path / "log"
    )
    try:
        hits = httpx.post(f"https://127.0.0.1:{rest}/search_nfcorpus", json={"query": "soy and prostate", "top_k": 2})
        assert hits.status_code == 200 and len(hits.json()["results"]) == 2
        card = httpx.get(f"https://127.0.0.1:{a2a}/.well-known/agent-card.json").json()
        assert json.dumps(card).count(f"https://127.0.0.1:{a2a}/") >= 1 and "http://" not in json.dumps(card)

        async def mcp_call():
            from mcp import Client

            async with Client(f"https://127.0.0.1:{rest}/mcp") as client:
                return await client.call_tool("search_nfcorpus", {"query": "coffee and the liver", "top_k": 2})

        assert not asyncio.run(mcp_call()).is_error
        from a2a.types.a2a_pb2 import Part

        task = a2a_v1_send(f"https://127.0.0.1:{a2a}/", [Part(text=json.dumps({"query": "statins", "top_k": 2}))])
        assert task is not None and len(task.artifacts) == 1

        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port: the connection fails, nothing hangs
            httpx.get(f"http://127.0.0.1:{rest}/health", timeout=5)
        assert httpx.get(f"https://127.0.0.1:{rest}/health").status_code == 200  # and the server carries on
    finally:
        assert stop_server(server) == 0


def test_mutual_tls_refuses_a_client_without_a_certificate(index_dir, pki, tmp_path):
    port = free_port()
    tls = ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), "--tls-client-ca", str(pki["ca"])]
    log = (tmp_path / "log").open("w")
    server = subprocess.Popen(CLI + serve_args(index_dir, port, *tls), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}/health"
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    mine = httpx.Client(verify=context)
    try:
        deadline = time.time() + 180
        while True:
            try:
                assert mine.get(url).status_code == 200
                break
            except httpx.HTTPError as exc:
                assert time.time() < deadline and server.poll() is None, f"{exc!r}: {(tmp_path / 'log').read_text()}"
                time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=ssl.create_default_context(cafile=str(pki["ca"])))
    finally:
        mine.close()
        server.terminate()
        assert server.wait(timeout=60) == 0


@pytest.mark.parametrize(
    "files, message",
    [
        (("cert", "other_key"), "the key does not belong to the certificate"),
        (("cert", None), "--tls-cert and --tls-key go together"),
        (("missing", "key"), "file not found"),
    ],
)
def test_bad_tls_files_stop_serve_with_a_clear_message(index_dir, pki, tmp_path, files, message, capsys):
    """Through ``main`` in this process: serve reads the TLS files before it loads anything."""
    from cli.main import main

    cert, key = files
    args = ["--tls-cert", str(pki.get(cert, tmp_path / "missing.pem"))]
    if key:
        args += ["--tls-key", str(pki[key])]
    assert main(serve_args(index_dir, free_port(), *args)) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and "Traceback" not in stderr
