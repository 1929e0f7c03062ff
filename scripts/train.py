"""Trains a synthetic DLRM with torchrec_cnr checkpoints.

    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml \
        checkpoint.policy=consecutive train.steps=200

Every ``key.path=value`` after the options overrides the YAML file.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from torchrec_cnr import config_file
from torchrec_cnr.job import JobConfig, run
from torchrec_cnr.launch import init_distributed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file mapping onto JobConfig")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    try:
        config = config_file.load(JobConfig, args.config, args.overrides)
    except config_file.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed()
    try:
        run(config)
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
