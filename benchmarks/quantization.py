"""Per-row checkpoint quantization: error, compression and throughput (Check-N-Run Fig. 9),
against PyTorch's and FBGEMM's quantizers, in one process on ``--threads``.

Every method and bit width on ``--rows`` Gaussian rows of ``--dim`` (PyTorch's slow greedy
on the first ``--peer-rows``). ``--vs-greedy``: adaptive 4-bit against the greedy, dims
``--vs-greedy-dims`` x {Gaussian, Student-t 3}. Targets: adaptive 4-bit's error <= the
greedy's and its MB/s >= 50x; FBGEMM 4-bit's MB/s <= 1.5x asymmetric 4-bit's.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import best_seconds
from benchmarks.results import Goal, Table
from torchrec_cnr.quantization import quantize
from torchrec_cnr.quantization._uniform import fbgemm_ops

METHODS = ("symmetric", "asymmetric", "kmeans", "adaptive")
BITS = (2, 3, 4, 8)
DISTRIBUTIONS = ("gaussian", "student_t3")
SPEED = 50.0  # adaptive 4-bit must quantize at least this many times faster than the greedy

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, int]]  # -> (dequantized, stored bytes)

METHOD_TARGETS = [
    # The greedy is slow: it runs on the first --peer-rows rows, and errors are compared there.
    Goal("adaptive 4-bit error <= PyTorch greedy 4-bit's (same rows)",
           "ours.adaptive_4.rel_error_on_peer_rows", "<=", "peers.pytorch_greedy_4bit.rel_error"),
    Goal(f"adaptive 4-bit MB/s >= {SPEED:g} x PyTorch greedy 4-bit's",
           "ours.adaptive_4.mb_per_s", ">=", "peers.pytorch_greedy_4bit.mb_per_s", SPEED),
    Goal("FBGEMM 4-bit MB/s <= 1.5 x asymmetric 4-bit's",
           "peers.fbgemm_4bit.mb_per_s", "<=", "ours.asymmetric_4.mb_per_s", 1.5),
]  # fmt: skip


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=200_000, help="rows (per cell: as many bytes)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--peer-rows", type=int, default=20_000, help="rows for the slow greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed runs at least, best kept")
    p.add_argument("--min-seconds", type=float, default=1.0, help="timed at least, per entry")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--vs-greedy", action="store_true", help="adaptive 4-bit vs greedy, 6 cells")
    p.add_argument("--vs-greedy-dims", type=int, nargs="+", default=[16, 64, 128])


def rel_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean over rows of ``||x - x_hat|| / ||x||`` (all-zero rows skipped)."""
    norm = x.norm(dim=1)
    keep = norm > 0
    return float(((x - x_hat).norm(dim=1)[keep] / norm[keep]).mean())


def _measure(x: torch.Tensor, fn: Quantizer,
             a: argparse.Namespace) -> tuple[dict[str, Any], torch.Tensor]:  # fmt: skip
    secs = best_seconds(lambda: fn(x), a.repeats, a.min_seconds)
    x_hat, nbytes = fn(x)
    row = {"rows": x.shape[0], "rel_error": rel_error(x, x_hat),
           "compression": x.numel() * 4 / nbytes, "mb_per_s": x.numel() * 4 / 1e6 / secs,
           "seconds": secs}  # fmt: skip
    return row, x_hat


def _ours(method: str, bits: int) -> Quantizer:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        q = quantize(x, method, bits)
        return q.dequantize(), q.nbytes

    return fn


def _packed(pack: Callable[..., torch.Tensor], unpack: Callable[..., torch.Tensor]) -> Quantizer:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        packed = pack(x)
        return unpack(packed)[:, : x.shape[1]], packed.numel() * packed.element_size()

    return fn


def _greedy(bits: int) -> Quantizer:
    ops = torch.ops.quantized
    prepack = getattr(ops, f"embedding_bag_{bits}bit_prepack")
    unpack = getattr(ops, f"embedding_bag_{bits}bit_unpack")
    return _packed(functools.partial(prepack, optimized_qparams=True), unpack)


def _rows(kind: str, rows: int, dim: int, seed: int) -> torch.Tensor:
    """Seeded ``(rows, dim)`` fp32 rows: ``gaussian`` or ``student_t3`` (heavy-tailed)."""
    torch.manual_seed(seed)  # StudentT samples from the global generator
    if kind == "gaussian":
        return torch.randn(rows, dim)
    return torch.distributions.StudentT(3.0).sample((rows, dim)).float()


