"""helm/duet: lints clean, renders with default and production-like values, every manifest
validates against the Kubernetes 1.34 schemas (strict), and the rendered objects keep the
promises the chart makes (GPUs, probes, no privilege, secrets by reference, scoped RBAC)."""

from __future__ import annotations

import copy
import json

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.chart_render import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    Rendered,
    container,
    env_values,
    production_values,
)

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize("values", ["default", "production"])
def test_lint_strict_is_clean(values):
    report = helm.lint(
        CHART_DIR,
        production_values() if values == "production" else None,
        strict=True,
        kube_version=f"v{KUBE_VERSION}.0",
    )
    assert report["errors"] == []
    # The only finding is informational (we publish no icon URL).
    assert report["messages"] == [
        {"severity": 1, "path": "Chart.yaml", "error": "icon is recommended"}
    ]


def test_default_render_objects(default):
    assert default.kinds() == [
        ("Deployment", "duet-decode"),
        ("Deployment", "duet-head"),
        ("Deployment", "duet-prefill"),
        ("NetworkPolicy", "duet-redis"),
        ("NetworkPolicy", "duet-routers"),
        ("NetworkPolicy", "duet-workers"),
        ("PodDisruptionBudget", "duet-decode"),
        ("PodDisruptionBudget", "duet-prefill"),
        ("Secret", "duet-cluster-secret"),
        ("Secret", "duet-ray-auth"),
        ("Service", "duet-head"),
        ("Service", "duet-redis"),
        ("Service", "duet-router"),
        ("ServiceAccount", "duet"),
        ("StatefulSet", "duet-redis"),
    ]


def test_production_render_objects(prod):
    assert prod.kinds() == [
        ("Deployment", "duet-decode"),
        ("Deployment", "duet-head"),
        ("Deployment", "duet-planner"),
        ("Deployment", "duet-prefill"),
        ("Deployment", "duet-router"),
        ("NetworkPolicy", "duet-planner"),
        ("NetworkPolicy", "duet-routers"),
        ("NetworkPolicy", "duet-workers"),
        ("PodDisruptionBudget", "duet-decode"),
        ("PodDisruptionBudget", "duet-prefill"),
        ("PodDisruptionBudget", "duet-router"),
        ("Role", "duet-planner"),
        ("RoleBinding", "duet-planner"),
        ("Service", "duet-head"),
        ("Service", "duet-router"),
        ("ServiceAccount", "duet"),
        ("ServiceAccount", "duet-planner"),
        ("ServiceMonitor", "duet"),
    ]


@pytest.mark.parametrize("values", ["default", "production"])
def test_every_manifest_validates_against_kubernetes_1_34_strict(values, default, prod):
    rendered = prod if values == "production" else default
    checked = 0
    for obj in rendered.objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD kind: no upstream schema; test_service_monitor checks it
        assert kubernetes_validate.validate(obj, KUBE_VERSION, strict=True) == KUBE_VERSION
        checked += 1
    assert checked == len(rendered.objects) - (values == "production")


