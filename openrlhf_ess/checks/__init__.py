"""Checks that stop a run before it spends GPU time: pre-flight (every input, before Ray: ``preflight``), the
machine and placement (memory, devices, bundles: ``resources``) and the start-up self-checks that prove each GPU
contract on the user's cluster (``selfcheck``)."""
