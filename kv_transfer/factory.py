"""Backends register by name and load lazily, so a process imports only what it uses.

A caller names the backend (or "auto") and passes the settings every backend takes
(`SenderConfig`, `ReceiverConfig`); a backend's own options (the local backend's `hub`, tcp's
`stripes`) come as keyword arguments, checked against its config: the caller needs no
knowledge of which backend takes what.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from duet.kv_transfer.base import KVReceiver, KVSender
from duet.kv_transfer.config import ReceiverConfig, SenderConfig, build_config
from duet.kv_transfer.layout import KVLayout

# name -> (module, sender class, receiver class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "local": ("duet.kv_transfer.local", "LocalKVSender", "LocalKVReceiver"),
    "torch_dist": ("duet.kv_transfer.torch_dist", "TorchDistKVSender", "TorchDistKVReceiver"),
    "tcp": ("duet.kv_transfer.tcp", "TcpKVSender", "TcpKVReceiver"),
    "nixl": ("duet.kv_transfer.nixl", "NixlKVSender", "NixlKVReceiver"),
}


AUTO = "auto"
"""Pick by where the caches live: `tcp` for CPU caches (straight between the caches, no staging
copies: ~1.4x torch_dist/gloo on loopback), `torch_dist` for GPU caches (NCCL)."""


def resolve_backend(name: str, kv_caches: list[Any]) -> str:
    """The backend to run: `name`, or for "auto" the one that suits caches on their device."""
    if name != AUTO:
        _check_name(name)
        return name
    from duet.kv_transfer import sockio

    on_cpu = bool(kv_caches) and all(
        c.device.type == "cpu" and c.is_contiguous() for c in kv_caches
    )
    return "tcp" if on_cpu and sockio.supported() else "torch_dist"


def check_backend_name(name: str) -> None:
    """Raise ValueError naming `kv_backend` unless `name` is "auto" or a registered backend."""
    if name != AUTO:
        _check_name(name)


def _check_name(name: str) -> None:
    if name not in _BACKENDS:
        raise ValueError(
            f"kv_backend: unknown {name!r}; available: {AUTO}, {', '.join(available_backends())}"
        )


def register_backend(name: str, module: str, sender: str, receiver: str) -> None:
    _BACKENDS[name] = (module, sender, receiver)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _load(name: str, index: int) -> Any:
    _check_name(name)
    module_name, *classes = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), classes[index])


def create_sender(
    backend: str,
    kv_caches: list[torch.Tensor],
    layout: KVLayout,
    settings: SenderConfig | None = None,
    draft_caches: list[torch.Tensor] | None = None,
    **options: Any,
) -> KVSender:
    """The sender of `backend` ("auto": resolved from `kv_caches`, see `resolve_backend`),
    built with `settings` plus the backend's own `options` (which override a setting of the
    same name). Raises ValueError naming an option the backend does not take.
    `draft_caches`: a draft model's, whose KV transfers may carry (`layout.draft` names it)."""
    backend = resolve_backend(backend, kv_caches)
    _check_draft(layout, draft_caches)
    cls: type[KVSender] = _load(backend, 0)
    config = build_config(cls.config_type, settings, options, f"the {backend} KV sender")
    return cls(kv_caches, layout, config, draft_caches)  # type: ignore[call-arg]


def create_receiver(
    backend: str,
    kv_caches: list[torch.Tensor],
    layout: KVLayout,
    settings: ReceiverConfig | None = None,
    draft_caches: list[torch.Tensor] | None = None,
    **options: Any,
) -> KVReceiver:
    """The receiver of `backend`, as `create_sender` builds a sender."""
    backend = resolve_backend(backend, kv_caches)
    _check_draft(layout, draft_caches)
    cls: type[KVReceiver] = _load(backend, 1)
    config = build_config(cls.config_type, settings, options, f"the {backend} KV receiver")
    return cls(kv_caches, layout, config, draft_caches)  # type: ignore[call-arg]


def _check_draft(layout: KVLayout, draft_caches: list[torch.Tensor] | None) -> None:
    """`draft_caches` exactly when the layout names a draft, of the shape it names."""
    if (layout.draft is None) != (draft_caches is None):
        raise ValueError("draft_caches: given exactly when the layout names a draft model")
    if draft_caches is not None and layout.draft is not None:
        _, _, block_size, heads, head_dim = draft_caches[0].shape
        draft = layout.draft
        if (len(draft_caches), heads, head_dim, block_size) != (
            draft.num_layers,
            draft.num_kv_heads,
            draft.head_dim,
            layout.block_size,
        ):
            raise ValueError(f"draft_caches: do not match the layout's draft {draft}")
