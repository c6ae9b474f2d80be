"""A live gRPC server on a shared engine, in its own event loop thread, for the session and
rate-limit tests. Session stores and rate limiters passed in are closed in that loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc

from duet.engine import AsyncEngine
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.grpc_server import start_grpc_server
from duet.v1 import serving_pb2, serving_pb2_grpc
from tests.router.rest_server import MODEL_NAME, Closable


class LiveGrpcServer:
    def __init__(self, engine: AsyncEngine, closables: tuple[Closable, ...] = (), **kwargs: Any):
        self._closables = closables
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                # Composed in this loop: the stores and limiters it is handed belong to it.
                self.front = FrontDoor.compose(engine, MODEL_NAME, RouterOptions(**kwargs))
                self.server, self.port = self.loop.run_until_complete(
                    start_grpc_server(self.front, port=0)
                )
            except BaseException as e:
                failure.append(e)
                return
            finally:
                started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(30), "gRPC server did not start"
        if failure:
            raise failure[0]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = serving_pb2_grpc.DuetStub(self.channel)

    def stop(self) -> None:
        async def shutdown() -> None:
            await self.server.stop(grace=1)
            for closable in self._closables:
                await closable.close()

        self.channel.close()
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def chat_request(
    content: str, session_id: str = "", max_tokens: int = 6, **sampling: Any
) -> serving_pb2.ChatRequest:
    opts = serving_pb2.SamplingOptions(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling
    )
    return serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content=content)],
        sampling=opts,
        session_id=session_id,
    )


def collect_text(responses: Any) -> tuple[str, serving_pb2.Usage | None]:
    """The reply text of sample 0 and the usage message of a finished stream."""
    text, usage = "", None
    for r in responses:
        if r.HasField("usage"):
            usage = r.usage
        else:
            text += r.text
    return text, usage
