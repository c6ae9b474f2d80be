"""`duet-planner` (or `python -m duet.deploy.planner`): flags, each also settable through the
environment as DUET_PLANNER_<FLAG> (e.g. DUET_PLANNER_GPU_BUDGET=16); a flag wins."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from duet.deploy.planner.config import PlannerConfig, PlannerConfigError, PoolConfig
from duet.deploy.stop_signal import StopSignal

ENV_PREFIX = "DUET_PLANNER_"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duet-planner",
        description="Scale duet's prefill and decode Deployments to meet TTFT/TPOT SLOs "
        "within a GPU budget.",
        epilog=f"Every flag can also come from the environment as {ENV_PREFIX}<FLAG>.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every decision")
    where = p.add_argument_group("what to watch and scale")
    where.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"))
    where.add_argument("--prefill-deployment", required=True)
    where.add_argument("--decode-deployment", required=True)
    where.add_argument(
        "--metrics-service", help="router Service whose EndpointSlices list the routers"
    )
    where.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a router's /metrics URL (repeatable; instead of --metrics-service)",
    )
    where.add_argument("--metrics-port", type=int, default=8000, help="REST port of routers")
    where.add_argument("--api-key-file", help="duet keys file; its first key reads /metrics")
    where.add_argument("--kube-api", help="API server URL (default: in-cluster service account)")
    where.add_argument("--kube-token-file", help="bearer token for --kube-api")
    loop = p.add_argument_group("control loop")
    loop.add_argument("--interval-s", type=float, default=15.0)
    loop.add_argument("--scrape-timeout-s", type=float, default=5.0)
    loop.add_argument("--dry-run", action="store_true", help="log decisions, patch nothing")
    loop.add_argument("--health-port", type=int, default=8080, help="GET /healthz; 0: off")
    policy = p.add_argument_group("policy (see docs/kubernetes.md: how the planner decides)")
    defaults = PlannerConfig()
    for name in (
        "gpu_budget", "ttft_p90_target_s", "tpot_p90_target_s",
        "prefill_queued_tokens_per_replica", "decode_occupancy_target", "hysteresis",
        "scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_stabilization_s",
        "max_scale_up_factor", "min_samples",
    ):  # fmt: skip
        default = getattr(defaults, name)
        policy.add_argument(
            "--" + name.replace("_", "-"), type=type(default), default=default,
            help=f"(default: {default})",
        )  # fmt: skip
    for pool in ("prefill", "decode"):
        group = p.add_argument_group(f"{pool} pool")
        for field, default in (
            ("min_replicas", 1), ("max_replicas", 4), ("gpus_per_replica", 1),
            ("workers_per_replica", 1), ("pods_per_group", 1),
        ):  # fmt: skip
            group.add_argument(
                f"--{pool}-{field.replace('_', '-')}", type=int, default=default,
                help=f"(default: {default})",
            )  # fmt: skip
    return p


def _apply_env(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Environment values as flags placed before `argv`, so an explicit flag wins."""
    from_env: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value.strip().lower() in ("1", "true", "yes", "on"):
                from_env.append(flag)
        else:
            from_env.append(f"{flag}={value}")
    return [*from_env, *argv]


def config_from_args(args: argparse.Namespace) -> PlannerConfig:
    pools = {
        pool: PoolConfig(
            name=pool,
            min_replicas=getattr(args, f"{pool}_min_replicas"),
            max_replicas=getattr(args, f"{pool}_max_replicas"),
            gpus_per_replica=getattr(args, f"{pool}_gpus_per_replica"),
            workers_per_replica=getattr(args, f"{pool}_workers_per_replica"),
            pods_per_group=getattr(args, f"{pool}_pods_per_group"),
        )
        for pool in ("prefill", "decode")
    }
    return PlannerConfig(
        prefill=pools["prefill"],
        decode=pools["decode"],
        gpu_budget=args.gpu_budget,
        ttft_p90_target_s=args.ttft_p90_target_s,
        tpot_p90_target_s=args.tpot_p90_target_s,
        prefill_queued_tokens_per_replica=args.prefill_queued_tokens_per_replica,
        decode_occupancy_target=args.decode_occupancy_target,
        hysteresis=args.hysteresis,
        scale_up_cooldown_s=args.scale_up_cooldown_s,
        scale_down_cooldown_s=args.scale_down_cooldown_s,
        scale_down_stabilization_s=args.scale_down_stabilization_s,
        max_scale_up_factor=args.max_scale_up_factor,
        min_samples=args.min_samples,
    )


def read_api_key(path: str) -> str:
    """The first key of a duet keys file (one per line; blank lines and # comments skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            key = line.strip()
            if key and not key.startswith("#"):
                return key
    raise PlannerConfigError(f"--api-key-file: {path} holds no key")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_apply_env(parser, sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        if not args.namespace:
            raise PlannerConfigError("--namespace: required (or POD_NAMESPACE)")
        if not args.metrics_service and not args.metrics_url:
            raise PlannerConfigError("--metrics-service or --metrics-url: one is required")
        if args.interval_s <= 0:
            raise PlannerConfigError(f"--interval-s: must be > 0; got {args.interval_s}")
        api_key = read_api_key(args.api_key_file) if args.api_key_file else None
    except (PlannerConfigError, OSError) as e:
        print(f"duet-planner: error: {e}", file=sys.stderr)
        return 2

    from duet.deploy.planner.controller import Controller, PoolTargets, RouterScraper, serve_health
    from duet.deploy.planner.kube import DeploymentScaler, RouterEndpoints, api_client
    from duet.deploy.planner.policy import ScalingPolicy

    token = None
    if args.kube_token_file:
        with open(args.kube_token_file, encoding="utf-8") as f:
            token = f.read().strip()
    api = api_client(args.kube_api, token)
    static_urls = list(args.metrics_url)

    def find_urls() -> list[str]:
        if static_urls:
            return static_urls
        return RouterEndpoints(
            api, args.namespace, args.metrics_service, default_port=args.metrics_port
        ).metrics_urls()

    controller = Controller(
        ScalingPolicy(config),
        DeploymentScaler(api, args.namespace),
        RouterScraper(find_urls, api_key, timeout_s=args.scrape_timeout_s),
        PoolTargets(args.prefill_deployment, args.decode_deployment),
        dry_run=args.dry_run,
    )
    stop = StopSignal()  # a handler that only sets a flag (deploy/stop_signal.py says why)
    try:
        if args.health_port:
            # Three intervals plus the worst-case time of the calls inside one step.
            max_age_s = 3 * args.interval_s + 4 * args.scrape_timeout_s + 30
            serve_health(controller, args.health_port, max_age_s)
        logging.getLogger("duet.planner").info(
            "planning %s/%s and %s/%s%s",
            args.namespace, args.prefill_deployment, args.namespace, args.decode_deployment,
            " (dry run)" if args.dry_run else "",
        )  # fmt: skip
        controller.run(args.interval_s, stop)
    finally:
        stop.restore()
    logging.getLogger("duet.planner").info("stopped")
    return 0
