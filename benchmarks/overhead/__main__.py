"""``python -m benchmarks.overhead``: see :mod:`benchmarks.overhead`."""

from __future__ import annotations

import argparse

import benchmarks.overhead
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import model_arguments
from benchmarks.overhead import floor, gil, paired, save_cost
from torchrec_cnr.config import BACKGROUND


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=200_000)
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument("--intervals", type=float, nargs="+", default=[5.0, 10.0, 30.0])
    p.add_argument("--warmup-steps", type=int, default=30, help="untimed training steps first")
    p.add_argument("--probe-steps", type=int, default=100, help="timed steps that set K")
    ask = p.add_mutually_exclusive_group(required=True)
    for module in ("paired", "save_cost", "gil", "floor"):
        flag = "--" + module.replace("_", "-")
        ask.add_argument(flag, action="store_true", help=f"ask overhead.{module}'s question")
    p.add_argument("--saves", type=int, default=8, help="--save-cost: checkpoints per arm")
    p.add_argument("--before", type=int, default=100, help="--save-cost: steps before a save")
    p.add_argument(
        "--after",
        type=int,
        default=200,
        help="--save-cost: steps after it (again, while its commit has not landed)",
    )
    p.add_argument("--pair-s", type=float, default=90.0, help="--paired: seconds of pairs")
    p.add_argument("--busy-steps", type=int, default=60, help="--paired: steps per busy stretch")
    p.add_argument("--busy-pairs", type=int, default=5, help="--paired: pairs per busy arm")
    p.add_argument("--policy", default="intermittent", help="--floor: the checkpoints' policy")
    p.add_argument("--background", default="thread", choices=BACKGROUND,
                   help="--floor: where the checkpoints are written (CheckpointConfig)")  # fmt: skip
    p.add_argument("--per-stretch", type=int, default=1,
                   help="--floor: checkpoints per stretch, one every interval")  # fmt: skip
    p.add_argument("--compact-every", type=int, default=None,
                   help="--floor: CheckpointConfig.compact_every")  # fmt: skip
    p.add_argument("--gil-s", type=float, default=20.0, help="--gil: seconds sampled per format")


def run(b: Bench) -> Outcome:
    """The question the flag asks."""
    a = b.args
    question = gil if a.gil else floor if a.floor else save_cost if a.save_cost else paired
    return question.run(b)


CASE = Case("overhead", "End-to-end overhead: throughput lost to checkpoints every K steps",
            _arguments, "--tables 2 --rows 4000 --dim 16 --batch 64 --intervals 0.3 0.6 "
            "--warmup-steps 3 --probe-steps 20 --saves 1 --before 5 --after 40 "
            "--pair-s 1.2 --busy-steps 6 --busy-pairs 2 --gil-s 2", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, benchmarks.overhead.__doc__)
