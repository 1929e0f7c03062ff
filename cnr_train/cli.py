"""The training application's command line: ``cnr-train``.

    torchrun --standalone --nproc_per_node=2 -m cnr_train run --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/demo.yaml \\
        checkpoint.policy=consecutive train.steps=200
    cnr-train serve --config configs/demo.yaml   # beside the job: follows its checkpoints
    cnr-train criteo-convert /data/criteo/day_* --cache-dir runs/criteo_npy
    torchrun --standalone --nproc_per_node=2 -m cnr_train import-dcp --config configs/demo.yaml \
        --from runs/dcp/step_500 --step 500   # the job's root starts from a DCP checkpoint

Every ``key.path=value`` after the options overrides the YAML file.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from cnr_train.quiet import quiet_third_party

quiet_third_party()
# Importing TorchRec makes some 350k objects that live as long as the process: the
# collections that would run while they are made find almost nothing to free and take a
# fifth of the imports' time. They are frozen instead (see job.freeze_heap).
_collecting = gc.isenabled()
gc.disable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cnr_train import config_file, criteo  # noqa: E402
from cnr_train.config import JobConfig  # noqa: E402
from cnr_train.job import Trainer, run  # noqa: E402
from torchrec_cnr import CnrError  # noqa: E402
from torchrec_cnr.launch import init_distributed  # noqa: E402

gc.freeze()
if _collecting:
    gc.enable()


def _load(config_path: str | None, overrides: list[str]) -> JobConfig | None:
    """The job's configuration (``None`` after printing why it is wrong); the torch threads
    set from ``OMP_NUM_THREADS``, as the job shares the machine with its other ranks."""
    try:
        config = config_file.load(JobConfig, config_path, overrides)
    except config_file.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return config


def train(config_path: str | None, overrides: list[str]) -> int:
    """Trains under torchrun (or as one process), as configured."""
    config = _load(config_path, overrides)
    if config is None:
        return 2
    init_distributed()
    try:
        run(config)
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    except CnrError as e:  # the library's own: every rank raised it, with the same message
        print(f"[rank {dist.get_rank()}] error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        if "by peer" not in str(e):
            raise
        # Another rank died (an injected failure, or a real one): torchrun restarts the job.
        print(f"[rank {dist.get_rank()}] lost a peer: {str(e).splitlines()[0][:120]}", flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


def serve(config_path: str | None, overrides: list[str]) -> int:
    """Serves the job's model from its checkpoints until the job finishes (one process)."""
    from cnr_train.report import serving_lines
    from cnr_train.serve import Server

    config = _load(config_path, overrides)
    if config is None:
        return 2
    server = Server(config)
    try:
        result = server.run()
    finally:
        server.close()
    print("\n".join(serving_lines(result)), flush=True)
    return 0


def import_dcp(config_path: str | None, overrides: list[str], source: str, step: int) -> int:
    """Starts the job's root from a DCP checkpoint of its model: imports it into the
    model (any world size and sharding it was saved from), then saves it as a baseline
    at ``step``; ``cnr-train run`` then resumes from there."""
    config = _load(config_path, overrides)
    if config is None:
        return 2
    init_distributed()
    try:
        t = Trainer.build(config, config.train.seed)
        try:
            t.ckpt.restore(from_dcp=source, step=step)
            t.ckpt.save(step)
        finally:
            t.ckpt.close()
        if dist.get_rank() == 0:
            print(f"{source} -> {config.checkpoint.path}: a baseline of step {step}", flush=True)
    except (CnrError, ValueError) as e:
        print(f"[rank {dist.get_rank()}] error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def criteo_convert(paths: list[str], cache_dir: str) -> int:
    """Converts Criteo TSV files into the ``.npy`` cache that ``data.path`` reads."""
    try:
        for entry in criteo.convert(paths, cache_dir):
            print(f"{entry.stem}_{{dense,sparse,labels}}.npy: {entry.rows} samples")
    except (OSError, criteo.CriteoFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cnr-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train, checkpoint, inject failures, evaluate")
    p_run.add_argument("--config", help="YAML file mapping onto JobConfig")
    p_run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    p_serve = sub.add_parser("serve", help="serve the job's model from its checkpoints")
    p_serve.add_argument("--config", help="YAML file mapping onto JobConfig (the job's)")
    p_serve.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.dtype=int8")
    p_conv = sub.add_parser("criteo-convert", help="Criteo TSV -> the cache data.path reads")
    p_conv.add_argument("paths", nargs="+", help="TSV files or globs (train.txt, day_*)")
    p_conv.add_argument("--cache-dir", default="runs/criteo_npy", help="as data.cache_dir")
    p_imp = sub.add_parser("import-dcp", help="start the job's root from a DCP checkpoint")
    p_imp.add_argument("--config", help="YAML file mapping onto JobConfig (the job's)")
    p_imp.add_argument("--from", dest="source", required=True, help="the DCP checkpoint")
    p_imp.add_argument("--step", type=int, default=0, help="the step it stands for")
    p_imp.add_argument("overrides", nargs="*", help="dotted overrides")
    args = parser.parse_args(argv)
    if args.command == "import-dcp":
        return import_dcp(args.config, args.overrides, args.source, args.step)
    if args.command == "criteo-convert":
        return criteo_convert(args.paths, args.cache_dir)
    if args.command == "serve":
        return serve(args.config, args.overrides)
    return train(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
