"""The attempt's state machine's vocabulary (attempt.py): its phases, the events that move it
(each put on the attempt's one queue by the task that waited for it) and where it runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from duet.cluster.decode_client import DecodeStream
from duet.cluster.worker_pool import DecodeState, PrefillState
from duet.v1 import worker_pb2


class Phase(enum.Enum):
    RESERVE = "reserve"
    PREFILL = "prefill"
    STREAM = "stream"
    DONE = "done"


@dataclass(frozen=True)
class Reserved:
    """The decode worker took the request; its outputs come on `stream`."""

    stream: DecodeStream


@dataclass(frozen=True)
class ReserveFailed:
    error: Exception


@dataclass(frozen=True)
class PrefillAnswered:
    """The prefill call ended; its task holds the answer or the error."""


@dataclass(frozen=True)
class DeltaArrived:
    delta: worker_pb2.OutputDelta


@dataclass(frozen=True)
class StreamEnded:
    """The decode stream ended before its finishing delta: `error`, or None (cut short)."""

    error: Exception | None


Event = Reserved | ReserveFailed | PrefillAnswered | DeltaArrived | StreamEnded


@dataclass(frozen=True)
class Route:
    """Where one attempt runs."""

    decode: DecodeState
    prefill: PrefillState | None
    """None: the decode worker prefills the prompt itself."""
    num_uncached: int
    """Prompt tokens the prefill worker has not cached (what its queue grows by)."""
