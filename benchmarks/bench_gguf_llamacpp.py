"""llama.cpp's own quantizations of a bundled model, transcoded with `kimi-convert --quant keep` and run
by both programs: KL between llama.cpp's logits and kimi-run's on held-out text (the same weights,
so it should be near zero), top-1 agreement, and warm tok/s side by side. Prints one JSON object.

    python benchmarks/bench_gguf_llamacpp.py [--llama-dir DIR] [--workdir DIR] [--model stdlib-moe]
        [--types Q2_K IQ2_XXS IQ1_S] [--windows 4] [--threads 2]

1. `convert_hf_to_gguf.py --outtype f32` on models/MODEL (through bench_llamacpp's wrapper, which only
   answers an unknown pre-tokenizer hash), `llama-imatrix` over the start of the model's held-out
   text file's complement (its first 16 KB are measured on, the windows scored come after them),
   then `llama-quantize --imatrix` to each type.
2. `kimi-convert X.gguf -o X.kst --quant keep` (every block kept).
3. The held-out text, tokenized once by the weight file's tokenizer, cut into windows of 256 tokens;
   both programs get the same token ids. kimi-stream's logits from its runtime (`Model.forward`, all
   positions); llama.cpp's from the llama-cpp-python bindings of the sdist the tree came from
   (`LLAMA_CPP_LIB_PATH` = the tree's build/bin, `logits_all`).
4. Speed: `llama-bench -p 256 -n 32` and `kimi-run --prompt ... --max-tokens 32` on the same file, warm.

Build llama.cpp as bench_llamacpp.py's docstring says, with shared libraries and the tools used here:

    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DBUILD_SHARED_LIBS=ON
    cmake --build build -j2 --target llama llama-quantize llama-imatrix llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp import _GGUF_WRAPPER, default_llama_dir, find_tool, log, run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = {"stdlib-moe": "stdlib-heldout.txt", "manpages-moe": "manpages-heldout.txt"}
CALIBRATION_CHARS = 16_000
WINDOW = 256


def f32_gguf(llama: Path, model: str, d: Path) -> Path:
    out = d / f"{model}-f32.gguf"
    if not out.exists():
        part = out.with_name(out.name + ".partial")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama), str(llama / "gguf-py")]))
        args = [ROOT / "models" / model, "--outtype", "f32", "--outfile", part]
        run([sys.executable, "-c", _GGUF_WRAPPER, llama, *args], env=env, capture=True,
            shown=shlex.join(["python", str(llama / "convert_hf_to_gguf.py"), *map(str, args)]))
        part.rename(out)
    return out


def quantized(llama: Path, src: Path, kind: str, imatrix: Path, threads: int) -> Path:
    out = src.with_name(src.name.replace("-f32.gguf", f"-{kind}.gguf"))
    if not out.exists():
        part = out.with_name(out.name + ".partial")
        run([find_tool(llama, "llama-quantize"), "--imatrix", imatrix, src, part, kind, threads], capture=True)
        part.rename(out)
    return out


def make_imatrix(llama: Path, src: Path, text: str, threads: int) -> Path:
    out = src.with_name(src.name.replace("-f32.gguf", "-imatrix.gguf"))
    if not out.exists():
        calib = src.with_name("calibration.txt")
        calib.write_text(text)
        run([find_tool(llama, "llama-imatrix"), "-m", src, "-f", calib, "-o", out, "-c", WINDOW, "-t", threads],
            capture=True)
    return out


def transcode(gguf: Path) -> Path:
    out = gguf.with_suffix(".kst")
    if not out.exists():
        run([sys.executable, "-m", "kimistream.convert.cli", gguf, "-o", out, "--quant", "keep", "--quiet"], capture=True)
    return out


def our_logits(kst: Path, windows: list[list[int]]) -> list[np.ndarray]:
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    w = ModelWeights(kst)
    w.load_resident()
    m = Model(w, WINDOW)
    out = []
    for ids in windows:
        m.reset()
        out.append(np.asarray(m.forward(ids, all_logits=True), np.float64))
    w.close()
    return out


_LLAMA_LOGITS = r"""
import sys, json, numpy as np
sys.path.insert(0, sys.argv[1])
from llama_cpp import Llama
windows = json.load(open(sys.argv[3]))
llm = Llama(model_path=sys.argv[2], n_ctx=len(windows[0]), n_batch=len(windows[0]), n_ubatch=len(windows[0]),
            logits_all=True, n_threads=int(sys.argv[5]), verbose=False)
out = []
for ids in windows:
    llm.reset()
    llm.eval(ids)
    out.append(np.array(llm.scores[:len(ids)], dtype=np.float64))
