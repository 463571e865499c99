"""What this machine's TCP sockets listen on, read from /proc/net (Linux)."""
from __future__ import annotations

from pathlib import Path

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (host byte order)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found
