"""A stand-in for a prefill or decode worker behind the real gRPC servicers."""

from __future__ import annotations

from types import SimpleNamespace

from duet.engine.stats import EngineStats


class FakeWorker:
    """What the servicers read; `calls` counts the work a caller got out of the worker."""

    def __init__(self) -> None:
        self.is_running = True
        self.calls = 0
        self.config = SimpleNamespace(block_size=8)
        self.kv_address = "127.0.0.1:1"
        self.deterministic = True
        self.speculates_with_ngram = False
        self.role = SimpleNamespace(record_queue_times=False)  # the prefill role's switch
        self.engine = SimpleNamespace(stats=EngineStats())  # what the load reports carry
        self.load = SimpleNamespace(
            num_running=0, num_waiting=0, num_waiting_for_kv=0, num_transferring=0,
            num_queued_tokens=0, num_free_blocks=7, num_blocks=9, max_num_seqs=4,
        )  # fmt: skip
        self.prefix_index = SimpleNamespace(
            since=lambda _: SimpleNamespace(last_event=0, snapshot=False, stored=[], removed=[])
        )

    async def generate_deltas(
        self, prompt, params, request_id, num_replayed=0, priority=0
    ):  # issue #25: free inference
        self.calls += 1
        for _ in ():  # an empty stream: what matters is that it was served
            yield
