"""Build the native engine (native/) as fp_core._native with nothing but a C compiler.

No libaio, no liburing, no torch headers: io_uring is reached through raw system calls.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fp_core._native",
            # every native/*.c (tests/native/test_native_engine_c.py checks that none is missing)
            sources=[
                "native/binding.c",
                "native/crc32c.c",
                "native/engine.c",
                "native/faults.c",
                "native/read_job.c",
                "native/staging.c",
                "native/uring.c",
                "native/write_job.c",
            ],
            depends=["native/fp_engine.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["pthread"],
        )
    ]
)
