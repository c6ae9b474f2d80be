"""`duet serve`: flags, startup log, API keys from a file (never logged), REST and gRPC in one
process, clean stop on Ctrl-C or SIGTERM (in-flight streams end with an error, not a cut)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.cli.main import build_parser, main
from duet.v1 import serving_pb2, serving_pb2_grpc
from tests.net import free_port
from tests.waiting import wait_for


def test_serve_flags_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--port", "9000", "--api-key", "a", "--api-key", "b"]
    )
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 9000, ["a", "b"], "m")
    assert (args.grpc_port, args.session_store) == (50051, None)
    assert (args.rate_limit_rpm, args.rate_limit_tpm) == (None, None)
    args = build_parser().parse_args(
        ["serve", "--grpc-port", "0", "--session-store", "redis://h:1/0", "--rate-limit-rpm", "5"]
    )
    assert (args.grpc_port, args.session_store, args.rate_limit_rpm) == (0, "redis://h:1/0", 5)
    args = build_parser().parse_args(["serve", "--served-model-name", "main", "gpt-4o-mini"])
    assert args.served_model_name == ["main", "gpt-4o-mini"]
    assert build_parser().parse_args(["serve", "--served-model-name=one"]).served_model_name == [
        "one"
    ]


def test_page_metrics_and_tracing_flags_reach_the_router_config(tmp_path: Path) -> None:
    from duet.cli.serve import _router_config
    from duet.router.server import RouterConfig

    store = ["--session-store", f"sqlite:///{tmp_path}/s.db"]
    args = build_parser().parse_args(["serve", *store])
    config = _router_config(args, [])
    assert (config.web_ui, config.metrics_prefix, config.otlp_endpoint) == (True, "duet", None)
    assert config.metrics_open is False
    argv = ["serve", *store, "--no-ui", "--metrics-prefix", "vllm", "--otlp-endpoint", "h:4317",
            "--metrics-open"]  # fmt: skip
    config = _router_config(build_parser().parse_args(argv), [])
    assert (config.web_ui, config.metrics_prefix, config.otlp_endpoint) == (False, "vllm", "h:4317")
    assert config.metrics_open is True
    with pytest.raises(ValueError, match="--metrics-prefix: must be one of duet, vllm; got 'x'"):
        RouterConfig(metrics_prefix="x")


def test_the_embedding_pooling_reaches_the_router_config(tmp_path: Path) -> None:
    from duet.cli.serve import _router_config
    from duet.router.server import RouterConfig

    store = ["--session-store", f"sqlite:///{tmp_path}/s.db"]
    assert _router_config(build_parser().parse_args(["serve", *store]), []).embedding_pooling == (
        "auto"
    )
    argv = ["serve", *store, "--embedding-pooling", "cls"]
    assert _router_config(build_parser().parse_args(argv), []).embedding_pooling == "cls"
    with pytest.raises(
        ValueError, match="--embedding-pooling: must be one of auto, last, mean, cls; got 'max'"
    ):
        RouterConfig(embedding_pooling="max")


def test_request_chat_templates_are_trusted_only_with_the_flag(tmp_path: Path) -> None:
    from duet.cli.serve import _router_config

    store = ["--session-store", f"sqlite:///{tmp_path}/s.db"]
    config = _router_config(build_parser().parse_args(["serve", *store]), [])
    assert config.chat_options.trust_request_chat_template is False
    argv = ["serve", *store, "--trust-request-chat-template"]
    config = _router_config(build_parser().parse_args(argv), [])
    assert config.chat_options.trust_request_chat_template is True


def test_the_queue_event_ttl_and_retention_reach_the_router_config(tmp_path: Path) -> None:
    from duet.cli.serve import _router_config
    from duet.session_store import DEFAULT_EVENT_TTL_S, DEFAULT_RETENTION_S

    store = ["--session-store", f"sqlite:///{tmp_path}/s.db"]
    config = _router_config(build_parser().parse_args(["serve", *store]), [])
    assert config.queue_event_ttl_s == DEFAULT_EVENT_TTL_S == 86400
    assert config.queue_retention_s == DEFAULT_RETENTION_S == 30 * 86400
    argv = ["serve", *store, "--queue-event-ttl", "600", "--queue-retention", "7200"]
    config = _router_config(build_parser().parse_args(argv), [])
    assert (config.queue_event_ttl_s, config.queue_retention_s) == (600, 7200)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--api-key", ""], "--api-key"),
        (["serve", "--api-key-file", "/no/such/file"], "--api-key-file"),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
        (["serve", "--grpc-port", "-1"], "--grpc-port"),
        (
            ["serve", "--port", "8777", "--grpc-port", "8777"],
            "--grpc-port: must differ from --port (both 8777)",
        ),
        (["serve", "--session-store", "mysql://db/x"], "--session-store"),
        (["serve", "--queue-url", "kafka://b:9092"], "--queue-url: unsupported scheme 'kafka'"),
        (["serve", "--queue-lease", "0"], "--queue-lease: must be > 0"),
        (["serve", "--queue-max-deliveries", "0"], "--queue-max-deliveries: must be >= 1"),
        (["serve", "--queue-event-ttl", "0"], "--queue-event-ttl: must be > 0"),
        (["serve", "--queue-event-ttl", "inf"], "--queue-event-ttl: must be > 0"),
        (["serve", "--queue-retention", "0"], "--queue-retention: must be > 0"),
        (["serve", "--queue-retention", "nan"], "--queue-retention: must be > 0"),
        (["serve", "--rate-limit-rpm", "0"], "--rate-limit-rpm"),
        (["serve", "--rate-limit-tpm", "nan"], "--rate-limit-tpm"),
        (["serve", "--disaggregated", "--kv-wait", "30"], "--kv-wait"),
        (["serve", "--disaggregated", "--request-timeout", "60"], "--request-timeout"),
        (["serve", "--disaggregated", "--router-replicas", "0"], "--router-replicas"),
        (["serve", "--disaggregated", "--prefill-tp", "0"], "--prefill-tp"),
        (
            ["serve", "--disaggregated", "--prefill-pp", "0"],
            "--prefill-pp: must be an integer >= 1",
        ),
        (["serve", "--disaggregated", "--decode-tp", "0"], "--decode-tp: must be an integer >= 1"),
        (
            ["serve", "--disaggregated", "--prefill-tp", "2", "--prefill-ep", "3"],
            "--prefill-ep: must be 1 or the group's tensor-parallel size 2",
        ),
        (
            ["serve", "--disaggregated", "--decode-ep", "2"],
            "--decode-ep: must be 1 or the group's tensor-parallel size 1",
        ),
    ],
)
def test_bad_serve_flags_fail_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tp"])
def test_group_sizes_the_model_cannot_split_fail_before_ray_starts(
    flag: str, tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--disaggregated", "--model", tiny_llama, flag, "5"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: must be between 1 and the model's num_attention_heads (4); got 5" in err


def test_more_prefill_stages_than_layers_fail_before_ray_starts(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--disaggregated", "--model", tiny_llama, "--prefill-pp", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "--prefill-pp: must be an integer between 1 and the model's num_hidden_layers (2); "
        "got 3" in err
    )


def _truncated_gguf(tmp_path: Path, num_bytes: int) -> str:
    from duet.engine.loader import resolve_model_path

    path = tmp_path / f"cut-{num_bytes}.gguf"
    with open(resolve_model_path(None), "rb") as whole:
        path.write_bytes(whole.read(num_bytes))
    return str(path)


@pytest.mark.parametrize(
    ("model", "line"),
    [
        ("/no/such/model", "duet: error: model path '/no/such/model' does not exist"),
        (4, "duet: error: model: {} is not a readable GGUF file (truncated or corrupt? IndexError"),
        (1 << 20, "duet: error: model: {} is not a readable GGUF file (truncated or corrupt? "),
    ],
)
def test_a_bad_model_exits_2_with_one_line_and_no_traceback(
    tmp_path: Path, model: str | int, line: str
) -> None:
    """What a user sees in the terminal: the one `duet: error:` line naming the model, nothing
    else (the engine thread used to log the same error with its traceback first)."""
    path = model if isinstance(model, str) else _truncated_gguf(tmp_path, model)
    proc = subprocess.run(
        [sys.executable, "-m", "duet.cli", "serve", "--model", path, "--grpc-port", "0",
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    [printed] = [x for x in proc.stderr.splitlines() if not x.startswith("Loading ")]
    assert printed.startswith(line.format(path)), proc.stderr


def test_unknown_kv_backend_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--disaggregated", "--kv-backend", "rdma"])
    assert exc.value.code == 2
    assert "--kv-backend: invalid choice: 'rdma'" in capsys.readouterr().err


def test_a_taken_grpc_port_fails_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--grpc-port", str(port)]) == 2
    assert f"--grpc-port: cannot bind 127.0.0.1:{port}" in capsys.readouterr().err


class _LogReader:
    """Collects a child's stderr lines as they come, so a test can wait for one."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stderr is not None
        self._stderr = proc.stderr
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, proc: subprocess.Popen[str], timeout_s: float) -> re.Match:
        def logged() -> re.Match | None:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            return next(filter(None, (re.search(pattern, line) for line in list(self.lines))), None)

        try:
            return wait_for(logged, timeout_s, f"a log line matching {pattern!r}", 0.05)
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.text()}") from None

    def text(self, timeout_s: float = 0) -> str:
        self._thread.join(timeout_s)
        return "".join(self.lines)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_logs_where_it_listens_and_stops_cleanly_on_a_signal(
    tiny_llama: str, tmp_path: os.PathLike[str], stop_signal: signal.Signals
) -> None:
    key = "sk-from-a-file"
    key_file = os.path.join(tmp_path, "keys")
    with open(key_file, "w") as f:
        f.write(f"# accepted keys\n\n{key}\n")
    port = free_port()
    cmd = [
        sys.executable, "-m", "duet.cli", "serve", "--model", tiny_llama, "--dtype", "float32",
        "--port", str(port), "--grpc-port", "0", "--api-key-file", key_file,
        "--served-model-name", "tiny", "--shutdown-timeout", "0",
        "--session-store", f"sqlite:///{os.path.join(tmp_path, 'sessions.db')}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    log = _LogReader(proc)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    body = {"messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 1000, "ignore_eos": True}  # fmt: skip
    try:
        grpc_port = int(
            log.wait_for(r"gRPC API \(duet\.v1\.Duet\) on 127\.0\.0\.1:(\d+)", proc, 60)[1]
        )
        assert grpc_port != 0
        assert httpx2.get(f"{url}/ready", timeout=5).status_code == 200
        assert httpx2.get(f"{url}/v1/models").status_code == 401
        page = httpx2.get(f"{url}/")  # the web chat: open, its data behind the key
        assert page.status_code == 200 and "<title>duet chat</title>" in page.text
        models = httpx2.get(f"{url}/v1/models", headers=auth)
        assert models.json()["data"][0]["id"] == "tiny"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service="duet.v1.Duet"), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            # The same key for both APIs.
            stub = serving_pb2_grpc.DuetStub(channel)
            with pytest.raises(grpc.RpcError) as denied:
                stub.ListModels(serving_pb2.ListModelsRequest(), timeout=10)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = (("authorization", f"Bearer {key}"),)
            opts = serving_pb2.SamplingOptions(max_tokens=1000, ignore_eos=True)
            grpc_stream = stub.Generate(
                serving_pb2.GenerateRequest(text="go on", sampling=opts), metadata=metadata,
                timeout=30,
            )  # fmt: skip
            next(grpc_stream)
            # Streams in flight at the signal end with an error (shutdown timeout 0), not a cut.
            with httpx2.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30
            ) as rest_stream:
                lines = rest_stream.iter_lines()
                assert next(lines).startswith("data: {")
                proc.send_signal(stop_signal)
                events = [line for line in lines if line]
            with pytest.raises(grpc.RpcError) as ended:
                list(grpc_stream)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        # A failed stream ends with its error event and no [DONE] (a client never reads it as
        # whole; issue 47 item 7).
        assert "data: [DONE]" not in events
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable"
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(stop_signal)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    err = log.text(timeout_s=5)
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}/v1" in err
    assert "engine stopped" in err
    frozen = re.search(r"froze (\d+) start-up objects", err)  # the serving process's heap
    assert frozen is not None and int(frozen[1]) > 10_000, err
    assert key not in err + out


