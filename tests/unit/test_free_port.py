"""The port a launch from a notebook or a test gives rank 0: free when drawn, and below the kernel's ephemeral range,
where the dozens of sockets gloo opens in another worker's job (each bound to port 0) can never take it before rank 0
binds it."""

import socket
from pathlib import Path

from distlab.runtime import free_port


def test_ports_are_drawn_below_the_ephemeral_range_and_free():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(10000 <= port < low for port in ports), ports
    assert len(set(ports)) > 15                     # drawn at random: two launches at once rarely meet
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
