"""A free TCP port on 127.0.0.1, for the tests' rendezvous and Ray clusters (no heavy import: the GPU checks' harness
uses it on the device image too)."""

# moved to benchmarks/common.py (the benchmarks' one-process DeepSpeed actor takes a port too)
from benchmarks.common import free_port  # noqa: F401
