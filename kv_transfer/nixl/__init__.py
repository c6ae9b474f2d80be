"""The `nixl` backend: KV blocks move cache to cache between NIXL agents (UCX underneath: RDMA or
TCP between hosts, NVLink or CUDA IPC between GPUs, CMA or shared memory between CPU processes
on one host), never through a staging copy.

Each side registers its whole KV cache once at start-up (every layer's tensor, K and V; a
draft model's too), CPU or GPU memory alike (`agent.py`). A transfer is a list of block-to-block
descriptors over those registrations (`regions.py`): one per K or V row of a block and layer,
or, where a side holds more KV heads than move between the two ranks (tensor-parallel layouts
that differ: `layout.head_route`), one per token of a row, over the heads' slice; runs that
continue each other on both sides are merged.

Membership (`service.py`, proto/duet/v1/kv_agent.proto): the receiver serves `KVAgent` on the
internal gRPC plane (calls signed with the cluster secret, TLS when configured). A sender's
first transfer to a receiver `Join`s it: both learn the other's agent metadata, layout (checked
as every backend's handshake: a mismatch refused on both sides) and cache regions. `close`
sends `Leave`; while transfers are open the sender `Ping`s each receiver (a dead or silent
one fails them, retryable, within the transfer timeout; one that no longer knows this sender,
restarted, too) and the next transfer joins again. A receiver drops a sender's agent when it
leaves or rejoins. Nobody restarts for a worker that comes or goes.

Protocol (NIXL notifications carrying JSON, `{"t": kind, "id": request id, ...}`):

- sender -> receiver: `offer` (its block ids and the draft's, the layers carried, the layers
  computed so far, its window on the blocks, the metadata unless it is a trailer, the mode);
  `ready` (layer-wise: more layers computed, a new window); `meta` (the trailer: the first
  token); `cancel` (the sender gave up); push: `written` (carried by each write, delivered
  once its data landed) and `stopped`.
- receiver -> sender: `done` (every layer of every shard landed and the metadata is here: the
  sender may free its blocks); `refuse` (it will not touch the blocks: aborted, not expected in
  time, the window closed); push: `dest` (its reserved block ids and its window on them) and
  `stop`.

Pull (the default, as vLLM's NixlConnector): the receiver reads the offered layers into the
blocks it reserved, once the request is both offered and expected, as layers become ready
(layer-wise: layer i is read while later ones compute), then says `done`. Push: the receiver
answers the offer with `dest`, and the sender writes each computed layer range there. Which is
faster, and why: docs/kv_transfer.md.

Ownership (`windows.py`): whoever hands out blocks also gives a window; the mover starts no
operation on them after it and cancels one that runs too long; the owner holds the blocks until
the mover let go, or the window plus its run time passed. The receiver reports a request only
once no operation on its blocks runs; its `abort` returns once none does.

Files: `config.py`, `agent.py` (the agent and its thread), `regions.py` (descriptors),
`windows.py`, `service.py` (membership), `sender.py`, `receiver.py`; the sender's outcome
bookkeeping is the shared `kv_transfer/outbox.py`.
"""

from duet.kv_transfer.nixl.config import NixlReceiverConfig, NixlSenderConfig
from duet.kv_transfer.nixl.receiver import NixlKVReceiver
from duet.kv_transfer.nixl.sender import NixlKVSender

__all__ = ["NixlKVReceiver", "NixlKVSender", "NixlReceiverConfig", "NixlSenderConfig"]
