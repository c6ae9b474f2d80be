"""The `torch_dist` backend: a pairwise channel per (sender, receiver), built on demand.

The receiver hosts a `TCPStore` at `address` ("host:port"). A sender opening a channel to it
writes its `KVLayout` under a fresh channel id, pushes the id onto the store's accept queue and
waits for the receiver's layout (or a refusal): the handshake. Both sides then build a 2-rank
group over a `PrefixStore` for that channel (gloo for CPU caches, NCCL for CUDA caches), so no
global world is needed and workers can come and go.

A transfer stages the request's blocks in one tensor `[L, 2, n, BS, h, D]` and ships it in
chunks of whole layers, each as soon as its layers are gathered. `send` gathers every layer on
the caller's thread (its blocks are free to reuse once it returns); layer-wise, `begin` opens
the transfer before the forward pass that computes the request's last prompt tokens, and
`layer_computed` gathers each layer right after the pass wrote it, so layer i is on the wire
while later layers compute; `finish` then publishes the metadata (the first token, sampled
after the last layer) as a trailer under a store key. A background thread pushes one header per
channel for the transfers queued together (`{transfers: [{request_id, shape, chunks, meta,
trailer}]}`) and sends their chunks in layer order across requests.

The receiver's channel thread pops a header, posts a receive per chunk of every transfer in it,
leaves the tensors in the inbox (`InboxKVReceiver`) and reports each chunk as it lands; the
engine thread's `poll` scatters landed layers into the blocks reserved by `expect` (only while
still expected: an aborted request's late data is dropped, never written), reads a trailer once
it is there, and acknowledges through the store once all is written. So compute, gather, wire
and scatter overlap instead of running one after the other. Both sides stage transfers in
buffers reused from a `StagingPool` (fresh ones page-fault on first touch).

CUDA: a chunk's gather records an event on the compute stream; the send thread waits for that
event on a side stream and sends from there, so NCCL waits for that chunk only, not for later
layers the CPU has already queued. The side stream is synchronised before a staging buffer is
reused. (Not exercised in CI: no GPU there.)

Files: `channel.py` (store keys, the pair group), `config.py` (`TorchDistSenderConfig`,
`TorchDistReceiverConfig`), `sender.py`, `acks.py` (the sender's threads that read the
acknowledgements), `receiver.py`, `relay.py` (the receiver's thread that writes them and reads
trailers): no `poll` makes a store round trip. The sender's outcome bookkeeping is the shared
`kv_transfer/outbox.py`, the receiver's `inbox.py`.

Timeouts: gloo ops and store waits use `timeout_s`; a receiver gives up on a request at the
`expect` deadline; a sender reports FAILED (retryable) when no acknowledgement comes within
`ack_timeout_s`, or when its peer is gone. A send that fails abandons its channel (the receiver
may be waiting for chunks that will never come); the next send to that receiver opens a new one.
"""

from kv_transfer.torch_dist.config import TorchDistReceiverConfig, TorchDistSenderConfig
from kv_transfer.torch_dist.receiver import TorchDistKVReceiver
from kv_transfer.torch_dist.sender import TorchDistKVSender

__all__ = [
    "TorchDistKVReceiver",
    "TorchDistKVSender",
    "TorchDistReceiverConfig",
    "TorchDistSenderConfig",
]
