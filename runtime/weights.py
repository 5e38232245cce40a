"""The runtime's view of a weight file: the memory map, the resident set (touched once at start and
kept), the embedding table (rows gathered on demand, then released) and routed experts (fetched
through the expert pager only when a token is routed to them)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kimistream.formats.checksum import extent_digest
from kimistream.formats.codecs import get_codec, is_float_codec
from kimistream.formats.ggufcodecs import is_gguf_codec
from kimistream.formats.constants import EXTENT_EMBEDDING, EXTENT_EXPERT, EXTENT_RESIDENT
from kimistream.formats.layout import EXPERT_PROJS, expert_tensor
from kimistream.formats.memplan import DECODED_SUFFIXES
from kimistream.formats.weightfile import WeightFile, WeightFileError, check_model

from .pager import ExpertPager, GuessTrial, make_pager, successor, wants_successor

PAGE = mmap.PAGESIZE
UNBOUNDED = 1 << 62
PREFETCH_MODES = ("auto", "off", "next-layer")
# --prefetch auto: guess the next layer's experts only while it pays. When the cache cannot keep a
# whole token's experts, every token reads them all again and the disk is the bottleneck: a guess then
# evicts an expert about to be used, and each wrong guess spends the disk's bandwidth (measured under
# a memory cap on a 0.8 GB file, 64 experts top-6 over 11 MoE layers: 12 experts cached, next-layer
# 2.7-3.1 tok/s against 4.6-5.2 without; 43 cached, 12.3 against 15.2-17.6 at 67 % recall). So guesses
# are tried only when the cache holds a token's experts of every MoE layer plus one guessed set, and
# stop if most of them turn out wrong. They also pause while every read finds its expert in the page
# cache (a warm file): a read ahead then saves nothing, and guessing (the next router, the reads on a
# helper thread) costs ~10 % of a warm decode step (measured on the 2.4 B bench model, two threads:
# 49.5-49.8 tok/s guessing, 55.2-56.1 without); the first read from disk resumes them.
GUESS_TRIAL = 256           # routed experts scored before the recall is judged
GUESS_MIN_RECALL = 0.5      # below this share of guessed experts used, guessing stops for the run
GUESS_IDLE_READS = 64       # reads in a row served by the page cache that pause guessing
# The embedding table's pages go back after this many rows read (a row touches a page or so in each of
# its codec's planes: at most ~300 KiB held between releases)
EMBED_RELEASE_ROWS = 16



@dataclass
class Weight:
    """A 2-D weight in some codec; `dense()` gives float32 [out, in] (a zero-copy view for f32)."""
    name: str
    codec: str
    shape: tuple
    raw: np.ndarray
    offset: int = -1                # byte offset of `raw` in the expert provider's buffer, if it lies there
    _dense: np.ndarray | None = None
    _kernel: object = None          # kernels.Linear, made at the first product
    _with_up: object = None         # an expert's gate: (up, kernels.Stacked of both), see DenseMLP

    def dense(self) -> np.ndarray:
        if self._dense is not None:
            return self._dense
        if has_fused_kernel(self.codec) or is_gguf_codec(self.codec):
            from . import kernels            # the C decoder: same values, far faster
            return kernels.dequantize(self.codec, self.raw, self.shape)
        return get_codec(self.codec).decode(self.raw, self.shape)

    def keep_dense(self) -> int:
        """Decode once and keep, for float codecs without a fused kernel (f32 is a view, costing
        nothing); block codecs stay packed. Returns the extra bytes held."""
        if self.codec == "f32":
            self._dense = self.dense()
            return 0
        if has_fused_kernel(self.codec) or is_gguf_codec(self.codec):    # multiplied from their packed bytes
            return 0
        self._dense = np.ascontiguousarray(self.dense())
        return self._dense.nbytes

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x @ W.T: BLAS on float weights, a fused kernel on packed low-bit ones."""
        if self._kernel is not None:
            return self._kernel(x)
        if self._dense is not None:
            return x @ self._dense.T
        if has_fused_kernel(self.codec) or is_gguf_codec(self.codec):
            from . import kernels        # imported only when a file has block codecs
            self._kernel = kernels.Linear(self.codec, self.raw, self.shape)
            return self._kernel(x)
        return x @ self.dense().T