def test_serve_dummy_weights_from_a_config_alone_answers(tmp_path: Path) -> None:
    """`--load-format dummy` with a folder holding only config.json: random weights, the
    byte-level tokenizer (one token per byte), a completion of exactly max_tokens tokens."""
    from openai import OpenAI

    model = tmp_path / "config-only"
    model.mkdir()
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    port = free_port()
    cmd = [
        sys.executable, "-m", "duet.cli", "serve", "--model", str(model), "--load-format",
        "dummy", "--device", "cpu", "--dtype", "float32", "--port", str(port), "--grpc-port",
        "0", "--num-kv-blocks", "64", "--no-ui",
        "--session-store", f"sqlite:///{tmp_path / 'sessions.db'}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = _LogReader(proc)
    try:
        log.wait_for(r"gRPC API \(duet\.v1\.Duet\) on", proc, 60)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=30)
        assert [m.id for m in client.models.list().data] == ["config-only"]
        reply = client.completions.create(
            model="config-only", prompt="héllo", max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (6, 6)
        assert reply.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    err = log.text(timeout_s=5)
    assert "using a byte-level tokenizer of 512 ids" in err
    assert proc.returncode == 0, err


@pytest.mark.parametrize(
    "flags",
    [
        ["--tensor-parallel-size", "2"],
        ["--pipeline-parallel-size", "2"],
        ["--data-parallel-size", "2", "--expert-parallel-size", "2"],  # a mixture of experts
    ],
    ids=["tp", "pp", "dp"],
)
def test_serve_with_tensor_parallel_ranks_answers_as_one_rank(
    tmp_path: Path, flags: list[str]
) -> None:
    """`duet serve --tensor-parallel-size 2` (or 2 pipeline stages, or two data-parallel
    ranks exchanging a Qwen3-MoE's experts): the server process is rank 0, rank 1 a child
    process; a greedy completion equals the offline engine's at one rank (dummy weights are the
    same at every TP size, stage and expert range), and SIGTERM stops both ranks."""
    from openai import OpenAI

    from duet.engine import LLM, SamplingParams
    from tests.conftest import ARCH_CONFIGS

    model = tmp_path / "config-only"
    model.mkdir()
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    if "--data-parallel-size" in flags:
        config = {**config, **ARCH_CONFIGS["qwen3_moe"], "head_dim": 16}
    (model / "config.json").write_text(json.dumps(config))
    kwargs = dict(load_format="dummy", dtype="float32", num_kv_blocks=64, load_progress=False)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLM(str(model), **kwargs).generate(["héllo"], greedy)[0].outputs[0].text
    port = free_port()
    cmd = [
        sys.executable, "-m", "duet.cli", "serve", "--model", str(model), "--load-format",
        "dummy", "--device", "cpu", "--dtype", "float32", "--port", str(port), "--grpc-port",
        "0", "--num-kv-blocks", "64", "--no-ui", *flags,
        "--session-store", f"sqlite:///{tmp_path / 'sessions.db'}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = _LogReader(proc)
    try:
        log.wait_for(r"gRPC API \(duet\.v1\.Duet\) on", proc, 120)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=30)
        reply = client.completions.create(
            model="config-only", prompt="héllo", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].text == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    err = log.text(timeout_s=5)
    assert proc.returncode == 0, err
    assert "engine stopped" in err
    assert "did not stop; killing it" not in err  # rank 1 left on rank 0's Stop
