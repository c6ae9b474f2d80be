#!/usr/bin/env bash
# Run a command (`make test`'s pytest) where naming loopback never asks a DNS server.
#
# c10d (torch.distributed's TCPStore clients, every KV channel and tensor-parallel group) looks
# up the name of each socket's peer with getnameinfo. Its clients connect over IPv6 sockets, so
# the peer of a loopback connection is ::ffff:127.0.0.1, which the hosts file does not name:
# each connection sent a PTR query to the machine's DNS server, and a dropped one stalled the
# connection for the resolver's 5 s timeout (docs/development.md, "Name lookups"). Tests send
# traffic only to loopback and to namespaces they build, so here, as root, the command runs in
# a private mount namespace whose /etc/hosts is the machine's plus names for the IPv6 forms of
# loopback. Without root (or without unshare) it runs as it is, and says so.
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --mount true 2>/dev/null; then
    hosts=$(mktemp "${TMPDIR:-/tmp}/duet-hosts.XXXXXX")
    trap 'rm -f "$hosts"' EXIT
    { cat /etc/hosts; printf '::1 localhost\n::ffff:127.0.0.1 localhost\n'; } > "$hosts"
    chmod 644 "$hosts"
    unshare --mount sh -c 'mount --bind "$0" /etc/hosts && shift && exec "$@"' "$hosts" _ "$@"
else
    echo "tests/hermetic_names.sh: not root or no unshare: loopback names may go to DNS" >&2
    exec "$@"
fi
