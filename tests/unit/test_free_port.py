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


def test_ports_never_land_where_a_job_derives_its_port():
    # A scheduler's job on this machine (the Slurm and PBS tiers run beside the other tests) binds the port its id
    # gives it (PORT_RANGE); a launch that drew the same port first would fail that job with EADDRINUSE.
    from distlab.runtime import PORT_RANGE
    ports = [free_port() for _ in range(200)]
    assert not [p for p in ports if PORT_RANGE[0] <= p < PORT_RANGE[1]], sorted(ports)[-5:]
