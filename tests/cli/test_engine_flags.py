"""The engine flags of `duet serve`, `duet generate` and `duet chat`: one per `EngineConfig`
field (a new field without a flag fails here), exact values reaching the config the CLI builds
(also the disaggregated workers' configs), and bad values as argparse errors naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from duet.cli.engine_flags import (
    build_config,
    field_docs,
    flag_names,
    given_engine_flags,
    parse_bytes,
)
from duet.cli.main import build_parser, main
from duet.cli.serve_cluster import check_worker_configs
from duet.decode_worker.config import DecodeWorkerConfig
from duet.engine.config import EngineConfig
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.router.server import RouterConfig

COMMANDS = ("serve", "generate", "chat")
FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def command_parser(name: str) -> argparse.ArgumentParser:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    args = build_parser().parse_args(argv)
    return args.command_parser, args


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_config_field_has_a_flag(command: str) -> None:
    flags = {action.dest: action.option_strings for action in command_parser(command)._actions}
    missing = [name for name in FIELDS if name not in flags]
    assert missing == [], f"EngineConfig fields without a `duet {command}` flag: {missing}"
    spelled = {"kv_cache_memory_bytes": "--kv-cache-memory"}  # vLLM's spelling
    for name in FIELDS:
        assert flags[name][0] == spelled.get(name, "--" + name.replace("_", "-"))


def test_every_field_has_a_docstring_for_its_help() -> None:
    docs = field_docs(EngineConfig)
    assert sorted(name for name in FIELDS if not docs.get(name)) == []
    help_text = {a.dest: a.help for a in command_parser("serve")._actions}
    assert help_text["block_size"] == (
        "Tokens per KV block: the unit of allocation, prefix caching and transfer. (default: 16)"
    )


def test_vllm_spellings() -> None:
    assert flag_names("kv_cache_memory_bytes") == ("--kv-cache-memory", "--kv-cache-memory-bytes")
    assert flag_names("tensor_parallel_size") == ("--tensor-parallel-size", "-tp")
    assert flag_names("data_parallel_size") == ("--data-parallel-size", "-dp")
    assert flag_names("max_num_batched_tokens") == ("--max-num-batched-tokens",)


@pytest.mark.parametrize("command", COMMANDS)
def test_no_engine_flags_give_the_dataclass_defaults(command: str) -> None:
    parser, args = parse([command, "hi"] if command == "generate" else [command])
    assert all(getattr(args, name) is None for name in FIELDS)  # None: "not given"
    assert build_config(parser, args) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_reach_the_engine_config(command: str) -> None:
    argv = [
        command, "--model", "/models/m", "--tokenizer", "/models/t", "--dtype", "float32",
        "--device", "cpu", "--block-size", "32", "--num-kv-blocks", "100",
        "--kv-cache-memory", "4GiB", "--gpu-memory-utilization", "0.5", "--enforce-eager",
        "--cuda-graph-mode", "piecewise", "--max-num-batched-tokens", "512", "--max-num-seqs", "3", "--max-model-len", "1024",
        "--no-enable-prefix-caching", "--no-deterministic", "--scheduling-policy", "priority",
        "-tp", "2", "-pp", "2", "--expert-parallel-size", "2", "-dp", "1",
        "--num-threads", "1", "--seed", "7", "--attention-backend", "torch",
        "--prefill-attention", "sdpa",
        "--no-load-progress", "--load-format", "dummy",
        "--hf-overrides", '{"rope_theta": 10000.0}', "--quantization", "int4", "--quantization-group-size", "64", "--quantization-symmetric",
        "--quantize-lm-head",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
    ]  # fmt: skip
    parser, args = parse([*argv, "hi"] if command == "generate" else argv)
    expected = dict(
        model="/models/m", tokenizer="/models/t", dtype="float32", device="cpu", block_size=32,
        num_kv_blocks=100, kv_cache_memory_bytes=4 * 2**30, gpu_memory_utilization=0.5,
        enforce_eager=True, cuda_graph_mode="piecewise", max_num_batched_tokens=512, max_num_seqs=3, max_model_len=1024,
        enable_prefix_caching=False, deterministic=False, scheduling_policy="priority",
        tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2,
        data_parallel_size=1, num_threads=1, seed=7, attention_backend="torch",
        prefill_attention="sdpa", load_progress=False, load_format="dummy",
        hf_overrides={"rope_theta": 10000.0}, quantization="int4", quantization_group_size=64,
        quantization_symmetric=True, quantize_lm_head=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )  # fmt: skip
    assert sorted(expected) == sorted(FIELDS)  # a new field: add it here too
    assert build_config(parser, args) == EngineConfig(**expected)


def test_boolean_flags_have_both_spellings() -> None:
    for flag, expected in (
        ("--no-enable-prefix-caching", False),
        ("--enable-prefix-caching", True),
        ("--enforce-eager", True),
        ("--no-enforce-eager", False),
    ):
        parser, args = parse(["serve", flag])
        name = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        assert getattr(build_config(parser, args), name) is expected


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("123", 123), ("4GiB", 4 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
     ("2kb", 2000), ("1TiB", 2**40), ("7B", 7)],
)  # fmt: skip
def test_kv_cache_memory_units(text: str, num_bytes: int) -> None:
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--block-size", "0"], "--block-size: must be an integer >= 1; got 0"),
        (
            ["serve", "--gpu-memory-utilization", "2"],
            "--gpu-memory-utilization: must be a number in (0, 1]; got 2.0",
        ),
        (["generate", "--max-num-seqs", "0", "hi"], "--max-num-seqs: must be an integer >= 1"),
        (["chat", "-tp", "0"], "--tensor-parallel-size: must be an integer >= 1; got 0"),
        (["chat", "--num-kv-blocks", "0"], "--num-kv-blocks: must be an integer >= 1; got 0"),
        (["serve", "--kv-cache-memory", "0"], "--kv-cache-memory: must be an integer >= 1"),
        (["serve", "--kv-cache-memory", "4G"], "--kv-cache-memory/--kv-cache-memory-bytes: must"),
        (["serve", "--kv-cache-memory", "0.5B"], "must be a whole number of bytes; got '0.5B'"),
        (["generate", "--block-size", "x", "hi"], "--block-size: invalid int value: 'x'"),
        (["chat", "--hf-overrides", "[1]"], "--hf-overrides: must be a JSON object"),
        (["chat", "--hf-overrides", "{"], "--hf-overrides: not valid JSON"),
        (
            ["serve", "--speculative-config", '{"method": "ngram", "k": 3}'],
            "--speculative-config: 'k' is not a key; known keys are method, ",
        ),
        (
            [
                "generate",
                "--speculative-config",
                '{"method": "ngram", "prompt_lookup_min": 0}',
                "hi",
            ],
            "--speculative-config: 'prompt_lookup_min' must be an integer in [1, 1024]; got 0",
        ),
        (["serve", "--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
        (
            ["generate", "-tp", "2", "--expert-parallel-size", "4", "hi"],
            "--expert-parallel-size: must be 1 or tensor_parallel_size (2)",
        ),
        (["serve", "--scheduling-policy", "lifo"], "--scheduling-policy: invalid choice: 'lifo'"),
        (["serve", "--load-format", "pt"], "--load-format: invalid choice: 'pt'"),
        (["generate", "--temperature", "-1", "hi"], "--temperature: must be >= 0; got -1.0"),
    ],
)
def test_bad_values_are_argparse_errors_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert f"duet {argv[0]}: error:" in err and "Traceback" not in err


def test_disaggregated_workers_get_the_engine_flags() -> None:
    parser, args = parse(
        ["serve", "--disaggregated", "--model", "m", "--block-size", "32", "--max-num-seqs", "7",
         "--no-enable-prefix-caching", "--dtype", "float32", "--prefill-tp", "2", "--decode-tp", "3"]
    )  # fmt: skip
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    prefill = PrefillWorkerConfig.from_kwargs(**spec.worker_config("prefill"))
    decode = DecodeWorkerConfig.from_kwargs(**spec.worker_config("decode"))
    for config in (prefill, decode):
        assert (config.model, config.block_size, config.max_num_seqs) == ("m", 32, 7)
        assert (config.enable_prefix_caching, config.dtype) == (False, "float32")
        assert config.load_progress is False  # workers load quietly unless asked
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (2, 3)
    assert spec.cluster.max_num_seqs_per_decode_worker == 7


def test_disaggregated_workers_get_the_staging_pool(capsys: pytest.CaptureFixture[str]) -> None:
    parser, args = parse(["serve", "--disaggregated", "--kv-staging-memory", "64MiB"])
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    for role, config_cls in (("prefill", PrefillWorkerConfig), ("decode", DecodeWorkerConfig)):
        assert config_cls.from_kwargs(**spec.worker_config(role)).kv_staging_bytes == 64 << 20
    parser, args = parse(["serve", "--disaggregated"])
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    assert "kv_staging_bytes" not in spec.worker_config("decode")  # the config's default
    parser, args = parse(["serve", "--disaggregated", "--kv-staging-memory", "512KiB"])
    with pytest.raises(SystemExit) as exc:
        check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    assert exc.value.code == 2
    assert (
        "--kv-staging-memory: must be in [1048576, 1099511627776] bytes" in capsys.readouterr().err
    )


def test_only_decode_workers_get_the_speculative_config() -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 2}'
    parser, args = parse(["serve", "--disaggregated", "--speculative-config", config])
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    decode = DecodeWorkerConfig.from_kwargs(**spec.worker_config("decode"))
    prefill = PrefillWorkerConfig.from_kwargs(**spec.worker_config("prefill"))
    assert decode.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert prefill.speculative_config is None


@pytest.mark.parametrize("where", ["decode", "prefill", "auto"])
def test_prefill_workers_get_a_draft_they_prefill(
    where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With draft_prefill prefill or auto the prefill workers load the draft too (to compute its
    prompt KV), which refuses prefill and decode tensor parallelism naming the key."""
    draft = {"method": "draft_model", "model": "d", "draft_prefill": where}
    parser, args = parse(["serve", "--disaggregated", "--speculative-config", json.dumps(draft)])
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    prefill = PrefillWorkerConfig.from_kwargs(**spec.worker_config("prefill"))
    assert prefill.speculative_config == (None if where == "decode" else draft)
    parser, args = parse(
        ["serve", "--disaggregated", "--prefill-tp", "2", "--speculative-config", json.dumps(draft)]
    )
    if where == "decode":
        assert check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
        return
    with pytest.raises(SystemExit):
        check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    err = capsys.readouterr().err
    assert f"--speculative-config: 'draft_prefill' '{where}' prefills the draft on" in err
    # and it lands whole on one decode rank
    parser, args = parse(
        ["serve", "--disaggregated", "--decode-tp", "2", "--speculative-config", json.dumps(draft)]
    )
    with pytest.raises(SystemExit):
        check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    err = capsys.readouterr().err
    assert f"--speculative-config: 'draft_prefill' '{where}' sends the draft's prompt KV" in err


