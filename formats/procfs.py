"""The kernel's own memory accounting, for both commands: this process's counters from
/proc/self/status (VmRSS, VmHWM, RssAnon, RssFile, ...) and the machine's from /proc/meminfo, in
bytes. Read in microseconds (smaps_rollup walks every mapping: milliseconds)."""

from __future__ import annotations


def _read_kb(path: str, wanted) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if wanted(key):
                    value, *unit = rest.split()
                    if unit == ["kB"]:
                        out[key] = int(value) * 1024
    except OSError:
        pass
    return out


def status() -> dict[str, int]:
    """This process's Vm* and Rss* counters in bytes ({} where /proc is missing)."""
    return _read_kb("/proc/self/status", lambda k: k.startswith(("Vm", "Rss")))


def meminfo(key: str) -> int:
    """One /proc/meminfo field in bytes (0 where it is missing)."""
    return _read_kb("/proc/meminfo", lambda k: k == key).get(key, 0)
