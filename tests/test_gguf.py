"""GGUF files as a source (formats/gguffile.py), on files written here from the bundled trained
models in llama.cpp's deepseek2 layout (tests/ggufmodels.py): the config and every tensor come back
as the safetensors checkpoint has them, and bad files get one clear error."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from ggufmodels import write_gguf
from kimistream.formats.config import ModelConfig
from kimistream.formats.gguffile import GGUFError, GGUFModel, is_gguf
from kimistream.formats.layout import split_kv_b_names

MODELS = Path(__file__).resolve().parent.parent / "models"


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True)


def _source(model):
    src = MODELS / model
    return src, {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}


@pytest.mark.parametrize("model", ["stdlib-moe", "manpages-moe"])
def test_an_f32_gguf_reads_back_as_its_checkpoint(model, tmp_path):
    """Config, names, shapes and values: kv_b rebuilt from attn_k_b / attn_v_b, experts sliced out of
    the merged tensors, the router and bias in F32, bit for bit."""
    src, st = _source(model)
    path = write_gguf(src, tmp_path / "m.gguf")
    assert is_gguf(path) and not is_gguf(src / "config.json")
    m = GGUFModel(path)
    assert ModelConfig.from_hf(m.config) == ModelConfig.from_hf(json.loads((src / "config.json").read_text()))
    cfg = json.loads((src / "config.json").read_text())
    nh, nope, r = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
    halves = {}
    for i in range(cfg["num_hidden_layers"]):       # MLA's kv_b also as llama.cpp's halves, as stored
        kv_b = st[f"model.layers.{i}.self_attn.kv_b_proj.weight"].reshape(nh, -1, r)
        k_b, v_b = split_kv_b_names(i)
        halves[k_b] = kv_b[:, :nope].transpose(0, 2, 1).reshape(nh * r, nope)
        halves[v_b] = kv_b[:, nope:].reshape(-1, r)
    assert set(m.names()) == set(st) | set(halves)
    for name, want in {**st, **halves}.items():
        assert m.shape(name) == want.shape, name
        got = m.read(name)
        assert got.dtype == np.float32 and np.array_equal(got, want), name


def test_a_q8_0_gguf_reads_as_the_gguf_dequantizer_gives_it(tmp_path):
    src, st = _source("stdlib-moe")
    m = GGUFModel(write_gguf(src, tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert m.quant_type(name) == "Q8_0"
    want = gguf.quants.dequantize(gguf.quants.quantize(st[name], gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(m.read(name), want)
    assert np.abs(m.read(name) - st[name]).max() <= np.abs(st[name]).max() / 127


def test_bad_gguf_files_get_one_line_errors(tmp_path):
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    other = write_gguf(src, tmp_path / "llama.gguf", arch="llama")
    split = tmp_path / "m-00001-of-00002.gguf"
    split.write_bytes(data)
    for bad, what in ((cut, "not a readable GGUF file"), (other, "architecture 'llama'"),
                      (split, "split file(s) missing: m-00002-of-00002.gguf")):
        with pytest.raises(GGUFError) as e:
            GGUFModel(bad)
        msg = str(e.value)
        assert what in msg and str(bad.parent) in msg and "\n" not in msg, msg


@pytest.mark.parametrize("model,pre", [("stdlib-moe", "gpt2"), ("manpages-moe", "gpt2"), ("stdlib-moe", "gpt-2")])
def test_the_tokenizer_rebuilt_from_gguf_metadata_gives_the_original_ids(model, pre, tmp_path):
    """"gpt-2" is the name llama.cpp's own converter writes for GPT-2's split."""
    from kimistream.runtime.tokenizer import Tokenizer
    src, _ = _source(model)
    kind, files = GGUFModel(write_gguf(src, tmp_path / "m.gguf", pre=pre)).tokenizer_files()
    rebuilt = Tokenizer(kind, files)
    original = Tokenizer("hf", {n: (src / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")})
    text = (MODELS.parent / "data" / f"{model.split('-')[0]}-heldout.txt").read_text()
    ids = original.encode(text)
    assert rebuilt.encode(text) == ids and len(ids) > 50_000
    assert (rebuilt.bos_id, rebuilt.eos_id) == (original.bos_id, original.eos_id)
    assert rebuilt.decode(ids) == original.decode(ids)
    assert rebuilt.chat_template == original.chat_template


def test_kimi_convert_reads_a_gguf_like_its_checkpoint(tmp_path):
    """kimi-convert MODEL.gguf: an F32 GGUF converts to a file whose logits equal the safetensors
    conversion's bit for bit, tokenizer included; a quantized one is requantized with a warning."""
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")

    logits = []
    for source, out in ((path, tmp_path / "g.kst"), (src, tmp_path / "s.kst")):
        proc = _run("kimistream.convert.cli", source, "-o", out, "--quant", "f32", "--quiet")
        assert proc.returncode == 0, proc.stderr
        npy = out.with_suffix(".npy")
        proc = _run("kimistream.runtime.cli", "--weights", out, "--prompt", "import os", "--max-tokens", 4,
                   "--dump-logits", npy, "--quiet")
        assert proc.returncode == 0, proc.stderr
        logits.append(np.load(npy))
    assert logits[0].shape[0] >= 2 and np.array_equal(logits[0], logits[1])
    q8 = write_gguf(src, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    proc = _run("kimistream.convert.cli", q8, "-o", tmp_path / "q.kst", "--quant", "q2", "--calibration", "none")
    assert proc.returncode == 0, proc.stderr
    assert "holds Q8_0 blocks" in proc.stderr and "two quantizations stacked" in proc.stderr


def test_quant_keep_transcodes_q8_0_blocks_exactly(tmp_path):
    """kimi-convert MODEL.gguf --quant keep: Q8_0 tensors become q8 without requantizing (decoded, each
    equals the gguf package's dequantizer of its source blocks, bit for bit; kv_b, which llama.cpp
    stores transposed, is the one tensor encoded again), F32 ones stay f32, and the file runs with
    the logits of the same values in f32; a type no codec holds (MXFP4) is refused in one line."""

    from kimistream.formats.codecs import get_codec
    from kimistream.formats.weightfile import WeightFile
    src, _ = _source("stdlib-moe")
    q8 = write_gguf(src, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)

    proc = _run("kimistream.convert.cli", q8, "-o", tmp_path / "keep.kst", "--quant", "keep", "--quiet")
    assert proc.returncode == 0, proc.stderr
    m = GGUFModel(q8)
    with WeightFile(tmp_path / "keep.kst") as wf:
        checked = 0
        for name, t in wf.tensors.items():
            if name.endswith("kv_b_proj.weight"):
                continue
            assert t.codec == {"Q8_0": "q8", "F32": "f32"}[m.quant_type(name)], name
            decoded = get_codec(t.codec).decode(wf.raw(name), t.shape).reshape(t.shape)
            assert np.array_equal(decoded, m.read(name)), name
            checked += t.codec == "q8"
        assert checked > 200
    kept, f32 = _kept_and_f32_logits(q8, tmp_path)
    assert np.abs(kept - f32).max() <= 2e-2 * np.abs(f32).max()
    mx = write_gguf(src, tmp_path / "mx.gguf", gguf.GGMLQuantizationType.MXFP4)
    proc = _run("kimistream.convert.cli", mx, "-o", tmp_path / "mx.kst", "--quant", "keep")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "MXFP4" in proc.stderr and "mx.gguf" in proc.stderr and not (tmp_path / "mx.kst").exists()
    proc = _run("kimistream.convert.cli", src, "-o", tmp_path / "x.kst", "--quant", "keep")
    assert proc.returncode == 2 and "not a GGUF file" in proc.stderr


def test_kimi_verify_checks_a_gguf(tmp_path):
    """kimi-verify MODEL.gguf: structure and SHA-256 against --manifest (0), a byte flipped in a tensor
    (4, SHA-256 mismatch), no expected hash (5, structure ok), truncated (4, one line naming why)."""
    import hashlib
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    manifest = tmp_path / "m.sha256"
    manifest.write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  m.gguf\n")

    def verify(*args):
        proc = _run("kimistream.convert.verify_cli", *args, "--json")
        return proc.returncode, json.loads(proc.stdout)["rows"] if proc.stdout.strip() else proc.stderr
    code, rows = verify(path, "--manifest", manifest)
    assert code == 0 and [r["status"] for r in rows] == ["ok"], rows
    assert verify(path)[0] == 5
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    code, rows = verify(path, "--manifest", manifest)
    assert code == 4 and rows[0]["detail"] == "SHA-256 mismatch"
    path.write_bytes(bytes(data[:len(data) // 2]))
    code, rows = verify(path, "--manifest", manifest)
    assert code == 4 and "not a readable GGUF file" in rows[0]["detail"]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q2_K"])
def test_quant_keep_holds_llama_cpp_blocks_unchanged(qtype, tmp_path):
    """Block types without a native codec are kept as llama.cpp's own blocks (codec gguf-<type>): each
    tensor decodes to exactly what the gguf dequantizer gives for its source blocks (experts sliced out
    of the merged tensors), and a Q4_0 file runs with the logits of the same values converted to f32."""

    from kimistream.formats.codecs import get_codec
    from kimistream.formats.weightfile import WeightFile
    src, _ = _source("stdlib-moe")
    g = write_gguf(src, tmp_path / "m.gguf", gguf.GGMLQuantizationType[qtype])

    proc = _run("kimistream.convert.cli", g, "-o", tmp_path / "keep.kst", "--quant", "keep", "--quiet")
    assert proc.returncode == 0, proc.stderr
    m = GGUFModel(g)
    with WeightFile(tmp_path / "keep.kst") as wf:
        kept = [n for n, t in wf.tensors.items() if t.codec == f"gguf-{qtype.lower()}"]
        assert len(kept) > 100            # rows not whole blocks fall back to F16, as llama.cpp does
        halves = [n for n in wf.tensors if n.endswith((".k_b_proj.weight", ".v_b_proj.weight"))]
        whole = [n for n in wf.tensors if n.endswith("kv_b_proj.weight")]
        if qtype == "Q4_0":
            # MLA's quantized attn_k_b / attn_v_b kept as they are, not put back together (and
            # requantized) as kv_b
            assert not whole and len(halves) == 10
            assert all(wf.tensors[n].codec == "gguf-q4_0" for n in halves)
        else:                             # too narrow for Q2_K: F16 halves, put back together exactly
            assert not halves and len(whole) == 5 and all(wf.tensors[n].codec == "f16" for n in whole)
        for name in kept[::7] + kept[-3:] + halves:
            t = wf.tensors[name]
            assert np.array_equal(get_codec(t.codec).decode(wf.raw(name), t.shape), m.read(name)), name
    if qtype != "Q4_0":
        return
    kept, f32 = _kept_and_f32_logits(g, tmp_path, "--gguf-inputs", "f32")
    # the same values: what differs is the order of float32 sums (C products against BLAS)
    assert np.abs(kept - f32).max() <= 1e-5 * np.abs(f32).max()
    # by default the kept blocks take their inputs rounded to 8 bits as llama.cpp does: other logits
    # (llama.cpp's, held to its rounding rule in test_ggml_kernels.py), still close to the values'
    default = tmp_path / "default.npy"
    proc = _run("kimistream.runtime.cli", "--weights", tmp_path / "keep.kst", "--prompt", "import os",
                "--max-tokens", 2, "--dump-logits", default, "--kv-dtype", "f32", "--quiet")
    assert proc.returncode == 0, proc.stderr
    rounded = np.load(default)
    assert 1e-4 * np.abs(f32).max() < np.abs(rounded - f32).max() < 0.05 * np.abs(f32).max()


def _kept_and_f32_logits(gguf_path: Path, tmp_path: Path, *run_args):
    """The prompt logits of tmp_path/keep.kst (kimi-run given run_args) and of the GGUF converted to
    f32 (both with an f32 KV cache)."""
    runs = [("kimistream.convert.cli", gguf_path, "-o", tmp_path / "f32.kst", "--quant", "f32", "--quiet")]
    runs += [("kimistream.runtime.cli", "--weights", tmp_path / f"{f}.kst", "--prompt", "import os", "--max-tokens", 2,
              "--dump-logits", tmp_path / f"{f}.npy", "--kv-dtype", "f32", "--quiet", *(run_args if f == "keep" else ()))
             for f in ("keep", "f32")]
    for args in runs:
        proc = _run(*args)
        assert proc.returncode == 0, proc.stderr
    return np.load(tmp_path / "keep.npy"), np.load(tmp_path / "f32.npy")


def test_gguf_block_sizes_are_llama_cpps():
    from kimistream.formats.ggufcodecs import BLOCK_SIZES
    for t, sizes in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]] == sizes, t


def test_end_of_turn_ids_of_a_gguf_end_generation(tmp_path):
    """llama.cpp stops at tokenizer.ggml.eot_token_id and eom_token_id as well as at eos: the rebuilt
    tokenizer carries them in generation_config.json (so kimi-run stops there too); without them none
    is written; an id outside the vocabulary is one error naming the key."""
    from kimistream.runtime.tokenizer import Tokenizer
    src, _ = _source("stdlib-moe")
    kind, files = GGUFModel(write_gguf(src, tmp_path / "plain.gguf")).tokenizer_files()
    assert "generation_config.json" not in files
    eos = Tokenizer(kind, files).eos_id
    kind, files = GGUFModel(write_gguf(src, tmp_path / "chat.gguf", end_ids={"eot": 7, "eom": 9})).tokenizer_files()
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [eos, 7, 9]}
    assert Tokenizer(kind, files).stop_ids == {eos, 7, 9}
    bad = write_gguf(src, tmp_path / "bad.gguf", end_ids={"eot": 10 ** 6})
    with pytest.raises(GGUFError, match="metadata key tokenizer.ggml.eot_token_id: 1000000 is not a token id"):
        GGUFModel(bad).tokenizer_files()


@pytest.mark.parametrize("key,value,message", [
    ("deepseek2.block_count", 100_000_000_000,
     "metadata key deepseek2.block_count is 100000000000, but the file holds tensors of 5 layers"),
    ("deepseek2.block_count", [1, 2], "metadata key deepseek2.block_count: a value of the wrong type or range"),
    ("deepseek2.block_count", "five", "metadata key deepseek2.block_count: a value of the wrong type or range"),
    ("deepseek2.expert_gating_func", "sigmoid", "metadata key deepseek2.expert_gating_func: a value of the wrong type"),
    ("tokenizer.ggml.bos_token_id", 99999, "metadata key tokenizer.ggml.bos_token_id is 99999, outside the"),
    ("tokenizer.ggml.merges", [1, 2], "metadata key tokenizer.ggml.merges: a value of the wrong type or range"),
    ("tokenizer.ggml.token_type", [1], "metadata key tokenizer.ggml.token_type: 1 entries for"),
])
def test_metadata_of_the_wrong_type_or_range_is_one_error_naming_the_key(tmp_path, monkeypatch, key, value, message):
    """A value llama.cpp's writer would not give (a huge block_count had made the name map loop for
    ever; others ended in IndexError, AttributeError or TypeError tracebacks)."""
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    real = GGUFModel._get

    def get(self, k, default=None, required=False):
        got = real(self, k, default, required)          # names the key being read
        return value if k == key else got
    monkeypatch.setattr(GGUFModel, "_get", get)
    with pytest.raises(GGUFError) as e:
        GGUFModel(path).tokenizer_files()
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)


