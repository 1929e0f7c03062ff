"""Serves the demo DLRM from the training job's checkpoints while it trains (a thin
launcher of ``cnr_train.serve``): start it beside the job, on the job's config.

    .venv/bin/python scripts/serve.py --config configs/demo.yaml &
    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml
    wait

    .venv/bin/python scripts/serve.py --config configs/demo.yaml serve.dtype=int8 \
        serve.metrics_path=runs/demo-serve.json

It follows ``checkpoint.path`` until the job writes its done marker, then prints its lag,
the bytes each update read and its AUC. Every ``key.path=value`` after the options
overrides the YAML file.
"""

from __future__ import annotations

import argparse
import sys

from cnr_train.cli import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file mapping onto JobConfig (the job's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.dtype=int8")
    args = parser.parse_args(argv)
    # serve() closes the follower and the request thread in its ``finally``.
    return serve(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
