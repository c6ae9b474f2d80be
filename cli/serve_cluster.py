"""`duet serve --disaggregated` and `python -m duet.cli.ray_job`: the cluster options, and
running a `DuetCluster` until Ctrl-C / SIGTERM (or the Ray job is stopped).

The engine flags (cli/engine_flags.py) reach every worker: each prefill rank builds a
`PrefillWorkerConfig` and each decode worker a `DecodeWorkerConfig` (both `EngineConfig`
subclasses) from them, with `--prefill-tp` as the prefill groups' and `--decode-tp` as the
decode workers' `tensor_parallel_size`."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from duet.cli.engine_flags import fail_on_field, parse_bytes
from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError

if TYPE_CHECKING:
    from duet.router.server import RouterConfig

logger = logging.getLogger("duet.serve")


def _count_or_auto(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto'; got {value!r}") from None


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated mode (Ray)")
    g.add_argument(
        "--disaggregated",
        action="store_true",
        help="run prefill and decode on separate Ray actors behind router actors",
    )
    g.add_argument(
        "--prefill-workers", type=_count_or_auto, default=1, metavar="N|auto",
        help="prefill groups; auto: one per --prefill-tp units of the cluster's 'prefill' "
        "resource, following nodes as they come and go (default: 1)",
    )  # fmt: skip
    g.add_argument("--prefill-tp", type=int, default=1, help="ranks per prefill group")
    g.add_argument(
        "--prefill-pp", type=int, default=1, metavar="P",
        help="pipeline stages per prefill group, each of --prefill-tp ranks (P x T ranks; "
        "each stage ships its layers' KV)",
    )  # fmt: skip
    g.add_argument(
        "--decode-workers", type=_count_or_auto, default=1, metavar="M|auto",
        help="decode workers; auto: one per --decode-tp units of the 'decode' resource "
        "(default: 1)",
    )  # fmt: skip
    g.add_argument(
        "--decode-tp", type=int, default=1,
        help="ranks per decode worker (tensor parallelism; any prefill TP hands KV to any "
        "decode TP, each decode rank receiving the KV heads it holds)",
    )  # fmt: skip
    for role in ("prefill", "decode"):
        g.add_argument(
            f"--{role}-ep", type=int, default=1, metavar="N",
            help=f"a mixture of experts: shard the routed experts over each {role} group's "
            f"--{role}-tp ranks, whole (1, or the same as --{role}-tp; prefill and decode "
            "choose independently)",
        )  # fmt: skip
        g.add_argument(
            f"--{role}-dp", type=int, default=1, metavar="D",
            help=f"a mixture of experts: each of the --{role}-workers groups is D whole {role} "
            "workers (each its own server and requests, TP 1) holding 1/D of the routed experts "
            "and exchanging them (data-parallel attention; default 1: none)",
        )  # fmt: skip
    g.add_argument(
        "--router-replicas",
        dest="routers",
        type=int,
        default=1,
        metavar="N",
        help="router actors, each serving REST and gRPC (they share the ports)",
    )
    g.add_argument(
        "--ray-address", default=None, metavar="ADDR",
        help="join this Ray cluster (e.g. 127.0.0.1:6379 or auto) instead of starting one "
        "with the resources the flags ask for",
    )  # fmt: skip
    g.add_argument(
        "--local-prefill-threshold", type=int, default=32, metavar="TOKENS",
        help="prompts with at most this many uncached tokens prefill on their decode worker",
    )  # fmt: skip
    g.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S",
        help="longest a request may take, retries included",
    )  # fmt: skip
    g.add_argument(
        "--kv-wait", type=float, default=90.0, metavar="S",
        help="how long a decode worker waits for a request's KV",
    )  # fmt: skip
    g.add_argument(
        "--kv-backend", choices=("auto", "tcp", "torch_dist", "nixl"), default="auto",
        help="how KV blocks move from prefill to decode workers: tcp (CPU caches, straight "
        "between the caches), torch_dist (gloo on CPU, NCCL on GPU), nixl (cache to cache over "
        "UCX: RDMA, CUDA IPC, shared memory; DUET_KV_NIXL_MODE=push to write instead of read); "
        "auto: tcp on CPU, torch_dist on GPU",
    )  # fmt: skip
    g.add_argument(
        "--kv-staging-memory", type=parse_bytes, default=None, metavar="BYTES",
        help="the staging pool each prefill rank and decode worker streams torch_dist and tcp "
        "transfers through (e.g. 256MiB, the default): a transfer of any length uses at most "
        "this much; on a GPU the KV pool leaves room for it",
    )  # fmt: skip
    g.add_argument(
        "--gpus-per-worker", type=float, default=None,
        help="GPUs per prefill rank and decode worker (default: 1 when the cluster has GPUs)",
    )  # fmt: skip
    g.add_argument(
        "--startup-timeout", type=float, default=900.0, metavar="S",
        help="how long to wait for every worker to load its model",
    )  # fmt: skip
    for name, what in (("cert", "this cluster's certificate"), ("key", "its private key"),
                       ("ca", "the CA that signed it")):  # fmt: skip
        g.add_argument(
            f"--internal-tls-{name}", default=None, metavar="PEM",
            help=f"mTLS on the workers' gRPC plane, one machine: {what} (all three or none; "
            "a Ray cluster's nodes set DUET_INTERNAL_TLS_CERT/KEY/CA instead)",
        )  # fmt: skip


def build_spec(args: argparse.Namespace, router: RouterConfig, engine: dict[str, Any]) -> Any:
    """The ClusterSpec of the flags; `ValueError` names a bad flag. `engine` holds the
    EngineConfig fields the command line set."""
    from duet.cluster.config import ClusterConfig
    from duet.deploy.cluster_spec import ClusterSpec
    from duet.prefill_worker.config import PrefillWorkerConfig

    if "tensor_parallel_size" in engine:
        raise ValueError(
            "--tensor-parallel-size: with --disaggregated, prefill groups shard across "
            "--prefill-tp ranks and decode workers across --decode-tp ranks; use those"
        )
    if engine.get("data_parallel_size", 1) != 1:
        raise ValueError(
            "--data-parallel-size: with --disaggregated, groups of data-parallel workers are "
            "--prefill-dp and --decode-dp; use those"
        )
    if engine.get("expert_parallel_size", 1) != 1:
        raise ValueError(
            "--expert-parallel-size: with --disaggregated, prefill groups shard experts with "
            "--prefill-ep and decode workers with --decode-ep; use those"
        )
    if engine.get("pipeline_parallel_size", 1) != 1:
        raise ValueError(
            "--pipeline-parallel-size: with --disaggregated, prefill groups split into stages "
            "with --prefill-pp; decode workers run one stage"
        )
    internal_tls(args)  # refused here, naming the flag, before Ray starts
    lease_s = PrefillWorkerConfig.kv_lease_s  # the dataclass field's default
    if not args.kv_wait > lease_s:  # a decode worker outwaits the blocks the sender holds
        raise ValueError(
            f"--kv-wait: must exceed the prefill workers' hold lease ({lease_s} s); "
            f"got {args.kv_wait}"
        )
    cluster = ClusterConfig(
        local_prefill_threshold=args.local_prefill_threshold,
        request_timeout_s=args.request_timeout,
        kv_wait_s=args.kv_wait,
        max_num_seqs_per_decode_worker=engine.get("max_num_seqs", EngineConfig.max_num_seqs),
        num_decode_workers=args.decode_workers or 1,
        scheduling_policy=engine.get("scheduling_policy", EngineConfig.scheduling_policy),
    )
    return ClusterSpec(
        model=engine.get("model"),
        engine={k: v for k, v in engine.items() if k != "model"},
        prefill_workers=args.prefill_workers,
        prefill_tp=args.prefill_tp,
        prefill_pp=args.prefill_pp,
        decode_workers=args.decode_workers,
        decode_tp=args.decode_tp,
        prefill_ep=args.prefill_ep,
        decode_ep=args.decode_ep,
        prefill_dp=args.prefill_dp,
        decode_dp=args.decode_dp,
        routers=args.routers,
        router=router,
        cluster=cluster,
        served_model_name=args.served_model_name,
        gpus_per_worker=args.gpus_per_worker or 0.0,
        kv_backend=args.kv_backend,
        kv_staging_bytes=args.kv_staging_memory,
    )


def internal_tls(args: argparse.Namespace) -> dict[str, str]:
    """The environment that turns mTLS on in a local cluster's processes (cluster_auth/tls.py)
    from the --internal-tls-* flags: all three or none, readable files, one machine only.
    `ValueError` names the flag."""
    from duet.cluster_auth.tls import ENV_CA, ENV_CERT, ENV_KEY

    flags = {"cert": ENV_CERT, "key": ENV_KEY, "ca": ENV_CA}
    given = {n: getattr(args, f"internal_tls_{n}", None) for n in flags}
    if not any(given.values()):
        return {}
    for name, path in given.items():
        if not path:
            raise ValueError(f"--internal-tls-{name}: mTLS needs --internal-tls-cert, -key and -ca")
        if not os.access(path, os.R_OK):
            raise ValueError(f"--internal-tls-{name}: cannot read {path}")
    if args.ray_address:
        raise ValueError(
            "--internal-tls-cert: with --ray-address, set DUET_INTERNAL_TLS_CERT, _KEY and _CA "
            "on every Ray node instead (docs/security.md)"
        )
    return {flags[n]: os.path.abspath(p) for n, p in given.items() if p}


def check_worker_configs(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    router: RouterConfig,
    engine: dict[str, Any],
) -> Any:
    """The ClusterSpec of the flags, once the configs its workers will build from it are
    valid: a refused engine value exits through `parser.error` naming its flag, here rather
    than in a worker actor after Ray has started."""
    from duet.decode_worker.config import DecodeWorkerConfig
    from duet.prefill_worker.config import PrefillWorkerConfig

    spec = build_spec(args, router, engine)
    check_gpu_placement(args, spec)
    for role, config_cls in (("prefill", PrefillWorkerConfig), ("decode", DecodeWorkerConfig)):
        try:
            config_cls.from_kwargs(**spec.worker_config(role))
        except InvalidInputError as e:
            if e.field == "kv_staging_bytes":  # a worker config's field, not an engine flag
                parser.error(f"--kv-staging-memory: {e.message}")
            fail_on_field(parser, e)
    return spec


def check_gpu_placement(args: argparse.Namespace, spec: Any) -> None:
    """Refuse, before Ray starts, a GPU placement that would put a prefill rank and a decode
    worker on one GPU while their KV moves over NCCL (torch_dist with CUDA caches), which
    refuses two ranks of one communicator on one device. `ValueError` names the flags."""
    import torch

    if spec.engine.get("device", "auto") == "cpu" or spec.kv_backend in ("tcp", "nixl"):
        return  # CPU caches: KV moves over tcp or gloo; nixl moves it between two processes
        # on one GPU too (UCX's CUDA IPC)
    if not torch.cuda.is_available():
        return
    ways_out = (
        "give each prefill rank and decode worker a whole GPU, serve aggregated (without "
        "--disaggregated), or keep the model on the CPU (--device cpu)"
    )
    gpus = args.gpus_per_worker
    if gpus is not None and gpus < 1:
        raise ValueError(
            f"--gpus-per-worker: {gpus:g} lets Ray put a prefill rank and a decode worker on one "
            f"GPU, and NCCL (--kv-backend {spec.kv_backend}: torch_dist on GPUs) cannot move KV "
            f"between two processes on one GPU; {ways_out}"
        )
    if args.ray_address:
        return  # a cluster's GPUs are Ray's to place (one each, from --gpus-per-worker)
    num_prefill = spec.prefill_workers if spec.prefill_workers is not None else 1
    num_decode = spec.decode_workers if spec.decode_workers is not None else 1
    needed = num_prefill * spec.prefill_ranks + num_decode * spec.decode_ranks
    have = torch.cuda.device_count()
    if needed > have:
        stages = f" x --prefill-pp {spec.prefill_pp}" if spec.prefill_pp > 1 else ""
        raise ValueError(
            f"--prefill-workers {num_prefill} x --prefill-tp {spec.prefill_tp}{stages} + "
            f"--decode-workers {num_decode} x --decode-tp {spec.decode_tp} need {needed} GPUs, "
            f"one each (NCCL cannot move KV "
            f"between two processes on one GPU); this machine has {have}: lower them, or "
            f"{ways_out}"
        )


def serve_disaggregated(args: argparse.Namespace, spec: Any) -> int:
    """Start (or join) Ray, bring `spec`'s cluster up and supervise it until told to stop."""
    import ray

    from duet.cluster_auth import load_cluster_secret
    from duet.cluster_auth.secret import remove_secret_file
    from duet.deploy.local_ray import start_local_ray
    from duet.deploy.ray_cluster import NAMESPACE, DuetCluster
    from duet.engine.loader import open_model

    arch = open_model(spec.model).arch  # a bad model fails here, before any actor starts
    check_group_sizes(spec, arch.num_attention_heads, arch.num_hidden_layers)
    check_data_parallel(spec, arch.moe)
    secret_file = None
    if args.ray_address:
        load_cluster_secret()  # a cluster's processes share its secret (Helm: from a Secret)
        ray.init(address=args.ray_address, namespace=NAMESPACE, log_to_driver=True)
    else:
        os.environ.update(internal_tls(args))  # forwarded to the Ray processes
        secret_file = start_local_ray(spec)  # a new secret; Ray detects this machine's GPUs
    if args.gpus_per_worker is None and ray.cluster_resources().get("GPU", 0) > 0:
        spec = _with_gpus(spec, 1.0)  # one GPU per prefill rank and decode worker
    from duet.deploy.stop_signal import StopSignal

    stop = StopSignal()  # a handler that only sets a flag (deploy/stop_signal.py says why)
    cluster = DuetCluster(spec)
    try:
        cluster.start(args.startup_timeout)
        for r in cluster.routers:
            logger.info(
                "duet cluster ready: REST http://%s:%s/v1, gRPC %s:%s (%s prefill group(s) of "
                "TP %d x PP %d, %d decode worker(s) of TP %d)",
                spec.router.host, r.rest_port, spec.router.host, r.grpc_port, len(cluster.groups),
                spec.prefill_tp, spec.prefill_pp, len(cluster.decodes), spec.decode_tp,
            )  # fmt: skip
        cluster.run(stop)
    finally:
        stop.restore()  # a second signal during shutdown acts as it did before
        logger.info("stopping the cluster")
        cluster.shutdown()
        ray.shutdown()
        if secret_file is not None:
            remove_secret_file(secret_file)
    return 0


