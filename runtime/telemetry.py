"""Where time and memory go, per token, from the OS's own accounting: wall time split into compute
and waiting on expert I/O, the CPU time reads and their checksums took (on any thread), bytes read,
cache hit rate, prefetch recall, major faults (getrusage), RSS split into anonymous and file-backed
(the kernel's counters in /proc/self/status), and the page cache (/proc/meminfo). Records go to a
JSONL trace; a summary closes the run; a trace can be plotted."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from kimistream.formats import procfs


def proc_status() -> dict:
    """Memory counters of /proc/self/status in bytes (VmHWM, VmRSS, RssAnon, RssFile, RssShmem)."""
    return procfs.status()


def meminfo(key: str) -> int:
    return procfs.meminfo(key)


def vm_hwm() -> int:
    return procfs.status().get("VmHWM", 0)


class Telemetry:
    def __init__(self, pager, trace_path: str | None = None, tuner=None):
        """tuner: a threadtune.ThreadTuner that times the decode steps too (or None)."""
        self.pager, self.tuner = pager, tuner
        self.records: list[dict] = []
        self._trialling = False          # --io auto's or --prefetch auto's trial was under way at the last decode step
        self._trace = open(Path(trace_path), "w") if trace_path else None
        self._t0 = time.perf_counter()
        self._mark()
        self._start = self._stats          # the pager's totals before this run (a --warm-up's reads are not its)

    def _mark(self):
        self._t = time.perf_counter()
        self._stats = self.pager.stats.snapshot()
        self._majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt

    def record(self, phase: str, tokens: int) -> dict:
        """Close one step (a prefill chunk or a decoded token) and start the next."""
        now = time.perf_counter()
        s = self.pager.stats.snapshot()
        d = {k: s[k] - self._stats[k] for k in s}
        mem = proc_status()
        wall = now - self._t
        rec = {
            "step": len(self.records), "phase": phase, "tokens": tokens, "t": round(now - self._t0, 6),
            "wall_s": round(wall, 6), "io_wait_s": round(d["io_wait_s"], 6),
            "compute_s": round(max(0.0, wall - d["io_wait_s"]), 6),
            "read_cpu_s": round(d["read_cpu_s"], 6),
            "bytes_read": d["bytes_read"], "hits": d["hits"], "misses": d["misses"],
            "hit_rate": round(d["hits"] / (d["hits"] + d["misses"]), 4) if d["hits"] + d["misses"] else None,
            "prefetch_recall": round(d["predicted_used"] / d["routed_checked"], 4) if d["routed_checked"] else None,
            "prefetch_bytes": d["prefetch_bytes"], "prefetch_wasted_bytes": d["prefetch_wasted_bytes"],
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - self._majflt,
            "rss_bytes": mem.get("VmRSS", 0), "rss_anon_bytes": mem.get("RssAnon", 0),
            "rss_file_bytes": mem.get("RssFile", 0) + mem.get("RssShmem", 0),
            # (the page cache only into a trace: /proc/meminfo costs a decode step 25 us)
            "page_cache_bytes": meminfo("Cached") if self._trace else None, "vm_hwm_bytes": mem.get("VmHWM", 0),
        }
        self.records.append(rec)
        if phase == "decode":
            io, guess = getattr(self.pager, "io_trial", None), getattr(self.pager, "guess_trial", None)
            trialling = io is not None and io.running or guess is not None and guess.running
            # --page-cache auto may be timing its two policies, --io auto O_DIRECT against the mapping,
            # --prefetch auto guessing against not: not on a step a thread count trial ran
            self.pager.observe_step(wall, scored=self.tuner is None or self.tuner.trial is None)
            if self.tuner is not None:
                # compute only: the wait on expert reads is no thread count's doing, nor is a step
                # whose computation faulted mapped experts in from the disk (faults beyond the ones
                # the pager's own reads took, whose time is in io_wait_s), nor one of --io auto's trial
                # of O_DIRECT against the mapping, whose switches move compute (a step's faults on
                # the mapping, a pool filling afresh): thread trials it set off had run in most runs;
                # nor one of --prefetch auto's trial (guessing runs the next layer's router twice)
                if self._trialling and not trialling:
                    self.tuner.rebase()
                self._trialling = trialling
                self.tuner.observe_step(rec["compute_s"],
                                        scored=rec["major_faults"] <= d["read_faults"] and not trialling)
        if self._trace:
            self._trace.write(json.dumps(rec) + "\n")
            self._trace.flush()
        self._mark()
        return rec

    def summary(self) -> dict:
        now = self.pager.stats.snapshot()
        s = {k: now[k] - self._start[k] for k in now}          # this run's share of the pager's totals
        dec = [r for r in self.records if r["phase"] == "decode"]
        pre = [r for r in self.records if r["phase"] == "prefill"]
        n, accesses = len(dec), s["hits"] + s["misses"]
        return {
            "hits": s["hits"], "misses": s["misses"], "hit_rate": round(s["hits"] / accesses, 4) if accesses else 0.0,
            "bytes_read": s["bytes_read"], "io_wait_s": round(s["io_wait_s"], 4), "evictions": s["evictions"],
            "prefetch_recall": round(s["predicted_used"] / s["routed_checked"], 4) if s["routed_checked"] else None,
            "prefetch_bytes": s["prefetch_bytes"], "prefetch_wasted_bytes": s["prefetch_wasted_bytes"],
            "prefill_bytes_read": sum(r["bytes_read"] for r in pre),
            "prefill_io_wait_s": round(sum(r["io_wait_s"] for r in pre), 4),
            "decode_bytes_read_per_token": round(sum(r["bytes_read"] for r in dec) / n) if n else 0,
            "decode_io_wait_s_per_token": round(sum(r["io_wait_s"] for r in dec) / n, 6) if n else 0,
            "decode_compute_s_per_token": round(sum(r["compute_s"] for r in dec) / n, 6) if n else 0,
            "decode_read_cpu_s_per_token": round(sum(r["read_cpu_s"] for r in dec) / n, 6) if n else 0,
            "prefill_read_cpu_s": round(sum(r["read_cpu_s"] for r in pre), 4),
            "major_faults": sum(r["major_faults"] for r in self.records),
            "peak_rss_anon_bytes": max((r["rss_anon_bytes"] for r in self.records), default=0),
            "peak_rss_file_bytes": max((r["rss_file_bytes"] for r in self.records), default=0),
            "vm_hwm_bytes": vm_hwm(),
        }

    def close(self):
        if self._trace:
            self._trace.close()
            self._trace = None


TRACE_KEYS = ("step", "rss_bytes", "rss_anon_bytes", "rss_file_bytes", "vm_hwm_bytes", "bytes_read", "io_wait_s",
              "compute_s")           # what plot_trace draws, each a number in every record


def plot_trace(trace: str, out: str) -> None:
    """Memory over time and I/O per step from a --trace file, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = []
    for i, line in enumerate(Path(trace).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{trace}: line {i}: not JSON ({e.msg})") from None
        missing = [k for k in TRACE_KEYS if not isinstance(rec, dict) or not isinstance(rec.get(k), (int, float))]
        if missing or not isinstance(rec.get("phase"), str):
            raise ValueError(f"{trace}: line {i}: not a kimi-run --trace record (no {(missing or ['phase'])[0]!r})")
        recs.append(rec)
    if not recs:
        raise ValueError(f"{trace}: no records")
    steps = [r["step"] for r in recs]
    mib = 2 ** 20
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    a.plot(steps, [r["rss_bytes"] / mib for r in recs], label="RSS")
    a.plot(steps, [r["rss_anon_bytes"] / mib for r in recs], label="RSS anonymous")
    a.plot(steps, [r["rss_file_bytes"] / mib for r in recs], label="RSS file-backed")
    a.plot(steps, [r["vm_hwm_bytes"] / mib for r in recs], "--", label="peak RSS (VmHWM)")
    prefill = [r["step"] for r in recs if r["phase"] == "prefill"]
    if prefill:
        a.axvspan(min(prefill) - 0.5, max(prefill) + 0.5, alpha=0.1, color="gray", label="prefill")
    a.set_ylabel("MiB")
    a.legend(loc="lower right")
    a.set_title(f"kimi-run memory and I/O — {Path(trace).name}")
    b.bar(steps, [r["bytes_read"] / mib for r in recs], label="expert bytes read")
    b2 = b.twinx()
    b2.plot(steps, [r["io_wait_s"] * 1000 for r in recs], "r.-", label="I/O wait (ms)")
    b2.plot(steps, [r["compute_s"] * 1000 for r in recs], "g.-", label="compute (ms)")
    b.set_ylabel("MiB read")
    b2.set_ylabel("ms")
    b.set_xlabel("step (prefill chunk or decoded token)")
    b.legend(loc="upper left")
    b2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
