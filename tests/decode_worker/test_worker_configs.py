"""The worker configs refuse impossible KV settings, naming the field; `kv_backend` reaches
both kinds of worker from the cluster's spec."""

from __future__ import annotations

import pytest

from duet.decode_worker.config import DecodeWorkerConfig
from duet.deploy.cluster_spec import ClusterSpec
from duet.engine.errors import InvalidInputError
from duet.prefill_worker.config import PrefillWorkerConfig


@pytest.mark.parametrize("config", [PrefillWorkerConfig, DecodeWorkerConfig])
def test_unknown_kv_backend_is_refused(config):
    with pytest.raises(InvalidInputError) as exc:
        config(kv_backend="rdma")
    assert exc.value.field == "kv_backend"
    assert (
        str(exc.value)
        == "kv_backend: unknown 'rdma'; available: auto, local, nixl, tcp, torch_dist"
    )
    assert config().kv_backend == "auto"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_port": 70000}, "kv_port"),
        ({"kv_wait_s": 0}, "kv_wait_s"),
        ({"kv_transfer_timeout_s": -1}, "kv_transfer_timeout_s"),
    ],
)
def test_decode_kv_settings_out_of_range(kwargs, field):
    with pytest.raises(InvalidInputError) as exc:
        DecodeWorkerConfig(**kwargs)
    assert exc.value.field == field


def test_prefill_lease_must_outlast_a_transfer():
    with pytest.raises(InvalidInputError, match=r"kv_lease_s: must be > kv_transfer_timeout_s"):
        PrefillWorkerConfig(kv_transfer_timeout_s=30, kv_lease_s=30)


def test_cluster_spec_gives_both_roles_its_kv_backend_and_tp_size():
    spec = ClusterSpec(
        model="m", engine={"dtype": "float32"}, prefill_tp=2, decode_tp=3, kv_backend="tcp",
        prefill_ep=2,
    )  # fmt: skip
    assert spec.worker_config("prefill")["kv_backend"] == "tcp"
    assert spec.worker_config("decode") == {
        "model": "m", "load_progress": False, "dtype": "float32", "kv_backend": "tcp",
        "tensor_parallel_size": 3, "expert_parallel_size": 1,
    }  # fmt: skip
    assert spec.worker_config("prefill")["tensor_parallel_size"] == 2
    assert spec.worker_config("prefill")["expert_parallel_size"] == 2
    for bad in (3, True):
        with pytest.raises(
            ValueError, match="--decode-ep: must be 1 or the group's tensor-parallel size 2"
        ):
            ClusterSpec(decode_tp=2, decode_ep=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"--decode-tp: must be an integer >= 1; got {bad!r}"):
            ClusterSpec(decode_tp=bad)


def test_prefill_groups_take_pipeline_stages_and_decode_workers_do_not():
    assert PrefillWorkerConfig(pipeline_parallel_size=2, tensor_parallel_size=2).num_ranks == 4
    with pytest.raises(InvalidInputError) as exc:
        DecodeWorkerConfig(pipeline_parallel_size=2)
    assert str(exc.value) == (
        "pipeline_parallel_size: decode workers run one pipeline stage (prefill groups and "
        "aggregated engines take more); got 2"
    )
    with pytest.raises(InvalidInputError, match="must then run on one rank"):
        PrefillWorkerConfig(
            pipeline_parallel_size=2,
            speculative_config={"method": "draft_model", "model": "d",
                                "num_speculative_tokens": 2, "draft_prefill": "prefill"},
        )  # fmt: skip