def check_group_sizes(spec: Any, num_heads: int, num_layers: int) -> None:
    """`ValueError` naming --prefill-tp, --prefill-pp or --decode-tp when the model cannot be
    split that way (every rank needs a query head, every stage a layer; any prefill TP hands
    KV to any decode TP)."""
    from duet.engine.parallel import check_tp_size
    from duet.engine.pipeline import check_pp_size

    try:
        for flag, tp in (("--prefill-tp", spec.prefill_tp), ("--decode-tp", spec.decode_tp)):
            check_tp_size(tp, num_heads, flag)
        check_pp_size(spec.prefill_pp, num_layers, "--prefill-pp")
    except InvalidInputError as e:
        raise ValueError(str(e)) from e


def check_data_parallel(spec: Any, moe: Any) -> None:
    """`ValueError` naming --prefill-dp or --decode-dp when the model has no routed experts
    to exchange, or they do not split into that many whole shares."""
    from duet.engine.model.moe import check_ep_size

    for flag, dp in (("--prefill-dp", spec.prefill_dp), ("--decode-dp", spec.decode_dp)):
        if dp == 1:
            continue
        if moe is None:
            raise ValueError(f"{flag}: needs a mixture of experts (the model is dense)")
        try:
            check_ep_size(dp, moe)
        except InvalidInputError as e:
            raise ValueError(f"{flag}: {e.message}") from e


def _with_gpus(spec: Any, gpus: float) -> Any:
    import dataclasses

    return dataclasses.replace(spec, gpus_per_worker=gpus)
