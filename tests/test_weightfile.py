"""The kimi-stream weight file (formats/weightfile.py): writer/reader round trip, atomic creation,
and the reader's validation of untrusted files.

The file layout is re-implemented here independently (prefix struct, xxh3 digests) so the tests can
craft malicious files: `rewrite_header` replaces the header JSON and recomputes the prefix's header
length and xxh3-128 digest, so only the check under test can reject the file."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.weightfile import WeightFile, WeightFileError, WeightFileWriter

PREFIX = struct.Struct("<8sIIQQQQ16s")      # magic, version, alignment, hoff, hlen, data_start, size, digest
MAGIC, HOFF = b"KIMISTRM", 64
F_MAGIC, F_VERSION, F_ALIGN, F_HOFF, F_HLEN, F_DATA, F_SIZE, F_DIGEST = range(8)


# ----------------------------------------------------------------------------------- building files

def exact_values(codec: str, shape, rng) -> np.ndarray:
    """Random float32 values exactly representable in `codec` (so decode must give them back bit for bit)."""
    v = (rng.standard_normal(shape) * 2.0).astype(np.float32)
    if codec == "f16":
        v = v.astype(np.float16).astype(np.float32)
    elif codec == "bf16":
        v = (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.ascontiguousarray(v)


def expert(layer, e, codec, shape=(6, 24)):
    p = f"model.layers.{layer}.mlp.experts.{e}"
    return [(f"{p}.gate_proj.weight", "routed_experts", codec, shape),
            (f"{p}.up_proj.weight", "routed_experts", codec, shape),
            (f"{p}.down_proj.weight", "routed_experts", codec, shape[::-1])]


# (kind, name, tensors) in layout order; ("blob", name, data) for embedded files. Odd sizes everywhere so
# tensors need padding to their 64-byte boundary and extents to the file alignment.
PLAN = [
    ("resident", "layers.0", [
        ("model.layers.0.self_attn.q_proj.weight", "attention", "f32", (7, 5)),
        ("model.layers.0.input_layernorm.weight", "norms", "f16", (13,)),
        ("model.layers.0.mlp.gate.weight", "router", "bf16", (8, 16)),
        ("model.layers.0.mlp.gate_proj.weight", "dense_mlp", "bf16", (9, 11)),
    ]),
    ("blob", "tokenizer.json", bytes(random.Random(1).randrange(256) for _ in range(5000))),
    ("resident", "layers.1", [
        ("model.layers.1.self_attn.o_proj.weight", "attention", "f16", (5, 3)),
        ("model.layers.1.post_attention_layernorm.weight", "norms", "f32", (24,)),
        ("model.layers.1.mlp.shared_experts.up_proj.weight", "shared_experts", "bf16", (6, 24)),
    ]),
    ("embedding", "embed", [("model.embed_tokens.weight", "embeddings", "bf16", (50, 24))]),
    ("embedding", "lm_head", [("lm_head.weight", "lm_head", "f16", (50, 24))]),
    ("expert", "layers.1.experts.0", expert(1, 0, "bf16")),
    ("expert", "layers.1.experts.1", expert(1, 1, "f16")),
    ("expert", "layers.2.experts.0", expert(2, 0, "f32", (40, 67))),       # > 4096 bytes per tensor
    ("blob", "chat_template.jinja", b"{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ("blob", "special_tokens_map.json", b""),                                # empty blob, last extent
]
EXTENT_NAMES = [("blob:" + n) if k == "blob" else n for k, n, _ in PLAN]
BLOBS = {n: d for k, n, d in PLAN if k == "blob"}
TENSORS = {t[0]: t for k, _, ts in PLAN if k != "blob" for t in ts}
META = {"config": {"hidden_size": 24, "vocab_size": 50}, "tokenizer": {"kind": "hf"}, "note": "ünïcödé ✓"}


def expected_tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, cls, codec, shape in TENSORS.values():
        v = exact_values(codec, shape, rng)
        out[name] = (v, encode(codec, v))
    return out


def build(path: Path, alignment=4096, order_seed=0, meta=None, values=None) -> Path:
    values = values or expected_tensors()
    w = WeightFileWriter(path, alignment=alignment)
    for kind, name, payload in PLAN:
        if kind == "blob":
            w.add_blob(name, payload)
        else:
            w.add_extent(name, kind, payload)
    w.begin(dict(META if meta is None else meta))
    names = list(TENSORS)
    random.Random(order_seed).shuffle(names)
    assert names != list(TENSORS)
    for n in names:
        w.write_tensor(n, values[n][1])
    return w.finish()


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("wf") / "base.kst", alignment=4096, order_seed=3)


@pytest.fixture
def victim(base_file, tmp_path) -> Path:
    """A fresh copy of the valid base file, to be damaged by the test."""
    p = tmp_path / "victim.kst"
    shutil.copyfile(base_file, p)
    return p


# ----------------------------------------------------------------------------------- crafting files

def load(path: Path):
    raw = bytearray(path.read_bytes())
    fields = list(PREFIX.unpack_from(raw, 0))
    header = bytes(raw[fields[F_HOFF]:fields[F_HOFF] + fields[F_HLEN]])
    return raw, fields, header


def write_prefix(path: Path, **changes) -> None:
    """Change prefix fields (by name) without touching anything else (the header digest stays)."""
    raw, f, _ = load(path)
    idx = {"magic": F_MAGIC, "version": F_VERSION, "alignment": F_ALIGN, "hoff": F_HOFF, "hlen": F_HLEN,
           "data_start": F_DATA, "size": F_SIZE, "digest": F_DIGEST}
    for k, v in changes.items():
        f[idx[k]] = v
    raw[:HOFF] = PREFIX.pack(*f)
    path.write_bytes(bytes(raw))


def rewrite_header(path: Path, mutate=None, raw_header: bytes | None = None) -> None:
    """Replace the header (mutate(dict) edits the parsed JSON in place, or give raw bytes), then fix the
    prefix's header length and xxh3-128 digest so the new header is 'authentic'."""
    raw, f, header = load(path)
    if raw_header is None:
        h = json.loads(header)
        mutate(h)
        raw_header = json.dumps(h, separators=(",", ":")).encode()
    assert HOFF + len(raw_header) <= f[F_DATA], "crafted header does not fit before the data"
    raw[HOFF:f[F_DATA]] = raw_header + b"\0" * (f[F_DATA] - HOFF - len(raw_header))
    f[F_HLEN] = len(raw_header)
    f[F_DIGEST] = xxhash.xxh3_128_digest(raw_header)
    raw[:HOFF] = PREFIX.pack(*f)
    path.write_bytes(bytes(raw))


