"""``python -m benchmarks.overhead``: see :mod:`benchmarks.overhead`."""

from __future__ import annotations

import argparse
from pathlib import Path

import benchmarks.overhead
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import model_arguments
from benchmarks.overhead import arms, floor, gil, paired, save_cost
from torchrec_cnr.config import BACKGROUND


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=200_000)
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument("--intervals", type=float, nargs="+", default=[2.0, 5.0, 15.0, 30.0, 60.0])
    p.add_argument("--arm-s", type=float, default=10.0, help="least training time of an arm")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per interval")
    p.add_argument("--warmup-steps", type=int, default=30, help="untimed training steps first")
    p.add_argument("--probe-steps", type=int, default=100, help="timed steps that set K")
    p.add_argument("--headline-s", type=float, default=30.0, help="the target's interval")
    p.add_argument("--save-cost", action="store_true", help="ask overhead.save_cost's question")
    p.add_argument("--saves", type=int, default=8, help="--save-cost: checkpoints per arm")
    p.add_argument("--before", type=int, default=100, help="--save-cost: steps before a save")
    p.add_argument("--after", type=int, default=200, help="--save-cost: steps after it")
    p.add_argument("--paired", action="store_true", help="ask overhead.paired's question")
    p.add_argument("--pair-s", type=float, default=90.0, help="--paired: seconds of pairs")
    p.add_argument("--busy-steps", type=int, default=60, help="--paired: steps per busy stretch")
    p.add_argument("--busy-pairs", type=int, default=5, help="--paired: pairs per busy arm")
    p.add_argument("--gil", action="store_true", help="ask overhead.gil's question")
    p.add_argument("--floor", action="store_true", help="ask overhead.floor's question")
    p.add_argument("--policy", default="intermittent", help="--floor: the checkpoints' policy")
    p.add_argument("--background", default="thread", choices=BACKGROUND,
                   help="--floor: where the checkpoints are written (CheckpointConfig)")  # fmt: skip
    p.add_argument("--per-stretch", type=int, default=1,
                   help="--floor: checkpoints per stretch, one every interval")  # fmt: skip
    p.add_argument("--compact-every", type=int, default=None,
                   help="--floor: CheckpointConfig.compact_every")  # fmt: skip
    p.add_argument("--gil-s", type=float, default=20.0, help="--gil: seconds sampled per format")
    p.add_argument("--merge", type=Path, help="this case's result at another world size")


def run(b: Bench) -> Outcome:
    """The question the flags ask (the arms without one)."""
    a = b.args
    question = (gil if a.gil else floor if a.floor else save_cost if a.save_cost
                else paired if a.paired else arms)  # fmt: skip
    return question.run(b)


CASE = Case("overhead", "End-to-end overhead: throughput lost to checkpoints every K steps",
            _arguments, "--tables 2 --rows 4000 --dim 16 --batch 64 --intervals 0.3 0.6 --arm-s "
            "0.6 --rounds 1 --warmup-steps 3 --probe-steps 20 --saves 1 --before 5 --after 40 "
            "--pair-s 1.2 --busy-steps 6 --busy-pairs 2 --gil-s 2", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, benchmarks.overhead.__doc__)
