"""The ``cnr`` command line tool.

cnr inspect ROOT            # the chain: steps, kinds, rows saved, bytes, what a restore needs
cnr verify ROOT [--step N]  # every checksum and the chain's completeness
cnr criteo-convert PATH... --cache-dir DIR   # Criteo TSV -> the .npy cache that data.path reads
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from torchrec_cnr.integrity import verify_entry
from torchrec_cnr.manifest import Manifest, ManifestError


def _inspect(root: str) -> int:
    manifest = Manifest.load(root)
    if not manifest.checkpoints:
        print(f"{root}: no committed checkpoint")
        return 1
    latest = manifest.checkpoints[-1]
    print(
        f"{root}: {len(manifest.checkpoints)} committed checkpoint(s), {manifest.restores} restore(s)"
    )
    print(
        f"{'step':>8} {'kind':>6} {'policy':>13} {'ranks':>5} {'rows saved':>11} {'MB':>9}  restore needs"
    )
    for e in manifest.checkpoints:
        saved = sum(s["saved_rows"] for s in e["shards"])
        total = sum(s["spec"]["rows"] for s in e["shards"])
        needs = ", ".join(str(manifest.by_id(i)["step"]) for i in e["chain"])
        print(
            f"{e['step']:>8} {e['kind']:>6} {e['policy']:>13} {e['world_size']:>5} "
            f"{saved:>11} {e['bytes'] / 1e6:>9.2f}  steps {needs}"
        )
    print(f"\nlatest (step {latest['step']}) per table:")
    per_table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    formats: dict[str, str] = {}
    for s in latest["shards"]:
        acc = per_table[s["spec"]["table"]]
        acc[0] += s["saved_rows"] * s["spec"]["cols"]
        acc[1] += s["spec"]["rows"] * s["spec"]["cols"]
        acc[2] += s["nbytes"]
        acc[3] += 1
        fmt = s["format"]
        formats[s["spec"]["table"]] = (
            "fp32" if fmt["method"] == "none" else f"{fmt['method']} {fmt['bits']}-bit"
        )
    for table, (saved, total, nbytes, shards) in sorted(per_table.items()):
        print(
            f"  {table:<40} {100 * saved / max(total, 1):6.1f}% of rows  {shards} shard(s)  "
            f"{nbytes / 1e6:8.2f} MB  {formats[table]}"
        )
    print(
        f"restoring it reads {manifest.chain_bytes(latest) / 1e6:.2f} MB from {len(latest['chain'])} checkpoint(s)"
    )
    return 0


def _verify(root: str, step: int | None) -> int:
    manifest = Manifest.load(root)
    if not manifest.checkpoints:
        print(f"{root}: no committed checkpoint")
        return 1
    if step is None:
        entries = manifest.checkpoints
    else:
        found = manifest.find(step)
        if found is None:
            print(
                f"{root}: no committed checkpoint of step {step}; committed steps: {manifest.steps()}"
            )
            return 1
        entries = [found]
    problems: list[str] = []
    checked: set[str] = set()
    for entry in entries:
        # Each checkpoint is checked once, even when several chains need it.
        todo = dict(entry, chain=[i for i in entry["chain"] if i not in checked])
        checked.update(entry["chain"])
        for problem in verify_entry(Path(root), manifest, todo):
            problems.append(f"step {entry['step']}: {problem}")
    if problems:
        print(f"{root}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(
        f"{root}: {len(checked)} checkpoint(s) verified, every chain complete and every checksum matches"
    )
    return 0


def _criteo_convert(paths: list[str], cache_dir: str) -> int:
    from torchrec_cnr import criteo

    try:
        for entry in criteo.convert(paths, cache_dir):
            print(f"{entry.stem}_{{dense,sparse,labels}}.npy: {entry.rows} samples")
    except (OSError, criteo.CriteoFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cnr", description="Inspect torchrec_cnr checkpoints; prepare Criteo data."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="print the chain of a checkpoint root")
    p_inspect.add_argument("root")
    p_verify = sub.add_parser("verify", help="check every checksum and the chain's completeness")
    p_verify.add_argument("root")
    p_verify.add_argument("--step", type=int, default=None, help="only the chain of this step")
    p_criteo = sub.add_parser(
        "criteo-convert", help="convert Criteo TSV files into the cache that data.path reads"
    )
    p_criteo.add_argument("paths", nargs="+", help="TSV files or globs (train.txt, day_*)")
    p_criteo.add_argument("--cache-dir", default="runs/criteo_npy", help="as data.cache_dir")
    args = parser.parse_args(argv)
    if args.command == "criteo-convert":
        return _criteo_convert(args.paths, args.cache_dir)
    try:
        if args.command == "verify":
            return _verify(args.root, args.step)
        return _inspect(args.root)
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
