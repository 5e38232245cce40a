"""GGUF files made by llama.cpp, run by llama.cpp and by kimi-run after `kimi-convert --quant keep`:
the KL between the two programs' logits on held-out text, and their speed side by side.

    python benchmarks/bench_gguf_llamacpp.py [--llama-dir DIR] [--workdir DIR] [--models stdlib-moe,manpages-moe]
        [--types Q2_K,IQ2_XXS,IQ1_S] [--windows 4] [--window 256] [--repeats 3] [--speed-gguf FILE.gguf] [--json]

For each bundled model (models/NAME, a trained DeepseekV3):
1. llama.cpp's own converter writes an F32 GGUF (`convert_hf_to_gguf.py --outtype f32`, run from the
   wrapper in bench_llamacpp.py that answers its unknown pre-tokenizer hash with "gpt-2");
2. `llama-imatrix` on the first 16 000 bytes of data/NAME-heldout.txt, then `llama-quantize --imatrix`
   to each type (llama.cpp's own mix: tensors whose rows are not whole 256-weight blocks fall back
   to its legacy types);
3. `kimi-convert X.gguf -o X.kst --quant keep`: every block kept as it is;
4. logits of --windows windows of --window tokens of the held-out text after the calibration bytes
   (tokenized once, by the file's tokenizer, and fed as ids to both), from llama.cpp through its
   Python bindings (`llama_cpp` from the llama-cpp-python sdist, loading the libllama built here:
   n_ctx = n_batch = n_ubatch = the window, logits for every position, flash attention off, F32 KV
   cache, weight repacking off, so nothing but the weights and each engine's arithmetic differ) and from kimi-stream's
   Model in this process; KL(llama.cpp || kimi-stream) per position, and the share of positions
   whose top-1 token agrees;
5. the control: the same quantized GGUF with every quantized tensor replaced by its F32 values
   (the gguf package's dequantizer), run by llama.cpp, against the same kimi-stream file. If the
   transcoding and our decoders are exact this KL is at float32 rounding. kimi-stream runs the
   control with `--gguf-inputs f32` (kernels.set_gguf_inputs("f32"): float32 activations times the
   exactly decoded weights, which is what llama.cpp computes on F32 weights) and step 4 with the
   default, llama.cpp's own rounding of the activations to 8 bits (Q8_K / Q8_0 / Q8_1) before each
   product by a block type; with it, step 4 should approach the control.

Speed (--speed-gguf FILE, e.g. the Q2_K file bench_llamacpp.py makes, model-Q2_K.gguf in its work
directory): that GGUF transcoded, then `llama-bench` on the GGUF and `kimi-run` on the transcoded
file, alternating rounds (bench_llamacpp.measure), warm. Same weights, bit for bit, in both.

llama.cpp is a benchmark-only peer, built outside the repository (see bench_llamacpp.py). The
bindings are found under --llama-python (default: the sdist directory the llama.cpp tree lives in).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp as bl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION_BYTES = 16_000


def log(msg: str) -> None:
    print(f"bench_gguf_llamacpp: {msg}", file=sys.stderr, flush=True)


def f32_gguf(llama: Path, model_dir: Path, out: Path) -> None:
    if out.exists():
        return
    part = out.with_name(out.name + ".partial")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama), str(llama / "gguf-py")]))
    args = [model_dir, "--outtype", "f32", "--outfile", part]
    bl.run([sys.executable, "-c", bl._GGUF_WRAPPER, llama, *args], env=env, capture=True,
           shown=shlex.join(["python", str(llama / "convert_hf_to_gguf.py"), *map(str, args)]) + "  (via the wrapper)")
    part.rename(out)


def imatrix(llama: Path, f32: Path, text: str, out: Path, threads: int) -> None:
    if out.exists():
        return
    calib = out.with_suffix(".txt")
    calib.write_text(text)
    part = out.with_name(out.name + ".partial.gguf")
    bl.run([bl.find_tool(llama, "llama-imatrix"), "-m", f32, "-f", calib, "-o", part, "-c", 256, "-t", threads],
           capture=True)
    part.rename(out)


def quantize(llama: Path, f32: Path, imat: Path, qtype: str, out: Path, threads: int) -> None:
    if out.exists():
        return
    part = out.with_name(out.name + ".partial")
    bl.run([bl.find_tool(llama, "llama-quantize"), "--imatrix", imat, f32, part, qtype, threads], capture=True)
    part.rename(out)


def transcode(src: Path, out: Path) -> None:
    if out.exists():
        return
    part = out.with_name(out.name + ".tmp.kst")
    bl.run([sys.executable, "-m", "kimistream.convert.cli", src, "-o", part, "--quant", "keep", "--quiet"], capture=True)
    part.rename(out)


def dequantized_copy(src: Path, out: Path) -> None:
    """The GGUF at src with every quantized tensor stored as F32 (gguf's dequantizer); metadata as is."""
    if out.exists():
        return
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    part = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(part), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))          # numpy order
        if t.tensor_type in float_types:
            a = np.asarray(t.data).reshape(shape)
            w.add_tensor(t.name, a.astype(np.float32) if t.tensor_type == gguf.GGMLQuantizationType.BF16 else a)
        else:
            w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.rename(out)


