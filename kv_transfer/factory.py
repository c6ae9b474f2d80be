"""Backends register by name and load lazily, so a process imports only what it uses."""

from __future__ import annotations

import importlib
from typing import Any

from kv_transfer.base import KVReceiver, KVSender

# name -> (module, sender class, receiver class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "local": ("kv_transfer.local", "LocalKVSender", "LocalKVReceiver"),
    "torch_dist": ("kv_transfer.torch_dist", "TorchDistKVSender", "TorchDistKVReceiver"),
}


def register_backend(name: str, module: str, sender: str, receiver: str) -> None:
    _BACKENDS[name] = (module, sender, receiver)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _load(name: str, index: int) -> Any:
    if name not in _BACKENDS:
        raise ValueError(
            f"kv_transfer backend: unknown {name!r}; available: {', '.join(available_backends())}"
        )
    module_name, *classes = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), classes[index])


def create_sender(backend: str, **kwargs: Any) -> KVSender:
    sender: KVSender = _load(backend, 0)(**kwargs)
    return sender


def create_receiver(backend: str, **kwargs: Any) -> KVReceiver:
    receiver: KVReceiver = _load(backend, 1)(**kwargs)
    return receiver
