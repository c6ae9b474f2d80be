"""Separate network hosts for fault tests: Linux network namespaces on a bridge the test creates.

`NetLab` makes a bridge in the root namespace (no address: the root namespace cannot reach the
hosts, and they reach nothing but one another and their own loopback), and per host a
namespace joined to it by a veth pair, with one address of a private /24 chosen per lab.
Everything is named after a random tag, so labs of parallel test processes never collide, and
`close` removes it all (processes first, by their own pids).

Faults between hosts:
- `partition(a, b)` / `heal(a, b)`: blackhole routes both ways, so `a` and `b` lose each other
  and keep everyone else (TCP between them stalls, as across a failed switch port);
- `link_down(host)` / `link_up(host)`: the host's interface down, so it loses everyone;
- `impair(host, ...)`: its egress delayed and lossy (`tc netem`, where the kernel has it) or
  rate-limited with tail drops (`tc tbf`), cleared by `clear_impairment`.

Code in the test process reaches a host's network from a thread that entered a namespace
(`enter`), e.g. a `ThreadPoolExecutor(initializer=lab.enter_fn(name))` whose sockets are all
created there. NOTE: not gRPC: its library connects from threads of its own, made in the
namespace of the thread that first used gRPC in the process (under `make test`, another test's,
in the root namespace, whose packets to the lab's addresses leave the machine); gRPC calls go
from a process spawned in the host (`spawn_piped`). Needs root (CI runs as root); `unavailable()` says why a lab cannot be made."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNET = 0x40000000


def _ip(
    *args: str, netns: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=10)


def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", "netns", "exec", netns, "tc", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=10)


def unavailable() -> str | None:
    """Why this machine cannot make a lab (None: it can): not root, no iproute2, or the
    kernel refuses a network namespace or a bridge."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    tag = secrets.token_hex(3)
    try:
        made = _ip("netns", "add", f"duet-probe-{tag}", check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", f"duet-probe-{tag}", check=False)
        made = _ip("link", "add", f"dpb{tag}", "type", "bridge", check=False)
        if made.returncode != 0:
            return f"cannot create a bridge: {made.stderr.strip()}"
        _ip("link", "del", f"dpb{tag}", check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run ip: {e}"
    return None


def netem_unavailable() -> str | None:
    """Why `impair(..., netem=True)` cannot run here (None: it can): the kernel's sch_netem."""
    tag = secrets.token_hex(3)
    ns = f"duet-probe-{tag}"
    try:
        _ip("netns", "add", ns)
        try:
            _ip("link", "set", "lo", "up", netns=ns)
            got = _tc(ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
            if got.returncode != 0:
                return f"the kernel has no netem qdisc (sch_netem): {got.stderr.strip()}"
        finally:
            _ip("netns", "del", ns, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot probe netem: {e}"
    return None


OWNER = "duet-netlab-owner="
"""The alias of a lab's bridge: its owner process, so a lab whose process was killed before
`close` is removed by the next one (`remove_orphans`)."""


def remove_orphans() -> list[str]:
    """Remove the labs (bridge, namespaces, veths) whose owner process is gone; their tags."""
    removed = []
    for line in _ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        alias = line.split(" alias ", 1)[1].strip() if " alias " in line else ""
        if not (name.startswith("dbr") and alias.startswith(OWNER)):
            continue
        owner = int(alias[len(OWNER) :])
        try:
            os.kill(owner, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        tag = name[len("dbr") :]
        for ns in _ip("netns", "list").stdout.split():
            if ns.startswith(f"duet-{tag}-"):
                for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _ip("netns", "del", ns, check=False)
        for veth in _ip("-o", "link", "show", "master", name, check=False).stdout.splitlines():
            _ip("link", "del", veth.split(":")[1].strip().split("@")[0], check=False)
        _ip("link", "del", name, check=False)
        removed.append(tag)
    return removed


@dataclass
class Host:
    name: str
    netns: str
    address: str
    host_veth: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


class NetLab:
    """A bridge and network namespaces (see the module docstring). Use as a context manager."""

    def __init__(self, hosts: Sequence[str], logdir: Path) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"dbr{self.tag}"
        subnet = secrets.randbelow(200 * 250)
        self.prefix = f"10.{10 + subnet // 250}.{subnet % 250}"
        self.logdir = logdir
        self.hosts: dict[str, Host] = {}
        self._blackholes: set[tuple[str, str]] = set()
        remove_orphans()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", f"{OWNER}{os.getpid()}")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(hosts):
                self._add_host(name, i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, index: int) -> None:
        host = Host(name, f"duet-{self.tag}-{name}", f"{self.prefix}.{index + 2}",
                    f"dv{self.tag}{index:x}")  # fmt: skip
        self.hosts[name] = host
        peer = f"dp{self.tag}{index:x}"
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.host_veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", host.host_veth, "master", self.bridge)
        _ip("link", "set", host.host_veth, "up")
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", peer, "name", "eth0", netns=host.netns)
        _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        _ip("link", "set", "eth0", "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, host: str) -> str:
        return self.hosts[host].address

    # -- processes ---------------------------------------------------------------------------

    def spawn(self, host: str, argv: Sequence[str], log_name: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        """Run `argv` inside `host`'s namespace (`ip netns exec` execs it: the pid is the
        program's), output to `logdir/log_name`."""
        h = self.hosts[host]
        log = open(self.logdir / log_name, "wb")
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        finally:
            log.close()
        h.procs.append(proc)
        return proc

    def spawn_piped(self, host: str, argv: Sequence[str], log_name: str,
                    env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        """`spawn` with the program's stdin and stdout as pipes to this process (its stderr to
        `logdir/log_name`)."""
        h = self.hosts[host]
        log = open(self.logdir / log_name, "wb")
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env,
                                    start_new_session=True)  # fmt: skip
        finally:
            log.close()
        h.procs.append(proc)
        return proc

    def log(self, log_name: str) -> str:
        path = self.logdir / log_name
        return path.read_text(errors="replace") if path.exists() else ""

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(10)
        return int(proc.returncode)

    # -- entering a namespace from this process ----------------------------------------------

    def enter(self, host: str) -> None:
        """Move the calling thread (only it) into `host`'s network namespace: the sockets it
        creates from now on live there."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.hosts[host].netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {host}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def enter_fn(self, host: str) -> Callable[[], None]:
        return lambda: self.enter(host)

    # -- faults -----------------------------------------------------------------------------

    def partition(self, a: str, b: str) -> None:
        """`a` and `b` lose each other (blackhole routes both ways); others still reach both."""
        for src, dst in ((a, b), (b, a)):
            if (src, dst) not in self._blackholes:
                _ip("route", "add", "blackhole", f"{self.address(dst)}/32",
                    netns=self.hosts[src].netns)  # fmt: skip
                self._blackholes.add((src, dst))

    def heal(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            if (src, dst) in self._blackholes:
                _ip("route", "del", "blackhole", f"{self.address(dst)}/32",
                    netns=self.hosts[src].netns, check=False)  # fmt: skip
                self._blackholes.discard((src, dst))

    def link_down(self, host: str) -> None:
        _ip("link", "set", "eth0", "down", netns=self.hosts[host].netns)

    def link_up(self, host: str) -> None:
        ns = self.hosts[host].netns
        _ip("link", "set", "eth0", "up", netns=ns)
        # The /24's route comes back with the link; wait until it is there.
        deadline = time.monotonic() + 5
        while self.prefix not in _ip("route", "show", netns=ns).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host}: no route after link up")
            time.sleep(0.05)

    def impair(self, host: str, *, netem: bool, delay_ms: int = 50, loss_pct: float = 5.0,
               rate: str = "2mbit") -> str:  # fmt: skip
        """Impair `host`'s egress: with `netem`, `delay_ms` of latency and `loss_pct` random
        loss; else a `rate` limit with a short queue (tbf: bursts wait, then are dropped at the
        tail). Returns the qdisc as `tc` shows it."""
        ns = self.hosts[host].netns
        if netem:
            spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        else:
            spec = ["tbf", "rate", rate, "burst", "16kb", "latency", f"{delay_ms}ms"]
        _tc(ns, "qdisc", "replace", "dev", "eth0", "root", *spec)
        return _tc(ns, "qdisc", "show", "dev", "eth0").stdout.strip()

    def clear_impairment(self, host: str) -> None:
        _tc(self.hosts[host].netns, "qdisc", "del", "dev", "eth0", "root", check=False)

    def heal_all(self) -> None:
        for src, dst in list(self._blackholes):
            self.heal(src, dst)
        for name in self.hosts:
            self.clear_impairment(name)
            self.link_up(name)

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process this lab started (by pid), then delete its namespaces, veths
        and bridge. Safe to call twice and after a partial set-up."""
        for host in self.hosts.values():
            for proc in host.procs:
                self.stop(proc, timeout_s=5)
        for host in self.hosts.values():
            _ip("link", "del", host.host_veth, check=False)  # takes its peer with it
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()
