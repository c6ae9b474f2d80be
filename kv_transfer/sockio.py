"""Vectored socket I/O straight between paged KV caches: `sendmsg`/`recvmsg` with one iovec per
block row, so a transfer's bytes go from the sender's cache to the socket and from the socket
into the receiver's reserved blocks with no staging copy on either side (the kernel's own copy
is all there is, as for one contiguous send).

The iovec arrays are int64 tensors `[n, 2]` (address, length): Linux's `struct iovec` on 64-bit
machines, built from the caches' data pointers with tensor ops (no Python loop over blocks), and
handed to libc through ctypes, which releases the GIL for the call.

Timeouts are the socket's `SO_SNDTIMEO`/`SO_RCVTIMEO` (see `set_timeouts`): the socket object
stays in blocking mode (a Python-level timeout would make the descriptor non-blocking).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys

import torch

IOV_MAX = 1024  # Linux's limit on iovecs per call
_MSG_WAITALL = getattr(socket, "MSG_WAITALL", 0x100)
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0x4000)


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("sendmsg", "recvmsg"):
        fn = getattr(libc, name)
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
        fn.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc() if sys.platform == "linux" else None


def supported() -> bool:
    """Vectored I/O needs Linux's iovec layout (64-bit pointers and sizes)."""
    return _LIBC is not None and ctypes.sizeof(ctypes.c_void_p) == 8


