"""What a run needs from the machine and the OS, outside the maths: the run lock (one run per output folder), the
/dev/shm watch and sweep, stale build locks, signals, Ray's worker set-up hook and the CPU shim it installs, cache
folders when HOME is read-only, and quieting third-party noise. Imported before torch where it matters
(``cpu_compat``, ``caches``): keep this package's ``__init__`` empty of imports."""
