"""The kernel's own memory accounting, for both commands: this process's counters from
/proc/self/status (VmRSS, VmHWM, RssAnon, RssFile, ...), the machine's from /proc/meminfo and the
memory limit of this process's cgroup, in bytes. Read in microseconds (smaps_rollup walks every
mapping: milliseconds)."""

from __future__ import annotations

import os
import re


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


_STATUS_FIELD = re.compile(rb"\n((?:Vm|Rss)[A-Za-z]+):\s+(\d+) kB")       # (the first line is Name:)
_status_fd: tuple[int, int] | None = None      # (pid, descriptor of /proc/PID/status)


def status() -> dict[str, int]:
    """This process's Vm* and Rss* counters in bytes ({} where /proc is missing). Read through one
    descriptor kept open, by pid so that a forked child opens its own: kimi-run reads it after every
    decode step, and opening the file and splitting its fifty lines in Python took 55 us a read
    against 16 here (11 of them the kernel's)."""
    global _status_fd
    pid = os.getpid()
    try:
        if _status_fd is None or _status_fd[0] != pid:
            _status_fd = (pid, os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC))
        data = os.pread(_status_fd[1], 1 << 14, 0)
    except OSError:
        return {}
    return {key.decode(): int(kb) * 1024 for key, kb in _STATUS_FIELD.findall(data)}


def meminfo(key: str) -> int:
    """One /proc/meminfo field in bytes (0 where it is missing)."""
    return _read_kb("/proc/meminfo", lambda k: k == key).get(key, 0)


UNLIMITED = 1 << 60          # cgroup v1 writes "no limit" as the largest page-aligned 63-bit number


def cgroup_memory_limit(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's own cgroup in bytes (v2 memory.max, v1's memory controller's
    memory.limit_in_bytes; both count the page cache), or None where there is none or it cannot be read."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            where = f"{root}/memory{path}/memory.limit_in_bytes"
        elif hid == "0" and controllers == "":
            where = f"{root}{path}/memory.max"
        else:
            continue
        try:
            with open(where.replace("//", "/")) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < UNLIMITED:
            return int(text)
        return None
    return None