def test_disaggregated_groups_shard_experts_independently() -> None:
    """--prefill-ep and --decode-ep: each role's engines get their own expert_parallel_size."""
    parser, args = parse(
        ["serve", "--disaggregated", "--model", "m", "--prefill-tp", "2", "--prefill-ep", "2",
         "--decode-tp", "2"]
    )  # fmt: skip
    spec = check_worker_configs(parser, args, RouterConfig(), given_engine_flags(args))
    prefill = PrefillWorkerConfig.from_kwargs(**spec.worker_config("prefill"))
    decode = DecodeWorkerConfig.from_kwargs(**spec.worker_config("decode"))
    assert (prefill.expert_parallel_size, decode.expert_parallel_size) == (2, 1)
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (2, 2)


def test_disaggregated_tensor_parallel_size_points_to_prefill_tp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--disaggregated", "-tp", "2"]) == 2
    assert "--tensor-parallel-size: with --disaggregated" in capsys.readouterr().err


def test_generate_samples_reproducibly_with_the_engine_seed(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def sample(seed: str) -> str:
        argv = ["generate", "--model", tiny_llama, "--dtype", "float32", "--temperature", "1",
                "--max-tokens", "24", "--no-load-progress", "--seed", seed, "hello"]  # fmt: skip
        assert main(argv) == 0
        return capsys.readouterr().out

    first = sample("5")
    assert sample("5") == first
    assert sample("6") != first


def test_docs_list_every_engine_flag() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    rows = {line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| `--")}
    assert sorted(f"`{name}`" for name in FIELDS if f"`{name}`" not in rows) == []


def test_disaggregated_pipeline_stages_point_to_the_group_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--disaggregated", "-pp", "2"]) == 2
    assert (
        "--pipeline-parallel-size: with --disaggregated, prefill groups split into stages "
        "with --prefill-pp; decode workers run one stage" in capsys.readouterr().err
    )


def test_disaggregated_data_parallelism_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--disaggregated", "-dp", "2", "--expert-parallel-size", "2"]) == 2
    assert (
        "--data-parallel-size: with --disaggregated, groups of data-parallel workers are "
        "--prefill-dp and --decode-dp" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode-dp", "2", "--decode-tp", "2"],
         "--decode-dp: data-parallel decode workers run at TP and PP 1 (each a whole worker); "
         "got --decode-tp 2"),
        (["--prefill-dp", "2", "--prefill-pp", "2"],
         "--prefill-dp: data-parallel prefill workers run at TP and PP 1 (each a whole worker); "
         "got --prefill-tp 1, --prefill-pp 2"),
        (["--decode-dp", "0"], "--decode-dp: must be an integer >= 1; got 0"),
        (["--decode-dp", "2"], "--decode-dp: needs a mixture of experts (the model is dense)"),
    ],
)  # fmt: skip
def test_bad_data_parallel_groups_are_refused_before_ray_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--disaggregated", *argv]) == 2
    assert message in capsys.readouterr().err


def test_disaggregated_expert_parallelism_points_to_the_group_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Prefill groups and decode workers each shard experts over their own ranks: the engine's
    --expert-parallel-size is refused naming --prefill-ep and --decode-ep."""
    assert main(["serve", "--disaggregated", "--expert-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "--expert-parallel-size: with --disaggregated, prefill groups shard experts with "
        "--prefill-ep and decode workers with --decode-ep; use those" in err
    )
