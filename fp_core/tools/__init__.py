"""FastPersist's tools, apart from the runtime: the ``fastpersist`` command (:mod:`.cli`), the
benchmarks (:mod:`.bench`, :mod:`.bench_async`, their options in :mod:`.bench_args`, what both
use in :mod:`.common`) and this process's resources as the tests and benchmarks read them
(:mod:`.procinfo`).

Nothing here is imported by ``fp_core`` itself, and importing this package imports nothing.
"""
