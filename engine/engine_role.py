"""`EngineRole`: what one kind of worker (aggregated server, prefill worker, decode worker)
does around `EngineCore`'s step loop, as hooks the core calls on its engine thread."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from duet.engine.commands import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    FinishStopped,
    ReleaseHeld,
    ReserveRemote,
)
from duet.engine.errors import InvalidInputError
from duet.engine.llm_engine import LLMEngine
from duet.engine.outputs import EngineOutput


class RoleHost(Protocol):
    """What a role sees of its `EngineCore` (engine/core.py), on the engine thread."""

    engine: LLMEngine

    def publish(self, request_id: str, item: Any) -> None:
        """Queue `item` for the request's stream; sent at the iteration's end."""

    def submit_internal(self, cmd: EngineCommand) -> None:
        """Apply `cmd` at the next iteration (rank 0), broadcast like the rest."""

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The gloo group over the engine's ranks (None: one rank)."""

    @property
    def dead(self) -> BaseException | None:
        """Why the loop ended (None while it runs): `EngineDeadError` after a shutdown."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped; in-flight and new requests fail (retryable elsewhere)."""


class EngineRole:
    """What one kind of worker does around the core's step loop. This base is the aggregated
    engine: requests are generated here and each step's outputs go to their streams.

    Invariants: every hook runs on the engine thread, between steps, and must not block
    (poll, never wait). A hook reports to callers only through `core.publish`. An exception
    raised by `add` or `reserve` is the caller's (published to its stream); one raised by any
    other hook stops the loop, and every open stream ends with `EngineDeadError`.
    """

    core: RoleHost

    def attach(self, core: RoleHost) -> None:
        """Called once by the core before its thread starts."""
        self.core = core

    def start(self) -> None:
        """Called once on the engine thread, once the engine exists and before the first
        iteration: build what needs the engine (KV connectors). An exception fails start-up."""

    @property
    def engine(self) -> LLMEngine:
        return self.core.engine

    def add(self, cmd: AddRequest) -> None:
        if cmd.prefill_dest is not None:
            raise InvalidInputError("prefill_dest", "this engine runs no prefill-only requests")
        self.engine.add_request(
            cmd.prompt,
            cmd.params,
            cmd.request_id,
            cmd.priority,
            prompt_text=cmd.prompt_text,
            num_replayed=cmd.num_replayed,
        )

    def abort(self, cmd: AbortRequest) -> None:
        out = self.engine.abort(cmd.request_id)
        if out is not None:
            self.core.publish(cmd.request_id, out)

    def finish_stopped(self, cmd: FinishStopped) -> None:
        self.engine.finish_stopped(cmd.request_id, cmd.index, cmd.num_tokens)

    def reserve(self, cmd: ReserveRemote) -> None:
        raise InvalidInputError("request_id", "this engine takes no remote-KV reservations")

    def release(self, cmd: ReleaseHeld) -> None:
        raise InvalidInputError("request_id", "this engine holds no prefilled blocks")

    def before_step(self) -> None:
        """Take in what arrived from outside the engine (e.g. remote KV)."""

    def after_step(self, outputs: list[EngineOutput]) -> None:
        """Deliver a step's outputs (and start whatever they trigger)."""
        for out in outputs:
            self.core.publish(out.request_id, out)

    def has_io_in_flight(self) -> bool:
        """True while the role waits on I/O the loop must poll for soon (transfers)."""
        return False

    def busy_elsewhere(self) -> bool:
        """True while other ranks have work that needs this loop to keep stepping (the
        data-parallel lockstep: engine/data_parallel.py)."""
        return False

    def on_exit(self) -> None:
        """The loop ended (stop or failure): release what the role holds."""
