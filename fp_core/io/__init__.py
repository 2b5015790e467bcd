"""Native I/O: the engine, planned writes and checksums, staging arenas (in shared memory too), reads."""