def test_kimi_verify_rebuilds_a_gguf_config_as_a_conversion_does(tmp_path, monkeypatch):
    """A GGUF whose metadata a conversion refuses (no attention heads) is CORRUPT to kimi-verify, not
    "structure ok"."""
    from kimistream.convert.verify import CORRUPT, verify_gguf
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    assert verify_gguf(path, None)[0].status != CORRUPT
    real = GGUFModel._get
    monkeypatch.setattr(GGUFModel, "_get", lambda self, k, default=None, required=False:
                        0 if k == "deepseek2.attention.head_count" else real(self, k, default, required))
    (row,) = verify_gguf(path, None)
    assert row.status == CORRUPT and row.detail.startswith("metadata: ") and "num_attention_heads" in row.detail, row


def test_kimi_verify_checks_a_gguf_tensors_shapes_against_its_metadata(tmp_path, monkeypatch):
    """A GGUF whose metadata gives half the experts' width (its tensors disagree, as a conversion
    refuses) is CORRUPT to kimi-verify, naming a tensor, not "structure ok"."""
    from kimistream.convert.verify import CORRUPT, verify_gguf
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    real = GGUFModel._get

    def get(self, k, default=None, required=False):
        got = real(self, k, default, required)
        return got // 2 if k == "deepseek2.expert_feed_forward_length" else got
    monkeypatch.setattr(GGUFModel, "_get", get)
    (row,) = verify_gguf(path, None)
    assert row.status == CORRUPT and row.detail.startswith("tensor ") and "its metadata implies" in row.detail, row


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q2_K"])
def test_quant_keep_refuses_a_block_whose_scale_is_not_finite(qtype, tmp_path):
    """A NaN in one block's binary16 scale had been copied into the weight file (and decoded to zeros
    at run time); the scale at the offset the layout table gives is the one llama.cpp's dequantizer
    turns the whole block into NaN with."""
    from kimistream.formats.ggufcodecs import BLOCK_SIZES, SCALE_OFFSETS
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf", gguf.GGMLQuantizationType[qtype])
    t = next(t for t in gguf.GGUFReader(path).tensors
             if t.name == "blk.0.attn_q_a.weight" or (t.tensor_type.name == qtype and "attn" in t.name))
    assert t.tensor_type.name == qtype
    size = 34 if qtype == "Q8_0" else BLOCK_SIZES[qtype][1]
    off = int(t.data_offset) + size + SCALE_OFFSETS[qtype][0]            # the second block's scale
    data = bytearray(path.read_bytes())
    data[off:off + 2] = np.float16(np.nan).tobytes()
    path.write_bytes(bytes(data))
    bad = gguf.GGUFReader(path).tensors[[x.name for x in gguf.GGUFReader(path).tensors].index(t.name)]
    values = gguf.quants.dequantize(np.asarray(bad.data), bad.tensor_type).reshape(-1)
    block = BLOCK_SIZES.get(qtype, (32,))[0]
    assert np.isnan(values[block:2 * block]).all() and np.isfinite(values[:block]).all()
    proc = _run("kimistream.convert.cli", path, "-o", tmp_path / "k.kst", "--quant", "keep", "--quiet")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"kimi-convert: error: {path}: tensor {t.name}: a block's scale is NaN or Inf"
    assert not (tmp_path / "k.kst").exists()


