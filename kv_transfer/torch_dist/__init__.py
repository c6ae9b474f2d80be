"""The `torch_dist` backend: a pairwise channel per (sender, receiver), built on demand.

The receiver hosts a `TCPStore` at `address` ("host:port"). A sender opening a channel to it
writes its `KVLayout` and its link kind under a fresh channel id, pushes the id onto the
store's accept queue and waits for the receiver's layout (or a refusal): the handshake. Both
sides then open the channel's link (`link.py`) over a `PrefixStore` for that channel: NCCL
between CUDA caches, gloo between CPU caches, or gloo with NCCL's semantics
(`nccl_emu.py`, `DUET_KV_EMULATE_NCCL=1`), so no global world is needed and workers can come
and go.

A transfer streams through the worker's bounded staging pool (`kv_transfer/staging.py`), one
piece at a time (`kv_transfer/chunks.py`: whole layers, or a layer's blocks where a layer is
larger than a quarter of the smaller of the two sides' pools, which the receiver states at the
handshake). `send` marks every layer computed; layer-wise, `begin` opens the transfer before
the forward pass that computes the request's last prompt tokens and `layer_computed` marks
each layer as the pass wrote it, so layer i is on the wire while later layers compute; `finish`
then publishes the metadata (the first token, sampled after the last layer) as a trailer under
a store key. A background thread pushes one header per channel for the transfers queued
together (`{transfers: [{request_id, shape, draft_shape, chunks: [[start, end, first, last,
tag], ...], meta, trailer}], order: [[transfer, piece], ...]}`), then, for each piece in layer
order across requests (a0, b0, a1, ...), the order the header lists, takes a slot (waiting,
while its own sends complete, up to `timeout_s`), gathers the piece from the cache into it and
posts its send; the slot goes back once the send completed. The blocks are the caller's again
(once the outcome is reported) when the last piece is gathered.

NCCL matches messages by issue order, not by tag: the receiver's channel thread pops a header
and posts a receive per chunk in exactly the header's `order`, each followed by an event on
the link; it reports a chunk landed (`progress`) only once its event completed (NCCL's
`wait()` returns before the data is there), and the engine thread's `poll` scatters landed
layers into the blocks reserved by `expect` (only while still expected: an aborted request's
late data is dropped, never written), reads a trailer once it is there, and acknowledges
through the store once all is written. So compute, gather, wire and scatter overlap. The
receiver takes a slot of its own pool for each receive it posts (while the pool is full it hands
landed pieces to the inbox, whose writes free slots, and waits up to `timeout_s`); the inbox
gives a piece's slot back once it wrote it. A staging allocation that fails (the pool's arena,
at first use) fails the sender's batch before its header goes out, or loses the receiver's
channel: retryable, and the next transfer tries again.

CUDA: the pass records an event on the compute stream after the layers that complete a piece;
the send thread's copy stream waits for it and gathers, the link's stream waits for the gather
and sends, so NCCL waits for that piece only. Receives run on the receiver link's own stream
and their completion is learned from a CUDA event queried from the host, so the decode step
never waits for an incoming transfer; a slot is received into again only after the scatter
queued out of it ran. (Not exercised in CI: no GPU there; the emulation runs the same
code path on CPU.)

Files: `channel.py` (store keys, handshake checks, the header's order), `link.py` (the link
kinds, their events and marks, abort), `landing.py` (gloo works waited for on a thread),
`nccl_emu.py`, `config.py` (`TorchDistSenderConfig`, `TorchDistReceiverConfig`), `sender.py`
(and `send_job.py`, a transfer on its way out), `acks.py` (the sender's threads that read the
acknowledgements), `probe.py` (the link probe), `receiver.py`, `relay.py` (the receiver's
thread that writes the acknowledgements and reads trailers): no `poll` makes a store round
trip. The sender's outcome bookkeeping is the shared `kv_transfer/outbox.py`, the receiver's
`inbox.py`.

Timeouts (a lost peer raises nothing under NCCL): every operation of a channel is bounded by
`timeout_s` without progress, on both sides. On expiry the side aborts the channel's link and
fails only that channel's unfinished transfers (retryable); the process and its other
channels go on (the sender's thread posts and never waits on a send; NCCL's own timeout, which
by default tears the process down, is set to 4x). Store waits use `timeout_s`; a receiver gives
up on a request at the `expect` deadline; a sender reports FAILED (retryable) when no
acknowledgement comes within `ack_timeout_s`. A failed channel is never reused; the next send
to that receiver opens a new one.
"""

from duet.kv_transfer.torch_dist.config import TorchDistReceiverConfig, TorchDistSenderConfig
from duet.kv_transfer.torch_dist.receiver import TorchDistKVReceiver
from duet.kv_transfer.torch_dist.sender import TorchDistKVSender

__all__ = [
    "TorchDistKVReceiver",
    "TorchDistKVSender",
    "TorchDistReceiverConfig",
    "TorchDistSenderConfig",
]
