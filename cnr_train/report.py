"""What the job prints at the end: the restore check, the checkpoints written, and what a
full fp32 checkpoint at every interval would have cost, measured in the same run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_cnr import CheckpointConfig, CheckpointManager, QuantizeConfig
from torchrec_cnr.offline import CheckpointInfo, RootInfo, checkpoint_info
from torchrec_cnr.quantization import quantize
from torchrec_cnr.storage import open_storage
from torchrec_cnr.tracking import model_state

__all__ = ["check_restore", "full_fp32_bytes", "plot_bytes", "serving_lines", "summarize"]


def say(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def full_fp32_bytes(model: nn.Module, app_state: dict[str, Any], scratch: str) -> int:
    """Bytes stored of one full fp32 checkpoint of ``model``: written to ``scratch``, then deleted."""
    storage = open_storage(scratch)
    if dist.get_rank() == 0:
        storage.clear()
    config = CheckpointConfig(path=scratch, policy="full")
    with CheckpointManager(model, config, app_state) as ckpt:
        ckpt.save(0)
    dist.barrier()
    entry = checkpoint_info(storage)
    dist.barrier()
    if dist.get_rank() == 0:
        storage.clear()
    return entry.bytes


def _expected(weight: torch.Tensor, method: str, bits: int, config: QuantizeConfig) -> torch.Tensor:
    if method == "none":
        return weight
    q = quantize(weight, method, bits, n_bins=config.n_bins, ratio=config.ratio)
    return q.dequantize()


def check_restore(
    live: nn.Module, restored: nn.Module, chain: list[CheckpointInfo], config: QuantizeConfig
) -> tuple[bool, float]:
    """Whether ``restored`` holds exactly what the checkpoint must give for ``live``.

    Every stored row is the quantization of the row's value when it last changed, which
    is its live value now: a restore gives, bit for bit, the quantizer's round trip of the
    live row in the format of the checkpoint of ``chain`` that stored it (``bits: auto``
    widens the format as restores add up), or the live row itself: an fp32 row, or one
    that an earlier restore of this job set from a stored row and training has not changed
    since. Optimizer state, step counters and dense state come back exactly.

    Args:
        chain: the restored checkpoint's chain, baseline first.

    Returns:
        Whether every rank's state matches, and the largest absolute error of a restored
        embedding value against the live one.
    """
    formats: dict[str, set[tuple[str, int]]] = {}
    for info in chain:
        for name, table in info.tables.items():
            formats.setdefault(name, set()).add((table.method, table.bits))
    ok, err = True, 0.0
    for a, b in zip(
        model_state.local_shards(live), model_state.local_shards(restored), strict=True
    ):
        matched = (a.weight == b.weight).all(dim=1)  # as live: fp32, or restored untouched
        for method, bits in formats[a.spec.table]:
            want = _expected(a.weight, method, bits, config)
            matched |= (want == b.weight).all(dim=1)
        ok &= a.spec == b.spec and bool(matched.all())
        ok &= all(torch.equal(v, b.states[k]) for k, v in a.states.items())
        ok &= a.scalar_states() == b.scalar_states()
        if a.weight.numel():
            err = max(err, float((a.weight - b.weight).abs().max()))
    da, db = model_state.dense_state(live), model_state.dense_state(restored)
    ok &= da.keys() == db.keys() and all(torch.equal(v, db[k]) for k, v in da.items())
    t = torch.tensor([int(ok), -err], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t[0].item()), -float(t[1].item())


def summarize(root: RootInfo, full_bytes: int) -> dict[str, Any]:
    """Prints each checkpoint and the totals against a full fp32 checkpoint every interval."""
    entries = root.checkpoints
    n = len(entries)
    say(f"\n{'step':>6} {'kind':>6} {'rows saved':>10} {'MB':>8} {'stall ms':>9}  chain")
    for e in entries:
        say(
            f"{e.step:>6} {e.kind:>6} {100 * e.saved_fraction:>9.1f}% "
            f"{e.bytes / 1e6:>8.2f} {1e3 * e.stall_s:>9.1f}  {len(e.chain)} checkpoint(s)"
        )
    written = sum(e.bytes for e in entries)
    stored = max(e.restore_bytes for e in entries)
    stalls = [e.stall_s for e in entries]
    fmt = {(t.method, t.bits) for t in entries[-1].tables.values()}
    kind = ", ".join(sorted("fp32" if m == "none" else f"{m} {b}-bit" for m, b in fmt))
    say(
        f"\n{n} checkpoints, {entries[-1].policy} policy, rows stored as {kind}; "
        f"one full fp32 checkpoint is {full_bytes / 1e6:.2f} MB (measured)"
    )
    say(f"| {'':<38} | {'this run':>10} | {'full fp32 each time':>20} | {'less':>7} |")
    say(f"|{'-' * 40}|{'-' * 12}|{'-' * 22}|{'-' * 9}|")
    rows = [
        ("bytes written", written, n * full_bytes),
        ("bytes a restore needs (largest chain)", stored, full_bytes),
    ]
    for name, ours, theirs in rows:
        say(
            f"| {name:<38} | {ours / 1e6:>7.1f} MB | {theirs / 1e6:>17.1f} MB | "
            f"{theirs / max(ours, 1):>6.1f}x |"
        )
    say(
        f"stall per checkpoint: median {1e3 * statistics.median(stalls):.1f} ms, "
        f"max {1e3 * max(stalls):.1f} ms (training blocked inside save(), waiting for the "
        "previous write included)"
    )
    return {
        "checkpoints": n,
        "bytes_written": written,
        "bytes_stored": stored,
        "full_fp32_bytes": full_bytes,
        "written_reduction": n * full_bytes / max(written, 1),
        "stored_reduction": full_bytes / max(stored, 1),
        "stall_median_s": statistics.median(stalls),
        "stall_max_s": max(stalls),
        "restores": root.restores,
    }


def serving_lines(serve: dict[str, Any]) -> list[str]:
    """The serving process's closing lines, under the job's table: its lag behind training,
    the bytes each update read against a full reload, and its AUC against the trained one.

    Args:
        serve: what :meth:`cnr_train.serve.Server.run` returns.
    """
    full, per_update = serve["full_reload_bytes"], serve["bytes_per_update_median"]
    latency = serve["request_latency_median_s"]
    answered = f"{serve['requests']} requests answered while training"
    if latency is not None:
        answered += f" (at {serve['request_steps']} served steps, median {1e3 * latency:.0f} ms)"
    rows = [  # name, format, scale, the result's median and max
        ("lag behind training (commit to served)", "{:.2f} s", 1, "lag_median_s", "lag_max_s"),
        ("freshness (row trained to served)", "{:.2f} s", 1, "fresh_median_s", "fresh_max_s"),
        ("serving blocked per update", "{:.1f} ms", 1e3, "blocked_median_s", "blocked_max_s"),
        (
            "rows read per incremental update",
            "{:.0f}",
            1,
            "rows_per_update_median",
            "rows_per_update_max",
        ),
        (
            "bytes read per incremental update",
            "{:.2f} MB",
            1e-6,
            "bytes_per_update_median",
            "bytes_per_update_max",
        ),
    ]
    lines = [
        f"\nserving: {serve['dtype'].upper()} model following {serve['root']} every "
        f"{serve['interval_s']} s: {serve['updates']} updates, serves step "
        f"{serve['served_step']}; {answered}",
        f"| {'':<38} | {'median':>10} | {'max':>10} |",
        f"|{'-' * 40}|{'-' * 12}|{'-' * 12}|",
    ]
    for name, fmt, scale, *keys in rows:
        if any(serve.get(k) is None for k in keys):
            continue  # no incremental update to measure it on
        median, most = (fmt.format(scale * serve[k]) for k in keys)
        lines.append(f"| {name:<38} | {median:>10} | {most:>10} |")
    lines.append(
        f"a full fp32 reload reads {full / 1e6:.2f} MB, {full / max(per_update, 1):.1f}x the "
        f"median update; the first update (cold: every row, as stored) read "
        f"{serve['cold_bytes'] / 1e6:.2f} MB"
    )
    trained = serve.get("trained_auc")
    versus = (
        ""
        if trained is None
        else f" against the trained model's {trained:.4f} ({serve['auc'] - trained:+.4f})"
    )
    lines.append(
        f"AUC: served model {serve['auc']:.4f} ({serve['dtype'].upper()}, step "
        f"{serve['served_step']}){versus}"
    )
    return lines


def plot_bytes(root: RootInfo, full_bytes: int, path: Path) -> None:
    """A PNG of the bytes each checkpoint wrote, against a full fp32 checkpoint every time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    entries = root.checkpoints
    steps = [e.step for e in entries]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    colors = ["tab:orange" if e.kind == "full" else "tab:blue" for e in entries]
    width = 0.8 * min((b - a for a, b in zip(steps, steps[1:])), default=1)
    ax.bar(steps, [e.bytes / 1e6 for e in entries], width=width, color=colors)
    line = ax.axhline(full_bytes / 1e6, color="black", linestyle="--")
    policy = entries[-1].policy
    ax.legend(
        [line, Patch(color="tab:orange"), Patch(color="tab:blue")],
        ["full fp32 checkpoint (policy full)", f"{policy}: baseline", f"{policy}: delta"],
        fontsize=8,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("MB written")
    ax.set_title("bytes written per checkpoint interval")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
