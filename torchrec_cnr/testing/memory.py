"""This process's memory, read from ``/proc/self`` (Linux): its resident set size and the
peak of it, which a test or a benchmark resets before the work it measures."""

from __future__ import annotations

__all__ = ["proc_status_mb", "reset_peak_rss"]


def proc_status_mb(name: str) -> float:
    """A memory figure of this process (``VmRSS``, ``VmHWM``, ...) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {name} in /proc/self/status")


def reset_peak_rss() -> float:
    """Resets this process's peak resident set size (``VmHWM``) to the current one, in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_mb("VmRSS")
