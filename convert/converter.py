"""The conversion pipeline: checkpoint directory -> precision plan -> one kimi-stream weight file.

Tensors are read, encoded and written one at a time in source-shard order, so memory stays bounded
by the largest tensor (on a Ray cluster, a few per worker, written in place as they finish). The output
is written to `OUT.partial` and renamed when complete."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from kimistream.formats import procfs
from kimistream.formats.checksum import sha256_file
from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.imatrix import ImatrixError
from kimistream.formats.constants import DEFAULT_ALIGNMENT, TENSOR_CLASSES
from kimistream.formats.layout import model_shapes, plan_extents, split_kv_b_names
from kimistream.formats.weightfile import ResumeRefused, WeightFileWriter

from kimistream.formats.presets import PrecisionPlan
from .encoder import clear_factor_cache, encode
from .source import INDEX_FILE, HFCheckpoint, SourceError, open_checkpoint

MANIFEST_NAME = "kimi-stream.sha256"   # written by a verified download; saves re-hashing sources


class ConversionError(ValueError):
    pass


@dataclass
class ClassStats:
    tensors: int = 0
    params: int = 0
    bytes: int = 0

    @property
    def bpw(self) -> float:
        return 8.0 * self.bytes / self.params if self.params else 0.0


@dataclass
class Summary:
    output: str = ""
    classes: dict = field(default_factory=lambda: {c: ClassStats() for c in TENSOR_CLASSES})
    skipped: list = field(default_factory=list)
    file_bytes: int = 0
    largest_tensor_bytes: int = 0       # the largest tensor as float32, what encoding one holds
    peak_rss_bytes: int = 0             # the process's VmHWM when the file was complete
    converted_params: int = 0           # parameters read, encoded and written in this run (not resumed)
    convert_seconds: float = 0.0        # the wall time those took

    def to_json(self) -> dict:
        total = ClassStats()
        classes = {}
        for c, s in self.classes.items():
            classes[c] = {"tensors": s.tensors, "params": s.params, "bytes": s.bytes, "bpw": round(s.bpw, 4)}
            total.tensors += s.tensors
            total.params += s.params
            total.bytes += s.bytes
        return {"output": self.output, "classes": classes,
                "total": {"tensors": total.tensors, "params": total.params, "bytes": total.bytes,
                          "bpw": round(total.bpw, 4), "file_bytes": self.file_bytes},
                "skipped_source_tensors": self.skipped,
                "memory": {"peak_rss_bytes": self.peak_rss_bytes, "largest_tensor_f32_bytes": self.largest_tensor_bytes},
                "throughput": {"params": self.converted_params, "seconds": round(self.convert_seconds, 3),
                               "params_per_s": round(self.converted_params / self.convert_seconds)
                               if self.convert_seconds > 0 else None}}


def _vm_hwm() -> int:
    # VmHWM, not getrusage's ru_maxrss, which keeps the parent's peak across fork+exec.
    return procfs.status().get("VmHWM", 0)


def _manifest(ckpt: HFCheckpoint) -> dict:
    known = {}
    manifest = ckpt.dir / MANIFEST_NAME
    if manifest.is_file():
        for line in manifest.read_text().splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and not line.startswith("#"):
                known[parts[1].lstrip("*").strip()] = parts[0]
    return known


_HASHED: dict[tuple, str] = {}      # (path, size, mtime): SHA-256, so one run hashes a file once


def _sha256_of(path: Path, known: dict, name: str) -> str:
    if name in known:
        return known[name]
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(path)
    return _HASHED[key]


def hash_sources(ckpt: HFCheckpoint, progress) -> None:
    """Hash the source files not hashed yet (nor listed in a verified download's manifest), with
    progress ("hashing", total_bytes=...), ("hashed", nbytes=...): a terabyte takes many minutes."""
    known = _manifest(ckpt)
    todo = []
    for name in ckpt.source_files():
        path = ckpt.dir / name
        if name in known or not path.is_file():
            continue
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _HASHED:
            todo.append((path, key))
    if not todo:
        return
    progress("hashing", total_bytes=sum(key[1] for _, key in todo))
    for path, key in todo:
        _HASHED[key] = sha256_file(path, on_bytes=lambda n, name=path.name: progress("hashed", nbytes=n, name=name))


def source_record(ckpt: HFCheckpoint) -> dict:
    """Size and SHA-256 of every source file the output was built from."""
    known = _manifest(ckpt)
    names = ckpt.source_files()
    return {"files": {n: {"size": (ckpt.dir / n).stat().st_size, "sha256": _sha256_of(ckpt.dir / n, known, n)}
                      for n in names}}


def check_output_apart(ckpt: HFCheckpoint, out, extra_inputs=()) -> None:
    """ConversionError unless the output and its .partial / .journal side files are none of the files
    the conversion reads (through symlinks and hard links too): `-o` must never overwrite a source."""
    out = Path(out)
    outputs = [out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.journal")]
    names = [INDEX_FILE, *ckpt.source_files()]
    inputs = [ckpt.dir / n for n in names if (ckpt.dir / n).exists()] + [Path(p) for p in extra_inputs]
    for o in outputs:
        for i in inputs:
            same = o.resolve() == i.resolve() or (o.exists() and i.exists() and o.samefile(i))
            if same:
                raise ConversionError(f"{out}: the output would overwrite the source file {i} (choose another -o)")
    if out.resolve() == ckpt.dir.resolve():
        raise ConversionError(f"{out}: the output is the source directory (choose another -o)")


def encode_tensor(ckpt: HFCheckpoint, name: str, codec: str, importance=None, moment=None):
    """Read one source tensor and encode it: (encoded bytes, float32 bytes it held while encoding).
    Every failure is a one-line ConversionError naming the file and the tensor."""
    try:
        exact = getattr(ckpt, "kept_bytes", lambda n, c: None)(name, codec)   # a GGUF's blocks, kept
        if exact is not None:
            if exact.size != get_codec(codec).nbytes(ckpt.shape(name)):
                raise ConversionError(f"{ckpt.dir / ckpt.location[name]}: tensor {name}: its blocks do not fill {codec}")
            return exact, 0
        values = ckpt.read(name)
        return encode(get_codec(codec), values, importance=importance, moment=moment), values.size * 4
    except SourceError as e:
        raise ConversionError(str(e)) from None
    except CodecError as e:
        raise ConversionError(f"{ckpt.dir / ckpt.location[name]}: tensor {name}: {e}") from None


def _encode_here(ckpt: HFCheckpoint, jobs):
    """The jobs (name, codec, importance, moment) encoded in order in this process (whose encoder uses
    every core): yields (name, encoded, float32 bytes held)."""
    for name, codec, importance, moment in jobs:
        encoded, held = encode_tensor(ckpt, name, codec, importance, moment)
        yield name, encoded, held


def convert_checkpoint(src, out, plan: PrecisionPlan, alignment: int = DEFAULT_ALIGNMENT,
                       progress=None, delete_source: bool = False, imatrix=None,
                       calibration: str | None = None, ray: str | None = None) -> Summary:
    """Convert a local checkpoint directory. `progress(kind, **info)` is called as work advances:
    ("hashing", total_bytes=...) and ("hashed", nbytes=..., name=...) while the sources not hashed yet
    are, ("start", total_bytes=..., tensors=..., resumed=...), ("tensor", name=..., nbytes=...),
    ("shard-done", path=...), ("done").

    An interrupted conversion of the same source and plan resumes from its journal and produces the
    same bytes. With `delete_source`, each shard is deleted once all of its tensors are written.
    `imatrix` (formats.imatrix.Imatrix) gives the quantizer per-channel importances and second moments;
    `calibration` says how they were measured (recorded in the header, so a resume never mixes two).
    `ray` ("local" or a cluster address) encodes on a Ray cluster (convert/distributed.py); the file is
    the same bytes."""
    progress = progress or (lambda *a, **k: None)
    if ray:
        from .distributed import preflight
        preflight(ray)                       # before the output's .partial and journal exist
    try:
        ckpt = open_checkpoint(src, allow_missing_shards=delete_source)
    except SourceError as e:
        raise ConversionError(str(e)) from None
    check_output_apart(ckpt, out)
    cfg = ckpt.config
    # MLA's kv_b in the two halves a GGUF keeps (formats/layout.py) when the plan names them
    split = cfg.num_hidden_layers > 0 and split_kv_b_names(0)[0] in plan.tensors
    expected = model_shapes(cfg, split)
    other_form = set(model_shapes(cfg, not split)) - set(expected)
    missing = [n for n in expected if not ckpt.has(n)]
    if missing:
        raise ConversionError(f"{getattr(ckpt, 'path', ckpt.dir)}: checkpoint lacks {len(missing)} tensor(s) the config requires, "
                              f"e.g. {missing[0]}")
    for n, shape in expected.items():
        if ckpt.shape(n) is not None and ckpt.shape(n) != shape:
            raise ConversionError(f"{ckpt.dir / ckpt.location[n]}: tensor {n} has shape {list(ckpt.shape(n))}, "
                                  f"config.json implies {list(shape)}")
    summary = Summary(output=str(out))
    summary.skipped = sorted(n for n in ckpt.location
                             if n not in expected and n not in other_form and not n.endswith("_scale_inv"))
    if ckpt.missing_shards:
        names = ", ".join(sorted(ckpt.missing_shards))
        if not WeightFileWriter(out, alignment).journaled_meta():
            raise ConversionError(f"{ckpt.dir}: shard(s) {names} missing and no interrupted conversion of {out} "
                                  f"to resume")

    tok_files = ckpt.tokenizer_files()
    if "tokenizer.json" in tok_files:
        tok_kind = "hf"
    elif "tiktoken.model" in tok_files:
        tok_kind = "tiktoken"
    else:
        raise ConversionError(f"{ckpt.dir}: no tokenizer (need tokenizer.json, or tiktoken.model with "
                              f"tokenizer_config.json)")

    plan.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    writer = WeightFileWriter(out, alignment)
    for name, kind, tensors in plan_extents(cfg, plan.codec_for, split_kv_b=split):
        writer.add_extent(name, kind, tensors)
    for name, data in tok_files.items():
        writer.add_blob(name, data)
    meta = {
        "config": cfg.to_dict(),
        "hf_config": ckpt.hf_config,
        "tokenizer": {"kind": tok_kind, "files": sorted(tok_files)},
        "plan": plan.to_json(),
    }
    if imatrix:
        meta["imatrix"] = {"tensors": len(imatrix), "moments": len(getattr(imatrix, "moment_keys", ())),
                           "calibration": calibration}
    previous = writer.journaled_meta()
    hash_sources(ckpt, progress)
    if previous and all(previous.get(k) == v for k, v in meta.items()) and same_sources(ckpt, previous):
        meta["source"] = previous["source"]        # shards may have been deleted since: trust the journal
    elif ckpt.missing_shards:
        raise ConversionError(_cannot_resume(ckpt, out, previous or {}, meta))
    else:
        meta["source"] = source_record(ckpt)
    # Source-shard order: each shard is read front to back once.
    order = sorted(expected, key=lambda n: (ckpt.shard_names.index(ckpt.location[n]), ckpt.offset(n)))
    total_bytes = sum(writer.tensors[n].nbytes for n in order)
    try:        # with shards already deleted, a journal that cannot be used must not be started over
        resumed = writer.begin(meta, require_resume=bool(ckpt.missing_shards))
    except ResumeRefused:
        raise ConversionError(_cannot_resume(ckpt, out, previous or {}, meta,
                                             "it laid the file out otherwise (another --alignment)")) from None
    progress("start", total_bytes=total_bytes, tensors=len(order), resumed=resumed)
    left_in_shard = {}
    for n in order:
        left_in_shard[ckpt.location[n]] = left_in_shard.get(ckpt.location[n], 0) + 1
    cluster = None

    def done_with(n, t):
        _tally(summary, t)
        progress("tensor", name=n, nbytes=t.nbytes)
        shard = ckpt.location[n]
        left_in_shard[shard] -= 1
        if delete_source and left_in_shard[shard] == 0 and shard not in ckpt.missing_shards:
            _consume(ckpt, shard, writer, meta, progress)    # (a resumed shard may have been fetched again)

    def jobs(names):
        for n in names:
            try:
                yield (n, writer.tensors[n].codec, imatrix.get(n) if imatrix else None,
                       imatrix.moment(n) if hasattr(imatrix, "moment") else None)
            except ImatrixError as e:
                raise ConversionError(str(e)) from None
    try:
        todo = []
        for n in order:
            if writer.is_written(n):
                done_with(n, writer.tensors[n])
            elif ckpt.location[n] in ckpt.missing_shards:
                raise ConversionError(f"{ckpt.dir / ckpt.location[n]}: deleted, but tensor {n} from it is not in "
                                      f"the journal of {writer.tmp_path} — fetch the shard again")
            else:
                todo.append(n)
        if ray and todo:
            from .distributed import RayEncoder
            cluster = RayEncoder(ray, ckpt.path)
        t0 = time.perf_counter()
        results = cluster.map(jobs(todo)) if cluster else _encode_here(ckpt, jobs(todo))
        for n, encoded, held in results:
            # written in place wherever the tensor lies (the layout is planned), in whatever order
            # the tensors come, and journaled
            t = writer.tensors[n]
            summary.largest_tensor_bytes = max(summary.largest_tensor_bytes, held)
            writer.write_tensor(n, encoded)
            summary.converted_params += math.prod(t.shape)
            del encoded
            done_with(n, t)
        summary.convert_seconds = time.perf_counter() - t0
        path = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if cluster:
            cluster.close()
        ckpt.close()
        clear_factor_cache()
    summary.file_bytes = path.stat().st_size
    summary.peak_rss_bytes = _vm_hwm()
    progress("done")
    return summary


def _cannot_resume(ckpt: HFCheckpoint, out, previous: dict, meta: dict, layout: str | None = None) -> str:
    """Why an interrupted --delete-source conversion cannot go on, and what the user can do."""
    what = {"plan": "another precision plan (--quant/--override)", "tokenizer": "another tokenizer",
            "config": "another config.json", "hf_config": "another config.json",
            "imatrix": "another importance matrix (--imatrix/--calibration)"}
    why = next((f"it used {what[k]}" for k in meta if k in what and previous.get(k) != meta[k]), layout)
    if why is None:
        known = _manifest(ckpt)
        changed = next((n for n, rec in previous.get("source", {}).get("files", {}).items()
                        if (ckpt.dir / n).exists() and ((ckpt.dir / n).stat().st_size != rec.get("size")
                                                        or _sha256_of(ckpt.dir / n, known, n) != rec.get("sha256"))),
                       None)
        why = f"{ckpt.dir / changed} is not the file it read" if changed else "its journal is unreadable"
    gone = sorted(ckpt.missing_shards)
    return (f"{out}: cannot resume the interrupted conversion: {why}, and it already deleted "
            f"{', '.join(gone)} (--delete-source); rerun it as it was, or fetch "
            f"{'that shard' if len(gone) == 1 else 'those shards'} again to start over")


def _consume(ckpt: HFCheckpoint, shard: str, writer: WeightFileWriter, meta: dict, progress) -> None:
    """Delete a source shard all of whose tensors are written. The journal says so first (durably),
    so that a resumed download knows not to fetch it again (`consumed_shards`)."""
    ckpt.shards[shard].close()
    writer.note({"consumed": shard, "sha256": meta["source"]["files"][shard]["sha256"]})
    (ckpt.dir / shard).unlink(missing_ok=True)
    progress("shard-done", path=str(ckpt.dir / shard))


def consumed_shards(out) -> dict[str, str]:
    """{shard name: SHA-256} of the source shards that an interrupted `--delete-source` conversion to
    `out` wrote completely and deleted: a download resuming for it need not fetch them again."""
    return {r["consumed"]: r.get("sha256") for r in WeightFileWriter(out).journaled_notes("consumed")
            if isinstance(r["consumed"], str) and isinstance(r.get("sha256"), str)}


def _tally(summary: Summary, t) -> None:
    st = summary.classes[t.cls]
    st.tensors += 1
    st.params += math.prod(t.shape)
    st.bytes += t.nbytes


def same_sources(ckpt: HFCheckpoint, previous: dict) -> bool:
    """The journaled conversion (or a file's header) read these same files: every one still present
    has its recorded size and SHA-256 (two checkpoints of one architecture have equal sizes)."""
    known = _manifest(ckpt)
    for name, rec in previous.get("source", {}).get("files", {}).items():
        p = ckpt.dir / name
        if p.exists() and (p.stat().st_size != rec.get("size") or _sha256_of(p, known, name) != rec.get("sha256")):
            return False
    return True
