"""`duet serve`: flags, startup log, API keys from a file (never logged), clean stop on
Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx2
import pytest

from deploy.cli import build_parser, main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_flags_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--port", "9000", "--api-key", "a", "--api-key", "b"]
    )
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 9000, ["a", "b"], "m")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--api-key", ""], "--api-key"),
        (["serve", "--api-key-file", "/no/such/file"], "--api-key-file"),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
    ],
)
def test_bad_serve_flags_fail_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_logs_where_it_listens_and_stops_cleanly_on_a_signal(
    tiny_llama: str, tmp_path: os.PathLike[str], stop_signal: signal.Signals
) -> None:
    key = "sk-from-a-file"
    key_file = os.path.join(tmp_path, "keys")
    with open(key_file, "w") as f:
        f.write(f"# accepted keys\n\n{key}\n")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "deploy.cli", "serve", "--model", tiny_llama, "--dtype", "float32",
        "--port", str(port), "--api-key-file", key_file, "--served-model-name", "tiny",
        "--shutdown-timeout", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx2.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        assert httpx2.get(f"{url}/v1/models").status_code == 401
        models = httpx2.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.json()["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(stop_signal)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}/v1" in err
    assert "engine stopped" in err
    assert key not in err + out
