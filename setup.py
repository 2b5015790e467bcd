"""Build the native engine (native/) as fp_core._native with nothing but a C compiler.

No libaio, no liburing, no torch headers: io_uring is reached through raw system calls.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fp_core._native",
            sources=["native/fastpersist.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["pthread"],
        )
    ]
)
