"""The `tcp` backend: KV blocks between CPU caches over a channel per (sender, receiver) of
`stripes` TCP connections (2 by default), with no staging copy on either side.

`torch_dist` over gloo gathers a request's blocks into a contiguous buffer, sends it, receives
it into another and scatters it: four passes over the bytes where one contiguous send makes two
(the kernel's copies out of and into user memory). On CPU those extra copies cost as much as
the wire, so that path runs at about half the speed of a raw send on loopback. Here the kernel
copies straight out of the sender's block rows and into the receiver's reserved ones
(`sockio`: `sendmsg`/`recvmsg` with one iovec per block row). A payload of at least
`STRIPE_MIN_BYTES` per connection is cut into equal shares of bytes, one per connection, moved
at once (`stripes.py`): on loopback one stream keeps only ~1.4 of 2 cores busy, since each side
waits on the other's copies; two moved 256 SmolLM2 fp32 blocks at 0.85-1.08x a raw gloo send
where one managed ~0.7x (docs/benchmarks.md, "KV transfer").

Protocol (frames are a 4-byte big-endian length and a JSON header, all on the channel's first
connection; a `kv` frame's payload follows its header, striped over the connections):

- authentication (cluster_auth/handshake.py), on every connection before any frame when the
  configs carry the cluster secret: a challenge-response by HMAC both ways; a sender that fails
  it is closed before a byte of KV is read or a block is touched (`TcpKVReceiver.refusals`);
- handshake: the sender sends `{"layout"}`, the receiver answers `{"verdict": {"layout",
  "channel", "max_piece_bytes"}}` (the largest payload its staging pool takes whole) or
  `{"verdict": {"error"}}` (a mismatch refused on both sides, as in torch_dist);
  each further connection sends `{"attach": channel, "stripe": i}` (i = 1, 2, ... in order) and
  is answered `{"attached": i}`;
- `{"type": "xfer", "request_id", "num_blocks", "meta", "trailer"}` announces a transfer;
- `{"type": "kv", "request_id", "piece": [start, end, first, last], "nbytes", "stripes"}` +
  layers [start, end) of blocks [first, last) of it, laid out `[end - start, 2, last - first,
  BS, h, D]` (a piece, `kv_transfer/chunks.py`: at most `max_piece_bytes`; a whole-request
  send is one piece per layer group as far as that allows), sent as soon as those layers are in
  the sender's cache (layer-wise: while later layers still compute); share j of `stripes` (bytes
  [j * nbytes // stripes, ...), the last one to the end) goes over connection j;
- `{"type": "meta", "request_id", "meta"}`: a layer-wise transfer's trailer (the first token);
- `{"type": "cancel", "request_id", "error"}`: the sender gave the transfer up;
- receiver to sender: `{"type": "ack", "request_id"}` once every byte is in the blocks;
- `{"type": "ping", "nbytes", "stripes"}` + `nbytes` bytes striped as a `kv` frame's payload: a
  link probe (`probe.py`, on a channel of its own), read and dropped; the receiver answers
  `{"type": "pong", "nbytes"}` once all are in.

Where the data lands: an expected request (its `expect` came before its `xfer`) whose shard
holds all the receiver's heads is received straight into its reserved blocks. Anything else (a
request nobody expects yet, a slice of the receiver's heads: `layout.head_route`) lands
piece by piece in slots of the receiver's bounded staging pool (`kv_transfer/staging.py`),
which the engine thread scatters and gives back, as in torch_dist; a piece that finds the pool
full waits for room up to `timeout_s` (the sender's socket waits meanwhile), then the channel
is lost and its transfers fail (retryable).

Ownership: the sender reads its blocks until its thread has handed their last byte to the
kernel; `poll` reports a transfer's outcome (DONE, FAILED, ABORTED) only after that, so the
caller never frees blocks under a send. The receiver writes an expected request's blocks only
while it is still expected: `abort` waits for a write in progress (shutting the connection down
if it stalls: every connection of the channel), and `poll` does not time a request out under
a write; after either, anything still on the wire for the request is read and dropped.

Files: `framing.py` (frames, socket settings), `stripes.py` (a channel's connections),
`config.py` (`TcpSenderConfig`, `TcpReceiverConfig`), `sender.py`, `receiver.py`, `probe.py`
(the link probe); the sender's outcome bookkeeping is the shared `kv_transfer/outbox.py`, the
receiver's `inbox.py`.

Timeouts: every socket operation gives up after `timeout_s` without progress; the receiver
gives up on a request at its `expect` deadline; the sender reports FAILED (retryable) when no
acknowledgement comes within `ack_timeout_s` of its last byte, or when the connection breaks.
A broken connection is never reused; the next send to that receiver opens a new channel.
"""

from duet.kv_transfer.tcp.config import TcpReceiverConfig, TcpSenderConfig
from duet.kv_transfer.tcp.receiver import TcpKVReceiver
from duet.kv_transfer.tcp.sender import TcpKVSender

__all__ = ["TcpKVReceiver", "TcpKVSender", "TcpReceiverConfig", "TcpSenderConfig"]
