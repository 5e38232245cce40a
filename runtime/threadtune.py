"""The kernels' thread count during decode, chosen by timing steps (kimi-run without --threads).

A kernel call's jobs are shared by its threads, and a thread the OS takes off its core in the middle
of a job holds the call until it runs again. With another program busy on a core, all threads then
lose to fewer: on a two-core machine with one core busy, 34-35 tok/s on two threads against 47 on
one (idle: 79 against 46). So while decoding on all cores, the tuner watches each step's compute time
(not its wait on expert reads: under a memory cap that is most of a step and swings with the disk, and
trials timed with it kept one thread by chance; steps whose computation faulted mapped experts in from
the disk are not timed at all): when that grows past `slower` times the best seen, or
the calls spent more than `waiting` of it waiting for other threads' jobs (`waited`: the kernels'
running total; a preempted thread shows there, also when the run started with the core already
taken), it times a few steps on one thread and keeps whichever was faster. On one thread, it tries
all of them again every `recheck` steps (the other program may be gone). Decisions take the median
of `window` steps; the first step after a switch is not scored (the pool's workers wake up); a
setting is left only for one `margin` faster; a trial that meets `4 window` steps it cannot score
before it has its window gives up and goes back."""

from __future__ import annotations

import statistics


class ThreadTuner:
    def __init__(self, threads: int, set_threads, waited=None, window: int = 5, slower: float = 1.35,
                 waiting: float = 0.1, recheck: int = 64, margin: float = 0.95):
        self.most, self.set_threads, self.waited = threads, set_threads, waited
        self.window, self.slower, self.waiting, self.recheck, self.margin = window, slower, waiting, recheck, margin
        self._waited = waited() if waited is not None else 0.0
        self.current = threads
        self.recent: list[float] = []       # the current setting's last scored steps
        self.waits: list[float] = []        # and the share of each spent waiting for other threads
        self.best: float | None = None      # the quickest window seen on all threads since the last trial
        self.trial: dict | None = None      # {"threads", "skip", "times", "before"} while timing the other
        self.since = 0                      # steps since the last trial
        self.trials = self.switches = 0
        self.note = ""

    def observe_step(self, seconds: float, scored: bool = True) -> None:
        """One decode step's compute time (its wall time less its wait on expert reads), at the current
        setting. A step that is not `scored` (its computation waited on the disk: page faults of mapped
        experts) is passed over."""
        if self.most <= 1:
            return
        waited = 0.0
        if self.waited is not None:
            total = self.waited()
            waited, self._waited = total - self._waited, total
        if not scored:
            if self.trial is not None:
                self.trial["unscored"] += 1
                if self.trial["unscored"] >= 4 * self.window:    # the disk, not the threads: give up
                    self._abandon()
            return
        if self.trial is not None:
            self._trial_step(seconds)
            return
        self.since += 1
        self.recent = (self.recent + [seconds])[-self.window:]
        self.waits = (self.waits + [waited / seconds if seconds > 0 else 0.0])[-self.window:]
        if len(self.recent) < self.window:
            return
        now = statistics.median(self.recent)
        if self.current == self.most:
            if self.best is None or now < self.best:
                self.best = now
            if now > self.slower * self.best or statistics.median(self.waits) > self.waiting:
                self._start(1, now)
        elif self.since >= self.recheck:
            self._start(self.most, now)

    def rebase(self) -> None:
        """Forget the step times seen so far (what the steps do changed: --io auto's trial ended)."""
        self.recent, self.waits, self.best = [], [], None

    def _start(self, threads: int, before: float) -> None:
        self.trial = {"threads": threads, "skip": 1, "times": [], "before": before, "unscored": 0}
        self.trials += 1
        self.set_threads(threads)

    def _trial_step(self, seconds: float) -> None:
        tr = self.trial
        if tr["skip"]:
            tr["skip"] -= 1
            return
        tr["times"].append(seconds)
        if len(tr["times"]) < self.window:
            return
        tried, before = statistics.median(tr["times"]), tr["before"]
        keep = tried < self.margin * before
        previous = self.current
        if keep:
            self.current = tr["threads"]
            self.switches += 1
        self.set_threads(self.current)
        self.trial, self.recent, self.waits, self.since = None, [], [], 0
        self.best = None            # the step time drifts (a longer context): measure it afresh
        self.note = (f"{self.current} (auto: {tr['threads']} thread{'s' if tr['threads'] > 1 else ''} timed at "
                     f"{tried * 1e3:.1f} ms of compute a step against {before * 1e3:.1f} on {previous}; "
                     f"{self.trials} trial{'s' if self.trials > 1 else ''})")

    def _abandon(self) -> None:
        """End a trial that kept getting steps it cannot score: back to the setting it started from."""
        n = self.trial["threads"]
        self.set_threads(self.current)
        self.trial, self.recent, self.waits, self.since, self.best = None, [], [], 0, None
        self.note = (f"{self.current} (auto: a trial of {n} thread{'s' if n > 1 else ''} given up, its steps "
                     f"waited on the disk; {self.trials} trial{'s' if self.trials > 1 else ''})")

    @property
    def policy(self) -> str:
        """What the run summary says: the setting and why."""
        if self.most <= 1:
            return f"{self.most}"
        if self.trial is not None:
            n = self.trial["threads"]
            return f"{self.current} (auto: timing {n} thread{'s' if n > 1 else ''} when the run ended)"
        return self.note if self.trials else f"{self.current} (auto: steady, no trial needed)"
