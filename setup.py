"""Builds four small C libraries, loaded with ctypes: the range search of adaptive
quantization (torchrec_cnr/quantization/_compiled.py), the CRC32 of stored tensors
(torchrec_cnr/snapshot/checksum.py), lazy staging's copier (torchrec_cnr/staging/cow.py)
and the writing of rows by index (torchrec_cnr/rowcopy.py). Everything else is in
pyproject.toml. ``optional``: without a C compiler the install still succeeds; the
search runs as torch code, the CRC32 on zlib, lazy staging copies under a lock and rows
are written by numpy (slower; logged once)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchrec_cnr.quantization._rowsearch_lib",
            sources=[
                "torchrec_cnr/quantization/_rowsearch.c",
                "torchrec_cnr/quantization/_rowsearch_avx2.c",
                "torchrec_cnr/quantization/_rowsearch_avx512.c",
            ],
            # No contraction into FMA: every build of the search rounds alike.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi"],
            optional=True,
        ),
        Extension(
            "torchrec_cnr.snapshot._crc32_lib",
            sources=["torchrec_cnr/snapshot/_crc32.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "torchrec_cnr.staging._cow_lib",
            sources=["torchrec_cnr/staging/_cow.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
            optional=True,
        ),
        Extension(
            "torchrec_cnr._rowcopy_lib",
            sources=["torchrec_cnr/_rowcopy.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
            optional=True,
        ),
    ]
)
