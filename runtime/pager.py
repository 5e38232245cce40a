"""Routed experts on demand, under a byte budget, behind one interface with two I/O modes.

- `mmap`: experts are views of the file mapping. A miss maps the extent's pages in one blocking
  MADV_POPULATE_READ; prefetch is posix_fadvise(WILLNEED) from a helper thread (it releases the GIL)
  in pieces of at most 1 MiB (FADVISE_PIECE); eviction is MADV_DONTNEED, which drops the pages from this process's
  RSS (the page cache may keep them).
- `pread`: a fixed pool of page-aligned buffers, one expert each, filled by preadv (optionally
  O_DIRECT; readahead off) on the caller's thread or, for prefetch, a thread pool. The pool is the cache.

An evicted expert's pages may stay in the OS page cache or be dropped from it (`--page-cache`; auto
decides from how many evicted experts the page cache still held when they were needed again). Both
count hits, misses, bytes read, time spent waiting for I/O, and prefetch recall/waste.

`--io auto` (make_pager) starts with `mmap` and, when evicted pages are to be dropped, asks its
provider to hand over to an O_DIRECT `pread` pager between model steps (successor); O_DIRECT reads are
then timed against the mapping with evicted experts dropped (or kept, where most of them were still
cached when needed again), and the faster stays (IoTrial). The
pool is private memory in huge pages where it can be (read_buffer). `--prefetch auto`'s guesses of
the next layer's experts are timed against none the same way (GuessTrial, both a StepTrial)."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kimistream.formats.checksum import extent_digest
from kimistream.formats.layout import EXPERT_PROJS, expert_extent, expert_tensor
from kimistream.formats.sizes import align_up
from kimistream.formats.weightfile import WeightFile

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux 5.14+; constant missing in 3.11
# One WILLNEED call reads ahead at most a bounded amount; issued in 1 MiB pieces the whole extent
# streams at disk speed (measured here: 1.2 GB/s), while one call for 48 MiB then left the
# MADV_RANDOM mapping to fault in 4 KiB at a time (6 MB/s).
FADVISE_PIECE = 1 << 20
PAGE = mmap.PAGESIZE
PAGE_CACHE_MODES = ("auto", "keep", "drop")
# Evicted experts leave their pages in the OS page cache (unless read with O_DIRECT), where a later miss may find
# them without a read. That pays only if memory outside the budget holds them; when it does not (a
# machine, or a memory cgroup, hardly larger than the budget) the kernel must reclaim them again under
# pressure, taking pages of experts still in use along, and reads slow down (measured under a cgroup
# cap that counts the page cache, 0.8 GB file: at 193 MiB, 5.1-5.5 tok/s keeping against 8.4-9.3
# dropping them; at 385 MiB keeping wins, 17-18 against 10; at 256 MiB the verdict varies, below;
# benchmarks/RESULTS.md).
# --page-cache auto watches how much of each evicted expert is still cached when it is needed again.
# The first misses are not scored: the prompt churns the cache. Measured on the 0.8 GB bench model,
# share still cached by windows of 64 misses of evicted experts: at ½ of the file 0.76, 0.91, 0.92,
# ...; at 256 MiB 0, 0, 0.39, 0.64, 0.85, ...; at ¼ 0, 0, 0, 0, 0.01, 0.09, 0.32, ... Scoring misses
# 128-255 separates them early (about 0.9, 0.4-0.5 and 0). A share near 0 means keeping cannot pay
# (at ¼ dropping is 1.5-2x faster) and a share near 1 that it does; in between the share does not
# tell (at 256 MiB dropping won by 7-33 % on one machine and lost by 30-45 % on another, whose disk
# read 1.8 GB/s against 0.7), so the pager times a few decode steps keeping, then a few dropping, and
# stays with the faster. Wall time per step is the measure, not I/O wait: keeping's cost under a cap
# is mostly in-use pages the kernel reclaims and the computation faults back in. One switch to
# dropping and back, not several, and the pages kept before the switch are not dropped with it: each
# drop of them is re-read afterwards if keeping stays (measured at 256 MiB: two rounds of two-step
# windows, each dropping them, lost 12 % to keeping throughout; one such round 7 %). Those pages
# favour the dropping window a little, hence the margin it must win by.
RELOAD_SKIP = 128              # misses of evicted experts not scored
RELOAD_TRIAL = 128             # misses of evicted experts scored before deciding
RELOAD_CLEAR = (0.15, 0.85)    # shares still cached below which dropping, above which keeping is clear
# With --io auto, dropping means O_DIRECT reads, which cost nothing to drop; below this share they go
# ahead at once. Measured on the bench model under caps: at 256 MiB (share 0.43) O_DIRECT was 1.05-1.12x
# keeping, where dropping mapped pages was 0.87x. From this share on keeping the mapping's pages is
# timed against O_DIRECT reads themselves, not against dropping mapped pages (an IoTrial whose mapped
# windows keep them, keep_mapped), whatever the share: at ½ (share 0.76-0.93) keeping was 1.1-1.2x
# O_DIRECT on a Zen 3 VM reading 0.9-1.2 GB/s, while on a Zen 5 reading 2.5-3.8 GB/s O_DIRECT was
# 1.3-1.6x keeping at a share of 0.80 (benchmarks/RESULTS.md): the disk decides, not the share.
RELOAD_DIRECT = 0.6
TIMED_ORDER = (False, True)    # the timed windows: keeping (as during the share's trial), then dropping
TIMED_STEPS = 3                # decode steps per window; after a switch its first is not scored
TIMED_MARGIN = 0.95            # dropping stays if its steps took less than this share of keeping's
# --io auto drops evicted experts by reading them with O_DIRECT. Reading through the mapping and
# dropping its pages on eviction costs the computing thread a page-table and page-cache removal per
# expert, yet on some machines it is still the faster of the two (measured at a quarter of the 0.8 GB
# bench model's file: O_DIRECT 1.1-1.2x the mapping on a Xeon and on a 3-4.8 GB/s disk, the mapping
# 1.07-1.14x O_DIRECT on a Zen 3 VM reading 0.9-1.2 GB/s; benchmarks/RESULTS.md). So the pager times
# both (IoTrial): after IO_TRIAL_SKIP decode steps, windows of IO_TRIAL_STEPS in IO_TRIAL_ORDER
# (True: O_DIRECT), alternating so that the disk's drift falls on both; the first step after a switch
# starts with an empty cache and is not scored. The mapping stays only if its steps took less than
# IO_TRIAL_MARGIN of O_DIRECT's in each mapped window against the O_DIRECT window before it: on the
# average of all four, one window the disk slowed had kept the mapping in 2 of 8 runs at 256 MB where
# O_DIRECT was 1.2x faster (benchmarks/RESULTS.md). So the first pair the mapping loses ends the trial.
IO_TRIAL_SKIP = 2
IO_TRIAL_STEPS = 5
IO_TRIAL_ORDER = (True, False, True, False)
IO_TRIAL_MARGIN = 0.95
# --prefetch auto guesses the next layer's experts. Where the cache is short of the file the right
# guesses' reads overlap a layer's computation and the wrong ones spend disk bandwidth: on the 0.8 GB
# bench model under caps (68 % of guesses used) guessing won 1.08-1.18x, on a model of 48 MiB f32
# experts read at 600 MB (47 % used, reads 4.7x the compute) it lost 0.87x. So the steps are timed:
# after --io auto's trial, GUESS_TRIAL_SKIP steps, then windows of guessing and not in
# GUESS_TRIAL_ORDER, as IoTrial's; not guessing stays only if it wins each pair by the margin.
GUESS_TRIAL_SKIP = 2
GUESS_TRIAL_STEPS = 5
GUESS_TRIAL_ORDER = (True, False, True, False)
GUESS_TRIAL_MARGIN = 0.95
_libc = ctypes.CDLL(None, use_errno=True)
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def read_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of page-aligned private memory (O_DIRECT needs aligned buffers) for reads to land in,
    backed by transparent huge pages where the system allows them. An O_DIRECT read goes to the device
    as one scatter-gather entry per physically contiguous run of its buffer, and a request holds at
    most the device's max_segments entries (254 on the virtual disk measured here): into scattered
    4 KiB pages every read over 1016 KiB is split, and that disk then read at half its speed (random
    1 MiB reads two at a time 0.98 GB/s against 2.05 into huge pages, sequential 8 MiB reads 0.94
    against 2.11; 976 KiB reads alike; benchmarks/bench_read_buffer.py). A Kimi K2 expert is 13 MB."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:             # a kernel without transparent huge pages: 4 KiB pages it is
            pass
    return buf


def in_pages(nbytes: int) -> int:
    """What `nbytes` of an expert take in memory: whole pages (extents start on page boundaries), as a
    mapping or a pool slot holds them; the cache counts these."""
    return align_up(nbytes, PAGE)


def _thread_mark() -> tuple:
    """This thread's CPU time and major page faults so far (a read's cost to it: _count_cpu)."""
    return time.thread_time(), resource.getrusage(_RUSAGE_THREAD).ru_majflt


class ExpertReadError(OSError):
    pass


@dataclass
class PagerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    io_wait_s: float = 0.0
    evictions: int = 0
    prefetched: int = 0
    prefetch_bytes: int = 0
    prefetch_wasted_bytes: int = 0
    predicted_used: int = 0          # routed experts that had been predicted
    routed_checked: int = 0          # routed experts at layers where a prediction was made
    reloads: int = 0                 # misses of experts evicted before, scored while --page-cache auto decides
    reloads_cached: float = 0.0      # the share of their pages the page cache still held, summed
    read_cpu_s: float = 0.0          # CPU time of reads and their checksums, on whichever thread ran them
    read_faults: int = 0             # major page faults those threads took for them (mapped experts paged in)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_used / self.routed_checked if self.routed_checked else 0.0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Entry:
    key: tuple
    offset: int
    nbytes: int
    views: tuple = ()
    offsets: tuple = ()             # the views' offsets, once the provider has taken them (ExpertProvider.held)
    slot: int = -1
    freq: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ahead: bool = False             # read ahead of its use (fetch_ahead, prefetch): its first use is a miss
    guess: bool = False             # a speculative read (prefetch)


class StepTrial:
    """Decode steps timed in alternating windows of two ways of running them: `way` True is the
    incumbent, False the challenger, which stays only if its steps took less than the margin of the
    incumbent's in each of its windows against the incumbent's window before it; the first pair it
    loses ends the trial. After `skip` steps, windows of `steps` follow `order`; the first step after a
    switch (and a step not `scored`: a thread count trial ran it) is not scored. Subclasses give the
    parameters (the module constants <constants>_SKIP, _STEPS, _ORDER, _MARGIN, read at each step so
    that tests can set them) and the words."""
    constants = ""
    incumbent = challenger = ""             # how a step ran, as "timed X ms a step <challenger> against Y <incumbent>"
    incumbent_name = challenger_name = ""   # the two ways as subjects

    def __init__(self):
        self.way = True
        self.running = True
        self.steps = 0
        self.times: list[list[float]] = [[] for _ in self.order()]      # scored steps per window
        self.note = f"a trial of {self.incumbent_name} against {self.challenger_name} under way when the run ended"

    def skip(self) -> int:
        return globals()[f"{self.constants}_SKIP"]

    def window(self) -> int:
        return globals()[f"{self.constants}_STEPS"]

    def order(self) -> tuple:
        return globals()[f"{self.constants}_ORDER"]

    def margin(self) -> float:
        return globals()[f"{self.constants}_MARGIN"]

    def observe(self, seconds: float, scored: bool = True) -> None:
        """A decode step, run the way `way` said, took `seconds` of wall time."""
        if not self.running:
            return
        order, steps = self.order(), self.window()
        i = self.steps - self.skip()
        self.steps += 1
        if i < 0:
            return
        window, pos = divmod(i, steps)
        mode = order[window]
        if scored and (pos > 0 or window == 0 or order[window - 1] == mode):
            self.times[window].append(seconds)
        if pos + 1 < steps:
            return
        means = [sum(v) / len(v) if v else None for v in self.times[:window + 1]]
        pairs = [(means[w - 1], means[w]) for w in range(1, window + 1) if not order[w]]
        # the challenger must win every pair: one it lost settles the trial, and the windows still to
        # come would only cost (each of its steps was 1.2-1.3x an incumbent's where the incumbent won)
        lost = any(a is not None and b is not None and not b < self.margin() * a for a, b in pairs)
        if window + 1 < len(order) and not lost:
            self.way = order[window + 1]
            return
        self.running = False
        if not pairs or not lost and any(a is None or b is None for a, b in pairs):
            self.way = True
            self.note = f"{self.incumbent_name}: the trial against {self.challenger_name} met no step it could time"
            return
        self.way = lost
        timed = [(a, b) for a, b in pairs if a is not None and b is not None]
        self.note = (f"timed {' and '.join(f'{b * 1e3:.1f}' for _, b in timed)} ms a step {self.challenger} "
                     f"against {' and '.join(f'{a * 1e3:.1f}' for a, _ in timed)} {self.incumbent}"
                     + (f"; {self.challenger_name} lost, {len(order) - window - 1} windows left out"
                        if window + 1 < len(order) else ""))


class IoTrial(StepTrial):
    """--io auto with evicted experts dropped: O_DIRECT reads (`direct`, the incumbent) timed against
    reads through the mapping (IO_TRIAL_*), which drops evicted experts' pages too, or keeps them
    (keep_mapped: --page-cache auto found most of them cached when needed again). `direct` is the way the next decode step is to read; the
    expert provider hands over to a pager that reads so between model steps (successor). Shared by the
    pagers that take over from one another, so whichever of them the caller holds passes the steps on."""
    constants = "IO_TRIAL"
    incumbent, challenger = "with O_DIRECT reads", "through the mapping"
    incumbent_name, challenger_name = "O_DIRECT reads", "the mapping"

    def __init__(self, keep_mapped: bool = False, keep_policy: str = ""):
        if keep_mapped:             # (instance words: the class's serve the trial that drops them)
            self.challenger = "through the mapping keeping evicted experts' pages"
            self.challenger_name = "keeping them"
        super().__init__()
        self.direct_policy = ""     # the O_DIRECT pager's page-cache policy in words, for its successors
        # mapped windows keep evicted experts' pages in the page cache (--page-cache auto found most of
        # them still there when needed again) instead of dropping them; keep_policy: that finding in words
        self.keep_mapped, self.keep_policy = keep_mapped, keep_policy

    @property
    def direct(self) -> bool:
        return self.way


class GuessTrial(StepTrial):
    """--prefetch auto with a cache short of the file: decode steps guessing the next layer's experts
    (`guess`, the incumbent) timed against steps that do not (GUESS_TRIAL_*), after --io auto's trial.
    Shared by the pagers that take over from one another, as IoTrial."""
    constants = "GUESS_TRIAL"
    incumbent, challenger = "guessing", "without guesses"
    incumbent_name, challenger_name = "guessing", "not guessing"

    @property
    def guess(self) -> bool:
        return self.way


class ExpertPager:
    """get(layer, expert) -> (gate, up, down) weight views; prefetch(layer, experts)."""

    def __init__(self, wf: WeightFile, capacity_bytes: int, policy: str = "lru", threads: int = 2,
                 page_cache: str = "auto"):
        if policy not in ("lru", "lfru"):
            raise ValueError(f"unknown cache policy {policy!r} (lru, lfru)")
        if page_cache not in PAGE_CACHE_MODES:
            raise ValueError(f"unknown --page-cache {page_cache!r} ({', '.join(PAGE_CACHE_MODES)})")
        self.drop_evicted = page_cache == "drop"
        self._deciding = page_cache == "auto"
        self.page_cache_policy = {"auto": "keep evicted experts (auto: deciding)", "keep": "keep evicted experts",
                                  "drop": "drop evicted experts"}[page_cache]
        self._evicted: set = set()
        self._reloads_seen = 0
        self._timed: list | None = None     # (dropping, seconds, scored) of decode steps while timing the two
        self._trial_note = ""
        self.wf, self.capacity, self.policy = wf, capacity_bytes, policy
        self._largest = max((e.nbytes for e in wf.extents if e.kind == "expert"), default=0)
        if self._deciding and sum(in_pages(e.nbytes) for e in wf.extents if e.kind == "expert") <= capacity_bytes:
            self._deciding = False          # nothing will be evicted: nothing to decide
            self.page_cache_policy = "keep (auto: the cache holds every expert, none is evicted)"
        self.stats = PagerStats()
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._inflight: dict[tuple, _Entry] = {}
        self._predicted: dict[int, set] = {}
        self._freq: dict[tuple, int] = {}
        self._prefetched: set[tuple] = set()     # prefetched, not yet used
        self._guessed = False                    # speculative reads asked for, and not stopped for the run
        self._verified: set[tuple] = set()       # experts whose bytes matched their checksum once
        # the experts handed out for the computation under way (a layer's, or the one a stream is on):
        # no read evicts them, since a pool slot would be overwritten under the kernel reading it
        self._pinned: set[tuple] = set()
        self._lock = threading.Lock()
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kimi-prefetch")
        self.cached_bytes = 0
        # --io auto: a decision to drop evicted experts' pages asks for O_DIRECT reads instead (see
        # make_pager); the provider carries it out between model steps (successor)
        self.direct_on_drop = False
        self.wants_direct = False
        self.keep_trial = False                 # the hand-over to O_DIRECT is to be timed against keeping pages
        self.io_trial: IoTrial | None = None    # --io auto, dropping: O_DIRECT timed against the mapping
        self.guess_trial: GuessTrial | None = None      # --prefetch auto: guessing timed against not
        # reads in a row that found all their bytes in the page cache (0 after one that did not);
        # counted only when watch_reads is set (--prefetch auto: see ModelWeights.routed)
        self.watch_reads = False
        self.cached_reads = 0

    # ---------------------------------------------------------------- interface
    def extent(self, key):
        ext = self.wf.extent_by_name[expert_extent(*key)]
        return ext.offset, ext.nbytes

    def pin(self, layer: int, experts) -> None:
        """The experts the next computation uses (they replace the ones pinned before, whose
        computation is over): no read evicts them until then."""
        with self._lock:
            self._pinned = {(layer, int(e)) for e in experts}

    def get(self, layer: int, e: int):
        """One expert's views, pinned alone (a stream's: the previous one's computation is over)."""
        self.pin(layer, (e,))
        return self._fetch(layer, e)

    def _fetch(self, layer: int, e: int):
        key = (layer, e)
        self._freq[key] = self._freq.get(key, 0) + 1
        self._prefetched.discard(key)
        with self._lock:
            ent = self._cache.get(key)
            if ent is not None and ent.ready.is_set() and ent.error is None:
                self._cache.move_to_end(key)
                self._count_use(ent)
                return ent.views
        t0 = time.perf_counter()
        ent = self._load(key)
        self.stats.io_wait_s += time.perf_counter() - t0
        self.stats.misses += 1
        ent.ahead = False               # a read ahead of it that it waited for: this was its miss
        return ent.views

    def get_many(self, layer: int, experts) -> list:
        """[get(layer, e) for e in experts], all of them pinned, the cached ones under one lock (a
        decode step asks for a layer's experts at once, almost always all cached)."""
        out, missing = [], []
        with self._lock:
            self._pinned = {(layer, int(e)) for e in experts}
            for e in experts:
                key = (layer, e)
                ent = self._cache.get(key)
                if ent is not None and ent.ready.is_set() and ent.error is None:
                    self._freq[key] = self._freq.get(key, 0) + 1
                    self._cache.move_to_end(key)
                    self._count_use(ent)
                    out.append(ent.views)
                else:
                    missing.append(len(out))
                    out.append(None)
        if self._prefetched:
            self._prefetched.difference_update((layer, e) for e in experts)
        for i in missing:                                   # _fetch counts and reads them
            out[i] = self._fetch(layer, experts[i])
        return out

    def as_they_land(self, layer: int, experts):
        """get_many's experts, all pinned, as [(e, views)] runs in the order given, each run as soon as
        it is in memory: the leading experts whose reads have landed, or when the first has not, that
        one once it has (with every one after it landed meanwhile). A caller computing each run while
        the later reads go on keeps the order of the experts, so its sums are those of one call."""
        left = [int(e) for e in experts]
        with self._lock:
            self._pinned = {(layer, e) for e in left}
        while left:
            run, n = [(left[0], self._fetch(layer, left[0]))], 1      # waits for its read (or reads it)
            with self._lock:
                while n < len(left) and self._landed((layer, left[n])):
                    n += 1
            run += [(e, self._fetch(layer, e)) for e in left[1:n]]
            yield run
            left = left[n:]

    def _landed(self, key) -> bool:
        """(Under the lock) whether `key`'s bytes are in memory: cached, or its read has landed."""
        ent = self._cache.get(key) or self._inflight.get(key)
        return ent is not None and ent.ready.is_set() and ent.error is None

    def held(self, layer: int, experts) -> list | None:
        """The cache entries of `experts` (distinct ids) at `layer` when every one is cached and ready,
        counted and made most recent as get_many does; None when any is not (a warm decode step finds
        them all: one pass under the lock, no views handed out)."""
        cache = self._cache
        with self._lock:
            self._pinned = {(layer, int(e)) for e in experts}
            ents = [cache.get((layer, e)) for e in experts]
            for ent in ents:
                if ent is None or not ent.ready.is_set() or ent.error is not None:
                    return None
            for ent in ents:        # in routing order, as a token's fetch_ahead and as_they_land take them
                cache.move_to_end(ent.key)
                self._freq[ent.key] = self._freq.get(ent.key, 0) + 1
                self._count_use(ent)
        if self._prefetched:
            self._prefetched.difference_update(ent.key for ent in ents)
        return ents

    def _count_use(self, ent: _Entry) -> None:
        """A use of a ready entry (under the lock): a hit, but for the first use of one read ahead of
        it, which the cache did not hold before it was asked for (so a hit means the same under every
        --io: a use no read was started for)."""
        if ent.ahead:
            ent.ahead = False
            self.stats.misses += 1
        else:
            self.stats.hits += 1

    def holds_together(self, n: int) -> bool:
        """Whether n experts fetched one after another can all be held until used within the cache: a
        mapping's views stay valid anyway, but pages the cache gives back would be faulted in again
        behind its back and memory would grow past the budget (a prefill chunk can route to far more
        experts than a tight cache holds); then they are taken one at a time."""
        return n * self._largest <= self.capacity

    def cache_slots(self) -> int:
        """How many of the largest experts the cache holds."""
        return self.capacity // self._largest if self._largest else 0

    def read_ahead_depth(self) -> int:
        """How many experts may be read ahead of the one in use, in a pass over more experts than the
        cache holds, without the cache evicting one of them before its use: fetch_ahead makes those
        already read the most recent entries, so the oldest are used ones while the ones ahead and
        the one in use take at most half the cache (a quarter under lfru, which evicts the least used
        of the older half); two reads per prefetch thread at most, which keeps every thread busy."""
        room = (self.cache_slots() - 2) // (2 if self.policy == "lru" else 4)
        return max(0, min(room, 2 * self.threads))

    def note_routed(self, layer: int, experts) -> None:
        """Score the prediction made for `layer` against the experts actually routed there."""
        pred = self._predicted.pop(layer, None)
        if pred is None:
            return
        used = set(experts.tolist() if isinstance(experts, np.ndarray) else map(int, experts))
        self.stats.routed_checked += len(used)
        self.stats.predicted_used += len(used & pred)
        for e in pred - used:
            key = (layer, e)
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.prefetch_wasted_bytes += self.extent(key)[1]
                self._abandon(key)

    def prefetch(self, layer: int, experts) -> None:
        """Speculative: start reading experts predicted for `layer` (scored by note_routed)."""
        self._guessed = True
        self._predicted[layer] = set(int(x) for x in experts)
        for e in self._predicted[layer]:
            key = (layer, e)
            with self._lock:
                if key in self._cache or key in self._inflight:
                    continue
            self._prefetched.add(key)
            self._start_prefetch(key)

    def stop_guessing(self) -> None:
        """No more speculative reads in this run (the provider's decision)."""
        self._guessed = False

    def fetch_ahead(self, layer: int, experts) -> None:
        """Certain: start reading all of a layer's routed experts, so the read of the next one
        overlaps the computation of this one. Those already cached become the most recent first, so
        the room made for the others never evicts an expert about to be used."""
        missing = []
        with self._lock:
            for e in experts:
                key = (layer, int(e))
                if key in self._cache:
                    self._cache.move_to_end(key)
                elif key not in self._inflight:
                    missing.append(key)
        for key in missing:
            self._start_prefetch(key, speculative=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def cached_share(self, off: int, n: int) -> float:
        """The share of bytes off .. off+n of the file the page cache holds now (mincore)."""
        start = off // PAGE * PAGE
        pages = -(-(off + n - start) // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        addr = np.frombuffer(self.wf.mm, np.uint8).ctypes.data + start      # the view is dropped at once
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(off + n - start), vec):
            return 1.0                  # unknown: count it as cached (keeping is the safe side)
        return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) / pages

    def _note_read(self, key, off: int, n: int) -> None:
        """A read of `key` starts: count it as served by the page cache or not (watch_reads), and
        while --page-cache auto decides, score an evicted expert's pages."""
        if self.watch_reads:
            self.cached_reads = self.cached_reads + 1 if self._in_page_cache(off, n) else 0
        if not self._deciding or key not in self._evicted:
            return
        self._evicted.discard(key)
        self._reloads_seen += 1
        if self._reloads_seen <= RELOAD_SKIP or self._timed is not None:
            return
        st = self.stats
        st.reloads += 1
        st.reloads_cached += self.cached_share(off, n)
        if st.reloads >= RELOAD_TRIAL and self._timed is None:
            share = st.reloads_cached / st.reloads
            self._trial_note = f"{share:.0%} of {st.reloads} evicted experts were still cached when needed again"
            if self.direct_on_drop and share < RELOAD_DIRECT:
                # --io auto drops by reading with O_DIRECT: no time to take: see RELOAD_DIRECT
                self._decide(True)
            elif self.direct_on_drop:
                # keeping against O_DIRECT reads, timed (see RELOAD_DIRECT): the hand-over to O_DIRECT
                # starts an IoTrial whose mapped windows keep evicted experts' pages
                self._evicted.clear()
                self._deciding = False
                self.keep_trial = self.wants_direct = True
                self.page_cache_policy = f"keep evicted experts (auto: {self._trial_note})"
            elif RELOAD_CLEAR[0] <= share <= RELOAD_CLEAR[1]:
                self._timed = []                  # observe_step times the two policies from here
                self._set_dropping(TIMED_ORDER[0])
                self.page_cache_policy = f"keep evicted experts (auto: timing keeping against dropping; {self._trial_note})"
            else:
                self._decide(share < RELOAD_CLEAR[0])

    def observe_step(self, seconds: float, scored: bool = True) -> None:
        """A decode step took `seconds` of wall time (not `scored`: a thread count trial ran it). While
        --page-cache auto times dropping evicted experts against keeping them, the steps go to windows
        of each (TIMED_ORDER, TIMED_STEPS each; the first step after a switch lets it settle and is not
        scored), and the policy whose scored steps were faster on average stays; while --io auto times
        O_DIRECT reads against the mapping, to its IoTrial; then to --prefetch auto's GuessTrial."""
        timing_io = self.io_trial is not None and self.io_trial.running
        if self.io_trial is not None:
            self.io_trial.observe(seconds, scored)
        # one trial at a time: --io auto's and the page cache's keeping against dropping go first
        if self.guess_trial is not None and not timing_io and not (self._deciding and self._timed is not None):
            self.guess_trial.observe(seconds, scored)
        if not self._deciding or self._timed is None:
            return
        i = len(self._timed)
        window, pos = divmod(i, TIMED_STEPS)
        switched = window > 0 and TIMED_ORDER[window] != TIMED_ORDER[window - 1]
        self._timed.append((self.drop_evicted, seconds, scored and (pos > 0 or not switched)))
        if pos + 1 < TIMED_STEPS:
            return
        if window + 1 < len(TIMED_ORDER):
            self._set_dropping(TIMED_ORDER[window + 1])
            return
        times = {d: [t for dd, t, scored in self._timed if scored and dd == d] for d in (True, False)}
        drop_s, keep_s = (sum(v) / len(v) for v in (times[True], times[False]))
        self._trial_note += f"; {drop_s * 1e3:.1f} ms per step dropping them, {keep_s * 1e3:.1f} keeping"
        self._decide(drop_s < TIMED_MARGIN * keep_s)

    def _set_dropping(self, drop: bool, kept_too: bool = False) -> None:
        self.drop_evicted = drop
        if kept_too:
            # what keeping left goes now, as a drop from the start would have let it go: under a cap
            # that counts the page cache those pages pressed on the experts in use for the rest of the
            # run (measured at a quarter of the file: 7.3 tok/s against 9.5 for an explicit drop)
            for k in list(self._evicted):
                with self._lock:
                    held = k in self._cache or k in self._inflight
                if not held:
                    self._evicted_pages(k, *self.extent(k))

    def _decide(self, drop: bool) -> None:
        self._set_dropping(drop, kept_too=drop)
        self._evicted.clear()
        self._deciding = False
        self.page_cache_policy = f"{'drop' if drop else 'keep'} evicted experts (auto: {self._trial_note})"
        # Dropping through the page cache costs the computing thread a page-table and page-cache
        # removal per expert (about 10 ms a token at a quarter of the 0.8 GB bench model's file, out of
        # 62); reads that bypass it cost nothing to drop (benchmarks/RESULTS.md: 1.1-1.2x there)
        self.wants_direct = drop and self.direct_on_drop

    def retire(self) -> None:
        """Stop for good: reads in flight finish, and every expert held gives back its memory and its
        pages in the page cache (a successor reads them again its own way)."""
        self.close()
        self.drop_evicted, self._deciding = True, False
        with self._lock:
            ents = list(self._cache.values()) + list(self._inflight.values())
            self._cache.clear()
            self._inflight.clear()
            self.cached_bytes = 0
        for ent in ents:
            self._release(ent)

    def _in_page_cache(self, off: int, n: int) -> bool:
        """Whether a read of bytes off .. off+n would find them all in the page cache."""
        return self.cached_share(off, n) >= 1.0

    def _evicted_pages(self, key, off: int, n: int, evicted: bool = True) -> None:
        """An expert left the cache (`evicted`), or a guess's read was not used: drop its pages from
        the page cache, or, for an eviction, note it while deciding. An unused guess says nothing
        about memory pressure: counted, an uncapped run's guesses (all still cached when routed to
        later) had the decision time O_DIRECT reads against keeping, and a noisy win sent every
        first use of an expert to the disk in a warm run."""
        if self.drop_evicted:
            # here, not on a helper thread: measured at a quarter of the file, 9.9-10.2 tok/s against
            # 8.6-9.4 (a queued drop can also catch the expert's pages just read again)
            start = off // PAGE * PAGE
            os.posix_fadvise(self.wf.fileno(), start, off + n - start, os.POSIX_FADV_DONTNEED)
        elif self._deciding and evicted:
            self._evicted.add(key)

    # ---------------------------------------------------------------- eviction
    def _victim(self):
        """The entry to evict (under the lock), never a pinned one; None when there is none."""
        pinned = self._pinned
        if self.policy == "lru":
            for k, ent in self._cache.items():
                if ent.ready.is_set() and k not in pinned:
                    return k
            return None
        # lfru: among the least recent half, evict the least frequently routed expert.
        ready = [k for k, ent in self._cache.items() if ent.ready.is_set() and k not in pinned]
        if not ready:
            return None
        window = ready[: max(1, len(ready) // 2)]
        return min(window, key=lambda k: self._freq.get(k, 0))

    def _needs_room(self, nbytes: int) -> bool:
        return self.cached_bytes + nbytes > self.capacity

    def _make_room(self, nbytes: int) -> None:
        while self._cache and self._needs_room(nbytes):
            k = self._victim()
            if k is None:
                return
            ent = self._cache.pop(k)
            self.cached_bytes -= in_pages(ent.nbytes)
            self.stats.evictions += 1
            self._release(ent)

    # ---------------------------------------------------------------- per mode
    def _views(self, key, buf: np.ndarray, base: int, at: int):
        """(name, codec, shape, bytes, offset in self.base) of the expert's tensors, whose extent
        starts at file offset `base` and lies in buf, at byte `at` of self.base."""
        out = []
        for proj in EXPERT_PROJS:
            t = self.wf.tensors[expert_tensor(key[0], key[1], proj)]
            start = t.offset - base
            out.append((t.name, t.codec, t.shape, buf[start:start + t.nbytes], at + start))
        return tuple(out)

    def _load(self, key) -> _Entry:
        raise NotImplementedError

    def _verify(self, key, data) -> None:
        """The first time an expert's bytes are read, check them against the extent's checksum
        (xxh3 hashes far faster than a disk reads): a corrupted file stops the run, naming the
        extent, before its bytes are used."""
        if key in self._verified:
            return
        ext = self.wf.extent_by_name[expert_extent(*key)]
        if extent_digest(data) != ext.checksum:
            raise ExpertReadError(f"{self.wf.path}: extent {ext.name} fails its checksum (the file is corrupted; "
                                  f"kimi-verify {self.wf.path} checks all of it)")
        self._verified.add(key)

    def _count_cpu(self, mark: tuple) -> None:
        """Add what this thread spent since `mark` (_thread_mark) to the reads' account: its CPU time (the
        kernel's copy or zero-fill of a read, the page-table work of a mapping, the checksums: with the
        computation on every core, time the kernels did not get) and its major page faults (a mapped
        expert paged in by MADV_POPULATE_READ or by hashing it: the process's count holds them, and
        they are not the computation's)."""
        dt = time.thread_time() - mark[0]
        faults = resource.getrusage(_RUSAGE_THREAD).ru_majflt - mark[1]
        with self._lock:
            self.stats.read_cpu_s += dt
            self.stats.read_faults += faults

    def _start_prefetch(self, key, speculative: bool = True) -> None:
        raise NotImplementedError

    def _abandon(self, key) -> None:
        """A guessed expert was not routed to: what its read holds may go."""

    def _count_prefetch(self, nbytes: int, speculative: bool) -> None:
        # Reads ahead of a layer's known experts are not guesses: only speculative ones count.
        if speculative:
            self.stats.prefetched += 1
            self.stats.prefetch_bytes += nbytes

    def _release(self, ent: _Entry) -> None:
        raise NotImplementedError


class MmapPager(ExpertPager):
    mode = "mmap"

    def __init__(self, wf, capacity_bytes, policy="lru", threads=2, page_cache: str = "auto"):
        super().__init__(wf, capacity_bytes, policy, threads, page_cache)
        self._all = np.frombuffer(wf.mm, dtype=np.uint8)
        self.base = self._all
        self.inflight_bytes = 0         # reads started and not yet mapped: their pages arrive in memory too

    def _needs_room(self, nbytes: int) -> bool:
        return self.cached_bytes + self.inflight_bytes + nbytes > self.capacity

    def _load(self, key):
        off, n = self.extent(key)
        with self._lock:
            ent = self._inflight.get(key)
        if ent is not None:
            ent.ready.wait()
        else:
            self._note_read(key, off, n)
            self._willneed(off, n)
        with self._lock:
            if self._inflight.pop(key, None) is not None:
                self.inflight_bytes -= in_pages(n)      # its reserved room becomes the cache's
            self._make_room(in_pages(n))        # before mapping the new pages: RSS never exceeds the cache
        t0 = _thread_mark()
        try:
            self.wf.mm.madvise(MADV_POPULATE_READ, off // PAGE * PAGE, n + off % PAGE)
        except OSError as e:
            raise ExpertReadError(f"{self.wf.path}: reading expert {key[0]}.{key[1]} "
                                  f"(bytes {off}..{off + n}): {e.strerror}") from None
        self._verify(key, self._all[off:off + n])
        self._count_cpu(t0)
        self.stats.bytes_read += n
        with self._lock:
            ent = _Entry(key, off, n, self._views(key, self._all[off:off + n], off, off))
            ent.ready.set()
            self._cache[key] = ent
            self.cached_bytes += in_pages(n)
        return ent

    def _start_prefetch(self, key, speculative=True):
        off, n = self.extent(key)
        ent = _Entry(key, off, n)
        with self._lock:
            self._make_room(in_pages(n))        # the read's pages count against the cache from now on
            if self._needs_room(in_pages(n)):   # the room is taken by reads in flight or pinned experts
                self._prefetched.discard(key)
                return
            self._inflight[key] = ent
            self.inflight_bytes += in_pages(n)
        self._note_read(key, off, n)
        self._count_prefetch(n, speculative)

        def work():
            t0 = _thread_mark()
            try:
                self._willneed(off, n)
                if not speculative:
                    self._verify_ahead(key, off, n)
            except OSError as e:
                ent.error = e
            finally:
                self._count_cpu(t0)
                ent.ready.set()
        self._pool.submit(work)

    def _verify_ahead(self, key, off: int, n: int) -> None:
        """On the read's own thread, for an expert certain to be used: hash it through the mapping (the
        hash's page faults wait for the read; xxh3 lets go of the GIL), so that the checksum is off the
        computing thread's path (Kimi K2's first tokens spent ~15 % of it hashing). A mismatch is left
        for _load's _verify, which raises the error."""
        if key not in self._verified:
            if extent_digest(self._all[off:off + n]) == self.wf.extent_by_name[expert_extent(*key)].checksum:
                self._verified.add(key)

    def _abandon(self, key) -> None:
        with self._lock:
            ent = self._inflight.pop(key, None)
            if ent is not None:
                self.inflight_bytes -= in_pages(ent.nbytes)
        if ent is not None:
            self._evicted_pages(key, ent.offset, ent.nbytes, evicted=False)

    def _willneed(self, off: int, n: int) -> None:
        fd = self.wf.fileno()
        for p in range(off, off + n, FADVISE_PIECE):
            os.posix_fadvise(fd, p, min(FADVISE_PIECE, off + n - p), os.POSIX_FADV_WILLNEED)

    def _release(self, ent):
        if hasattr(mmap, "MADV_DONTNEED"):
            start = ent.offset // PAGE * PAGE
            self.wf.mm.madvise(mmap.MADV_DONTNEED, start, ent.offset + ent.nbytes - start)
        self._evicted_pages(ent.key, ent.offset, ent.nbytes)


class PreadPager(ExpertPager):
    mode = "pread"

    def __init__(self, wf, capacity_bytes, policy="lru", threads=2, direct: bool = False, page_cache: str = "auto"):
        super().__init__(wf, capacity_bytes, policy, threads, page_cache)
        if direct:                      # O_DIRECT reads leave nothing in the page cache
            self.drop_evicted = self._deciding = False
            self.page_cache_policy = "not used (O_DIRECT reads)"
        sizes = [e.nbytes for e in wf.extents if e.kind == "expert"]
        self.slot_bytes = in_pages(max(sizes, default=PAGE))
        self.slots = max(1, min(capacity_bytes // self.slot_bytes, len(sizes))) if sizes else 0   # none idle
        self.capacity = self.slots * self.slot_bytes
        self._arena = read_buffer(max(PAGE, self.slots * self.slot_bytes))
        self._buf = np.frombuffer(self._arena, dtype=np.uint8)
        self.base = self._buf
        self._free = list(range(self.slots))
        self.direct = direct
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            self._fd = os.open(wf.path, flags)
        except OSError as e:
            raise ExpertReadError(f"{wf.path}: cannot open for {'O_DIRECT ' if direct else ''}reads: {e.strerror}")
        # each read is one whole extent: the kernel's readahead would only pull in its neighbours
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _read_into(self, ent: _Entry) -> None:
        t0 = _thread_mark()
        try:
            self._read_and_check(ent)
        finally:
            self._count_cpu(t0)

    def _read_and_check(self, ent: _Entry) -> None:
        # O_DIRECT wants the length rounded up to the page; extents start page-aligned.
        length = -(-ent.nbytes // PAGE) * PAGE if self.direct else ent.nbytes
        length = min(length, self.wf.size - ent.offset) if not self.direct else length
        mv = memoryview(self._arena)[ent.slot * self.slot_bytes: ent.slot * self.slot_bytes + length]
        got = 0
        while got < ent.nbytes:
            n = os.preadv(self._fd, [mv[got:]], ent.offset + got)
            if n <= 0:
                raise ExpertReadError(f"{self.wf.path}: short read of expert {ent.key[0]}.{ent.key[1]} at byte "
                                      f"{ent.offset + got} (file truncated or changed since it was opened?)")
            got += n
        base = ent.slot * self.slot_bytes
        self._verify(ent.key, self._buf[base:base + ent.nbytes])
        ent.views = self._views(ent.key, self._buf[base:base + ent.nbytes], ent.offset, base)

    def _free_slot(self) -> int | None:
        """A free slot (under the lock), evicting an unpinned entry if need be; None when every slot is
        pinned or being read into."""
        if not self._free:
            self._make_room(self.capacity)      # evict one (capacity is full)
        return self._free.pop() if self._free else None

    def _take_slot(self, key) -> int:
        """A slot for a demand read: when every slot is pinned or being read into, wait for a read in
        flight to land (its entry can then be evicted)."""
        while True:
            with self._lock:
                slot = self._free_slot()
                if slot is not None:
                    return slot
                landing = next(iter(self._inflight.values()), None)
            if landing is None:
                raise ExpertReadError(f"{self.wf.path}: expert cache has no free slot for expert "
                                      f"{key[0]}.{key[1]} (raise --memory-budget)")
            landing.ready.wait()

    def _load(self, key):
        with self._lock:
            ent = self._inflight.get(key)
        if ent is not None:
            ent.ready.wait()
            if ent.error is None:
                return ent
        off, n = self.extent(key)
        self._note_read(key, off, n)
        ent = _Entry(key, off, n, slot=self._take_slot(key))
        try:
            self._read_into(ent)
        except OSError as e:
            with self._lock:
                self._free.append(ent.slot)
            if isinstance(e, ExpertReadError):
                raise
            raise ExpertReadError(f"{self.wf.path}: reading expert {key[0]}.{key[1]}: {e.strerror}") from None
        self.stats.bytes_read += n
        ent.ready.set()
        with self._lock:
            self._cache[key] = ent
            self.cached_bytes += in_pages(n)
        return ent

    def _in_page_cache(self, off: int, n: int) -> bool:
        return not self.direct and super()._in_page_cache(off, n)      # O_DIRECT reads bypass it

    def cache_slots(self) -> int:
        return self.slots

    def holds_together(self, n: int) -> bool:
        # Guesses may take slots while the layer's experts are fetched: room for both (a wrong guess's
        # read goes on after it is abandoned, and its slot counts until it lands). Without guesses
        # (none made, or stopped for the run and none in flight), n slots do under LRU: the layer's
        # experts are then the most recent entries, so no read of one of them evicts another (at a
        # quarter of the bench model's file, 6 slots for top-6: fused calls as the reads land instead
        # of three products per expert)
        if self.slots >= 2 * n:
            return True
        if self.slots < n or self.policy != "lru" or self._guessed:
            return False
        with self._lock:
            return not any(ent.guess for ent in self._inflight.values())

    def _needs_room(self, nbytes):
        return not self._free          # slots, not bytes, are the unit here

    def _start_prefetch(self, key, speculative=True):
        off, n = self.extent(key)
        with self._lock:
            # Reads ahead never hold more than all-but-one slot, nor evict a pinned expert: without a
            # slot to spare the read is left to the expert's use
            slot = (None if len(self._inflight) >= self.slots - 1 or (not self._free and len(self._cache) <= 1)
                    else self._free_slot())
            if slot is None:
                self._prefetched.discard(key)
                return
            ent = _Entry(key, off, n, slot=slot, ahead=True, guess=speculative)
            self._inflight[key] = ent
        self._note_read(key, off, n)
        self._count_prefetch(n, speculative)

        def work():
            try:
                self._read_into(ent)
            except BaseException as e:   # reported when the expert is needed
                ent.error = e
            # landing in one step under the lock: a get() between the entry entering the cache and its
            # ready flag had read the expert again into a second slot, the first one lost
            with self._lock:
                if ent.error is None:
                    self._cache[key] = ent
                    self.cached_bytes += in_pages(n)
                    self.stats.bytes_read += n
                else:
                    self._free.append(ent.slot)
                self._inflight.pop(key, None)
                ent.ready.set()
        self._pool.submit(work)

    def _release(self, ent):
        self._free.append(ent.slot)
        self._evicted_pages(ent.key, ent.offset, ent.nbytes)

    def retire(self):
        super().retire()
        # the pool's pages go back now: whoever still holds this pager (the run's telemetry) keeps
        # its arena mapped, and a successor's memory is inside the same budget
        if hasattr(mmap, "MADV_DONTNEED"):
            self._arena.madvise(mmap.MADV_DONTNEED)

    def close(self):
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


IO_MODES = ("auto", "mmap", "pread")


def make_pager(mode: str, wf: WeightFile, capacity_bytes: int, policy: str = "lru", direct: bool = False,
               page_cache: str = "auto"):
    """The pager for --io `mode`. `auto`: the mmap pager, which asks for O_DIRECT reads instead
    (wants_direct, carried out by successor) once evicted experts' pages are to be dropped from the
    page cache; with --page-cache drop, O_DIRECT reads from the start. Either way, O_DIRECT reads are
    then timed against reads through the mapping (IoTrial)."""
    if mode == "auto":
        if page_cache == "drop":
            try:
                pager = PreadPager(wf, capacity_bytes, policy, direct=True, page_cache=page_cache)
            except ExpertReadError as e:    # no O_DIRECT on this filesystem: mapped pages, dropped
                pager = MmapPager(wf, capacity_bytes, policy, page_cache=page_cache)
                pager.page_cache_policy += f"; O_DIRECT reads unavailable ({str(e).rsplit(': ', 1)[-1]})"
                return pager
            pager.io_trial = IoTrial()
            return pager
        pager = MmapPager(wf, capacity_bytes, policy, page_cache=page_cache)
        pager.direct_on_drop = True
        return pager
    if mode == "mmap":
        return MmapPager(wf, capacity_bytes, policy, page_cache=page_cache)
    if mode == "pread":
        return PreadPager(wf, capacity_bytes, policy, direct=direct, page_cache=page_cache)
    raise ValueError(f"unknown --io mode {mode!r} ({', '.join(IO_MODES)})")


def wants_successor(p: ExpertPager) -> bool:
    """Whether `p` asks to be handed over (to O_DIRECT reads, or as its IoTrial says) before the next step."""
    return p.wants_direct or (p.io_trial is not None and p.io_trial.direct != (p.mode == "pread"))


def successor(old: ExpertPager) -> ExpertPager:
    """The pager to take over from `old` when wants_successor(old): O_DIRECT reads into a pool (for an
    mmap pager whose page-cache policy came to dropping evicted experts, or an IoTrial's O_DIRECT
    window), or reads through the mapping with evicted experts' pages dropped (an IoTrial's mapped
    window or verdict). The same budget, cache policy, counters (the same PagerStats object, so whoever
    holds `old` keeps counting), verified experts and trial. `old` gives back every expert it holds,
    mappings, pool and page cache alike, before the new one fills. Where O_DIRECT cannot be had, `old`
    stays (its policy says why) and is returned."""
    trial = old.io_trial
    first = old.wants_direct                # the first hand-over to O_DIRECT reads starts the trial
    old.wants_direct = old.direct_on_drop = False
    if trial is not None and not trial.direct:
        trial.direct_policy = trial.direct_policy or old.page_cache_policy
        if trial.keep_mapped:
            new = MmapPager(old.wf, old.capacity, old.policy, page_cache="keep")
            new.page_cache_policy = trial.keep_policy
        else:
            new = MmapPager(old.wf, old.capacity, old.policy, page_cache="drop")
            new.page_cache_policy = ("drop evicted experts" if trial.direct_policy.startswith("not used")
                                     else trial.direct_policy)
    else:
        try:
            new = PreadPager(old.wf, old.capacity, old.policy, direct=True, page_cache="drop")
        except ExpertReadError as e:
            old.page_cache_policy += f"; O_DIRECT reads unavailable ({str(e).rsplit(': ', 1)[-1]})"
            old.io_trial = None
            return old
        if first and old.keep_trial:
            new.page_cache_policy = "not used (O_DIRECT reads)"
            trial = IoTrial(keep_mapped=True, keep_policy=old.page_cache_policy)
        else:
            new.page_cache_policy = (f"{old.page_cache_policy}; then O_DIRECT reads, which leave nothing to drop"
                                     if first else trial.direct_policy or old.page_cache_policy)
            if first:
                trial = IoTrial()
    new.stats, new._verified, new._freq, new.watch_reads = old.stats, old._verified, old._freq, old.watch_reads
    new._guessed, new.io_trial, new.guess_trial = old._guessed, trial, old.guess_trial
    # whoever still holds `old` (the run's telemetry holds the first pager) passes the steps on to the trial
    old.io_trial = trial
    old.retire()
    return new
