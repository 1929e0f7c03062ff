"""The ``cnr`` command line tool. ROOT is a path or a URL: ``s3://bucket/prefix``, or any
protocol fsspec opens (``gs://``, ``az://``, ...), its options given as JSON before the
command: ``cnr --storage-options '{"endpoint_url": "http://..."}' inspect gs://b/run1``.

cnr inspect ROOT            # the chain: steps, kinds, rows saved, bytes, what a restore needs
cnr verify ROOT [--step N]  # the manifest, every checksum and every chain's completeness
cnr export ROOT --out PATH [--step N] [--format torch|safetensors] [--tables T ...]
                            # the unsharded model's state dict
cnr export ROOT --out DIR --format dcp [--step N] [--overwrite] [--budget-mb MB]
                            # a DCP checkpoint a job resumes from with stock dcp.load;
                            # under torchrun every rank writes its share in parallel
cnr compact ROOT [--step N] [--take-over]
                            # merge a chain into one full checkpoint, committed like any other
cnr retire ROOT (--damaged | --id ID ...) [--take-over]
                            # remove damaged (or named) checkpoints and those built on them
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
from collections import defaultdict

import torch.distributed as dist

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.fence import Fence
from torchrec_cnr.compaction import compact_entry
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.env import json_object
from torchrec_cnr.errors import CnrError, ManifestError
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.launch import init_distributed
from torchrec_cnr.manifest import Manifest, saved_fraction
from torchrec_cnr.offline import EXPORT_FORMATS, export_state_dict, save_export
from torchrec_cnr.offline.catalog import changed_rows, saved_rows
from torchrec_cnr.offline.export import progress_line
from torchrec_cnr.restore import verify_chains
from torchrec_cnr.selection import Policy
from torchrec_cnr.storage import Storage, open_storage


def _inspect(storage: Storage, io: IOContext) -> int:
    root = storage.url
    manifest = Manifest.load(storage)
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
    entries = manifest.checkpoints
    read = {e.step: e.id for e in entries}  # the one a restore of its step reads: the last
    for e in entries:
        shards = manifest.shards(e)
        saved, changed = saved_rows(shards), changed_rows(shards)
        first = (base.get(e.parent or "") if e.depth > 2 else None) or manifest.chain(e)[0]
        base[e.id] = first
        if e.depth > 3:
            needs = f"{manifest.by_id(first).step}, ..., {e.step} ({e.depth})"
        else:
            needs = ", ".join(str(link.step) for link in manifest.links(e))
        print(
            f"{e.step:>8} {e.kind:>6} {e.policy:>13} {e.world_size:>5} {saved:>11} "
            f"{'?' if changed is None else changed:>9} {e.bytes / 1e6:>9.2f}  steps {needs}"
            + ("" if read[e.step] == e.id else "  *")
        )
    print(
        "rows saved, changed: table rows, stored / modified since the checkpoint before it "
        "(what a serving follower reads)"
    )
    if any(read[e.step] != e.id for e in entries):
        print(
            "*: a later checkpoint of the same step (its compaction, or the step saved again "
            "after a restore of an earlier one) is the one a restore of that step reads"
        )
    print(f"\nlatest (step {latest.step}) per table:")
    by_table = defaultdict(list)
    for s in manifest.shards(latest):
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
) -> tuple[list[str], list[str]] | None:
    """The problems of the chains (of ``step``, or of every checkpoint) and the ids of the
    checkpoints found damaged; ``None`` if no such step. A damaged history segment is a
    problem; the checkpoints it leaves are checked."""
    lost = []
    try:
        entries = manifest.checkpoints
    except ManifestError as e:
        lost, entries = (
            [f"{e}: the checkpoints before step {manifest.tail[0].step} are unreadable"],
            manifest.tail,
        )
    if step is not None:
        found = next((e for e in reversed(entries) if e.step == step), None)
        if found is None:
            return None if not lost else (lost, [])
        entries = [found]
    checked, problems, damaged = verify_chains(storage, manifest, entries, io)
    print(f"{storage.url}: {checked} checkpoint(s) read")
    return lost + problems, damaged


def _verify(storage: Storage, step: int | None, io: IOContext) -> int:
    root = storage.url
    try:
        manifest = Manifest.load(storage)
    except ManifestError as e:
        print(f"{root}: the manifest is damaged: {e}")
        previous = Manifest.previous(storage)
        if previous is not None:
            checked = _check(storage, previous, step, io)
            problems = None if checked is None else checked[0]
            state = "every checksum matches" if problems == [] else f"problems: {problems}"
            print(
                f"the previous committed manifest names steps {previous.steps()}; its chains: "
                f"{state}. CheckpointConfig(manifest_fallback=True) restores from it"
            )
        return 1
    if manifest.latest() is None:
        print(f"{root}: no committed checkpoint")
        return 1
    checked = _check(storage, manifest, step, io)
    if checked is None:
        print(
            f"{root}: no committed checkpoint of step {step}; committed steps: {manifest.steps()}"
        )
        return 1
    problems, damaged = checked
    if problems:
        print(f"{root}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
        if damaged:
            print(
                f"damaged: {', '.join(damaged)}; `cnr retire {root} --damaged` retires them "
                "and the checkpoints that build on them"
            )
        return 1
    print(f"{root}: every chain is complete and every checksum matches")
    return 0


def _progress(key: str, done: int, total: int) -> None:
    progress_line(f"export: {done}/{total} tables ({key})", done == total)


def _export_dcp(root: Storage, step: int | None, out: str, args: argparse.Namespace,
                io: IOContext) -> int:  # fmt: skip
    """A resumable DCP checkpoint; under torchrun every rank writes its share."""
    # Imported here: DCP's import takes 0.6 s of CPU, which no other command needs.
    from torchrec_cnr.interop.dcp_export import ExportOptions, export_dcp, terminal_progress

    if args.tables:
        raise ValueError("--format dcp exports the whole model: drop --tables")
    options = ExportOptions(budget_mb=args.budget_mb, overwrite=args.overwrite,
                            safe_globals=tuple(args.safe_globals))  # fmt: skip
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
    root: Storage, step: int | None, out: str, fmt: str, tables: list[str] | None, io: IOContext
) -> int:
    state_dict = export_state_dict(root, step, tables, progress=_progress, io=io)
    save_export(state_dict, out, fmt)  # type: ignore[arg-type]
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    print(f"{out}: {len(state_dict)} tensors, {nbytes / 1e6:.1f} MB ({fmt})")
    return 0


def _compact(storage: Storage, step: int | None, take_over: bool, io: IOContext) -> int:
    root = storage.url
    latest = Manifest.load(storage).latest()
    if latest is None:
        print(f"{root}: no committed checkpoint")
        return 1
    fence = _fence(storage, latest.policy, take_over, io)
    try:
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


def _fence(storage: Storage, policy: str, take_over: bool, io: IOContext) -> Fence:
    """This process's claim on the root, as a job's (a group of one); a live job's lease
    refuses it (``CheckpointError``: exit status 2) unless ``take_over``."""
    config = CheckpointConfig(path=storage.url, take_over=take_over, io=io.options)
    return Fence(storage, Collective.alone(), config, Policy(policy))  # type: ignore[arg-type]


def _retire(storage: Storage, ids: list[str], damaged: bool, take_over: bool, io: IOContext) -> int:
    root = storage.url
    manifest = Manifest.load(storage)
    latest = manifest.latest()
    if latest is None:
        print(f"{root}: no committed checkpoint")
        return 1
    if damaged:
        checked = _check(storage, manifest, None, io)
        ids = [] if checked is None else checked[1]
        if not ids:
            print(f"{root}: no damaged checkpoint; nothing retired")
            return 0
    unknown = [i for i in ids if manifest.find_id(i) is None]
    if unknown:
        raise ValueError(f"{root} commits no checkpoint {', '.join(unknown)}")
    fence = _fence(storage, latest.policy, take_over, io)
    try:
        retired = fence.retire(ids)
    finally:
        fence.release()
    after = Manifest.load(storage).latest()
    print(
        f"{root}: retired {len(retired)} checkpoint(s) (those named and every one built on "
        f"them): {', '.join(retired)}; the latest is now "
        + ("none" if after is None else f"step {after.step} ({after.id})")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cnr", description="Inspect torchrec_cnr checkpoints.")
    parser.add_argument(
        "--storage-options",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="the fsspec file system's options for a URL root (credentials, an endpoint)",
    )
    parser.add_argument(
        "--single-writer",
        action="store_true",
        help="compact, retire: allow a store without conditional writes (one writer at a time)",
    )
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
        default=None,
        help="dcp: the most the blocks hold, per rank (default: TORCHREC_CNR_READ_MEMORY_MB, "
        "else 256)",
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
    p_retire = sub.add_parser(
        "retire", help="remove damaged (or named) checkpoints and those built on them"
    )
    p_retire.add_argument("root")
    which = p_retire.add_mutually_exclusive_group(required=True)
    which.add_argument("--damaged", action="store_true", help="those cnr verify finds damaged")
    which.add_argument("--id", nargs="+", default=[], help="checkpoint directories")
    p_retire.add_argument(
        "--take-over", action="store_true", help="even if a live job holds the root"
    )
    args = parser.parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a traceback
        return code
    except BrokenPipeError:
        # The reader left (cnr inspect | head): stop quietly, as other commands do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


def _json_object(text: str) -> dict[str, object]:
    try:
        return json_object(text, "--storage-options")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _run(args: argparse.Namespace) -> int:
    try:
        with IOContext() as io:  # the environment's IOOptions
            root = open_storage(args.root, io.options, args.storage_options, args.single_writer)
            if args.command == "verify":
                return _verify(root, args.step, io)
            if args.command == "export" and args.format == "dcp":
                return _export_dcp(root, args.step, args.out, args, io)
            if args.command == "export":
                return _export(root, args.step, args.out, args.format, args.tables, io)
            if args.command == "compact":
                return _compact(root, args.step, args.take_over, io)
            if args.command == "retire":
                return _retire(root, args.id, args.damaged, args.take_over, io)
            return _inspect(root, io)
    except (CnrError, ValueError, FileExistsError) as e:  # no such step, table or format
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _ENVIRONMENT:
            raise
        print(f"error: {e}", file=sys.stderr)  # the machine's, not the command's
        return 1


_ENVIRONMENT = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)
"""Failures of the machine a command runs on (a full disk, a quota, permissions, a
read-only file system): a line on stderr and exit status 1, not a traceback."""


if __name__ == "__main__":
    sys.exit(main())
