"""Builds the compiled range search of adaptive quantization (plain C, loaded
with ctypes: see torchrec_cnr/quantization/_compiled.py). Everything else is
in pyproject.toml. ``optional``: without a C compiler the install still
succeeds and the search runs as torch code (slower; logged once)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchrec_cnr.quantization._rowsearch_lib",
            sources=["torchrec_cnr/quantization/_rowsearch.c"],
            # No contraction into FMA: every build of the search rounds alike.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi"],
            optional=True,
        )
    ]
)