np.save(sys.argv[4], np.stack(out))
"""


def llama_logits(llama: Path, gguf: Path, windows: list[list[int]], threads: int, d: Path) -> list[np.ndarray]:
    ids_file, out = d / "windows.json", d / f"{gguf.stem}.llama-logits.npy"
    ids_file.write_text(json.dumps(windows))
    bindings = sorted(llama.resolve().parents[1].glob("llama_cpp"))[0].parent     # the sdist's root
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(llama / "build" / "bin"))
    run([sys.executable, "-c", _LLAMA_LOGITS, bindings, gguf, ids_file, out, threads], env=env, capture=True,
        shown=f"llama-cpp-python: logits of {gguf.name}")
    return list(np.load(out))


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(ref: list[np.ndarray], other: list[np.ndarray]) -> dict:
    kls, agree, n = [], 0, 0
    for a, b in zip(ref, other):
        la, lb = log_softmax(a), log_softmax(b)
        kls.append((np.exp(la) * (la - lb)).sum(axis=-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += len(a)
    kl = np.concatenate(kls)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "top1_agreement": agree / n,
            "positions": n}


def speed(llama: Path, gguf: Path, kst: Path, threads: int, prompt: str) -> dict:
    lb = run([find_tool(llama, "llama-bench"), "-m", gguf, "-t", threads, "-p", WINDOW, "-n", 32, "-r", 3, "-o", "json"],
             capture=True)
    rows = json.loads(lb.stdout)
    theirs = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", kst, "--prompt", prompt, "--max-tokens", 32,
           "--json", "--quiet", "--threads", threads, "--max-context", 512]
    run(cmd, capture=True)                                    # warm the page cache
    reps = [json.loads(run(cmd, capture=True).stdout)["stats"] for _ in range(3)]
    ours = {"prefill": float(np.median([r["prefill_tokens_per_s"] for r in reps])),
            "decode": float(np.median([r["decode_tokens_per_s"] for r in reps]))}
    return {"llama_cpp_tok_s": theirs, "kimi_stream_tok_s": ours,
            "ratio": {k: round(ours[k] / theirs[k], 3) for k in ours if theirs.get(k)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-dir", default=default_llama_dir())
    ap.add_argument("--workdir", default="/var/tmp/kimi-bench/gguf")
    ap.add_argument("--model", default="stdlib-moe", choices=sorted(HELDOUT))
    ap.add_argument("--types", nargs="+", default=["Q2_K", "IQ2_XXS", "IQ1_S"])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-speed", action="store_true", help="only the logits")
    a = ap.parse_args()
    llama, d = Path(a.llama_dir), Path(a.workdir) / a.model
    d.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "data" / HELDOUT[a.model]).read_text()
    f32 = f32_gguf(llama, a.model, d)
    imatrix = make_imatrix(llama, f32, text[:CALIBRATION_CHARS], a.threads)
    ref_kst = transcode(f32)

    from kimistream.runtime.tokenizer import Tokenizer
    from kimistream.runtime.weights import ModelWeights
    w = ModelWeights(ref_kst)
    tok = Tokenizer(w.header["tokenizer"]["kind"], {n: w.file.blob(n) for n in w.header["tokenizer"]["files"]})
    w.close()
    ids = tok.encode(text[CALIBRATION_CHARS:], add_special_tokens=False)
    windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(a.windows)]
    assert all(len(x) == WINDOW for x in windows), "the held-out text is too short for that many windows"
    f32_logits = our_logits(ref_kst, windows)
    result = {"model": a.model, "windows": a.windows, "window_tokens": WINDOW, "threads": a.threads,
              "f32": {"llama_cpp_vs_kimi_stream": compare(llama_logits(llama, f32, windows, a.threads, d), f32_logits)},
              "types": {}}
    for kind in a.types:
        t0 = time.perf_counter()
        g = quantized(llama, f32, kind, imatrix, a.threads)
        kst = transcode(g)
        ours, theirs = our_logits(kst, windows), llama_logits(llama, g, windows, a.threads, d)
        row = {"gguf_bytes": g.stat().st_size, "kst_bytes": kst.stat().st_size,
               "llama_cpp_vs_kimi_stream": compare(theirs, ours),
               "kl_vs_f32": {"kimi_stream": compare(f32_logits, ours)["kl_mean"],
                             "llama_cpp": compare(f32_logits, theirs)["kl_mean"]}}
        if not a.no_speed:
            row["speed"] = speed(llama, g, kst, a.threads, text[CALIBRATION_CHARS:CALIBRATION_CHARS + 900])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        result["types"][kind] = row
        log(f"{kind}: {json.dumps(row)}")
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