@pytest.mark.parametrize("qtype", sorted(__import__("kimistream.formats.ggufcodecs", fromlist=["x"]).SCALE_OFFSETS))
def test_the_scale_offsets_are_where_llama_cpp_keeps_each_types_scales(qtype):
    """For every type in the table: a block of random bytes with finite binary16 at the listed offsets
    decodes (the gguf package's dequantizer) to finite values, and NaN at any one of them makes the
    block NaN; finite_scales says the same."""
    from kimistream.formats.ggufcodecs import BLOCK_SIZES, SCALE_OFFSETS, finite_scales
    n, size = (32, 34) if qtype == "Q8_0" else BLOCK_SIZES[qtype]
    kind = gguf.GGMLQuantizationType[qtype]
    assert gguf.GGML_QUANT_SIZES[kind] == (n, size)
    block = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        block[off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    assert np.isfinite(gguf.quants.dequantize(block[None], kind)).all() and finite_scales(qtype, block, size)
    for off in SCALE_OFFSETS[qtype]:
        bad = block.copy()
        bad[off:off + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):          # inf x 0 in the dequantizer
            decoded = gguf.quants.dequantize(bad[None], kind)
        assert not np.isfinite(decoded).all() and not finite_scales(qtype, bad, size)


def test_iq1_m_scale_spread_over_nibbles_is_checked():
    """IQ1_M keeps its binary16 d in the top nibbles of its four scale words (bytes 48-55): a finite d
    there decodes (the gguf package's dequantizer) to finite values and passes, Inf makes the block
    NaN and is refused."""
    from kimistream.formats.ggufcodecs import BLOCK_SIZES, finite_scales
    n, size = BLOCK_SIZES["IQ1_M"]
    kind = gguf.GGMLQuantizationType.IQ1_M

    def with_d(value):
        block = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        d = int(np.frombuffer(np.float16(value).tobytes(), np.uint16)[0])
        words = block[48:56].view(np.uint16).copy()
        for i in range(4):
            words[i] = (words[i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        block[48:56] = words.view(np.uint8)
        return block

    good, bad = with_d(0.01), with_d(np.inf)
    assert np.isfinite(gguf.quants.dequantize(good[None], kind)).all() and finite_scales("IQ1_M", good, size)
    with np.errstate(invalid="ignore", over="ignore"):
        assert not np.isfinite(gguf.quants.dequantize(bad[None], kind)).all()
    assert not finite_scales("IQ1_M", bad, size)


def test_a_dry_run_of_quant_keep_plans_each_tensors_own_type(tmp_path):
    """--dry-run with --quant keep plans the codecs the file will hold (it had planned every tensor as
    f32: 3.7x the file, then kv_b whole in f32 where the file keeps its two Q8_0 halves: 1.6 % over);
    the tokenizer's bytes are known, so the size is the file's to a few alignment blocks (the header's
    JSON is estimated), and the resident bytes are those kimi-run plans for the file."""
    src, _ = _source("stdlib-moe")
    q8 = write_gguf(src, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    dry = json.loads(_run("kimistream.convert.cli", q8, "--quant", "keep", "--dry-run", "--json").stdout)
    out = tmp_path / "k.kst"
    assert _run("kimistream.convert.cli", q8, "-o", out, "--quant", "keep", "--quiet").returncode == 0
    assert abs(dry["file_bytes"] - out.stat().st_size) <= 4 * 4096, (dry["file_bytes"], out.stat().st_size)
    run = json.loads(_run("kimistream.runtime.cli", "--weights", out, "--dry-run", "--json").stdout)
    assert dry["resident_bytes"] == run["memory_plan"]["resident"]


# ---------------------------------------------------------------------- headers walked with bounds
def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _count_offset(path: Path, key: str) -> int:
    """Where an array key's element count lies in the file (after its name, type and item type)."""
    f = gguf.GGUFReader(path).fields[key]
    return f.offset + 8 + len(bytes(f.parts[1])) + 4 + 4


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _damaged(path: Path, out: Path, offset: int, value: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.timeout(60)
def test_an_array_count_or_string_length_past_the_end_of_the_file_is_refused_at_once(tmp_path):
    """gguf.GGUFReader loops once per element an array claims, and past the end of the file reads
    empty arrays, not an error: a uint8 array of 2**40 in a 49-byte file, or one byte of a real file's
    tokenizer.ggml.token_type count damaged, ran for ever with memory growing (kimi-convert,
    kimi-verify). Every length and count is now checked against the bytes left first: one line naming
    the file and the key, in well under a second."""
    import resource
    import time
    src, _ = _source("stdlib-moe")
    good = write_gguf(src, tmp_path / "m.gguf")
    n_tokens = len(gguf.GGUFReader(good).fields["tokenizer.ggml.tokens"].data)
    top = 1 << 56                        # the count's top byte 0x00 -> 0x01
    cases = [                            # value types: 0 UINT8, 5 INT32, 8 STRING, 9 ARRAY
        (_written(tmp_path / "u8.gguf", _header(0, 1) + _key("a") + struct.pack("<IIQ", 9, 0, 1 << 40)), "a",
         "an array of 1099511627776 UINT8 values needs 1099511627776 bytes at offset 49, but the file has 0 left"),
        (_written(tmp_path / "i32.gguf", _header(0, 1) + _key("general.architecture") +
                  struct.pack("<IIQ", 9, 5, 1 << 62)),
         "general.architecture", "an array of 4611686018427387904 INT32 values needs"),
        (_written(tmp_path / "str.gguf", _header(0, 1) + _key("general.name") + struct.pack("<IQ", 8, 1 << 40) + b"x"),
         "general.name", "a string of 1099511627776 bytes needs 1099511627776 bytes at offset 56"),
        (_damaged(good, tmp_path / "types.gguf", _count_offset(good, "tokenizer.ggml.token_type"), top + n_tokens),
         "tokenizer.ggml.token_type", f"an array of {top + n_tokens} INT32 values needs"),
        (_damaged(good, tmp_path / "tokens.gguf", _count_offset(good, "tokenizer.ggml.tokens"), top + n_tokens),
         "tokenizer.ggml.tokens", f"an array of {top + n_tokens} STRING values (each at least its 8-byte length) needs"),
    ]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for path, key, what in cases:
        t = time.monotonic()
        with pytest.raises(GGUFError) as e:
            GGUFModel(path)
        assert time.monotonic() - t < 5
        msg = str(e.value)
        assert msg.startswith(f"{path}: not a readable GGUF file: metadata key {key}: ") and what in msg, msg
        assert "\n" not in msg
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000          # KiB
    # a count damaged but inside the file sends the walk into other bytes: what it meets there is
    # refused, named with the key it came from
    near = _damaged(good, tmp_path / "near.gguf", _count_offset(good, "tokenizer.ggml.token_type"), n_tokens + 4096)
    with pytest.raises(GGUFError, match=r"\(after metadata key tokenizer\.ggml\.token_type\)"):
        GGUFModel(near)
    # kimi-verify: a CORRUPT row naming the key; kimi-convert: one line, exit 1
    from kimistream.convert.verify import CORRUPT, verify_gguf
    (row,) = verify_gguf(tmp_path / "types.gguf", None)
    assert row.status == CORRUPT and "metadata key tokenizer.ggml.token_type: an array of" in row.detail, row
    proc = _run("kimistream.convert.cli", tmp_path / "types.gguf", "-o", tmp_path / "x.kst", "--quiet")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "tokenizer.ggml.token_type" in proc.stderr and not (tmp_path / "x.kst").exists()


def _patched(good: Path, out: Path, tensor: str, part: int, index: int, value: int) -> Path:
    """A copy of `good` with one tensor-info field changed (parts: name length, name, n_dims, dims,
    type, offset)."""
    out.write_bytes(good.read_bytes())
    r = gguf.GGUFReader(out, "r+")
    next(t for t in r.tensors if t.name == tensor).field.parts[part][index] = value
    r.data.flush()
    del r
    return out


def test_tensors_must_lie_where_llama_cpp_requires(tmp_path):
    """llama.cpp's gguf_init_from_file requires each tensor to start where the one before it (in file
    order) ends, padded to general.alignment, and inside the file; kimi-stream had read a tensor
    wherever its offset pointed (offset 0: token_embd's bytes as attn_q_a's values; +4: accepted).
    Each such file is now refused, naming the file and the tensor, before any tensor is read."""
    from kimistream.convert.verify import CORRUPT, verify_gguf
    src, _ = _source("stdlib-moe")
    good = write_gguf(src, tmp_path / "m.gguf")
    r = gguf.GGUFReader(good)
    names = [t.name for t in r.tensors]
    name = "blk.0.attn_q_a.weight"
    assert names.index(name) > names.index("token_embd.weight")
    offset = int(next(t for t in r.tensors if t.name == name).field.parts[5][0])
    del r
    OFFSET, TYPE, DIMS = 5, 4, 3
    cases = [
        (OFFSET, 0, 0, f"at data offset 0 overlaps the tensor before it (llama.cpp requires offset {offset}"),
        (OFFSET, 0, offset + 4,
         f"at data offset {offset + 4} is not aligned to 32 (llama.cpp requires offset {offset}"),
        (OFFSET, 0, offset + 32, f"at data offset {offset + 32} leaves a gap after the tensor before it"),
        (OFFSET, 0, 1 << 40, "ends past the end of the file"),
        (TYPE, 0, 99, "has unknown type 99"),
        (DIMS, 1, 1 << 40, "(1125899906842624 bytes at data offset"),
        (DIMS, 0, 1 << 63, "has a negative dimension"),
    ]
    for i, (part, index, value, what) in enumerate(cases):
        bad = _patched(good, tmp_path / f"bad{i}.gguf", name, part, index, value)
        with pytest.raises(GGUFError) as e:
            GGUFModel(bad)
        msg = str(e.value)
        assert msg.startswith(f"{bad}: not a readable GGUF file: tensor {name} ") and what in msg, msg
        assert "\n" not in msg
    (row,) = verify_gguf(tmp_path / "bad0.gguf", None)
    assert row.status == CORRUPT and row.detail.startswith(f"not a readable GGUF file: tensor {name} at data offset 0")


@pytest.mark.parametrize("alignment", [8, 64])
def test_gguf_writer_files_of_any_alignment_read_back_alike(alignment, tmp_path, monkeypatch):
    """The layout rule holds for what gguf.GGUFWriter writes, at general.alignment other than 32 too:
    the same tensors as the default-aligned file's, bit for bit."""
    src, _ = _source("stdlib-moe")
    base = GGUFModel(write_gguf(src, tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_0))
    real = gguf.GGUFWriter.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.add_custom_alignment(alignment)
    monkeypatch.setattr(gguf.GGUFWriter, "__init__", init)
    path = write_gguf(src, tmp_path / "a.gguf", gguf.GGMLQuantizationType.Q4_0)
    assert gguf.GGUFReader(path).alignment == alignment
    m = GGUFModel(path)
    assert m.names() == base.names()
    for name in m.names():
        assert np.array_equal(m.read(name), base.read(name)), name


def test_a_missing_expert_gating_func_is_softmax_as_in_llama_cpp(tmp_path, monkeypatch):
    """DeepSeek V2 / V2.5 GGUFs predate deepseek2.expert_gating_func: llama.cpp's deepseek2 loader
    takes softmax when it is missing (or 0), sigmoid only for GLM 4.7 Lite (47 or 48 layers besides
    the MTP ones, a vocabulary of 154880); kimi-stream had taken sigmoid."""
    src, _ = _source("stdlib-moe")
    written = GGUFModel(write_gguf(src, tmp_path / "m.gguf"))
    assert written.config["scoring_func"] == "sigmoid"           # the key written: as written
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_gating_func", lambda self, value: None)
    path = write_gguf(src, tmp_path / "nokey.gguf")
    assert "deepseek2.expert_gating_func" not in gguf.GGUFReader(path).fields
    m = GGUFModel(path)
    assert m.config["scoring_func"] == "softmax"
    values = {"deepseek2.expert_gating_func": 0}
    real = GGUFModel._get
    monkeypatch.setattr(GGUFModel, "_get", lambda self, k, default=None, required=False:
                        values[k] if k in values else real(self, k, default, required))
    assert GGUFModel(path).config["scoring_func"] == "softmax"    # 0 (none) as missing
    for layers, nextn, vocab, want in ((48, 0, 154880, 2), (48, 1, 154880, 2), (49, 1, 154880, 2),
                                       (49, 0, 154880, 1), (48, 0, 154881, 1)):
        values.update({"deepseek2.block_count": layers, "deepseek2.nextn_predict_layers": nextn,
                       "deepseek2.vocab_size": vocab})
        assert m._default_gating(None) == want, (layers, nextn, vocab)


def test_a_gguf_truncated_while_it_is_read_is_one_line(tmp_path):
    """gguf's reader maps the whole file: one truncated under a conversion (another program, a full
    disk) faults on the next read of a lost page. The process then says so in one line naming the
    file (mapguard) and exits 1, not silently by SIGBUS."""
    src, _ = _source("stdlib-moe")
    path = write_gguf(src, tmp_path / "m.gguf")
    script = (
        "import os, sys\n"
        "from kimistream.formats.gguffile import GGUFModel\n"
        "m = GGUFModel(sys.argv[1])\n"
        "names = sorted(m.names(), key=lambda n: -m.shape(n)[0])\n"
        "os.truncate(sys.argv[1], 4096)\n"
        "for n in names:\n"
        "    m.read(n)\n"
        "print('read it all')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "a memory-mapped file could not be read" in lines[0] and str(path) in lines[0]