def set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Every blocking send or receive on `sock` fails after `timeout_s` without progress."""
    seconds = int(timeout_s)
    tv = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def row_iovecs(caches: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """iovecs of rows `rows` of each cache, cache by cache: `[len(caches) * len(rows), 2]`.
    A cache is viewed as `[num_rows, row]` (a KV layer `[P, NB, BS, h, D]` has P * NB rows: K
    of block b is row b, V is row NB + b; MLA's one plane has NB); every cache must be
    contiguous and of one shape."""
    row_bytes = _check_rows(caches, rows)
    bases = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    iov = torch.empty((len(caches), rows.numel(), 2), dtype=torch.int64)
    iov[:, :, 0] = bases[:, None] + rows.to(torch.int64)[None, :] * row_bytes
    iov[:, :, 1] = row_bytes
    return merge_adjacent(iov.view(-1, 2))


def head_iovecs(
    caches: list[torch.Tensor], rows: torch.Tensor, heads: tuple[int, int]
) -> torch.Tensor:
    """iovecs of KV heads [start, end) of rows `rows` of each KV layer `[P, NB, BS, h, D]`,
    cache by cache, row by row, token by token: the bytes of `[len(rows), BS, end - start,
    D]` per cache, as `row_iovecs` gives whole rows (one iovec per token of a row: a head
    slice is contiguous only within one token)."""
    first = caches[0]
    _, _, block_size, num_heads, head_dim = first.shape
    start, end = heads
    if not 0 <= start < end <= num_heads:
        raise ValueError(f"heads: must be within [0, {num_heads}]; got {list(heads)}")
    row_bytes = _check_rows(caches, rows)
    head_bytes = head_dim * first.element_size()
    token = torch.arange(block_size, dtype=torch.int64) * num_heads * head_bytes
    token += start * head_bytes  # [BS]: where the slice starts in each token
    bases = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    addr = (
        bases[:, None, None] + rows.to(torch.int64)[None, :, None] * row_bytes + token[None, None]
    )
    iov = torch.empty((addr.numel(), 2), dtype=torch.int64)
    iov[:, 0] = addr.reshape(-1)
    iov[:, 1] = (end - start) * head_bytes
    return merge_adjacent(iov)


def _check_rows(caches: list[torch.Tensor], rows: torch.Tensor) -> int:
    """ValueError unless `rows` are rows of `caches`, contiguous CPU caches of one shape;
    returns the bytes of a row."""
    first = caches[0]
    row_bytes = first[0, 0].nbytes
    num_rows = first.numel() * first.element_size() // row_bytes
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < num_rows:
        raise ValueError(f"rows: must be in [0, {num_rows})")
    for cache in caches:
        if cache.device.type != "cpu" or not cache.is_contiguous() or cache.shape != first.shape:
            raise ValueError("caches: vectored I/O needs contiguous CPU caches of one shape")
    return row_bytes


def merge_adjacent(iov: torch.Tensor) -> torch.Tensor:
    """One iovec for each run that continues where the previous one ends (blocks allocated in
    a row, as a fresh pool hands them out): fewer, longer copies for the kernel."""
    if iov.shape[0] < 2:
        return iov
    starts = torch.ones(iov.shape[0], dtype=torch.bool)
    starts[1:] = iov[1:, 0] != iov[:-1, 0] + iov[:-1, 1]
    if bool(starts.all()):
        return iov
    run = torch.cumsum(starts, 0) - 1
    merged = torch.zeros((int(run[-1]) + 1, 2), dtype=torch.int64)
    merged[:, 0] = iov[starts, 0]
    merged[:, 1].index_add_(0, run, iov[:, 1])
    return merged


def split_iovecs(iov: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`iov` cut into `parts` runs of consecutive bytes, equal but for the last (which takes the
    remainder), an iovec cut in two where a share ends inside it. Both ends of a striped
    transfer cut at the same byte offsets, however differently their iovecs lie in memory."""
    total = int(iov[:, 1].sum()) if iov.numel() else 0
    if not 1 <= parts <= max(1, total):
        raise ValueError(f"parts: must be in [1, {max(1, total)}] for {total} bytes")
    out, rest = [], iov
    for _ in range(parts - 1):
        share = total // parts
        ends = torch.cumsum(rest[:, 1], 0)
        last = int(torch.searchsorted(ends, share))  # the iovec the share ends in
        over = int(ends[last]) - share  # its bytes past the share's end
        head = rest[: last + 1].clone()
        head[-1, 1] -= over
        if over:
            rest = rest[last:].clone()
            rest[0, 0] += head[-1, 1]
            rest[0, 1] = over
        else:
            rest = rest[last + 1 :]
        out.append(head)
    out.append(rest)
    return out


def buffer_iovecs(buf: torch.Tensor) -> torch.Tensor:
    """One iovec over a contiguous CPU tensor."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError("buf: must be a contiguous CPU tensor")
    return torch.tensor([[buf.data_ptr(), buf.nbytes]], dtype=torch.int64)


def send_iovecs(sock: socket.socket, iov: torch.Tensor, head: bytes = b"") -> None:
    """Send `head`, then the bytes `iov` points at, in order; blocks until all are handed to
    the kernel. Raises TimeoutError (no progress within the socket's timeout) or OSError."""
    if head:  # one syscall for both: a separate tiny send costs the receiver a wake-up
        keep = ctypes.create_string_buffer(head, len(head))
        first = torch.tensor([[ctypes.addressof(keep), len(head)]], dtype=torch.int64)
        iov = torch.cat([first, iov])
    _transfer(sock, iov, send=True)


def recv_iovecs(sock: socket.socket, iov: torch.Tensor) -> None:
    """Fill the bytes `iov` points at from the socket, in order. Raises ConnectionError when
    the peer closes first, TimeoutError, or OSError."""
    _transfer(sock, iov, send=False)


def _transfer(sock: socket.socket, iov: torch.Tensor, send: bool) -> None:
    assert _LIBC is not None
    if iov.numel() == 0:
        return
    iov = iov.clone()  # advanced in place after partial transfers
    call = _LIBC.sendmsg if send else _LIBC.recvmsg
    flags = _MSG_NOSIGNAL if send else _MSG_WAITALL
    fd = sock.fileno()
    lens = iov[:, 1]
    first, total = 0, iov.shape[0]
    while first < total:
        count = min(IOV_MAX, total - first)
        hdr = _MsgHdr()
        hdr.msg_iov = iov.data_ptr() + first * 16
        hdr.msg_iovlen = count
        done = call(fd, ctypes.byref(hdr), flags)
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise TimeoutError(f"socket {'send' if send else 'receive'} timed out")
            raise OSError(err, os.strerror(err))
        if done == 0 and not send:
            raise ConnectionError("peer closed the connection mid-transfer")
        # Skip the iovecs `done` covers whole, and advance into the one it ends in.
        span = lens[first : first + count]
        ends = torch.cumsum(span, 0)
        whole = int(torch.searchsorted(ends, done, right=True))
        first += whole
        if whole < count:
            covered = done - (int(ends[whole - 1]) if whole else 0)
            iov[first, 0] += covered
            iov[first, 1] -= covered
