"""helm/duet's KV-transfer values (kvTransfer): the head's `--kv-backend` and staging pool,
RDMA devices, IPC_LOCK and UCX/NCCL environment on the prefill and decode pods only, and the
schema's refusal of bad values naming the field (docs/kubernetes.md, "How KV travels between
pods")."""

from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart_render import CHART_DIR, KUBE_VERSION, container, env_values, render

RDMA_VALUES = CHART_DIR / "ci" / "rdma-values.yaml"
RDMA = "rdma/rdma_shared_device_a"
KV_ENV = {
    "UCX_TLS": "rc,ud,sm,self,cuda_copy,cuda_ipc",
    "UCX_NET_DEVICES": "mlx5_0:1",
    "UCX_IB_GID_INDEX": "3",
    "NCCL_IB_HCA": "mlx5_0",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IB_GID_INDEX": "3",
}
WORKERS = ("duet-prefill", "duet-decode")


def rdma_values() -> dict:
    return yaml.safe_load(RDMA_VALUES.read_text())


@pytest.fixture(scope="module")
def rdma(chart):
    return render(chart, rdma_values())


def pod_annotations(rendered, workload: str) -> dict[str, str]:
    (found,) = [
        o for o in rendered.objects
        if o["metadata"]["name"] == workload and o["kind"] in ("Deployment", "StatefulSet")
    ]  # fmt: skip
    annotations: dict[str, str] = found["spec"]["template"]["metadata"].get("annotations", {})
    return annotations


def head_args(rendered) -> list[str]:
    return container(rendered.pod_specs()["duet-head"], "head")["args"]


