"""`DuetCluster`: places duet's processes on a Ray cluster and keeps them serving.

Placement, by Ray custom resources (so that on Kubernetes each lands on the right pods):
- a prefill group is `prefill_tp` x `prefill_pp` `PrefillRankActor`s (tensor-parallel ranks
  of each pipeline stage) in a STRICT_PACK placement group, one `prefill` resource (and one
  GPU on GPU clusters) per rank;
- a decode worker is `decode_tp` `DecodeRankActor`s placed the same way, one `decode`
  resource (and GPU) per rank;
- with `prefill_dp` / `decode_dp` D, a group is D whole workers of one rank each (a mixture's
  data-parallel attention) in a PACK placement group: on one node when one has room, else
  spread over as few as hold them (a DeepSeek-sized group over two 8-GPU nodes); each serves,
  and is published to the routers as a worker of its own (`{group}-dp{rank}`);
- a router is a `RouterActor` on one `router` resource, serving REST and gRPC.
On one machine `deploy.local_ray.start_local_ray` provides exactly the resources asked for.

Keeping it serving (`reconcile`, every second from `run`): Ray restarts dead actors
(`max_restarts=-1`); a restarted rank breaks its group (a prefill group, or a tensor-parallel
decode worker), so every rank of the group is restarted and the group re-formed; workers without a live, started process are left out of the
registry the routers get (`RouterActor.set_workers`), which is re-sent whenever it changes and
every few seconds (a restarted router starts empty). With `prefill_workers` / `decode_workers`
None ("auto") the pools follow the cluster's `prefill` / `decode` resources (per
`prefill_ranks` or `decode_ranks` units) as nodes join
and leave, which is how the Kubernetes planner scales them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from duet.deploy.cluster_spec import ClusterSpec
from duet.deploy.ray_actors import DecodeRankActor, PrefillRankActor, RouterActor
from duet.deploy.stop_signal import Stopper

logger = logging.getLogger("duet.cluster")

NAMESPACE = "duet"
_INFO_TIMEOUT_S = 5.0
_REPUBLISH_S = 5.0


@dataclass
class _Group:
    """A worker's ranks: a prefill group, or a decode worker (of one rank or more)."""

    role: str  # "prefill" or "decode"
    name: str
    pg: PlacementGroup
    ranks: list[Any]
    starting: list[Any] | None = None  # start() calls in flight
    endpoint: str | None = None  # rank 0's gRPC address once started
    endpoints: list[str] = field(default_factory=list)  # every rank's that serves (data-parallel)
    address: str | None = None  # the endpoint while every rank is healthy, else None
    incarnations: list[str] = field(default_factory=list)

    @property
    def actor(self) -> Any:
        """Rank 0's actor: the one serving the worker's gRPC service."""
        return self.ranks[0]


@dataclass
class _Router:
    name: str
    actor: Any
    incarnation: str | None = None
    rest_port: int | None = None
    grpc_port: int | None = None


def _registry(groups: list[_Group]) -> dict[str, str]:
    """The healthy workers the routers get: a group's rank 0, or each worker of a
    data-parallel group under `{group}-dp{rank}`."""
    out: dict[str, str] = {}
    for g in groups:
        if not g.address:
            continue
        if len(g.endpoints) > 1:
            out.update({f"{g.name}-dp{r}": address for r, address in enumerate(g.endpoints)})
        else:
            out[g.name] = g.address
    return out


class DuetCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.groups: list[_Group] = []
        self.decodes: list[_Group] = []
        self.routers: list[_Router] = []
        self._counter = 0
        self._published: tuple[dict[str, str], dict[str, str]] | None = None
        self._published_at = 0.0
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> None:
        """Create the routers and pools and wait until every one of them serves."""
        spec = self.spec
        for i in range(spec.routers):
            self.routers.append(self._new_router(i))
        for _ in range(self._wanted_decode()):
            self.decodes.append(self._new_decode())
        for _ in range(self._wanted_groups()):
            self.groups.append(self._new_group())
        deadline = time.monotonic() + timeout_s
        while True:
            self.reconcile()
            if self.is_complete():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not come up within {timeout_s:.0f}s")
            time.sleep(0.25)

    def is_complete(self) -> bool:
        return (
            all(r.rest_port is not None for r in self.routers)
            and all(d.address for d in self.decodes)
            and all(g.address for g in self.groups)
        )

    def run(self, stop: Stopper, interval_s: float = 1.0) -> None:
        while not stop.wait(interval_s):
            try:
                self.reconcile()
            except Exception:  # one bad pass must not end supervision
                logger.exception("reconcile failed")

    def shutdown(self) -> None:
        for router in self.routers:
            try:
                ray.get(router.actor.stop.remote(), timeout=30)
            except Exception:
                pass
        actors = [r.actor for r in self.routers]
        actors += [a for g in self.groups + self.decodes for a in g.ranks]
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for group in self.groups + self.decodes:
            remove_placement_group(group.pg)

    # -- supervision -------------------------------------------------------------------------

    def reconcile(self) -> None:
        """One pass: notice restarts and deaths, re-form broken groups, follow the cluster's
        resources in auto mode, and publish the registry to the routers."""
        with self._lock:
            infos = self._infos()
            for router in self.routers:
                self._check_router(router, infos.get(id(router.actor)))
            for group in self.groups + self.decodes:
                self._check_group(group, [infos.get(id(a)) for a in group.ranks])
            self._autoscale()
            self._publish()

    def _infos(self) -> dict[int, dict[str, Any] | None]:
        actors = [r.actor for r in self.routers]
        actors += [a for g in self.groups + self.decodes for a in g.ranks]
        refs = [a.info.remote() for a in actors]
        ray.wait(refs, num_returns=len(refs), timeout=_INFO_TIMEOUT_S)
        out: dict[int, dict[str, Any] | None] = {}
        for actor, ref in zip(actors, refs, strict=True):
            try:
                out[id(actor)] = ray.get(ref, timeout=0)
            except Exception:  # dead, restarting, or still loading its model
                out[id(actor)] = None
        return out

    def _check_router(self, router: _Router, info: dict[str, Any] | None) -> None:
        if info is None or not info["started"]:
            router.rest_port = None
            return
        if info["incarnation"] != router.incarnation:
            if router.incarnation is not None:
                logger.warning("router %s restarted", router.name)
            router.incarnation = info["incarnation"]
            self._published = None  # a new router knows no workers yet
            if router.rest_port is None:
                logger.info(
                    "router %s: REST on port %s, gRPC on port %s",
                    router.name, info["rest_port"], info["grpc_port"],
                )  # fmt: skip
        router.rest_port, router.grpc_port = info["rest_port"], info["grpc_port"]

    def _check_group(self, group: _Group, infos: list[dict[str, Any] | None]) -> None:
        group.address = None
        if group.starting is not None:
            done, _ = ray.wait(group.starting, num_returns=len(group.starting), timeout=0)
            if len(done) < len(group.starting):
                return
            try:
                served = ray.get(group.starting)
                group.endpoint = served[0]
                group.endpoints = [a for a in served if a] if len(served) > 1 else []
                logger.info("%s %s serving at %s", group.role, group.name, group.endpoint)
            except Exception as e:
                logger.warning("%s %s failed to start: %s", group.role, group.name, e)
            group.starting = None
        if any(i is None for i in infos):
            return  # a rank is restarting or unreachable: wait for it
        ranks = [i for i in infos if i is not None]
        incarnations = [i["incarnation"] for i in ranks]
        if all(i["started"] and i["alive"] for i in ranks) and group.endpoint:
            if not group.incarnations:
                group.incarnations = incarnations
            if incarnations == group.incarnations:
                group.address = group.endpoint
                return
        started = [a for a, i in zip(group.ranks, ranks, strict=True) if i["started"]]
        group.endpoint, group.incarnations = None, []
        if started:
            # A rank came back without its group, or a rank's engine died: the whole group
            # restarts (a torch.distributed group cannot take a new member).
            logger.warning("%s %s is broken: restarting its ranks", group.role, group.name)
            for actor in started:
                ray.kill(actor, no_restart=False)
            return
        init = ray.get(group.ranks[0].rendezvous.remote(), timeout=_INFO_TIMEOUT_S)
        group.starting = [actor.start.remote(init) for actor in group.ranks]

    def _autoscale(self) -> None:
        wanted = self._wanted_groups()
        while len(self.groups) < wanted:
            self.groups.append(self._new_group())
        while len(self.groups) > wanted:
            victim = min(self.groups, key=lambda g: g.address is not None)
            self.groups.remove(victim)
            for actor in victim.ranks:
                ray.kill(actor, no_restart=True)
            remove_placement_group(victim.pg)
        wanted = self._wanted_decode()
        while len(self.decodes) < wanted:
            self.decodes.append(self._new_decode())
        while len(self.decodes) > wanted:
            victim = min(self.decodes, key=lambda d: d.address is not None)
            self.decodes.remove(victim)
            for actor in victim.ranks:
                ray.kill(actor, no_restart=True)
            remove_placement_group(victim.pg)

    def _publish(self) -> None:
        registry = (_registry(self.groups), _registry(self.decodes))
        now = time.monotonic()
        if registry == self._published and now - self._published_at < _REPUBLISH_S:
            return
        if registry != self._published:
            logger.info(
                "serving with prefill %s, decode %s", sorted(registry[0]), sorted(registry[1])
            )  # fmt: skip
        for router in self.routers:
            router.actor.set_workers.remote(*registry)
        self._published, self._published_at = registry, now

    # -- creation --------------------------------------------------------------------------

    def _wanted_groups(self) -> int:
        if self.spec.prefill_workers is not None:
            return self.spec.prefill_workers
        return int(ray.cluster_resources().get("prefill", 0) // self.spec.prefill_ranks)

    def _wanted_decode(self) -> int:
        if self.spec.decode_workers is not None:
            return self.spec.decode_workers
        return max(1, int(ray.cluster_resources().get("decode", 0) // self.spec.decode_ranks))

    def _next_name(self, role: str) -> str:
        self._counter += 1
        return f"duet-{role}-{self._counter}"

    def _new_router(self, index: int) -> _Router:
        spec = self.spec
        actor = (
            ray.remote(RouterActor)
            .options(
                name=f"duet-router-{index}",
                namespace=NAMESPACE,
                resources={"router": 1},
                num_cpus=0,
                max_restarts=-1,
                max_concurrency=4,
            )
            .remote(
                spec.model,
                spec.router,
                spec.cluster,
                spec.served_model_name,
                spec.engine.get("tokenizer"),
                spec.engine.get("max_model_len"),
            )
        )
        return _Router(f"duet-router-{index}", actor)

    def _new_decode(self) -> _Group:
        spec = self.spec
        return self._new_ranks("decode", DecodeRankActor, spec.decode_ranks, spec.decode_dp > 1)

    def _new_group(self) -> _Group:
        spec = self.spec
        return self._new_ranks("prefill", PrefillRankActor, spec.prefill_ranks, spec.prefill_dp > 1)

    def _new_ranks(self, role: str, actor_cls: type, tp: int, peers: bool) -> _Group:
        """A worker's `tp` ranks (all its stages') in one placement group, one `role`
        resource (and GPU) each; started by `_check_group` once every rank is up. STRICT_PACK
        (one node) for tensor-parallel ranks; PACK for a data-parallel group's workers
        (`peers`): on one node when one has room (their exchange through shared memory or
        NVLink), else over as few as hold them (gloo, or NCCL, between the nodes)."""
        spec = self.spec
        name = self._next_name(role)
        bundle: dict[str, float] = {role: 1}
        if spec.gpus_per_worker:
            bundle["GPU"] = spec.gpus_per_worker
        strategy = "PACK" if peers else "STRICT_PACK"
        pg = placement_group([dict(bundle) for _ in range(tp)], strategy=strategy)
        ranks: list[Any] = [
            ray.remote(actor_cls)
            .options(
                name=f"{name}-rank{rank}",
                namespace=NAMESPACE,
                num_cpus=0,
                num_gpus=spec.gpus_per_worker,
                resources={role: 1},
                max_restarts=-1,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, rank),
                runtime_env=spec.worker_runtime_env(),
            )
            .remote(spec.worker_config(role), rank, name)
            for rank in range(tp)
        ]
        return _Group(role, name, pg, ranks)