def header_of(path: Path) -> dict:
    return json.loads(load(path)[2])


def expect_error(path: Path, pattern: str, *names: str) -> str:
    """Opening `path` raises WeightFileError whose message starts with the path, matches `pattern`
    (the problem) and mentions every one of `names` (the offending extents/tensors)."""
    with pytest.raises(WeightFileError) as ei:
        WeightFile(path).close()
    msg = str(ei.value)
    assert msg.startswith(str(path)), msg
    assert re.search(pattern, msg[len(str(path)):], re.I), msg
    for n in names:
        assert n in msg, (n, msg)
    return msg


def ext_index(name: str) -> int:
    return EXTENT_NAMES.index(name)


# ----------------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("alignment", [4096, 65536])
@pytest.mark.parametrize("big_header", [False, True], ids=["small-header", "header-over-alignment"])
def test_round_trip(tmp_path, alignment, big_header):
    values = expected_tensors(seed=alignment)
    meta = dict(META)
    if big_header:        # the header alone is larger than one alignment unit: data must start later
        meta["padding"] = "x" * (alignment + 1234)
    path = build(tmp_path / "model.kst", alignment=alignment, order_seed=alignment + big_header, meta=meta,
                 values=values)
    assert path == tmp_path / "model.kst"

    # Prefix, checked independently of the reader.
    raw, f, header = load(path)
    assert f[F_MAGIC] == MAGIC and f[F_VERSION] == 2 and f[F_ALIGN] == alignment and f[F_HOFF] == 64
    assert f[F_SIZE] == len(raw)
    assert f[F_DATA] % alignment == 0 and f[F_DATA] >= 64 + f[F_HLEN]
    assert f[F_DIGEST] == xxhash.xxh3_128_digest(header)
    if big_header:
        assert f[F_DATA] >= 2 * alignment

    with WeightFile(path) as wf:
        assert wf.alignment == alignment and wf.size == len(raw) and wf.data_start == f[F_DATA]
        for k, v in meta.items():
            assert wf.meta[k] == v
        # Extents: in plan order, with their kinds; aligned, after the header, inside the file, disjoint.
        assert [e.name for e in wf.extents] == EXTENT_NAMES
        assert [e.kind for e in wf.extents] == [k for k, _, _ in PLAN]
        prev_end = f[F_DATA]
        for e in wf.extents:
            assert e.offset % alignment == 0, (e.name, e.offset)
            assert e.offset >= prev_end and e.offset + e.nbytes <= wf.size
            prev_end = e.offset + e.nbytes
            assert e.checksum == xxhash.xxh3_64_hexdigest(bytes(raw[e.offset:e.offset + e.nbytes]))
            assert wf.verify_extent(e), e.name
        # Blobs byte for byte.
        for n, data in BLOBS.items():
            assert wf.blob(n) == data
            assert wf.extent_by_name["blob:" + n].nbytes == len(data)
        with pytest.raises(KeyError):
            wf.blob("not-there.json")
        # Tensors: directory, placement, bytes, values.
        assert set(wf.tensors) == set(TENSORS)
        for name, (_, cls, codec, shape) in TENSORS.items():
            t = wf.tensors[name]
            ext = wf.extents[t.extent]
            assert name in ext.tensors
            assert (t.cls, t.codec, t.shape, t.nbytes) == (cls, codec, shape, get_codec(codec).nbytes(shape))
            assert ext.name == next(en for en, (k, _, ts) in zip(EXTENT_NAMES, PLAN)
                                    if k != "blob" and name in [x[0] for x in ts])
            assert t.offset % 64 == 0 and (t.offset - ext.offset) % 64 == 0, (name, t.offset)
            assert ext.offset <= t.offset and t.offset + t.nbytes <= ext.offset + ext.nbytes
            assert wf.raw(name).tobytes() == values[name][1].tobytes()
            got = wf.decode(name)
            assert got.dtype == np.float32 and got.shape == shape
            assert np.array_equal(got.view(np.uint32), values[name][0].view(np.uint32)), name
        # Tensors of one extent don't overlap each other.
        for e in wf.extents:
            spans = sorted((wf.tensors[n].offset, wf.tensors[n].offset + wf.tensors[n].nbytes) for n in e.tensors)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), e.name


