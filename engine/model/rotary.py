"""Rotary position embeddings (HF rotate-half layout), with llama3, linear and yarn scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from duet.engine.kernels import fused_ops_for


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    rope_freqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, always computed on the CPU."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if rope_freqs is not None:  # GGUF llama3 models ship the per-frequency factors directly
        return (inv_freq / rope_freqs.to("cpu", torch.float64)).float()
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "yarn":
        assert scaling is not None
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
    elif kind == "llama3":
        assert scaling is not None
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies (DeepSeek-V2/V3), computed as HF transformers does, in fp32:
    interpolated (divided by `factor`) below the correction range, extrapolated above it, a
    linear ramp between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin per position. On the CPU a C++ kernel, on CUDA a Triton one, rotates q
    and k in place (one pass, no copies); elsewhere `forward` returns rotated copies."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rope_freqs: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self._args = (head_dim, theta, scaling, rope_freqs)
        self.max_position = max_position
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.rebuild(torch.device("cpu"))

    def rebuild(self, device: torch.device) -> None:
        """(Re)compute the fp32 tables on `device`, e.g. after the model was built on meta."""
        inv_freq = rope_inv_freq(*self._args).to(device)
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D], positions: [T]
        kernels = fused_ops_for(q)
        if kernels is not None and _heads_contiguous(q) and _heads_contiguous(k):
            # the buffers from their dict: `self.cos` is a Python call (nn.Module.__getattr__)
            kernels.rotary_embedding(positions, q, k, self._buffers["cos"], self._buffers["sin"])
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """On CUDA with the Triton operators: `forward` (in place) and the KV write of this
        step in one kernel (`rotary_embedding_and_store`); False, having done nothing, where
        that kernel does not apply (the caller rotates and stores as usual)."""
        kernels = fused_store_for(q)
        if kernels is None or not all(_heads_contiguous(t) for t in (q, k, v)):
            return False
        if kv_cache.dtype != k.dtype or not kv_cache.is_contiguous():
            return False
        kernels.rotary_embedding_and_store(
            positions, q, k, v, self._buffers["cos"], self._buffers["sin"], kv_cache, slot_mapping
        )
        return True


def fused_store_for(x: torch.Tensor) -> Any | None:
    """The Triton operators where the rotary embedding and the KV write run as one kernel:
    CUDA tensors of a Triton dtype (`fused_ops_for`'s there), else None."""
    if not x.is_cuda:
        return None
    return fused_ops_for(x)


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Each token's heads one contiguous run (q and k as views of one qkv product are)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Computed in fp32 like HF, then cast back.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
