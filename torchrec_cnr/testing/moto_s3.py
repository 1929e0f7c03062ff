"""moto's S3 server, lighter per request, for the tests' and the benchmarks' S3 roots.

    python torchrec_cnr/testing/moto_s3.py -H 127.0.0.1 -p PORT

moto's server as ``python -m moto.server`` runs it, with two costs taken off each request
(about a quarter of its CPU on the tests' checkpoints of 64 KiB objects): moto looks for the
request's service by listing its own package folder on disk, here listed once, and
werkzeug logs every request, here only warnings. What it answers is unchanged. It
imports nothing of this package and runs by its path, as ``gcs_emulator.py`` does.
"""

from __future__ import annotations

import functools
import logging

from moto import backends, server

_listed = backends.list_of_moto_modules
# The folders are moto's installed modules: they do not change while it runs.
backends.list_of_moto_modules = functools.cache(lambda: tuple(_listed()))
logging.getLogger("werkzeug").setLevel(logging.WARNING)

if __name__ == "__main__":
    server.main()