def test_write_order_does_not_change_the_file(tmp_path):
    a = build(tmp_path / "a.kst", order_seed=11)
    b = build(tmp_path / "b.kst", order_seed=12)
    assert a.read_bytes() == b.read_bytes()


def test_file_appears_only_at_finish(tmp_path):
    path = tmp_path / "sub" / "model.kst"
    partial = path.with_name("model.kst.partial")
    values = expected_tensors()
    w = WeightFileWriter(path)
    for kind, name, payload in PLAN:
        w.add_blob(name, payload) if kind == "blob" else w.add_extent(name, kind, payload)
    assert not path.exists() and not partial.exists()
    w.begin(dict(META))
    assert partial.exists() and not path.exists()
    names = list(TENSORS)
    for i, n in enumerate(names):
        w.write_tensor(n, values[n][1])
        assert partial.exists() and not path.exists(), f"after {i + 1} tensor(s)"
    assert w.finish() == path
    assert path.exists() and not partial.exists()
    with WeightFile(path) as wf:
        assert all(wf.verify_extent(e) for e in wf.extents)


def test_existing_file_is_replaced_only_at_finish(tmp_path, base_file):
    path = tmp_path / "model.kst"
    shutil.copyfile(base_file, path)
    old = path.read_bytes()
    values = expected_tensors(seed=99)
    w = WeightFileWriter(path)
    for kind, name, payload in PLAN:
        w.add_blob(name, payload) if kind == "blob" else w.add_extent(name, kind, payload)
    w.begin(dict(META))
    for n in TENSORS:
        w.write_tensor(n, values[n][1])
        assert path.read_bytes() == old
    w.finish()
    assert path.read_bytes() != old
    with WeightFile(path) as wf:
        n = "lm_head.weight"
        assert np.array_equal(wf.decode(n), values[n][0])