def test_the_validator_rejects_an_unknown_field(default):
    # Guards the test above against a validator that accepts anything.
    head = copy.deepcopy(default.get("Deployment", "duet-head"))
    head["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="'gpus' was unexpected"):
        kubernetes_validate.validate(head, KUBE_VERSION, strict=True)


def test_worker_pods_request_gpus_and_offer_them_to_ray(default, prod):
    for rendered, prefill_gpus, decode_gpus in ((default, 1, 1), (prod, 8, 4)):
        for name, gpus in (("prefill", prefill_gpus), ("decode", decode_gpus)):
            spec = rendered.get("Deployment", f"duet-{name}")["spec"]["template"]["spec"]
            c = container(spec, name)
            assert c["resources"]["limits"][GPU] == gpus
            assert c["resources"]["requests"][GPU] == gpus
            assert c["command"] == ["ray"]
            assert c["args"] == [
                "start",
                "--address=duet-head:6379",
                f"--num-gpus={gpus}",
                f'--resources={{"{name}":{gpus}}}',
                "--node-manager-port=8076",
                "--block",
            ]
            assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert prod.get("Deployment", "duet-prefill")["spec"]["replicas"] == 2
    assert prod.get("Deployment", "duet-decode")["spec"]["replicas"] == 4
    prefill_spec = prod.get("Deployment", "duet-prefill")["spec"]["template"]["spec"]
    assert prefill_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # The head and router pods hold no GPU.
    for name in ("duet-head", "duet-router"):
        for c in prod.pod_specs()[name]["containers"]:
            assert GPU not in json.dumps(c["resources"])


def test_head_runs_ray_head_then_duet_serve(prod):
    spec = prod.get("Deployment", "duet-head")["spec"]["template"]["spec"]
    c = container(spec, "head")
    assert c["command"][:2] == ["/bin/sh", "-c"]
    script = c["command"][2]
    assert (
        "ray start --head --port=6379 --disable-usage-stats --num-gpus=0 "
        "--resources='{\"router\": 1}'\n" in script
    )
    assert script.endswith('exec "$@"\n')
    assert c["args"] == [
        "duet", "serve", "--disaggregated", "--ray-address=127.0.0.1:6379", "--host=0.0.0.0",
        "--port=8000", "--grpc-port=50051", "--model=/models/Llama-3.1-70B-Instruct",
        "--served-model-name=llama-3.1-70b", "--prefill-tp=4", "--kv-backend=auto",
        "--prefill-workers=auto",
        "--decode-workers=auto", "--router-replicas=3",
        "--session-store=$(DUET_SESSION_STORE_URL)",
        "--api-key-file=/etc/duet/api-keys/api-keys.txt",
        "--rate-limit-rpm", "600", "--max-queued-requests", "512",
    ]  # fmt: skip
    env = {e["name"]: e for e in c["env"]}
    assert env["DUET_SESSION_STORE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "duet-redis", "key": "url"}
    }
    assert prod.get("Deployment", "duet-head")["spec"]["strategy"] == {"type": "Recreate"}
    # Two extra router pods (router actors 2 and 3) join Ray with the `router` resource.
    router = prod.get("Deployment", "duet-router")
    assert router["spec"]["replicas"] == 2
    assert (
        '--resources={"router":1}'
        in container(router["spec"]["template"]["spec"], "router")["args"]
    )


@pytest.mark.parametrize("values", ["default", "prod"])
def test_head_args_parse_with_duets_own_cli(values, request):
    """The chart's `duet serve` flags are ones the CLI has (a renamed flag fails here, not in
    a crash-looping pod)."""
    from duet.cli.main import build_parser

    rendered: Rendered = request.getfixturevalue(values)
    args = container(rendered.get("Deployment", "duet-head")["spec"]["template"]["spec"], "head")[
        "args"
    ]
    assert args[0] == "duet"
    parsed = build_parser().parse_args(args[1:])
    assert parsed.disaggregated is True
    assert parsed.routers == (3 if values == "prod" else 1)


def test_default_head_uses_the_bundled_redis_and_embedded_model(default):
    c = container(default.pod_specs()["duet-head"], "head")
    assert "--session-store=redis://duet-redis:6379/0" in c["args"]
    assert not [
        a for a in c["args"] if a.startswith(("--model", "--api-key-file", "--router-replicas"))
    ]
    redis = default.get("StatefulSet", "duet-redis")
    assert container(redis["spec"]["template"]["spec"], "redis")["args"][:3] == [
        "redis-server", "--appendonly", "yes",
    ]  # fmt: skip
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    policy = default.get("NetworkPolicy", "duet-redis")
    assert policy["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "duet", "app.kubernetes.io/instance": "duet",
        }}}
    ]  # fmt: skip


