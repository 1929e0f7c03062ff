"""Trains the demo DLRM with torchrec_cnr checkpoints (a thin launcher of ``cnr_train``).

    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml \
        checkpoint.policy=consecutive train.steps=200

Every ``key.path=value`` after the options overrides the YAML file.
"""

from __future__ import annotations

import argparse
import sys

from cnr_train.cli import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file mapping onto JobConfig")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    return train(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