def test_finish_refuses_unwritten_tensors(tmp_path):
    path = tmp_path / "model.kst"
    values = expected_tensors()
    w = WeightFileWriter(path)
    for kind, name, payload in PLAN:
        w.add_blob(name, payload) if kind == "blob" else w.add_extent(name, kind, payload)
    w.begin({})
    for n in list(TENSORS)[:-1]:
        w.write_tensor(n, values[n][1])
    with pytest.raises(WeightFileError, match="never written"):
        w.finish()
    w.abort()
    assert not path.exists()


def test_writer_rejects_bad_alignment_and_wrong_sizes(tmp_path):
    for a in (0, 512, 4095, 3 * 4096, 4 << 20):
        with pytest.raises(ValueError):
            WeightFileWriter(tmp_path / "x.kst", alignment=a)
    w = WeightFileWriter(tmp_path / "x.kst")
    w.add_extent("r", "resident", [("model.norm.weight", "norms", "f32", (4,))])
    with pytest.raises(ValueError, match="twice"):
        w.add_extent("r2", "resident", [("model.norm.weight", "norms", "f32", (4,))])
    w.begin({})
    with pytest.raises(CodecError):
        w.write_tensor("model.norm.weight", np.zeros(15, dtype=np.uint8))
    w.abort()


def test_writing_a_tensor_twice_cannot_leave_another_unwritten(tmp_path):
    """BUG (formats/weightfile.py, WeightFileWriter.write_tensor, `self._pending[t.extent] -= 1`):
    the per-extent countdown counts writes, not distinct tensors. Writing tensor A twice and never
    writing B (same extent) drives the counter to 0, the extent is hashed with B's bytes all zeros,
    and finish() succeeds: a file with a silently missing tensor and a checksum that vouches for it.
    Fix: track written names per extent (a set), and raise on a second write of the same tensor
    (or at least make finish() check that every tensor was written once)."""
    path = tmp_path / "model.kst"
    w = WeightFileWriter(path)
    w.add_extent("r", "resident", [("model.norm.weight", "norms", "f32", (4,)),
                                   ("model.layers.0.input_layernorm.weight", "norms", "f32", (4,))])
    w.begin({})
    enc = encode("f32", np.ones(4, dtype=np.float32))
    w.write_tensor("model.norm.weight", enc)
    with pytest.raises((WeightFileError, ValueError)):
        w.write_tensor("model.norm.weight", enc)      # a repeated write should be refused ...
        w.finish()                                   # ... or finish() must notice the unwritten tensor
    w.abort()