def test_services_reach_the_right_pods(prod):
    head = prod.get("Service", "duet-head")["spec"]
    # Workers join before the head is ready (it turns ready only once they have).
    assert head["clusterIP"] == "None" and head["publishNotReadyAddresses"] is True
    assert [(p["name"], p["port"]) for p in head["ports"]] == [("gcs", 6379)]
    api = prod.get("Service", "duet-router")["spec"]
    assert api["type"] == "LoadBalancer"
    assert [(p["name"], p["port"]) for p in api["ports"]] == [("http", 8000), ("grpc", 50051)]
    selected = {
        name
        for name, obj in ((o["metadata"]["name"], o) for o in prod.of_kind("Deployment"))
        if api["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
    }
    assert selected == {"duet-head", "duet-router"}


def test_every_container_has_probes(default, prod):
    for rendered in (default, prod):
        for workload, spec in rendered.pod_specs().items():
            for c in spec["containers"]:
                assert "livenessProbe" in c, f"{workload}/{c['name']}"
                if c["name"] != "planner":
                    assert "readinessProbe" in c, f"{workload}/{c['name']}"
    for name in ("duet-head", "duet-router"):
        (c,) = prod.pod_specs()[name]["containers"]
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for name in ("duet-prefill", "duet-decode"):
        (c,) = prod.pod_specs()[name]["containers"]
        assert c["readinessProbe"]["tcpSocket"] == {"port": "raylet"}
    (planner,) = prod.pod_specs()["duet-planner"]["containers"]
    assert planner["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_no_container_is_privileged_or_root(default, prod):
    for rendered in (default, prod):
        for workload, spec in rendered.pod_specs().items():
            assert spec["securityContext"]["runAsNonRoot"] is True, workload
            assert spec["securityContext"]["runAsUser"] > 0, workload
            for key in ("hostNetwork", "hostPID", "hostIPC"):
                assert not spec.get(key), workload
            assert not [v for v in spec.get("volumes", []) if "hostPath" in v], workload
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["privileged"] is False, workload
                assert sc["allowPrivilegeEscalation"] is False, workload
                assert sc["readOnlyRootFilesystem"] is True, workload
                assert sc["capabilities"] == {"drop": ["ALL"]}, workload


def test_secrets_are_referenced_not_inlined(default, prod):
    # Production: every credential lives in an existing Secret; the chart renders none.
    assert prod.of_kind("Secret") == []
    for workload, spec in prod.pod_specs().items():
        for name, value in env_values(spec):
            assert name != "RAY_AUTH_TOKEN", workload
            if any(word in name for word in ("TOKEN", "KEY", "PASSWORD", "SECRET", "URL")):
                is_path = name in ("RAY_AUTH_TOKEN_PATH", "DUET_CLUSTER_SECRET_FILE")
                assert value is None or is_path, f"{workload}: {name}"
    secret_volumes = {
        name: sorted(v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v)
        for name, spec in prod.pod_specs().items()
    }
    assert secret_volumes == {
        "duet-head": ["duet-api-keys", "duet-internal-secret", "duet-ray-token"],
        "duet-router": ["duet-api-keys", "duet-internal-secret", "duet-ray-token"],
        "duet-prefill": ["duet-internal-secret", "duet-ray-token"],
        "duet-decode": ["duet-internal-secret", "duet-ray-token"],
        "duet-planner": ["duet-api-keys"],
    }
    for name in ("duet-head", "duet-prefill", "duet-decode", "duet-router"):
        spec = prod.pod_specs()[name]
        env = dict(env_values(spec))
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN_PATH"] == "/etc/duet/ray-auth/token"
        assert env["DUET_CLUSTER_SECRET_FILE"] == "/etc/duet/cluster-secret/secret"
        mounts = {
            m["name"]: m for m in container(spec, spec["containers"][0]["name"])["volumeMounts"]
        }
        assert mounts["cluster-secret"] == {
            "name": "cluster-secret", "mountPath": "/etc/duet/cluster-secret", "readOnly": True,
        }  # fmt: skip
    monitor = prod.get("ServiceMonitor", "duet")
    assert monitor["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "duet-metrics-key", "key": "key"},
    }  # fmt: skip
    # Default: the chart makes the Ray token and cluster secret Secrets (kept across upgrades
    # by `lookup`), and no pod spec carries their values.
    token = default.get("Secret", "duet-ray-auth")["data"]["auth_token"]
    assert len(token) == 64  # 48 random characters, base64
    cluster_secret = default.get("Secret", "duet-cluster-secret")["data"]["cluster_secret"]
    assert len(cluster_secret) == 88  # 64 random characters, base64
    for spec in default.pod_specs().values():
        assert token not in json.dumps(spec) and cluster_secret not in json.dumps(spec)


def test_planner_rbac_is_scoped_to_what_it_patches(prod, default):
    assert prod.of_kind("ClusterRole") == [] and prod.of_kind("ClusterRoleBinding") == []
    role = prod.get("Role", "duet-planner")
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["duet-prefill", "duet-decode"],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
    ]
    binding = prod.get("RoleBinding", "duet-planner")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "duet-planner",
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "duet-planner", "namespace": NAMESPACE}
    ]
    specs = prod.pod_specs()
    assert specs["duet-planner"]["serviceAccountName"] == "duet-planner"
    assert specs["duet-planner"]["automountServiceAccountToken"] is True
    for name, spec in specs.items():
        if name != "duet-planner":
            assert spec["automountServiceAccountToken"] is False, name
    # The planner is told to scale exactly the Deployments the Role names.
    args = container(specs["duet-planner"], "planner")["args"]
    assert "--prefill-deployment=duet-prefill" in args
    assert "--decode-deployment=duet-decode" in args
    assert "--metrics-service=duet-router" in args
    assert "--prefill-workers-per-replica=2" in args  # 8 GPUs / TP 4
    assert "--gpu-budget=48" in args
    # No planner, no RBAC.
    assert default.of_kind("Role") == [] and default.of_kind("RoleBinding") == []


def test_pod_disruption_budgets(default, prod):
    assert {
        p["metadata"]["name"]: p["spec"]["maxUnavailable"]
        for p in prod.of_kind("PodDisruptionBudget")
    } == {"duet-prefill": 1, "duet-decode": "25%", "duet-router": 1}
    for pdb in default.of_kind("PodDisruptionBudget"):
        component = pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert pdb["metadata"]["name"] == f"duet-{component}"


def test_service_monitor(prod):
    monitor = prod.get("ServiceMonitor", "duet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint = monitor["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    router_service = prod.get("Service", "duet-router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        router_service["metadata"]["labels"].items()
    )


def test_notes_tell_how_to_reach_the_api(default, prod):
    assert "kubectl -n serving port-forward svc/duet-router 8000:8000 50051:50051" in default.notes
    assert "WARNING: apiKeys.existingSecret is not set" in default.notes
    assert "http://duet-router.serving.svc:8000" in prod.notes
    assert 'grpcurl -plaintext -H "authorization: Bearer $DUET_API_KEY"' in prod.notes
    assert "kubectl -n serving logs deployment/duet-planner" in prod.notes
