"""A free TCP port on 127.0.0.1, for the tests' rendezvous and Ray clusters (no heavy import: the GPU checks' harness
uses it on the device image too)."""

import socket


def free_port() -> int:
    """A port the kernel had free a moment ago (bound to 127.0.0.1 and released); the caller binds it next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