def test_empty_extent_verifies(tmp_path):
    """BUG (formats/weightfile.py, WeightFileWriter: an extent added with add_extent(name, kind, [])
    has _pending == 0, so _hash_extent is never called and its checksum stays the placeholder
    '0000000000000000'; xxh3_64 of b'' is '2d06800538d394c2', so verify_extent() is False for a freshly
    written, intact file (kimi-verify would report corruption). Blobs are fine (hashed in begin()).
    Fix: in begin(), set ext.checksum = checksum.extent_digest(b'') for every extent with no tensors
    (or reject empty non-blob extents in add_extent)."""
    path = tmp_path / "model.kst"
    w = WeightFileWriter(path)
    w.add_extent("r", "resident", [("model.norm.weight", "norms", "f32", (4,))])
    w.add_extent("nothing", "resident", [])
    w.begin({})
    w.write_tensor("model.norm.weight", encode("f32", np.ones(4, dtype=np.float32)))
    w.finish()
    with WeightFile(path) as wf:
        assert [wf.verify_extent(e) for e in wf.extents] == [True, True]


# ----------------------------------------------------------------------------------- corruption of data

@pytest.mark.parametrize("target", [n for n, (k, _, p) in zip(EXTENT_NAMES, PLAN) if k != "blob" or p])
def test_corrupt_extent_byte_detected_only_for_that_extent(victim, target):
    with WeightFile(victim) as wf:
        ext = wf.extent_by_name[target]
        pos = ext.offset + ext.nbytes // 2
    raw = bytearray(victim.read_bytes())
    raw[pos] ^= 0x40
    victim.write_bytes(bytes(raw))
    with WeightFile(victim) as wf:                       # opens fine: data is not checked at open
        ok = {e.name: wf.verify_extent(e) for e in wf.extents}
    assert ok == {n: n != target for n in EXTENT_NAMES}


def test_corrupt_first_and_last_byte_of_extent(victim):
    with WeightFile(victim) as wf:
        ext = wf.extent_by_name["layers.2.experts.0"]
        first, last = ext.offset, ext.offset + ext.nbytes - 1
    for pos in (first, last):
        raw = bytearray(victim.read_bytes())
        raw[pos] ^= 0x01
        p = victim.with_name(f"c{pos}.kst")
        p.write_bytes(bytes(raw))
        with WeightFile(p) as wf:
            assert [wf.verify_extent(e) for e in wf.extents] == [n != ext.name for n in EXTENT_NAMES]


# ----------------------------------------------------------------------------------- malformed prefix

def test_missing_and_empty_files(tmp_path):
    expect_error(tmp_path / "nope.kst", r"cannot open|no such|not found")
    (tmp_path / "empty.kst").write_bytes(b"")
    expect_error(tmp_path / "empty.kst", r"short|truncated")
    (tmp_path / "short.kst").write_bytes(MAGIC + b"\0" * 20)
    expect_error(tmp_path / "short.kst", r"short|truncated")


def test_wrong_magic(victim):
    write_prefix(victim, magic=b"GGUF\0\0\0\0")
    expect_error(victim, r"magic|not a kimi-stream")


@pytest.mark.parametrize("version", [3, 0, 2 ** 32 - 1])
def test_unknown_version(victim, version):
    write_prefix(victim, version=version)
    expect_error(victim, rf"version\D*{version}\b")


def test_older_version_asks_for_a_reconversion(victim):
    """Version 1 stored outliers' values where version 2 stores corrections: read with today's
    decoders its weights would be silently wrong, so it is refused with what to do."""
    write_prefix(victim, version=1)
    msg = expect_error(victim, r"older kimi-stream \(format version 1\b")
    assert "re-convert" in msg and "\n" not in msg


@pytest.mark.parametrize("alignment", [0, 1000, 4097, 4 << 20])
def test_invalid_alignment(victim, alignment):
    write_prefix(victim, alignment=alignment)
    expect_error(victim, r"align")


