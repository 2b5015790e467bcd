"""How many reads FastPersist keeps in flight, and how large: one setting for every read of
a checkpoint (loads, load_into, DCP loads, verify) and for the bench's device row.

The disk reads faster with many smaller reads in flight than with a few large ones, into
memory faulted in before and into fresh memory alike (``benchmarks/read_depth.py`` sweeps
the settings; figures in benchmarks/README.md). A chunk of 2 MiB less two pages keeps a
staged group's buffer (chunk + 2 blocks of up to 4 KiB) within one 2 MiB huge page of the
staging pool.
Read at call time (``read_depth.THREADS``), so a benchmark can sweep them.
"""

THREADS = 32
CHUNK = (2 << 20) - (8 << 10)
