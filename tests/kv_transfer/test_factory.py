"""The factory builds each backend's typed config from the generic settings and the backend's
own options: an option a backend does not take is an error naming it, a bad value an error
naming the field; the caller needs no knowledge of the backend."""

from __future__ import annotations

import pytest

from duet.kv_transfer import ReceiverConfig, SenderConfig, create_receiver, create_sender
from duet.kv_transfer.local import LocalHub, LocalKVReceiver
from duet.kv_transfer.tcp import TcpKVSender, TcpSenderConfig
from duet.kv_transfer.torch_dist import TorchDistKVReceiver
from tests.kv_transfer.paged import caches, layout


def test_settings_and_options_make_the_backend_config():
    kv = caches()
    settings = SenderConfig(name="p0-tp0", timeout_s=5.0, ack_timeout_s=9.0)
    sender = create_sender("tcp", kv, layout(kv), settings, stripes=3)
    assert isinstance(sender, TcpKVSender)
    assert sender.config == TcpSenderConfig(
        name="p0-tp0", timeout_s=5.0, ack_timeout_s=9.0, stripes=3
    )
    sender.close()
    # An option overrides the setting of the same name.
    sender = create_sender("tcp", kv, layout(kv), settings, timeout_s=2.0)
    assert (sender.config.timeout_s, sender.config.ack_timeout_s) == (2.0, 9.0)
    sender.close()


def test_an_option_the_backend_does_not_take_is_an_error_naming_it():
    kv = caches()
    with pytest.raises(ValueError, match=r"^stripes: not an option of the torch_dist KV sender"):
        create_sender("torch_dist", kv, layout(kv), SenderConfig(), stripes=2)
    with pytest.raises(ValueError, match=r"^hub: not an option of the tcp KV receiver"):
        create_receiver("tcp", kv, layout(kv), ReceiverConfig(), hub=LocalHub())


@pytest.mark.parametrize(
    ("backend", "options", "message"),
    [
        ("tcp", {"stripes": 0}, r"stripes: must be in \[1, 16\], got 0"),
        ("tcp", {"ack_timeout_s": 0}, "ack_timeout_s: must be > 0, got 0"),
        ("torch_dist", {"name": ""}, "name: must not be empty"),
        ("local", {}, "hub: the local backend needs the LocalHub its receivers joined"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_field(backend, options, message):
    kv = caches()
    with pytest.raises(ValueError, match=message):
        create_sender(backend, kv, layout(kv), SenderConfig(), **options)


def test_a_receiver_reports_its_address_whatever_the_backend():
    kv = caches()
    settings = ReceiverConfig(name="decode-3", timeout_s=5.0, host="127.0.0.1", port=0)
    local = create_receiver("local", kv, layout(kv), settings, hub=LocalHub())
    assert isinstance(local, LocalKVReceiver) and local.address == "decode-3"
    local.close()
    remote = create_receiver("torch_dist", kv, layout(kv), settings, advertise_host="kv.example")
    assert isinstance(remote, TorchDistKVReceiver)
    assert remote.address == f"kv.example:{remote.store.port}"
    remote.close()
    with pytest.raises(ValueError, match=r"port: must be in \[0, 65535\], got 70000"):
        ReceiverConfig(port=70000)
