"""The ``cnr`` command line tool. ROOT is a path or an ``s3://bucket/prefix`` URL.

cnr inspect ROOT            # the chain: steps, kinds, rows saved, bytes, what a restore needs
cnr verify ROOT [--step N]  # the manifest, every checksum and every chain's completeness
cnr export ROOT --out PATH [--step N] [--format torch|safetensors] [--tables T ...]
                            # the unsharded model's state dict
cnr export ROOT --out DIR --format dcp [--step N] [--overwrite] [--budget-mb MB]
                            # a DCP checkpoint a job resumes from with stock dcp.load;
                            # under torchrun every rank writes its share in parallel
cnr compact ROOT [--step N] [--take-over]
                            # merge a chain into one full checkpoint, committed like any other
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import defaultdict

import torch.distributed as dist

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import Manifest, saved_fraction
from torchrec_cnr.commit.fence import Fence
from torchrec_cnr.compaction import compact_entry
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.errors import CnrError, ManifestError
from torchrec_cnr.interop.dcp_export import ExportOptions, export_dcp, terminal_progress
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.launch import init_distributed
from torchrec_cnr.offline import EXPORT_FORMATS, export_state_dict, save_export
from torchrec_cnr.offline.catalog import changed_rows
from torchrec_cnr.restore import verify_chains
from torchrec_cnr.selection import Policy
from torchrec_cnr.storage import Storage, open_storage


def _inspect(root: str, io: IOContext) -> int:
    manifest = Manifest.load(open_storage(root, io.options))
    latest = manifest.latest()
    if latest is None:
        print(f"{root}: no committed checkpoint")
        return 1
    print(
        f"{root}: {len(manifest.checkpoints)} committed checkpoint(s), {manifest.restores} restore(s)"
    )
    print(
        f"{'step':>8} {'kind':>6} {'policy':>13} {'ranks':>5} {'rows saved':>11} "
        f"{'changed':>9} {'MB':>9}  restore needs"
    )
    base: dict[str, str] = {}  # id -> its chain's baseline: a long chain is not walked again
    for e in manifest.checkpoints:
        saved = sum(s.saved_rows for s in e.shards)
        changed = changed_rows(e)
        first = (base.get(e.parent or "") if e.depth > 2 else None) or e.chain[0]
        base[e.id] = first
        if e.depth > 3:
            needs = f"{manifest.by_id(first).step}, ..., {e.step} ({e.depth})"
        else:
            needs = ", ".join(str(manifest.by_id(i).step) for i in e.chain)
        print(
            f"{e.step:>8} {e.kind:>6} {e.policy:>13} {e.world_size:>5} {saved:>11} "
            f"{'?' if changed is None else changed:>9} {e.bytes / 1e6:>9.2f}  steps {needs}"
        )
    print("changed: rows modified since the checkpoint before it (what a serving follower reads)")
    print(f"\nlatest (step {latest.step}) per table:")
    by_table = defaultdict(list)
    for s in latest.shards:
        by_table[s.spec.table].append(s)
    for table, recs in sorted(by_table.items()):
        fmt = recs[0].format
        kind = "fp32" if fmt.method == "none" else f"{fmt.method} {fmt.bits}-bit"
        print(
            f"  {table:<40} {100 * saved_fraction(recs):6.1f}% of rows  {len(recs)} shard(s)  "
            f"{sum(r.nbytes for r in recs) / 1e6:8.2f} MB  {kind}"
        )
    print(
        f"restoring it reads {manifest.chain_bytes(latest) / 1e6:.2f} MB from {latest.depth} checkpoint(s)"
    )
    return 0


def _check(
    storage: Storage, manifest: Manifest, step: int | None, io: IOContext
) -> list[str] | None:
    """The problems of the chains (of ``step``, or of every checkpoint); ``None`` if no such
    step. A damaged history segment is a problem; the checkpoints it leaves are checked."""
    damaged = []
    try:
        entries = manifest.checkpoints
    except ManifestError as e:
        damaged, entries = (
            [f"{e}: the checkpoints before step {manifest.tail[0].step} are unreadable"],
            manifest.tail,
        )
    if step is not None:
        found = next((e for e in reversed(entries) if e.step == step), None)
        if found is None:
            return None if not damaged else damaged
        entries = [found]
    checked, problems = verify_chains(storage, manifest, entries, io)
    print(f"{storage.url}: {checked} checkpoint(s) read")
    return damaged + problems


def _verify(root: str, step: int | None, io: IOContext) -> int:
    storage = open_storage(root, io.options)
    try:
        manifest = Manifest.load(storage)
    except ManifestError as e:
        print(f"{root}: the manifest is damaged: {e}")
        previous = Manifest.previous(storage)
        if previous is not None:
            problems = _check(storage, previous, step, io)
            state = "every checksum matches" if problems == [] else f"problems: {problems}"
            print(
                f"the previous committed manifest names steps {previous.steps()}; its chains: "
                f"{state}. CheckpointConfig(manifest_fallback=True) restores from it"
            )
        return 1
    if manifest.latest() is None:
        print(f"{root}: no committed checkpoint")
        return 1
    problems = _check(storage, manifest, step, io)
    if problems is None:
        print(
            f"{root}: no committed checkpoint of step {step}; committed steps: {manifest.steps()}"
        )
        return 1
    if problems:
        print(f"{root}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"{root}: every chain is complete and every checksum matches")
    return 0


def _progress(key: str, done: int, total: int) -> None:
    print(
        f"\rexport: {done}/{total} tables ({key})",
        end="\n" if done == total else "",
        file=sys.stderr,
    )


def _export_dcp(
    root: str, step: int | None, out: str, options: ExportOptions, io: IOContext
) -> int:
    """A resumable DCP checkpoint; under torchrun every rank writes its share."""
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        init_distributed("gloo")  # under torchrun: every rank its share
        group = dist.group.WORLD
    try:
        rank = dist.get_rank() if group is not None else 0
        options = dataclasses.replace(options, progress=terminal_progress(rank))
        report = export_dcp(root, out, step, options, group=group, io=io)
    finally:
        if group is not None:
            dist.destroy_process_group()
    print(
        f"{out}: step {report.step}, {report.tables} tables, {len(report.keys)} keys; "
        f"rank {rank} wrote {report.blocks} blocks, {report.bytes / 1e6:.1f} MB (dcp)"
    )
    return 0


def _export(
    root: str, step: int | None, out: str, fmt: str, tables: list[str] | None, io: IOContext
) -> int:
    state_dict = export_state_dict(root, step, tables, progress=_progress, io=io)
    save_export(state_dict, out, fmt)  # type: ignore[arg-type]
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    print(f"{out}: {len(state_dict)} tensors, {nbytes / 1e6:.1f} MB ({fmt})")
    return 0


def _compact(root: str, step: int | None, take_over: bool, io: IOContext) -> int:
    storage = open_storage(root, io.options)
    latest = Manifest.load(storage).latest()
    if latest is None:
        print(f"{root}: no committed checkpoint")
        return 1
    config = CheckpointConfig(path=root, take_over=take_over, io=io.options)
    fence = Fence(storage, Collective.alone(), config, Policy(latest.policy))  # type: ignore[arg-type]
    try:
        if fence.blocked is not None:
            print(f"error: {fence.blocked}", file=sys.stderr)
            return 2
        entry = compact_entry(fence.target(), io, step)
    finally:
        fence.release()
    if entry is None:
        print(
            f"{root}: step {step if step is not None else latest.step} is already one full checkpoint"
        )
        return 0
    print(
        f"{root}: step {entry.step} compacted into {entry.id} ({entry.bytes / 1e6:.2f} MB); "
        "restores of it now read one checkpoint"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cnr", description="Inspect torchrec_cnr checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="print the chain of a checkpoint root")
    p_inspect.add_argument("root")
    p_verify = sub.add_parser("verify", help="check every checksum and the chain's completeness")
    p_verify.add_argument("root")
    p_verify.add_argument("--step", type=int, default=None, help="only the chain of this step")
    p_export = sub.add_parser("export", help="write the unsharded model's state dict")
    p_export.add_argument("root")
    p_export.add_argument(
        "--out", required=True, help="file (torch, safetensors) or directory (dcp)"
    )
    p_export.add_argument(
        "--step", type=int, default=None, help="a committed step; the latest if absent"
    )
    p_export.add_argument("--format", choices=(*EXPORT_FORMATS, "dcp"), default="torch")
    p_export.add_argument(
        "--tables", nargs="+", default=None, help="only these tables, no dense state"
    )
    p_export.add_argument("--overwrite", action="store_true", help="dcp: replace --out")
    p_export.add_argument(
        "--budget-mb",
        type=float,
        default=ExportOptions.budget_mb,
        help="dcp: the most one block holds, per rank",
    )
    p_export.add_argument(
        "--safe-globals", nargs="*", default=[], help="dcp: types app_state may hold"
    )
    p_compact = sub.add_parser("compact", help="merge a chain into one full checkpoint")
    p_compact.add_argument("root")
    p_compact.add_argument(
        "--step", type=int, default=None, help="a committed step; the latest if absent"
    )
    p_compact.add_argument(
        "--take-over", action="store_true", help="even if a live job holds the root"
    )
    args = parser.parse_args(argv)
    try:
        with IOContext() as io:  # the environment's IOOptions
            if args.command == "verify":
                return _verify(args.root, args.step, io)
            if args.command == "export" and args.format == "dcp":
                if args.tables:
                    raise ValueError("--format dcp exports the whole model: drop --tables")
                options = ExportOptions(
                    budget_mb=args.budget_mb,
                    overwrite=args.overwrite,
                    safe_globals=tuple(args.safe_globals),
                )
                return _export_dcp(args.root, args.step, args.out, options, io)
            if args.command == "export":
                return _export(args.root, args.step, args.out, args.format, args.tables, io)
            if args.command == "compact":
                return _compact(args.root, args.step, args.take_over, io)
            return _inspect(args.root, io)
    except (CnrError, ValueError, FileExistsError) as e:  # no such step, table or format
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