@pytest.mark.parametrize("cut", ["last-byte", "mid-data", "mid-header", "in-prefix"])
def test_truncated_file(victim, cut):
    raw, f, _ = load(victim)
    keep = {"last-byte": len(raw) - 1, "mid-data": (f[F_DATA] + len(raw)) // 2,
            "mid-header": 64 + f[F_HLEN] // 2, "in-prefix": 40}[cut]
    victim.write_bytes(bytes(raw[:keep]))
    expect_error(victim, r"truncated|too short")


@pytest.mark.parametrize("extra", [1, 4096, 100_000])
def test_extra_bytes_appended(victim, extra):
    with open(victim, "ab") as fh:
        fh.write(b"\0" * extra)
    expect_error(victim, r"longer|extra|trailing|size")


def test_header_digest_mismatch(victim):
    raw, f, header = load(victim)
    i = 64 + header.index(b'"blob:tokenizer.json"') + 3
    raw[i] ^= 0x01                                     # still valid JSON, but not what was written
    victim.write_bytes(bytes(raw))
    expect_error(victim, r"checksum|digest")


def test_header_digest_field_changed(victim):
    _, f, _ = load(victim)
    write_prefix(victim, digest=bytes(b ^ 0xFF for b in f[F_DIGEST]))
    expect_error(victim, r"checksum|digest")


@pytest.mark.parametrize("hlen", ["file+1", "huge", "2^64-1"])
def test_header_length_larger_than_file(victim, hlen):
    size = victim.stat().st_size
    write_prefix(victim, hlen={"file+1": size + 1, "huge": 1 << 40, "2^64-1": 2 ** 64 - 1}[hlen])
    expect_error(victim, r"header")


def test_header_length_larger_than_file_with_data_start_moved(victim):
    # placement looks consistent (header ends before the claimed data start), but the file is too short
    size = victim.stat().st_size
    write_prefix(victim, hlen=size + 10, data_start=size + 4096 * 2)
    expect_error(victim, r"header|data|truncated")


@pytest.mark.parametrize("hoff", [0, 63, 65, 4096])
def test_header_offset_not_64(victim, hoff):
    write_prefix(victim, hoff=hoff)
    expect_error(victim, r"header")


def test_header_overlapping_data(victim):
    _, f, _ = load(victim)
    write_prefix(victim, data_start=64 + f[F_HLEN] - 1)
    expect_error(victim, r"header")


# ----------------------------------------------------------------------------------- malformed header

@pytest.mark.parametrize("raw_header", [b"this is not json {", b'{"format": "kimi-stream", "extents": [', b"\xc3\x28\xa0\xa1",
                                        b""], ids=["text", "cut-json", "bad-utf8", "empty"])
def test_non_json_header(victim, raw_header):
    rewrite_header(victim, raw_header=raw_header)
    expect_error(victim, r"JSON")


@pytest.mark.parametrize("doc", [[1, 2], "kimi-stream", {"format": "safetensors"},
                                 {"format": "kimi-stream", "tensors": {}},
                                 {"format": "kimi-stream", "extents": [], "tensors": []}])
def test_header_of_wrong_shape(victim, doc):
    rewrite_header(victim, raw_header=json.dumps(doc).encode())
    expect_error(victim, r"kimi-stream|extent|tensor|header")


def test_extent_past_end_of_file(victim):
    i = ext_index("layers.2.experts.0")
    rewrite_header(victim, lambda h: h["extents"][i].update(nbytes=h["extents"][i]["nbytes"] + 10 ** 6))
    expect_error(victim, r"past the end|end of (the )?file|beyond", "layers.2.experts.0")


def test_extent_starts_past_end_of_file(victim):
    size = victim.stat().st_size
    i = ext_index("embed")
    rewrite_header(victim, lambda h: h["extents"][i].update(offset=size + 4096 * 4))
    expect_error(victim, r"past the end|end of (the )?file|beyond", "embed")


@pytest.mark.parametrize("delta", [64, 1, -8])
def test_misaligned_extent(victim, delta):
    i = ext_index("layers.1")
    rewrite_header(victim, lambda h: h["extents"][i].update(offset=h["extents"][i]["offset"] + delta))
    expect_error(victim, r"align", "layers.1")


@pytest.mark.parametrize("offset", [0, 64])
def test_extent_inside_prefix_or_header(victim, offset):
    rewrite_header(victim, lambda h: h["extents"][0].update(offset=offset, nbytes=16))
    expect_error(victim, r"align|data|header", "layers.0")


def test_negative_extent_size(victim):
    rewrite_header(victim, lambda h: h["extents"][1].update(nbytes=-5))
    expect_error(victim, r"size|nbytes|negative|offset", "blob:tokenizer.json")


def test_overlapping_extents_partial(victim):
    a, b = ext_index("layers.1"), ext_index("embed")

    def grow(h):
        ea, eb = h["extents"][a], h["extents"][b]
        ea["nbytes"] = eb["offset"] - ea["offset"] + 1
    rewrite_header(victim, grow)
    expect_error(victim, r"overlap", "layers.1", "embed")


def test_overlapping_extents_same_offset(victim):
    a, b = ext_index("layers.1.experts.0"), ext_index("layers.1.experts.1")
    rewrite_header(victim, lambda h: h["extents"][b].update(offset=h["extents"][a]["offset"]))
    expect_error(victim, r"overlap", "layers.1.experts.0", "layers.1.experts.1")


def test_overlapping_extents_listed_out_of_order(victim):
    # the later-listed extent lies *before* the earlier one and runs into it
    a, b = ext_index("layers.0"), ext_index("lm_head")

    def move(h):
        ea, eb = h["extents"][a], h["extents"][b]
        eb["offset"] = ea["offset"]
        eb["nbytes"] = 100
    rewrite_header(victim, move)
    expect_error(victim, r"overlap", "layers.0", "lm_head")


def test_unknown_extent_kind(victim):
    i = ext_index("embed")
    rewrite_header(victim, lambda h: h["extents"][i].update(kind="swapfile"))
    expect_error(victim, r"kind", "embed", "swapfile")


@pytest.mark.parametrize("drop", ["name", "kind", "offset", "nbytes", "checksum"])
def test_extent_missing_field(victim, drop):
    rewrite_header(victim, lambda h: h["extents"][2].pop(drop))
    expect_error(victim, r"malformed|missing|extent")


T_NAME = "model.layers.0.mlp.gate.weight"       # bf16 (8, 16) = 256 bytes, in extent layers.0
T2_NAME = "model.layers.1.mlp.experts.0.up_proj.weight"


@pytest.mark.parametrize("change", [{"nbytes": 258}, {"nbytes": 254}, {"nbytes": 0}, {"shape": [8, 17]},
                                    {"shape": [16, 8, 2]}, {"codec": "f32"}, {"shape": [-8, -16]}],
                         ids=["nbytes+2", "nbytes-2", "nbytes0", "shape", "shape-rank", "codec", "negative-shape"])
def test_tensor_nbytes_not_matching_codec_and_shape(victim, change):
    rewrite_header(victim, lambda h: h["tensors"][T_NAME].update(change))
    expect_error(victim, r"bytes|needs|shape", T_NAME)


@pytest.mark.parametrize("where", ["after-end", "straddles-end", "before-start", "other-extent", "blob-extent"])
def test_tensor_outside_its_extent(victim, where):
    def mutate(h):
        t = h["tensors"][T2_NAME]
        e = h["extents"][t["extent"]]
        if where == "after-end":
            t["offset"] = e["offset"] + e["nbytes"] + 64
        elif where == "straddles-end":
            t["offset"] = e["offset"] + e["nbytes"] - 64
        elif where == "before-start":
            t["offset"] = e["offset"] - 64
        elif where == "other-extent":
            t["extent"] = ext_index("layers.1.experts.1")
        else:
            t["extent"] = ext_index("blob:tokenizer.json")
    rewrite_header(victim, mutate)
    expect_error(victim, r"outside|extent", T2_NAME)


@pytest.mark.parametrize("idx", [-1, len(PLAN), 10 ** 6])
def test_tensor_extent_index_out_of_range(victim, idx):
    rewrite_header(victim, lambda h: h["tensors"][T2_NAME].update(extent=idx))
    expect_error(victim, r"extent", T2_NAME)


def test_unknown_codec(victim):
    rewrite_header(victim, lambda h: h["tensors"][T_NAME].update(codec="q4_mystery"))
    expect_error(victim, r"codec", T_NAME, "q4_mystery")


def test_unknown_tensor_class(victim):
    rewrite_header(victim, lambda h: h["tensors"][T_NAME].update({"class": "vision_tower"}))
    expect_error(victim, r"class", T_NAME, "vision_tower")


@pytest.mark.parametrize("drop", ["class", "codec", "shape", "extent", "offset", "nbytes"])
def test_tensor_missing_field(victim, drop):
    rewrite_header(victim, lambda h: h["tensors"][T_NAME].pop(drop))
    expect_error(victim, r"malformed|missing", T_NAME)


# Untrusted-header robustness: whatever the JSON says, the reader must answer with WeightFileError.

@pytest.mark.parametrize("where,field", [("extent", "offset"), ("extent", "nbytes"), ("tensor", "offset"),
                                         ("tensor", "nbytes"), ("tensor", "extent"), ("tensor", "shape")])
def test_non_finite_numbers_in_header(victim, where, field):
    """BUG (formats/weightfile.py, WeightFile._validate_directory): Python's json accepts `Infinity`
    (and 1e999, which parses to inf); int(inf) raises OverflowError, which the `except (KeyError,
    TypeError, ValueError)` clauses around the Extent(...) / TensorEntry(...) construction do not catch,
    so a crafted header escapes as a bare OverflowError instead of WeightFileError naming the file.
    Fix: add OverflowError to both except tuples (better: require `type(x) is int` for offsets, sizes,
    indices and shape entries, which also rejects 4096.7, "4096" and the string shape "35"->(3,5)
    that int() currently accepts), and/or json.loads(..., parse_constant=<raise>)."""
    def mutate(h):
        if where == "extent":
            h["extents"][3][field] = float("inf")
        elif field == "shape":
            h["tensors"][T_NAME]["shape"] = [8, float("inf")]
        else:
            h["tensors"][T_NAME][field] = float("inf")
    rewrite_header(victim, mutate)      # json.dumps writes Infinity
    expect_error(victim, r"malformed|invalid|extent|tensor")


@pytest.mark.parametrize("codec", [["bf16"], {"name": "bf16"}], ids=["list", "object"])
def test_non_string_codec(victim, codec):
    """BUG (formats/weightfile.py, WeightFile._validate_directory, `get_codec(ent.codec)` wrapped in
    `except CodecError`): a non-string codec in the header (a JSON list or object) makes the dict lookup
    in formats/codecs.py get_codec raise TypeError('unhashable type'), which escapes instead of a
    WeightFileError. Fix: check `isinstance(t["codec"], str)` (and class) when building the TensorEntry,
    or catch TypeError there too."""
    rewrite_header(victim, lambda h: h["tensors"][T_NAME].update(codec=codec))
    expect_error(victim, r"codec|malformed", T_NAME)


def test_rewrite_helper_keeps_valid_file_valid(victim):
    """Sanity check of the crafting helper itself: an identity rewrite (re-serialised JSON, new length
    and digest) still opens and verifies, so each failure above is due to the one change made."""
    rewrite_header(victim, lambda h: None)
    with WeightFile(victim) as wf:
        assert all(wf.verify_extent(e) for e in wf.extents)
        assert wf.blob("tokenizer.json") == BLOBS["tokenizer.json"]