def _methods(b: Bench) -> Outcome:
    """Every method and bit width on one set of rows, then the peers."""
    a = b.args
    x, source = _rows("gaussian", a.rows, a.dim, a.seed), "gaussian"
    sub = x[: min(x.shape[0], a.peer_rows)].contiguous()
    ours: dict[str, Any] = {}
    for method, bits in [(m, k) for m in METHODS for k in BITS] + [("fp16", 16), ("bf16", 16)]:
        ours[f"{method}_{bits}"], x_hat = _measure(x, _ours(method, bits), a)
        # Quantization is row by row: its first rows are what it gives those rows alone.
        ours[f"{method}_{bits}"]["rel_error_on_peer_rows"] = rel_error(sub, x_hat[: len(sub)])
        b.log(f"{method} {bits}-bit done")
    peers: dict[str, Any] = {}
    for bits in (4, 2):
        try:
            peers[f"pytorch_greedy_{bits}bit"] = _measure(sub, _greedy(bits), a)[0]
        except (AttributeError, RuntimeError) as e:  # op missing, or dim unsupported
            b.log(f"pytorch greedy {bits}-bit skipped: {e}")
    ops = fbgemm_ops()
    if ops is not None:
        for bits in (2, 4):
            pack = functools.partial(ops.FloatToFusedNBitRowwiseQuantizedSBHalf, bit_rate=bits)
            unpack = functools.partial(ops.FusedNBitRowwiseQuantizedSBHalfToFloat, bit_rate=bits)
            try:
                peers[f"fbgemm_{bits}bit"] = _measure(x, _packed(pack, unpack), a)[0]
            except RuntimeError as e:  # dim not a multiple of 8 / bits * 2
                b.log(f"fbgemm {bits}-bit skipped: {e}")
        fn = _packed(ops.FloatToFused8BitRowwiseQuantized, ops.Fused8BitRowwiseQuantizedToFloat)
        peers["fbgemm_8bit"] = _measure(x, fn, a)[0]
    m = {"source": source, "shape": list(x.shape), "peer_rows": len(sub), "ours": ours,
         "peers": peers}  # fmt: skip
    rows = [{"impl": "torchrec_cnr", "key": k, **r} for k, r in ours.items()]
    rows += [{"impl": k.split("_")[0], "key": k.removesuffix("bit"), **r} for k, r in peers.items()]
    table = Table.of(f"{source} rows, {x.shape[0]} x {x.shape[1]} fp32, {a.threads} thread(s)", rows, {
        "impl": "impl", "method": lambda r: r["key"].rsplit("_", 1)[0],
        "bits": lambda r: int(r["key"].rsplit("_", 1)[1]), "rows": "rows",
        "rel L2 error": "rel_error", "compression": lambda r: f"{r['compression']:.2f}x",
        "MB/s": "mb_per_s",
    })  # fmt: skip
    return Outcome(m, [table], METHOD_TARGETS)


def _vs_greedy(b: Bench) -> Outcome:
    """Adaptive 4-bit against PyTorch's greedy: Gaussian and Student-t rows, three dims."""
    a = b.args
    elems, peer_elems = a.rows * a.dim, a.peer_rows * a.dim
    cells: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    targets: list[Goal] = []
    cell_list = [(d, k) for d in DISTRIBUTIONS for k in a.vs_greedy_dims]
    for i, (kind, dim) in enumerate(cell_list):
        x = _rows(kind, max(1, elems // dim), dim, seed=a.seed * 100 + i)
        sub = x[: max(1, min(x.shape[0], peer_elems // dim))].contiguous()
        ours, x_hat = _measure(x, _ours("adaptive", 4), a)
        greedy = _measure(sub, _greedy(4), a)[0]
        # Both errors on the same rows: adaptive works row by row.
        ours["rel_error_all_rows"] = ours["rel_error"]
        ours["rel_error"] = rel_error(sub, x_hat[: len(sub)])
        # Also the speed on the greedy's rows: outputs of a few MB are recycled by malloc,
        # while the whole cell's (over glibc's 32 MB mmap threshold) are page-faulted in anew
        # by every call, for ours and the greedy's alike.
        ours["mb_per_s_on_peer_rows"] = _measure(sub, _ours("adaptive", 4), a)[0]["mb_per_s"]
        key = f"{kind}_d{dim}"
        cells[key] = {"adaptive": ours, "greedy": greedy}
        rows.append({"kind": kind, "dim": dim, "a": ours, "g": greedy})
        cell = f"cells.{key}"  # >= 50x the greedy's speed, its error at most
        targets += [Goal(f"{key}: adaptive 4-bit MB/s >= {SPEED:g} x greedy's",
                         f"{cell}.adaptive.mb_per_s", ">=", f"{cell}.greedy.mb_per_s", SPEED),
                    Goal(f"{key}: adaptive 4-bit error <= greedy's", f"{cell}.adaptive.rel_error",
                         "<=", f"{cell}.greedy.rel_error")]  # fmt: skip
        b.log(f"{key} done")
    title = f"Adaptive 4-bit vs PyTorch greedy: {elems * 4 / 1e6:.1f} MB fp32 per cell, the "
    title += f"greedy and both errors on its first {peer_elems * 4 / 1e6:.1f} MB"
    table = Table.of(title, rows, {
        "rows": "kind", "dim": "dim",
        "greedy MB/s": lambda r: r["g"]["mb_per_s"], "greedy err": lambda r: r["g"]["rel_error"],
        "adaptive-4 MB/s": lambda r: r["a"]["mb_per_s"],
        "adaptive-4 err": lambda r: r["a"]["rel_error"],
        "speed": lambda r: f"{r['a']['mb_per_s'] / r['g']['mb_per_s']:.1f}x",
        "speed, same rows": lambda r: f"{r['a']['mb_per_s_on_peer_rows'] / r['g']['mb_per_s']:.1f}x",
        "error ratio": lambda r: r["a"]["rel_error"] / r["g"]["rel_error"],
    })  # fmt: skip
    m = {"elems_per_cell": elems, "peer_elems_per_cell": peer_elems, "cells": cells}
    return Outcome(m, [table], targets)


def run(b: Bench) -> Outcome:
    torch.set_num_threads(b.args.threads)
    return _vs_greedy(b) if b.args.vs_greedy else _methods(b)


CASE = Case("quantization", "Quantization (Check-N-Run Fig. 9)", _arguments,
            "--rows 2000 --peer-rows 200 --repeats 1 --min-seconds 0 --vs-greedy-dims 16 64", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
