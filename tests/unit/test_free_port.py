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


def test_a_port_drawn_is_never_handed_out_again_while_its_launch_may_not_have_bound_it(tmp_path, monkeypatch):
    """Two launches drawing at once (two test workers, a notebook beside a test) must not both get one port: the
    first's rank 0 has not bound it yet, so a bind test alone would pass twice and the second's ranks would join the
    first's store (a fresh clone's make test saw 'DistNetworkError: Connection reset by peer' from the store as a
    group formed, which such a meeting would give). The claims are read
    under a lock by every process of the user; a claim lapses after PORT_CLAIM_S."""
    import json
    import random
    import time

    from distlab import runtime

    monkeypatch.setenv("DISTLAB_PORT_CLAIMS", str(tmp_path / "claims.json"))
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, low, high: 15123)   # every draw the same
    first, second = free_port(), free_port()
    assert first == 15123 and second != 15123, (first, second)   # the second falls back to the kernel's choice
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert list(claims) == ["15123"]
    # once the claim has lapsed the port may be drawn again
    (tmp_path / "claims.json").write_text(json.dumps({"15123": time.time() - runtime.PORT_CLAIM_S - 1}))
    assert free_port() == 15123
