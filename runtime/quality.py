"""Measuring a model on text: perplexity in windows of --max-context, KL divergence and top-1
agreement against a reference weight file on the same windows, and collecting an importance matrix
(per-input-channel mean squared activation of every weight) for calibration-aware quantization."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kimistream.formats.imatrix import (DEFAULT_MOMENT_BUDGET, moment_key, moment_plan, records_moment,
                                        save_imatrix)
from kimistream.formats.layout import model_shapes

from . import kernels
from .generate import generate
from .model import DenseMLP, MoE, Model, linear, rms_norm
from .sampler import Sampler
from .weights import ExpertProvider


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def windows(ids: list[int], size: int):
    """Non-overlapping windows of `size` tokens (the last may be shorter; a 1-token tail is dropped)."""
    if size < 2:            # every window would be dropped, and the text called too short
        raise ValueError(f"--max-context {size}: windows of text need at least 2 tokens")
    for s in range(0, len(ids), size):
        w = ids[s:s + size]
        if len(w) >= 2:
            yield w


@dataclass
class QualityReport:
    tokens: int
    windows: int
    perplexity: float
    nll: float
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None
    reference_perplexity: float | None = None

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def evaluate(model: Model, ids: list[int], window: int, batch: int, reference: Model | None = None,
             progress=None) -> QualityReport:
    """Perplexity (and KL against `reference`) over `windows(ids, window)`, each from an empty cache.
    Every window is scored a chunk of `batch` tokens at a time, as the memory plan sized the logits:
    a whole window's logits (and their float64 copies) would take window x vocab x 8 bytes several
    times over. `progress(n)` after each chunk."""
    t = _Tally(reference is not None)
    for w in windows(ids, window):
        model.reset()
        if reference is not None:
            reference.reset()
        for s in range(0, len(w), batch):
            part = w[s:s + batch]
            targets = np.asarray(w[s + 1:s + batch + 1])          # the window's last token predicts nothing
            logits = model.prefill(part, batch, all_logits=True)
            ref = reference.prefill(part, batch, all_logits=True) if reference is not None else None
            t.add(logits[:len(targets)], targets, ref[:len(targets)] if ref is not None else None)
            if progress:
                progress(len(part))
        t.windows += 1
    if t.n == 0:
        raise ValueError("the text is too short: need at least 2 tokens")
    return t.report()


class _Tally:
    """Sums over the scored tokens: negative log-likelihoods, KL and top-1 agreement."""

    ROWS = 64             # logits turned into float64 log-probabilities this many rows at a time

    def __init__(self, with_reference: bool):
        self.nll = self.ref_nll = 0.0
        self.n = self.agree = self.windows = 0
        self.kls = [] if with_reference else None

    def add(self, logits, targets, ref_logits=None) -> None:
        for a in range(0, len(targets), self.ROWS):
            t = targets[a:a + self.ROWS]
            rows = np.arange(len(t))
            lp = log_softmax(logits[a:a + self.ROWS])
            self.nll -= lp[rows, t].sum()
            self.n += len(t)
            if ref_logits is not None:
                rlp = log_softmax(ref_logits[a:a + self.ROWS])
                self.ref_nll -= rlp[rows, t].sum()
                self.kls.append((np.exp(rlp) * (rlp - lp)).sum(axis=-1))
                self.agree += int((rlp.argmax(-1) == lp.argmax(-1)).sum())

    def report(self) -> QualityReport:
        n = self.n
        rep = QualityReport(tokens=n, windows=self.windows, perplexity=float(np.exp(self.nll / n)),
                            nll=float(self.nll / n))
        if self.kls is not None:
            kl = np.concatenate(self.kls)
            rep.kl_mean = float(kl.mean())
            rep.kl_p99 = float(np.percentile(kl, 99))
            rep.top1_agreement = self.agree / n
            rep.reference_perplexity = float(np.exp(self.ref_nll / n))
        return rep


# ----------------------------------------------------------------------------- importance matrix

class ImportanceCollector:
    """Sum of squared inputs per input channel and token counts for every weight that runs, and the
    full sum of x xᵀ for the moment keys chosen in advance (formats.imatrix.moment_plan)."""

    def __init__(self, moment_keys=frozenset()):
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.moment_keys = set(moment_keys)
        self.moments: dict[str, np.ndarray] = {}
        self.moment_counts: dict[str, int] = {}
        self._normalised = False
        self.tokens = 0

    def __call__(self, name: str, x: np.ndarray) -> None:
        x = x.reshape(-1, x.shape[-1])
        x64 = x.astype(np.float64)
        _accumulate(self.sums, self.counts, name, (x64 * x64).sum(axis=0), x.shape[0])
        key = moment_key(name)
        if key in self.moment_keys and x.shape[0] and records_moment(name):
            # float32 products and sums: half the memory and time of float64, and ~1e-5 relative
            # error after thousands of batches is far below the 1 % damping the quantizer adds
            x32 = np.ascontiguousarray(x, dtype=np.float32)
            _accumulate(self.moments, self.moment_counts, key, x32.T @ x32, x.shape[0])

    def save(self, path, config: dict) -> None:
        if not self._normalised:                  # in place: the accumulators can be gigabytes
            for k, m in self.moments.items():
                m /= self.moment_counts[k]
            self._normalised = True
        seen = [n for n in self.sums if self.counts[n]]     # an input of no rows measured nothing (0 / 0)
        save_imatrix(path, {n: self.sums[n] / self.counts[n] for n in seen}, config, self.tokens,
                     {n: self.counts[n] for n in seen}, self.moments, self.moment_counts)


def _accumulate(sums: dict, counts: dict, key: str, value: np.ndarray, n: int) -> None:
    if key in sums:
        sums[key] += value
        counts[key] += n
    else:
        sums[key] = value
        counts[key] = n


def collect_importance(model: Model, chunks, batch: int, progress=None,
                       moment_budget: int = DEFAULT_MOMENT_BUDGET) -> ImportanceCollector:
    """Importance over token windows, each run from an empty cache (see `windows`)."""
    col = ImportanceCollector(moment_plan(model_shapes(model.cfg), moment_budget))
    with observing(model, col):
        for w in chunks:
            model.reset()
            model.prefill(w, batch, all_logits=False)
            col.tokens += len(w)
            if progress:
                progress(len(w))
    return col


def collect_importance_by_layer(model: Model, chunks, batch: int, progress=None,
                                moment_budget: int = DEFAULT_MOMENT_BUDGET, state_ram: int | None = None,
                                state_dir=None) -> ImportanceCollector:
    """The importance `collect_importance` measures, layer-major, for a model whose experts do not fit
    in memory: every window goes through one layer before any goes through the next, and a MoE layer
    routes every token first, then runs each routed expert once on all the tokens routed to it, so a
    pass reads each expert once (token-major, a cache smaller than the experts reads them again for
    every prompt chunk). The residual stream of every token is kept between layers: in RAM when two
    copies fit `state_ram` bytes (default: always), else in files under `state_dir` (deleted after).
    Attention runs window by window in the same chunks of `batch` tokens as the token-major pass, and
    lm_head sees the same rows (each chunk's last), so the sums and second moments equal that pass's
    to float rounding. `progress(n)` counts tokens x layers."""
    chunks = [np.asarray(w) for w in chunks]
    cut = np.cumsum([0] + [len(w) for w in chunks])
    n, H = int(cut[-1]), model.cfg.hidden_size
    col = ImportanceCollector(moment_plan(model_shapes(model.cfg), moment_budget))
    st = _States(n, H, state_ram, state_dir)
    try:
        with observing(model, col):
            _by_layer(model, chunks, cut, batch, st, progress)
    finally:
        st.close()
    col.tokens = n
    return col


def _by_layer(model: Model, chunks, cut, batch: int, st, progress) -> None:
    kernels.set_decoding(False)      # several tokens per call, as Model.forward would set
    x, h, n = st.x, st.h, int(cut[-1])
    ids = np.concatenate(chunks)
    for a in range(0, n, batch):
        x[a:a + batch] = model.embed(ids[a:a + batch])
        st.release()
    for layer in model.layers:
        for k in range(len(chunks)):
            model.reset()
            for s in range(cut[k], cut[k + 1], batch):
                e = min(s + batch, cut[k + 1])
                h[s:e] = x[s:e] + layer.attn.forward(rms_norm(x[s:e], layer.ln1, layer.eps), int(s - cut[k]),
                                                     model.cache, model.rope)
                st.release()
        _mlp_by_expert(layer, st, batch) if isinstance(layer.mlp, MoE) else _mlp_by_slice(layer, st, batch)
        if progress:
            progress(n)
    model.reset()
    last = [min(s + batch, cut[k + 1]) - 1 for k in range(len(chunks)) for s in range(cut[k], cut[k + 1], batch)]
    for a in range(0, len(last), batch):          # a chunk's worth of logits at a time, as planned
        linear(rms_norm(np.asarray(x[last[a:a + batch]]), model.final_norm, model.cfg.rms_norm_eps), model.lm_head)


class _States:
    """The residual stream x and the stream after attention h, [n, H] float32 each: in RAM, or in two
    files (deleted after) mapped shared, whose pages `release()` drops from this process's memory
    (the data stays in the files: the pass touches every row once per layer, and mapped pages would
    otherwise stay resident)."""

    def __init__(self, n: int, H: int, ram: int | None, directory):
        self._maps, self._tmp = [], None
        if ram is None or 2 * 4 * n * H <= ram:
            self.x, self.h = np.empty((n, H), np.float32), np.empty((n, H), np.float32)
            return
        import mmap
        import tempfile
        self._tmp = tempfile.TemporaryDirectory(prefix="kimi-calibration-", dir=directory)
        arrays = []
        for name in ("x", "h"):
            with open(f"{self._tmp.name}/{name}", "w+b") as f:
                f.truncate(max(1, 4 * n * H))
                self._maps.append(mmap.mmap(f.fileno(), max(1, 4 * n * H)))
            arrays.append(np.frombuffer(self._maps[-1], np.float32, n * H).reshape(n, H))
        self.x, self.h = arrays

    def release(self) -> None:
        import mmap
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.x = self.h = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:           # an exception's traceback still holds a view: the GC closes it
                pass
        if self._tmp is not None:
            self._tmp.cleanup()


def _mlp_by_slice(layer, st, S: int) -> None:
    """x = h + mlp(norm(h)) for a dense layer, S tokens at a time (the prompt chunk the memory plan
    sized activations for)."""
    x, h = st.x, st.h
    for a in range(0, len(x), S):
        hs = np.array(h[a:a + S])
        x[a:a + S] = hs + layer.mlp.forward(rms_norm(hs, layer.ln2, layer.eps))
        st.release()


def _mlp_by_expert(layer, st, S: int) -> None:
    """x = h + moe(norm(h)) for every token: routing (and the shared expert) S tokens at a time, then
    each routed expert once, on all its tokens, S at a time (MoE.forward's grouped path, over the
    whole pass; S is the prompt chunk the memory plan sized activations for)."""
    x, h = st.x, st.h
    mlp, n = layer.mlp, len(x)
    idx = np.empty((n, mlp.cfg.num_experts_per_tok), np.int64)
    wts = np.empty(idx.shape, np.float32)
    for a in range(0, n, S):
        hs = np.array(h[a:a + S])
        hn = rms_norm(hs, layer.ln2, layer.eps)
        idx[a:a + S], wts[a:a + S] = mlp.route(hn)
        x[a:a + S] = hs + (mlp.shared.forward(hn) if mlp.shared is not None else 0)
        st.release()
    used = np.unique(idx)
    mlp.experts.routed(layer.index, used)
    for e in used:
        tok, slot = np.nonzero(idx == e)
        expert = DenseMLP(*mlp.experts.get(layer.index, int(e)))
        for a in range(0, len(tok), S):
            t, sl = tok[a:a + S], slot[a:a + S]
            y = expert.forward(rms_norm(h[t], layer.ln2, layer.eps)) * wts[t, sl][:, None]
            x[t] = x[t] + y
            st.release()


class _Observed:
    """A weight whose inputs `observer(tensor name, x)` sees before its product is computed."""

    def __init__(self, weight, observer):
        self.weight, self.observer = weight, observer

    def __getattr__(self, name):
        return getattr(self.weight, name)

    def matmul_t(self, x):
        self.observer(self.weight.name, x)
        return self.weight.matmul_t(x)


class _ObservedExperts(ExpertProvider):
    """The experts, one at a time and observed (so never in the fused call, which hides their inputs)."""

    def __init__(self, inner: ExpertProvider, observer):
        self.inner, self.observer = inner, observer

    def routed(self, layer, experts):
        self.inner.routed(layer, experts)

    def get(self, layer, e):
        return tuple(_Observed(w, self.observer) for w in self.inner.get(layer, e))


@contextmanager
def observing(model: Model, observer):
    """While inside, every weight's input goes to `observer(tensor name, x)` (calibration), kv_b's
    being the KV latent. The model's modules are wrapped from the outside and restored after.
    Calibration measures the model, not a kernel's rounding of it: while observing, the integer
    kernels take 16-bit inputs (with int8 ones, the float-rounding differences between a token-major
    and a layer-major pass can move a value across an int8 step and flip a token's routing)."""
    undo = []
    rounding = kernels.activations()
    kernels.set_activations("int16")

    def wrap(obj, attr, value):
        undo.append((obj, attr, obj.__dict__.get(attr, _ABSENT)))
        setattr(obj, attr, value)

    for layer in model.layers:
        wrap(layer, "step", None)           # each product on its own, where it is observed
        attn = layer.attn
        for attr in ("q", "q_a", "q_b", "kv_a", "o"):
            if getattr(attn, attr) is not None:
                wrap(attn, attr, _Observed(getattr(attn, attr), observer))

        wrap(attn, "qkv_a", None)           # q_a and kv_a as two products, so both are observed
        wrap(attn, "mla", None)             # the latent taken through `compress`, where it is observed

        def compress(h, attn=attn, inner=attn.compress):
            latent, k_rot = inner(h)
            if attn.kv_b is not None:       # (a GGUF's kept k_b / v_b halves take other inputs; not calibrated)
                observer(attn.kv_b.name, latent)
            return latent, k_rot
        wrap(attn, "compress", compress)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            wrap(mlp, "experts", _ObservedExperts(mlp.experts, observer))
            wrap(mlp, "_step", None)        # no one-call step while observed (nor one worked out for them)
            mlp = mlp.shared
        for attr in ("gate", "up", "down") if mlp is not None else ():
            wrap(mlp, attr, _Observed(getattr(mlp, attr), observer))
    wrap(model, "lm_head", _Observed(model.lm_head, observer))
    try:
        yield model
    finally:
        kernels.set_activations(rounding)
        for obj, attr, old in reversed(undo):
            if old is _ABSENT:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_ABSENT = object()


def sample_sequences(model: Model, start: list[int], stop_ids, n_tokens: int, window: int, batch: int,
                     seed: int, progress=None, lanes: int = 1) -> list[list[int]]:
    """Calibration text for users without any: sequences the model samples itself at temperature 1
    from `start` (the BOS token), each up to `window` tokens or an end token, `n_tokens` in all.
    Up to `lanes` sequences are sampled side by side, one forward step for all of them (each lane
    draws from its own generator, lane 0 from `seed`); one lane samples exactly as `generate` does."""
    stop = set(stop_ids)
    samplers = [Sampler(1.0, 1.0, seed if i == 0 else [seed, i]) for i in range(max(1, lanes))]
    sequences, total = [], 0
    while total < n_tokens:
        # this round's sequences: lane i fills up to `window` of what is left after the lanes before it
        targets = []
        for i in range(len(samplers)):
            left = n_tokens - total - sum(targets)
            if left <= 0 or (targets and left <= len(start)):
                break
            targets.append(max(len(start) + 1, min(window, left)))
        if progress:            # the start tokens count toward n_tokens too, as in the sequences' lengths
            progress(len(start) * len(targets))
        if len(targets) == 1:
            model.reset()
            seq = list(start)
            for t in generate(model, start, targets[0] - len(start), samplers[0], batch, stop):
                seq.append(t)
                if progress:
                    progress(1)
            sequences.append(seq[:window])
        else:
            sequences += _sample_lanes(model, start, stop, targets, samplers, progress)
        total += sum(len(s) for s in sequences[-len(targets):])
    return sequences


def _sample_lanes(model: Model, start, stop, targets, samplers, progress) -> list[list[int]]:
    """Sequences of the given lengths (or up to an end token), sampled side by side."""
    n = len(targets)
    seqs = [list(start) for _ in range(n)]
    with model.sequences(n) as m:
        logits = m.forward(np.tile(np.asarray(start), (n, 1)))             # [n, vocab]
        alive = [True] * n
        while True:
            toks = [samplers[i](logits[i]) for i in range(n)]
            for i in range(n):
                if alive[i]:
                    seqs[i].append(toks[i])
                    if progress:
                        progress(1)
                    alive[i] = toks[i] not in stop and len(seqs[i]) < targets[i]
            if not any(alive) or m.cache.length >= m.cache.max_context:
                break
            logits = m.forward(np.asarray(toks)[:, None])
    return seqs