def has_fused_kernel(codec: str) -> bool:
    """A codec of this project's block kernels (the MoE call, kv_b's head products); llama.cpp's
    blocks have their own products (kernels.Linear), not these."""
    return not is_float_codec(codec) and not is_gguf_codec(codec)


class ExpertProvider:
    """What the model asks of whoever holds the routed experts (ModelWeights, over the pager). The
    model says which experts a layer routed to and takes their weights; reading, caching, fetching
    ahead and guessing the next layer are the provider's decisions."""
    wants_guesses: bool = False         # take guesses of the next layer's experts (speculative reads)
    buffer: np.ndarray | None = None    # the buffer every expert tensor lies in (fused kernel calls)
    # once `held` has given an expert's offsets in `buffer`, they and its bytes stay there for the run
    # (a mapping of the whole file that never evicts): the model may then use them before asking again
    offsets_stay: bool = False

    def step_begins(self) -> None:
        """A model step (a prefill chunk or a decoded token) begins: no expert's weights are in use,
        and the only point where `buffer` may change."""

    def routed(self, layer: int, experts) -> None:
        """`layer` routed to `experts` (unique ids): score any guess, start reading them (all of them
        when they can be held together, else the first few, and `stream` reads on)."""

    def guess(self, layer: int, experts) -> None:
        """The model's guess of `layer`'s experts, before it gets there."""

    def together(self, layer: int, experts) -> dict | None:
        """{id: (gate, up, down)} for all of `experts` at once, or None when they cannot all be held
        at the same time (the model then takes them one by one with `get`)."""
        return None

    def held(self, layer: int, experts) -> list | None:
        """One token's routed `experts` (distinct ids, in routing order) when all are in memory now:
        their gate, up and down tensors' byte offsets in `buffer`, one (g, u, d) per expert, with
        everything `routed` and `together` would do done; None otherwise (the model then calls those)."""
        return None

    def uniform(self, layer: int) -> tuple | None:
        """((codec, shape) of gate and up, (codec, shape) of down) when every routed expert of `layer`
        has them, else None."""
        return None

    def landing(self, layer: int, experts):
        """together's experts as {id: (gate, up, down)} batches, each handed out as soon as its
        experts are in memory (the model computes one batch while the reads of the rest go on), or
        None when they cannot all be held at the same time."""
        experts = self.together(layer, experts)
        return None if experts is None else iter((experts,))

    def get(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        raise NotImplementedError

    def stream(self, layer: int, experts):
        """(id, (gate, up, down)) for each of `experts` in turn, when `together` could not hold them:
        each may be given back once the next is asked for."""
        for e in experts:
            yield int(e), self.get(layer, int(e))


class ModelWeights(ExpertProvider):
    def __init__(self, path, io: str = "mmap", cache_bytes: int = UNBOUNDED, policy: str = "lru",
                 direct: bool = False, prefetch: str = "off", page_cache: str = "auto"):
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"unknown --prefetch {prefetch!r} ({', '.join(PREFETCH_MODES)})")
        self.prefetch = prefetch
        self.file = path if isinstance(path, WeightFile) else WeightFile(path)     # (an open one is taken over)
        self.header = self.file.header
        try:
            self.config = check_model(self.file)
        except WeightFileError:
            self.file.close()
            raise
        self.experts_touched: set[tuple[int, int]] = set()
        self._expert_weights: dict = {}     # (layer, e) -> (the pager's views, their Weights)
        self.expert_bytes_touched = 0
        self.resident_bytes = 0
        self.decoded_bytes = 0
        self._embedded = 0                  # embedding rows read since the table's pages were given back
        self._guess_trial_seen = False      # the verdict of the pager's GuessTrial taken (_judge_guesses)
        self._advise_experts_random()
        self.pager: ExpertPager = make_pager(io, self.file, cache_bytes, policy, direct, page_cache)
        self.buffer = self.pager.base
        self.offsets_stay = self._offsets_stay()
        self.io = io
        self.wants_guesses, self.prefetch_policy = self._prefetch_policy(cache_bytes)
        self.pager.watch_reads = self.prefetch == "auto" and self.wants_guesses
        if self.prefetch == "auto" and self.wants_guesses and not self._holds_all(cache_bytes):
            self.pager.guess_trial = GuessTrial()       # guessing timed against not (see pager.GuessTrial)

    def _offsets_stay(self) -> bool:
        return self.pager.mode == "mmap" and self.pager.capacity >= sum(e.nbytes for e in self._extents(EXTENT_EXPERT))

    def _prefetch_policy(self, cache_bytes: int) -> tuple[bool, str]:
        """(guess the next layer's experts, the decision in words) for --prefetch."""
        if self.prefetch != "auto":
            return self.prefetch == "next-layer", self.prefetch
        # Guesses always, judged as they go (_judge_guesses); where a wrong guess can evict an expert
        # (a cache short of the file) they are first timed against none (pager.GuessTrial, which says
        # what was measured), and the faster stays.
        per = self.expert_extent_bytes
        cached, total = (cache_bytes // per if per else 0), len(self._extents(EXTENT_EXPERT))
        k = self.config.num_experts_per_tok or 0
        if per and cached < min(2 * k, total):
            # (the planner leaves auto this room where the budget allows it)
            return False, (f"off: the cache holds {cached} experts, too few for a layer's {k} and as many "
                           f"guesses (auto)")
        held = "all experts" if self._holds_all(cache_bytes) else f"{cached} of {total} experts"
        timed = "" if self._holds_all(cache_bytes) else "timed against no guesses in the first decode steps, "
        return True, (f"next-layer: the cache holds {held} (auto; {timed}pauses while reads come from the page "
                      f"cache, stops if fewer than {GUESS_MIN_RECALL:.0%} of guesses are used)")

    def _holds_all(self, cache_bytes: int) -> bool:
        """Whether a cache of `cache_bytes` holds every expert of the file (no guess can evict one)."""
        per = self.expert_extent_bytes
        return not per or cache_bytes // per >= len(self._extents(EXTENT_EXPERT))

    def _extents(self, kind):
        return [e for e in self.file.extents if e.kind == kind]

    @property
    def expert_extent_bytes(self) -> int:
        return max((e.nbytes for e in self._extents(EXTENT_EXPERT)), default=0)

    @property
    def resident_extent_bytes(self) -> int:
        return sum(e.nbytes for e in self._extents(EXTENT_RESIDENT))

    def _advise_experts_random(self) -> None:
        # Default readahead pulls far more than a fault needs in a randomly-accessed expert region;
        # MADV_RANDOM limits each fault to its page (docs/DESIGN.md, "The runtime").
        exps = self._extents(EXTENT_EXPERT)
        if exps and hasattr(mmap, "MADV_RANDOM"):
            lo = min(e.offset for e in exps) // PAGE * PAGE
            hi = max(e.offset + e.nbytes for e in exps)
            self.file.mm.madvise(mmap.MADV_RANDOM, lo, hi - lo)

    def load_resident(self) -> int:
        """Fault in every resident extent (WILLNEED, then read it all) and check each against its
        checksum on the way: a corrupted file stops here, before any of its bytes are used."""
        total = 0
        for ext in self._extents(EXTENT_RESIDENT):
            if not ext.nbytes:
                continue
            if hasattr(mmap, "MADV_WILLNEED"):
                self.file.mm.madvise(mmap.MADV_WILLNEED, ext.offset // PAGE * PAGE, ext.nbytes + ext.offset % PAGE)
            if extent_digest(self.file.extent_bytes(ext)) != ext.checksum:
                raise WeightFileError(f"{self.file.path}: extent {ext.name} fails its checksum (the file is "
                                      f"corrupted; kimi-verify {self.file.path} checks all of it)")
            total += ext.nbytes
        self.resident_bytes = total
        return total

    def weight(self, name: str) -> Weight:
        t = self.file.tensors[name]
        return Weight(name, t.codec, t.shape, self.file.raw(name))

    def resident(self, name: str) -> Weight:
        """A weight used at every token: float-stored ones named in DECODED_SUFFIXES (and lm_head) are
        decoded once and kept, counted in `decoded_bytes`; block codecs stay packed."""
        w = self.weight(name)
        if name.endswith(DECODED_SUFFIXES) or name in ("lm_head.weight", "model.embed_tokens.weight"):
            self.decoded_bytes += w.keep_dense()
        return w

    def vector(self, name: str) -> np.ndarray:
        return self.file.decode(name).astype(np.float32, copy=False)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def embed_rows(self, ids) -> np.ndarray:
        t = self.file.tensors["model.embed_tokens.weight"]
        if has_fused_kernel(t.codec):
            from . import kernels            # the C decoder, row by row: no Python pass over the table
            rows = kernels.dequantize_rows(t.codec, self.file.raw(t.name), t.shape, ids)
        else:
            rows = np.array(get_codec(t.codec).decode_rows(self.file.raw(t.name), t.shape, ids), dtype=np.float32)
        ext = self.file.extents[t.extent]
        self._embedded += len(rows)
        if ext.kind == EXTENT_EMBEDDING and hasattr(mmap, "MADV_DONTNEED") and self._embedded >= EMBED_RELEASE_ROWS:
            # Rows were copied out: give the table's pages back so RSS does not grow with the vocabulary
            # seen. Not at every decode step: with the kernels' threads about, each release interrupts
            # the other cores to flush their TLBs (about 60 us a token measured on two threads)
            self.file.mm.madvise(mmap.MADV_DONTNEED, ext.offset, -(-ext.nbytes // PAGE) * PAGE)
            self._embedded = 0
        return rows

    @property
    def io_policy(self) -> str:
        """How experts are read, in words (the run summary's)."""
        p = self.pager
        how = "O_DIRECT pread" if getattr(p, "direct", False) else p.mode
        if self.io != "auto":
            return how
        if p.io_trial is not None:
            kept = "kept" if p.io_trial.keep_mapped else "dropped"
            return f"auto: {how}{'' if p.mode == 'pread' else f', evicted experts {kept}'} ({p.io_trial.note})"
        if p.direct_on_drop:
            return f"auto: {how} (O_DIRECT reads if evicted experts' pages are to be dropped)"
        return f"auto: {how}" + ("" if how == "mmap" else " (evicted experts' pages are not kept)")

    # ---- the expert provider, over the pager
    def step_begins(self) -> None:
        """--io auto: when the pager has asked for O_DIRECT reads, or its trial of O_DIRECT against the
        mapping for the other way, hand over to a pager that reads so here, between model steps, where
        no expert's views are in use (the new pool or the mapping becomes the experts' buffer)."""
        if wants_successor(self.pager):
            self.pager = successor(self.pager)
            self.buffer = self.pager.base
            self.offsets_stay = self._offsets_stay()
            self._expert_weights.clear()

    def routed(self, layer: int, experts) -> None:
        p = self.pager
        p.note_routed(layer, experts)
        together = p.holds_together(len(experts))
        if together:            # no read for the next layer's guess evicts one of these before its use
            p.pin(layer, experts)
        # more than the cache holds (a prompt window's): only as many ahead as stream keeps ahead, as
        # reads started for all of them would evict the first before their use
        p.fetch_ahead(layer, experts if together else experts[:p.read_ahead_depth()])
        if p.watch_reads:
            self._judge_guesses()

    def stream(self, layer: int, experts):
        p = self.pager
        depth = p.read_ahead_depth()
        for j, e in enumerate(experts):
            if depth:
                p.fetch_ahead(layer, experts[j + 1:j + 1 + depth])
            yield int(e), self.expert(layer, int(e))

    def _judge_guesses(self) -> None:
        """--prefetch auto: guess or not as the timing of the two says while it runs, and stop for the
        run if not guessing was faster; stop guessing for the run when most guesses were wrong; pause
        while the page cache serves every read, resume at the first read it does not."""
        p, st = self.pager, self.pager.stats
        trial = p.guess_trial
        if trial is not None and (trial.running or not self._guess_trial_seen):
            if trial.running:
                # none while the mapping's trial runs: a pool's guesses would slow its O_DIRECT windows
                # where a mapping with no room for them makes none
                io = p.io_trial
                self.wants_guesses = trial.guess and (io is None or not io.running)
                return
            self._guess_trial_seen = True
            if not trial.guess:
                self.wants_guesses = p.watch_reads = False
                p.stop_guessing()
                self.prefetch_policy = f"off (auto: {trial.note})"
                return
            self.wants_guesses = True
            self.prefetch_policy = (f"next-layer (auto: {trial.note}; pauses while reads come from the page "
                                    f"cache, stops if fewer than {GUESS_MIN_RECALL:.0%} of guesses are used)")
        if self.wants_guesses and st.routed_checked >= GUESS_TRIAL and st.recall < GUESS_MIN_RECALL:
            self.wants_guesses = p.watch_reads = False
            p.stop_guessing()
            self.prefetch_policy = (f"stopped: {st.recall:.0%} of {st.routed_checked} guessed experts used "
                                    f"(auto; pays from {GUESS_MIN_RECALL:.0%})")
        elif self.wants_guesses and p.cached_reads >= GUESS_IDLE_READS:
            self.wants_guesses = False
            self.prefetch_policy = (f"paused: {p.cached_reads} reads in a row found their experts in the page "
                                    f"cache (auto; resumes at a read from disk)")
        elif not self.wants_guesses and p.cached_reads == 0:
            self.wants_guesses = True
            self.prefetch_policy = "next-layer: resumed at a read from disk (auto)"

    def guess(self, layer: int, experts) -> None:
        self.pager.prefetch(layer, experts)

    def held(self, layer: int, experts) -> list | None:
        ids = experts.tolist()
        p = self.pager
        p.note_routed(layer, ids)
        ents = p.held(layer, ids)
        if ents is None:
            return None
        if p.watch_reads:
            self._judge_guesses()
        offs = []
        for ent in ents:
            if not ent.offsets:              # the entry's first use since it was read
                self._touched(ent.key, ent.views)
                ent.offsets = tuple(v[4] for v in ent.views)
            offs.append(ent.offsets)
        return offs

    def uniform(self, layer: int) -> tuple | None:
        tensors = self.file.tensors
        try:
            specs = {tuple((t.codec, tuple(t.shape)) for t in (tensors[expert_tensor(layer, e, proj)] for proj in EXPERT_PROJS))
                     for e in range(self.config.n_routed_experts)}
        except KeyError:
            return None
        if len(specs) != 1:
            return None
        gate, up, down = specs.pop()
        return (gate, down) if gate == up else None

    def together(self, layer: int, experts) -> dict | None:
        if not self.pager.holds_together(len(experts)):
            return None
        ids = experts.tolist() if isinstance(experts, np.ndarray) else [int(e) for e in experts]
        return {e: self._weights(layer, e, views) for e, views in zip(ids, self.pager.get_many(layer, ids))}

    def landing(self, layer: int, experts):
        """together's experts as {e: weights} batches in the order their reads land (pager.as_they_land),
        or None when they cannot all be held."""
        if not self.pager.holds_together(len(experts)):
            return None
        return ({e: self._weights(layer, e, views) for e, views in batch}
                for batch in self.pager.as_they_land(layer, experts))

    def get(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        return self.expert(layer, e)

    def expert(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        return self._weights(layer, e, self.pager.get(layer, e))

    def _weights(self, layer: int, e: int, views) -> tuple[Weight, Weight, Weight]:
        """The Weights over an expert's views from the pager, made again only when they changed (read
        again since)."""
        key = (layer, e)
        made = self._expert_weights.get(key)
        if made is not None and made[0] is views:
            return made[1]
        self._touched(key, views)
        made = self._expert_weights[key] = (views, tuple(Weight(*v) for v in views))
        return made[1]

    def _touched(self, key, views) -> None:
        if key not in self.experts_touched:
            self.experts_touched.add(key)
            self.expert_bytes_touched += sum(v[3].nbytes for v in views)

    def close(self):
        self.pager.close()
        self.file.close()