def type_census(path: Path) -> dict:
    import gguf
    r = gguf.GGUFReader(str(path))
    out: dict = {}
    for t in r.tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_elements)
    return out


# ------------------------------------------------------------------------------------ logits

class LlamaLogits:
    def __init__(self, bindings: Path, lib: Path, threads: int):
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib))
        sys.path.insert(0, str(bindings))
        import llama_cpp
        import llama_cpp.llama
        defaults = llama_cpp.llama_model_default_params

        def no_repack():
            # llama.cpp's CPU weight repacking (Q4_0 into interleaved rows) takes tensors its MLA graph
            # then cannot run (a scheduler assert on these files); off, every tensor stays as stored
            p = defaults()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama.llama_cpp.llama_model_default_params = no_repack
        self.llama_cpp, self.threads = llama_cpp, threads

    def __call__(self, path: Path, windows: list[list[int]]) -> list[np.ndarray]:
        n = len(windows[0])
        llm = self.llama_cpp.Llama(str(path), n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=self.threads,
                                   flash_attn=False, type_k=self.llama_cpp.GGML_TYPE_F32,
                                   type_v=self.llama_cpp.GGML_TYPE_F32, verbose=False)
        out = []
        for win in windows:
            llm.reset()
            llm.eval(win)
            out.append(np.array(llm.scores[:len(win)], dtype=np.float32))
        llm.close()
        return out


def kimi_logits(path: Path, windows: list[list[int]], inputs: str = "llama.cpp") -> list[np.ndarray]:
    """kimi-stream's logits of each window, products by llama.cpp's blocks taking `inputs` (kimi-run
    --gguf-inputs)."""
    from kimistream.runtime import kernels
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    kernels.set_gguf_inputs(inputs)
    w = ModelWeights(path)
    w.load_resident()
    m = Model(w, len(windows[0]) + 1)
    out = []
    for win in windows:
        m.reset()
        out.append(m.forward(np.asarray(win), all_logits=True).astype(np.float32))
    w.close()
    return out


def compare(ref: list[np.ndarray], ours: list[np.ndarray]) -> dict:
    """KL(ref || ours) per position (float64), mean and max; top-1 agreement."""
    kls, agree = [], []
    for a, b in zip(ref, ours):
        la = a.astype(np.float64) - np.logaddexp.reduce(a.astype(np.float64), axis=-1, keepdims=True)
        lb = b.astype(np.float64) - np.logaddexp.reduce(b.astype(np.float64), axis=-1, keepdims=True)
        kls.append((np.exp(la) * (la - lb)).sum(-1))
        agree.append(a.argmax(-1) == b.argmax(-1))
    kl, ag = np.concatenate(kls), np.concatenate(agree)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(ag.mean()), "positions": int(kl.size)}


def windows_of(kst: Path, text: str, n: int, size: int) -> list[list[int]]:
    """n windows of `size` token ids of text, by the tokenizer the file carries (no BOS added)."""
    from kimistream.formats.weightfile import WeightFile
    from kimistream.runtime.tokenizer import Tokenizer
    with WeightFile(kst) as wf:
        meta = wf.header.get("tokenizer") or {}
        tok = Tokenizer(meta.get("kind", ""), {f: wf.blob(f) for f in meta.get("files", [])})
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n * size:
        raise SystemExit(f"bench_gguf_llamacpp: the held-out text gives {len(ids)} tokens, need {n * size}")
    return [list(map(int, ids[i * size:(i + 1) * size])) for i in range(n)]