def test_rdma_values_lint_and_validate_strict(rdma):
    report = helm.lint(CHART_DIR, rdma_values(), strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == []
    assert report["messages"] == [
        {"severity": 1, "path": "Chart.yaml", "error": "icon is recommended"}
    ]
    for obj in rdma.objects:
        assert kubernetes_validate.validate(obj, KUBE_VERSION, strict=True) == KUBE_VERSION


def test_the_head_serves_with_the_chosen_backend_and_pool(chart, default, rdma):
    from duet.cli.main import build_parser

    parser = build_parser()
    assert [a for a in head_args(default) if a.startswith("--kv-")] == ["--kv-backend=auto"]
    assert parser.parse_args(head_args(rdma)[1:]).kv_backend == "nixl"
    staged = render(chart, {"kvTransfer": {"backend": "torch_dist", "stagingMemory": "512MiB"}})
    args = head_args(staged)
    assert [a for a in args if a.startswith("--kv-")] == [
        "--kv-backend=torch_dist", "--kv-staging-memory=512MiB",
    ]  # fmt: skip
    parsed = parser.parse_args(args[1:])
    assert (parsed.kv_backend, parsed.kv_staging_memory) == ("torch_dist", 512 * 2**20)


def test_worker_pods_get_the_devices_ipc_lock_env_and_network(rdma):
    for name, spec in rdma.pod_specs().items():
        annotations = pod_annotations(rdma, name)
        env = dict(env_values(spec))
        for c in spec["containers"]:
            resources = json.dumps(c["resources"])
            if name in WORKERS:  # RDMA devices beside the GPUs, requested and limited alike
                assert c["resources"]["limits"][RDMA] == c["resources"]["requests"][RDMA] == 1
                assert c["securityContext"]["capabilities"] == {
                    "drop": ["ALL"], "add": ["IPC_LOCK"],
                }  # fmt: skip
                assert c["securityContext"]["privileged"] is False
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
            else:  # the head, extra routers, the planner, Redis: none of it
                assert RDMA not in resources, name
                assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name
        if name in WORKERS:
            assert {k: env[k] for k in KV_ENV} == KV_ENV, name
            assert annotations == {
                "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
                "k8s.v1.cni.cncf.io/networks": "roce-net",
            }, name
        else:
            assert not set(KV_ENV) & set(env), name
            assert "k8s.v1.cni.cncf.io/networks" not in annotations, name


def test_without_rdma_the_env_still_applies_and_nothing_else(chart, default):
    """The UCX/NCCL environment is the libraries' whatever the wire (NCCL_SOCKET_IFNAME picks
    the interface of its socket transport too); devices, IPC_LOCK and the worker-only
    annotations come with `rdma.enabled` alone, and IPC_LOCK only with `rdma.ipcLock`."""
    values = rdma_values()
    values["kvTransfer"]["rdma"]["enabled"] = False
    off = render(chart, values)
    for name in WORKERS:
        spec = off.pod_specs()[name]
        c = spec["containers"][0]
        assert RDMA not in json.dumps(c["resources"])
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {k: v for k, v in env_values(spec) if k in KV_ENV} == KV_ENV
    no_lock = rdma_values()
    no_lock["kvTransfer"]["rdma"]["ipcLock"] = False
    for name in WORKERS:
        c = render(chart, no_lock).pod_specs()[name]["containers"][0]
        assert c["resources"]["limits"][RDMA] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for name, spec in default.pod_specs().items():  # the defaults set none of it
        assert not set(KV_ENV) & {k for k, _ in env_values(spec)}, name
    only_tls = render(chart, {"kvTransfer": {"ucx": {"tls": "tcp,sm,self"}}})
    assert [(k, v) for k, v in env_values(only_tls.pod_specs()["duet-decode"]) if k in KV_ENV] == [
        ("UCX_TLS", "tcp,sm,self"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "tcp"}, "at '/kvTransfer/backend': value must be one of 'auto', 'torch_dist', 'nixl'"),
        ({"stagingMemory": "lots"}, "at '/kvTransfer/stagingMemory'"),
        ({"rdma": {"count": 0}}, "at '/kvTransfer/rdma/count': minimum: got 0, want 1"),
        ({"rdma": {"count": 65}}, "at '/kvTransfer/rdma/count': maximum: got 65, want 64"),
        ({"rdma": {"resourceName": "rdma"}}, "at '/kvTransfer/rdma/resourceName'"),
        ({"rdma": {"ipcLock": "yes"}}, "at '/kvTransfer/rdma/ipcLock'"),
        ({"rdma": {"devices": 1}}, "additional properties 'devices' not allowed"),
        ({"ucx": {"tls": "rc;ud"}}, "at '/kvTransfer/ucx/tls'"),
        ({"ucx": {"netDevices": "mlx5_0:x"}}, "at '/kvTransfer/ucx/netDevices'"),
        ({"nccl": {"ibHca": "mlx5 0"}}, "at '/kvTransfer/nccl/ibHca'"),
        ({"nccl": {"socketIfname": "eth0;rm"}}, "at '/kvTransfer/nccl/socketIfname'"),
        ({"nccl": {"ibGidIndex": 256}}, "at '/kvTransfer/nccl/ibGidIndex': maximum: got 256, want 255"),
        ({"nccl": {"hca": "mlx5_0"}}, "additional properties 'hca' not allowed"),
    ],
)  # fmt: skip
def test_bad_kv_transfer_values_are_refused_naming_the_field(chart, overrides, message):
    values = {"kvTransfer": overrides}
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as e:
        render(chart, values)
    assert message in str(e.value)
    report = helm.lint(CHART_DIR, values, strict=True)
    assert any(message in m["error"] for m in report["messages"] if m["severity"] == 3)


def test_the_cuda_image_carries_rdma_user_space():
    """The libraries NCCL opens for InfiniBand / RoCE, and the loader path on which NIXL's
    bundled libibverbs finds Debian's providers for NICs other than mlx5."""
    text = (CHART_DIR.parents[1] / "deploy" / "Dockerfile").read_text()
    install = text[text.index("apt-get install") : text.index("ldconfig")]
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1", "ibverbs-utils"):
        assert f" {package}" in install, package
    assert 'echo "/usr/lib/$(gcc -print-multiarch)/libibverbs"' in install