# ------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-dir", default=bl.default_llama_dir())
    ap.add_argument("--llama-python", default=None, help="directory holding the llama_cpp package (bindings)")
    ap.add_argument("--workdir", default="/tmp/kimi-bench-gguf")
    ap.add_argument("--models", default="stdlib-moe,manpages-moe", help="bundled models ('' for none)")
    ap.add_argument("--types", default="Q2_K,IQ2_XXS,IQ1_S")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-gguf", default=None, help="a GGUF to time both engines on (same weights)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    llama = Path(a.llama_dir).resolve()
    for tool in ("llama-imatrix", "llama-quantize"):
        bl.find_tool(llama, tool)
    bindings = Path(a.llama_python) if a.llama_python else llama.resolve().parent.parent
    logits_of = LlamaLogits(bindings, bl.find_tool(llama, "llama-quantize").parent, a.threads)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in [m for m in a.models.split(",") if m]:
        text = (ROOT / "data" / f"{model.split('-')[0]}-heldout.txt").read_text()
        d = work / model
        d.mkdir(exist_ok=True)
        f32 = d / "f32.gguf"
        f32_gguf(llama, ROOT / "models" / model, f32)
        imat = d / "imatrix.gguf"
        imatrix(llama, f32, text[:CALIBRATION_BYTES], imat, a.threads)
        f32_kst = d / "f32.kst"
        transcode(f32, f32_kst)
        wins = windows_of(f32_kst, text[CALIBRATION_BYTES + 4000:], a.windows, a.window)
        for qtype in ["F32"] + a.types.split(","):
            q = f32 if qtype == "F32" else d / f"{qtype}.gguf"
            if qtype != "F32":
                quantize(llama, f32, imat, qtype, q, a.threads)
            kst = d / f"{qtype}.kst"
            transcode(q, kst)
            t0 = time.perf_counter()
            ref, ours = logits_of(q, wins), kimi_logits(kst, wins)
            row = {"model": model, "type": qtype, "gguf_bytes": q.stat().st_size, "kst_bytes": kst.stat().st_size,
                   "census": type_census(q), "vs_llamacpp": compare(ref, ours)}
            if qtype != "F32":
                deq = d / f"{qtype}-dequantized.gguf"
                dequantized_copy(q, deq)
                row["vs_dequantized_in_llamacpp"] = compare(logits_of(deq, wins), kimi_logits(kst, wins, "f32"))
                row["llamacpp_quant_vs_dequantized"] = compare(logits_of(deq, wins), ref)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            log(json.dumps({k: row[k] for k in row if k != "census"}))
            rows.append(row)
    speed = None
    if a.speed_gguf:
        src = Path(a.speed_gguf)
        kst = work / (src.stem + "-keep.kst")
        transcode(src, kst)
        a.llama_depth, a.kimi_arg = 0, []
        theirs, ours = bl.measure(bl.LlamaBench(llama, src, a), bl.KimiRun(kst, a), a.repeats)
        speed = {"gguf": str(src), "census": type_census(src), "llama_cpp": theirs, "kimi_stream": ours,
                 "ratio_prefill": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
                 "ratio_decode": ours["decode_tok_s"] / theirs["decode_tok_s"]}
    result = {"command": shlex.join([sys.executable, *sys.argv]), "rows": rows, "speed": speed}
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print("\n| model | type | GGUF bytes | KL(llama.cpp ‖ ours) mean | max | top-1 | KL(llama.cpp on dequantized F32 ‖ ours, "
          "--gguf-inputs f32) mean | top-1 | KL(llama.cpp dequantized ‖ llama.cpp quantized) mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        v, c = r["vs_llamacpp"], r.get("vs_dequantized_in_llamacpp")
        s = r.get("llamacpp_quant_vs_dequantized")
        print(f"| {r['model']} | {r['type']} | {r['gguf_bytes']:,} | {v['kl_mean']:.3g} | {v['kl_max']:.3g} | "
              f"{v['top1']:.4f} | {c['kl_mean']:.3g} | {c['top1']:.4f} | {s['kl_mean']:.3g} |" if c else
              f"| {r['model']} | {r['type']} | {r['gguf_bytes']:,} | {v['kl_mean']:.3g} | {v['kl_max']:.3g} | "
              f"{v['top1']:.4f} | | | |")
    if speed:
        print(f"\nspeed on {speed['gguf']} (types by weights: {speed['census']}):")
        for name in ("llama_cpp", "kimi_stream"):
            r = speed[name]
            print(f"  {name}: prefill {r['prefill_tok_s']:.2f} ± {r['prefill_stddev']:.2f} tok/s, "
                  f"decode {r['decode_tok_s']:.2f} ± {r['decode_stddev']:.2f} tok/s  ({r['command']})")
        print(f"  ours / llama.cpp: prefill {speed['ratio_prefill']:.3f}x, decode {speed['ratio_decode']:.3f}x")
    print(f"\ncommand: {result['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
