"""Prefill and decode speed of kimi-run against llama.cpp on the same random DeepseekV3 checkpoint,
both at about 2 bits per routed weight, measured in one run and reported as ratios.

    python benchmarks/bench_llamacpp.py [--llama-dir DIR] [--workdir DIR] [--threads 2] [--json]

What it does, caching each product in --workdir under a key made of the geometry (a second run
with the same geometry skips straight to the measurements):

1. a random DeepseekV3 checkpoint (transformers `DeepseekV3Config` + `DeepseekV3ForCausalLM`, its
   own initialisation: normal(0, 0.02) weights, unit norms; saved as bf16 safetensors), plain RoPE
   (no YaRN), sigmoid routing without expert groups (as Kimi K2), no MTP layer. Default geometry:
   hidden 1024, 12 layers (the first dense, 11 MoE), 64 routed experts top-6 of 1024 intermediate +
   1 shared, 16 MLA heads, vocab 32000: about 2.4 B parameters (printed). Every matrix width is a
   multiple of 256, so llama.cpp's k-quants apply to all the big tensors;
2. llama.cpp: `convert_hf_to_gguf.py --outtype bf16`, then `llama-quantize ... Q2_K` (its Q2_K mix:
   Q2_K experts, Q3_K down projections, higher types for attention and the output layer);
3. kimi-stream: `kimi-convert CHECKPOINT -o OUT.kst --quant q2 --calibration none`;
4. `llama-bench -m Q2_K.gguf -t T -p P -n G -r 1 -o json` (pp and tg tok/s; before its measured
   test it runs the prompt and one token in the same process) and `kimi-run --weights OUT.kst
   --prompt TEXT --max-tokens G --json --threads T --quiet --warm-up` (the same warm-up), after one
   run of each to warm the page cache (--cold: neither warms up in-process, `llama-bench
   --no-warmup` and kimi-run without --warm-up: first-touch costs counted): R rounds of one run of each,
   alternating, so load from elsewhere on the machine falls on both alike; mean, sd and median of
   the R samples. kimi-run's prefill = prompt tokens / prefill seconds, its decode = decode steps /
   decode seconds (the first generated token belongs to the prefill), as it reports them. llama-bench's
   tg starts from an empty KV cache (--llama-depth P puts both its tests after P tokens instead);
5. the memory bound of decode, in the same run: after every round the memory read bandwidth on T
   threads (a C loop summing a 512 MiB buffer as 64-bit words, `_qdot.read_sum`), and each file's
   bytes read per decode token from its tensor directory: every weight but the embedding table
   (one row of it), the routed experts' share k / E of theirs, and the KV cache's latent rows (f16,
   both engines) at the mean decode position. Bound tok/s = bandwidth / bytes per token; each
   engine's decode tok/s over its own bound is its fraction of the bound.

The tokenizer: a byte-level BPE tokenizer.json like `kimistream.convert.synthetic.byte_tokenizer`
(256 byte tokens), plus one merge, two spaces (id 256; llama.cpp refuses a BPE vocabulary without
merges), then <s> (257), </s> (258); the other ids up to --vocab are unused rows. The prompt is P lowercase letters without spaces, so it is exactly P
tokens on both sides (checked against kimi-run's `prompt_tokens`); llama-bench feeds P random
tokens. No eos token is declared, so kimi-run generates exactly G tokens, as llama-bench does.
convert_hf_to_gguf.py identifies a BPE pre-tokenizer by hashing the ids its tokenizer gives for a
fixed text, and knows only the published tokenizers' hashes; ours is unknown to it. It is run
unmodified, from a short wrapper (`_GGUF_WRAPPER` below) that imports it and, only when that
lookup raises NotImplementedError, answers "gpt-2": the pre-tokenizer our tokenizer really has
(ByteLevel's split regex is GPT-2's). Nothing else in the conversion is touched.

llama.cpp is not part of this project: build it outside the repository, e.g. from the llama.cpp
vendored in the llama-cpp-python sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /work/llama/sdist
    tar xzf /work/llama/sdist/llama_cpp_python-*.tar.gz -C /work/llama
    ln -sfn /work/llama/llama_cpp_python-*/vendor/llama.cpp /work/llama/llama.cpp
    cd /work/llama/llama.cpp && mv .git .git.sdist    # a dangling submodule pointer keeps ninja re-configuring
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=ON
    cmake --build build -j2 --target llama-bench llama-quantize

convert_hf_to_gguf.py runs with the tree's own gguf-py on PYTHONPATH (needs numpy, torch,
transformers, pyyaml, tqdm, requests, which the project's test extras and their dependencies bring).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kimistream.formats.constants import EMBEDDINGS, ROUTED_EXPERTS, VERSION
from kimistream.formats.weightfile import WeightFile, file_version

CACHE_VERSION = 1            # bump when the checkpoint recipe changes, so old caches are not reused

# Runs convert_hf_to_gguf.py unmodified; only an unknown pre-tokenizer hash is answered with "gpt-2".
_GGUF_WRAPPER = r"""
import sys, logging
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import convert_hf_to_gguf as c
mods = [c] + [m for n, m in list(sys.modules.items()) if n == "conversion" or n.startswith("conversion.")]
patched = 0
for mod in mods:
    for obj in list(vars(mod).values()):
        if isinstance(obj, type) and "get_vocab_base_pre" in vars(obj):
            orig = vars(obj)["get_vocab_base_pre"]
            def pre(self, tokenizer, _orig=orig):
                try:
                    return _orig(self, tokenizer)
                except NotImplementedError:
                    logging.getLogger("bench").warning("unknown pre-tokenizer hash: using gpt-2 (ByteLevel regex)")
                    return "gpt-2"
            obj.get_vocab_base_pre = pre
            patched += 1
if not patched:
    sys.exit("bench_llamacpp: no get_vocab_base_pre in convert_hf_to_gguf.py to wrap")
c.main()
"""


# ------------------------------------------------------------------------------------ geometry

def hf_config(a) -> dict:
    """The checkpoint's config.json fields (beyond DeepseekV3Config's defaults)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "intermediate_size": a.dense_intermediate, "moe_intermediate_size": a.moe_intermediate,
        "first_k_dense_replace": a.dense_layers, "moe_layer_freq": 1,
        "n_routed_experts": a.experts, "num_experts_per_tok": a.top_k, "n_shared_experts": a.shared_experts,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_attention_heads": a.heads, "num_key_value_heads": a.heads,
        "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim, "head_dim": a.qk_rope_head_dim,
        "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "initializer_range": a.init_std, "bos_token_id": 257, "eos_token_id": None, "pad_token_id": None,
    }


def param_count(c: dict) -> dict:
    """Parameters by part, computed from the config (checked against the built model)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
            + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
            + heads * c["v_head_dim"] * h + 2 * h)
    n_dense = c["first_k_dense_replace"]
    n_moe = c["num_hidden_layers"] - n_dense
    mlp3 = 3 * h
    routed = n_moe * c["n_routed_experts"] * mlp3 * c["moe_intermediate_size"]
    other = (n_dense * mlp3 * c["intermediate_size"]
             + n_moe * (c["n_shared_experts"] * mlp3 * c["moe_intermediate_size"] + c["n_routed_experts"] * (h + 1)))
    embed = 2 * c["vocab_size"] * h + h
    total = c["num_hidden_layers"] * attn + routed + other + embed
    active = total - routed + n_moe * c["num_experts_per_tok"] * mlp3 * c["moe_intermediate_size"]
    return {"total": total, "routed_experts": routed, "active_per_token": active}


def cache_key(c: dict, seed: int) -> str:
    blob = json.dumps({"config": c, "seed": seed, "version": CACHE_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


# ------------------------------------------------------------------------------------ products

def log(msg: str) -> None:
    print(f"bench_llamacpp: {msg}", file=sys.stderr, flush=True)


def run(cmd, env=None, capture=False, cwd=None, shown=None) -> subprocess.CompletedProcess:
    log("$ " + (shown or shlex.join(str(x) for x in cmd)))
    p = subprocess.run([str(x) for x in cmd], env=env, cwd=cwd, text=True,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if p.returncode != 0:
        if capture:
            sys.stderr.write((p.stdout or "")[-4000:] + (p.stderr or "")[-4000:])
        raise SystemExit(f"bench_llamacpp: command failed with exit code {p.returncode}: {cmd[0]}")
    return p


def byte_level_tokenizer() -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json: 256 byte tokens (0..255), one merge '  ' (256),
    <s> (257), </s> (258). Written the way kimistream.convert.synthetic.byte_tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    space = "\u0120"                     # ByteLevel's printable stand-in for the byte ' '
    vocab[space + space] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(space, space)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    assert tok.token_to_id("<s>") == 257 and tok.token_to_id("</s>") == 258
    cfg = {"bos_token": "<s>", "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(cfg).encode()}


def make_checkpoint(c: dict, out: Path, seed: int) -> None:
    """A random bf16 DeepseekV3 checkpoint in `out` (written to out.partial, then renamed)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    fields = {k: v for k, v in c.items() if k not in ("architectures", "model_type", "rope_scaling")}
    config = DeepseekV3Config(**fields)
    t = time.perf_counter()
    model = DeepseekV3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    n = sum(t.numel() for t in model.state_dict().values())     # with the routers' correction biases
    log(f"random model built in {time.perf_counter() - t:.0f} s: {n:,} parameters")
    expected = param_count(c)["total"]
    if n != expected:
        raise SystemExit(f"bench_llamacpp: built {n:,} parameters, the formula says {expected:,}")
    model.save_pretrained(tmp, max_shard_size="2GB")
    del model
    cfg_path = tmp / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.update({"model_type": "deepseek_v3", "rope_scaling": None, "scoring_func": "sigmoid",
                  "topk_method": "noaux_tc", "eos_token_id": None})
    cfg_path.write_text(json.dumps(saved, indent=2))
    for name, data in byte_level_tokenizer().items():
        (tmp / name).write_bytes(data)
    tmp.rename(out)


def make_gguf(llama: Path, ckpt: Path, out: Path, threads: int, keep_bf16: bool) -> None:
    bf16 = out.with_name("model-bf16.gguf")
    if not bf16.exists():
        part = bf16.with_name(bf16.name + ".partial")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(llama), str(llama / "gguf-py")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        args = [ckpt, "--outtype", "bf16", "--outfile", part]
        run([sys.executable, "-c", _GGUF_WRAPPER, llama, *args], env=env,
            shown=shlex.join(["python", str(llama / "convert_hf_to_gguf.py"), *map(str, args)]) + "  (via _GGUF_WRAPPER)")
        part.rename(bf16)
    part = out.with_name(out.name + ".partial")
    run([find_tool(llama, "llama-quantize"), bf16, part, "Q2_K", threads], capture=True)
    part.rename(out)
    if not keep_bf16:
        bf16.unlink()


def make_kst(ckpt: Path, out: Path) -> None:
    part = out.with_name(out.name + ".tmp.kst")
    run([sys.executable, "-m", "kimistream.convert.cli", ckpt, "-o", part, "--quant", "q2",
         "--calibration", "none", "--quiet", "--json"], capture=True)
    part.rename(out)


def find_tool(llama: Path, name: str) -> Path:
    for d in ("build/bin", "build", "bin", "."):
        p = llama / d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise SystemExit(f"bench_llamacpp: no {name} under {llama} (build/bin/{name}); build llama.cpp first "
                     f"(see this script's docstring) or pass --llama-dir")


# ------------------------------------------------------------------------------------ measuring

class LlamaBench:
    """`llama-bench -r 1` per call (it warms up itself each time): one pp and one tg sample."""

    def __init__(self, llama: Path, gguf: Path, a):
        self.cmd = [find_tool(llama, "llama-bench"), "-m", gguf, "-t", a.threads, "-p", a.prompt_tokens,
                    "-n", a.gen_tokens, "-r", 1, "-o", "json"] + (["--no-warmup"] if a.cold else [])
        if a.llama_depth:
            self.cmd += ["-d", a.llama_depth]
        self.shown = shlex.join(str(x) for x in self.cmd)
        self.info = {}

    def once(self) -> tuple[float, float]:
        p = subprocess.run([str(x) for x in self.cmd], capture_output=True, text=True)
        if p.returncode != 0 and "cur_backend_id != -1" in p.stderr and "--repack" not in self.cmd:
            # Where the CPU backend repacks weights (Q4_0 into interleaved rows; on AVX-512 machines
            # more types), it can take a tensor the deepseek2 graph then cannot place, and aborts.
            # Without repacking every tensor stays as stored.
            log("llama-bench aborted with weight repacking (a scheduler assert); again with --repack 0")
            self.cmd += ["--repack", 0]
            self.shown = shlex.join(str(x) for x in self.cmd)
            return self.once()
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-4000:])
            raise SystemExit(f"bench_llamacpp: llama-bench failed: {self.shown}")
        rows = json.loads(p.stdout)
        pp = [r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0]
        tg = [r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0]
        if not pp or not tg:
            raise SystemExit(f"bench_llamacpp: llama-bench gave no pp/tg rows: {p.stdout[:500]}")
        self.info = {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                  "model_type", "model_size", "model_n_params", "n_batch",
                                                  "n_ubatch", "type_k", "use_mmap", "n_depth")}
        return pp[0]["avg_ts"], tg[0]["avg_ts"]


class KimiRun:
    """One `kimi-run` process per call, a prompt of exactly P tokens (P letters, no spaces)."""

    def __init__(self, kst: Path, a):
        rng = random.Random(0)
        self.prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(a.prompt_tokens))
        self.a = a
        self.cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", kst, "--prompt", self.prompt,
                    "--max-tokens", a.gen_tokens, "--json", "--threads", a.threads, "--quiet",
                    *([] if a.cold else ["--warm-up"]), *a.kimi_arg]
        self.shown = shlex.join(["kimi-run", "--weights", str(kst), "--prompt", f"<{a.prompt_tokens} letters>"]
                                + [str(x) for x in self.cmd[7:]])
        self.info = {}

    def once(self) -> tuple[float, float]:
        p = subprocess.run([str(x) for x in self.cmd], capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-4000:])
            raise SystemExit("bench_llamacpp: kimi-run failed")
        rep = json.loads(p.stdout)
        st = rep["stats"]
        if len(rep["prompt_tokens"]) != self.a.prompt_tokens:
            raise SystemExit(f"bench_llamacpp: the prompt is {len(rep['prompt_tokens'])} tokens, "
                             f"not {self.a.prompt_tokens}")
        if len(rep["tokens"]) != self.a.gen_tokens:
            raise SystemExit(f"bench_llamacpp: kimi-run generated {len(rep['tokens'])} tokens ({st['stop_reason']})")
        self.info = {k: st.get(k) for k in ("peak_rss_bytes", "resident_bytes", "experts_touched", "experts_total",
                                            "expert_cache_experts", "hit_rate")}
        return st["prefill_tokens_per_s"], st["decode_tokens_per_s"]


def read_bandwidth(threads: int, seconds: float = 1.0) -> float:
    """Memory read GB/s on `threads` threads: a 512 MiB buffer summed as 64-bit words, repeatedly."""
    import numpy as np
    from bench_kernels import read_gbps           # (this directory is on sys.path when run as a script)
    return read_gbps(np.ones(512 << 20, np.uint8), seconds, threads)


def kv_bytes_per_token(c: dict, position: float) -> float:
    """The latent cache rows (kv_lora_rank + rope dims, binary16) one decode step reads at `position`."""
    return position * c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2


def kst_bytes_split(kst: Path, c: dict) -> tuple[int, int]:
    """(resident, routed) weight bytes one decode step of kimi-run reads: every tensor but the routed
    experts and the embedding table, plus one row of that; the k routed experts of each MoE layer."""
    k, E, resident, routed = c["num_experts_per_tok"], c["n_routed_experts"], 0, 0
    with WeightFile(kst) as wf:
        for t in wf.tensors.values():
            if t.cls == ROUTED_EXPERTS:
                routed += t.nbytes * k / E
            elif t.cls == EMBEDDINGS:
                resident += t.nbytes / t.shape[0]
            else:
                resident += t.nbytes
    return int(resident), int(routed)


def kst_bytes_per_token(kst: Path, c: dict) -> int:
    """Weight bytes one decode step of kimi-run reads (kst_bytes_split's two parts)."""
    return sum(kst_bytes_split(kst, c))


def gguf_bytes_per_token(gguf_path: Path, c: dict) -> int:
    """The same for llama.cpp's file: its expert tensors hold all E experts of a layer."""
    from gguf import GGUFReader
    k, E, n = c["num_experts_per_tok"], c["n_routed_experts"], 0
    for t in GGUFReader(gguf_path).tensors:
        if "_exps." in t.name:
            n += int(t.n_bytes) * k / E
        elif t.name.startswith("token_embd."):
            n += int(t.n_bytes) / c["vocab_size"]
        else:
            n += int(t.n_bytes)
    return int(n)


def summarise(samples: list[tuple[float, float]]) -> dict:
    out = {}
    for i, phase in enumerate(("prefill", "decode")):
        xs = [s[i] for s in samples]
        out[f"{phase}_tok_s"] = statistics.mean(xs)
        out[f"{phase}_median"] = statistics.median(xs)
        out[f"{phase}_stddev"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[f"{phase}_samples"] = [round(x, 3) for x in xs]
    return out


def measure(theirs: LlamaBench, ours: KimiRun, repeats: int, threads: int) -> tuple[dict, dict, list]:
    """A warm-up run of each (page cache), then the two engines alternately, one run each per round,
    so that load from elsewhere on the machine falls on both alike; the memory read bandwidth after
    each round."""
    log(f"kimi-run warm-up: {ours.shown}")
    ours.once()
    log(f"llama.cpp warm-up: {theirs.shown}")
    theirs.once()
    a_samples, b_samples, bandwidth = [], [], []
    for i in range(repeats):
        a_samples.append(theirs.once())
        log(f"round {i + 1}/{repeats} llama.cpp:   prefill {a_samples[-1][0]:8.2f} tok/s, "
            f"decode {a_samples[-1][1]:8.2f} tok/s (load {os.getloadavg()[0]:.2f})")
        b_samples.append(ours.once())
        log(f"round {i + 1}/{repeats} kimi-stream: prefill {b_samples[-1][0]:8.2f} tok/s, "
            f"decode {b_samples[-1][1]:8.2f} tok/s (load {os.getloadavg()[0]:.2f})")
        bandwidth.append(read_bandwidth(threads))
        log(f"round {i + 1}/{repeats} memory read: {bandwidth[-1]:.2f} GB/s on {threads} threads")
    return ({**summarise(a_samples), "command": theirs.shown + f"  (warm-up + x{repeats}, alternating)", **theirs.info},
            {**summarise(b_samples), "command": ours.shown + f"  (warm-up + x{repeats}, alternating)", **ours.info},
            bandwidth)


# ------------------------------------------------------------------------------------ main

def default_llama_dir() -> str:
    env = os.environ.get("LLAMA_CPP_DIR")
    if env:
        return env
    for cand in ("/work/llama/llama.cpp",):
        if Path(cand).is_dir():
            return cand
    found = sorted(Path("/work/llama").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return str(found[-1]) if found else "/work/llama/llama.cpp"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-dir", default=default_llama_dir(),
                   help="built llama.cpp tree (default $LLAMA_CPP_DIR or /work/llama/llama.cpp)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kimi-bench-llamacpp"),
                   help="scratch and cache of the checkpoint and converted files (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each engine (default 3)")
    p.add_argument("--llama-depth", type=int, default=0,
                   help="llama-bench -d: KV depth for its tests (default 0; kimi-run decodes after the prompt)")
    p.add_argument("--cold", action="store_true",
                   help="no in-process warm-up on either side (llama-bench --no-warmup, kimi-run without --warm-up)")
    p.add_argument("--kimi-arg", action="append", default=[], metavar="ARG",
                   help="extra kimi-run argument (repeatable), e.g. --kimi-arg=--prefill-batch-size=128")
    p.add_argument("--keep-bf16-gguf", action="store_true", help="keep the intermediate bf16 GGUF")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    g = p.add_argument_group("geometry (defaults: about 2.4 B parameters)")
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace (default 1)")
    g.add_argument("--experts", type=int, default=64)
    g.add_argument("--top-k", type=int, default=6)
    g.add_argument("--shared-experts", type=int, default=1)
    g.add_argument("--moe-intermediate", type=int, default=1024)
    g.add_argument("--dense-intermediate", type=int, default=4096)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--q-lora-rank", type=int, default=512)
    g.add_argument("--kv-lora-rank", type=int, default=512)
    g.add_argument("--qk-nope-head-dim", type=int, default=128)
    g.add_argument("--qk-rope-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--init-std", type=float, default=0.02)
    g.add_argument("--seed", type=int, default=0)
    return p


def fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} B)"


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.vocab < 259:
        raise SystemExit("bench_llamacpp: --vocab must be at least 259 (byte tokenizer)")
    llama = Path(a.llama_dir).resolve()
    for tool in ("llama-bench", "llama-quantize"):
        find_tool(llama, tool)
    if not (llama / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"bench_llamacpp: {llama}/convert_hf_to_gguf.py not found")
    c = hf_config(a)
    params = param_count(c)
    key = cache_key(c, a.seed)
    work = Path(a.workdir) / f"dsv3-{params['total'] / 1e9:.2f}B-{key}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "geometry.json").write_text(json.dumps({"config": c, "seed": a.seed, "params": params}, indent=2))
    log(f"model: {params['total']:,} parameters ({params['total'] / 1e9:.3f} B; routed experts "
        f"{params['routed_experts'] / 1e9:.3f} B; active per token {params['active_per_token'] / 1e9:.3f} B)")
    log(f"work directory {work}")

    ckpt, gguf, kst = work / "hf", work / "model-Q2_K.gguf", work / "model-q2.kst"
    timings = {}
    if not ckpt.exists():
        t = time.perf_counter()
        make_checkpoint(c, ckpt, a.seed)
        timings["checkpoint_s"] = round(time.perf_counter() - t, 1)
    if not gguf.exists():
        t = time.perf_counter()
        make_gguf(llama, ckpt, gguf, a.threads, a.keep_bf16_gguf)
        timings["gguf_s"] = round(time.perf_counter() - t, 1)
    if kst.exists() and (file_version(kst) or 0) < VERSION:
        log(f"{kst}: written in an older weight-file format; converting again")
        kst.unlink()
    if not kst.exists():
        t = time.perf_counter()
        make_kst(ckpt, kst)
        timings["kst_s"] = round(time.perf_counter() - t, 1)

    load_before = os.getloadavg()
    theirs, ours, bandwidth = measure(LlamaBench(llama, gguf, a), KimiRun(kst, a), a.repeats, a.threads)
    load_after = os.getloadavg()
    gbps = statistics.mean(bandwidth)
    for r, weights, start in ((theirs, gguf_bytes_per_token(gguf, c), a.llama_depth),
                              (ours, kst_bytes_per_token(kst, c), a.prompt_tokens)):
        r["bytes_per_decode_token"] = int(weights + kv_bytes_per_token(c, start + a.gen_tokens / 2))
        r["bound_tok_s"] = gbps * 1e9 / r["bytes_per_decode_token"]
        r["decode_over_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "model": {"params": params, "config": c, "workdir": str(work)},
        "threads": a.threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "repeats": a.repeats,
        "llama_cpp": {**theirs, "file": str(gguf), "file_bytes": gguf.stat().st_size, "quant": "Q2_K"},
        "kimi_stream": {**ours, "file": str(kst), "file_bytes": kst.stat().st_size, "quant": "q2"},
        "ratio_prefill_ours_over_llamacpp": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
        "ratio_decode_ours_over_llamacpp": ours["decode_tok_s"] / theirs["decode_tok_s"],
        "memory_read_gb_s": gbps, "memory_read_samples": [round(x, 2) for x in bandwidth],
        "loadavg_before": load_before, "loadavg_after": load_after, "preparation_seconds": timings,
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"\nDeepseekV3 random model, {params['total'] / 1e9:.2f} B parameters "
          f"({params['active_per_token'] / 1e9:.2f} B active), {a.threads} threads, "
          f"prompt {a.prompt_tokens} tokens, {a.gen_tokens} generated, mean ± sd of {a.repeats} alternating runs\n")
    print("| engine | file | file bytes | prefill tok/s | decode tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("llama.cpp", result["llama_cpp"]), ("kimi-stream", result["kimi_stream"])):
        print(f"| {name} | {r['quant']} | {r['file_bytes']:,} | {r['prefill_tok_s']:.2f} ± {r['prefill_stddev']:.2f} "
              f"| {r['decode_tok_s']:.2f} ± {r['decode_stddev']:.2f} |")
    print(f"| **ours / llama.cpp** | | {result['kimi_stream']['file_bytes'] / result['llama_cpp']['file_bytes']:.3f}x "
          f"| **{result['ratio_prefill_ours_over_llamacpp']:.3f}x** | **{result['ratio_decode_ours_over_llamacpp']:.3f}x** |")
    print(f"\nDecode against the memory bound (read bandwidth {gbps:.2f} GB/s on {a.threads} threads, mean of "
          f"{len(bandwidth)}, one after each round: {', '.join(f'{x:.1f}' for x in bandwidth)}):\n")
    print("| engine | bytes read per decode token | bound tok/s | decode tok/s | decode / bound |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("llama.cpp", result["llama_cpp"]), ("kimi-stream", result["kimi_stream"])):
        print(f"| {name} | {r['bytes_per_decode_token'] / 1e6:.1f} MB | {r['bound_tok_s']:.1f} | "
              f"{r['decode_tok_s']:.2f} | {r['decode_over_bound']:.3f} |")
    for name, r in (("llama.cpp", result["llama_cpp"]), ("kimi-stream", result["kimi_stream"])):
        print(f"\n{name} samples, prefill: {r['prefill_samples']}, decode: {r['decode_samples']} (medians "
              f"{r['prefill_median']:.2f} / {r['decode_median']:.2f})", end="")
    print(f"\n\ncommand: {result['command']}")
    print(f"llama.cpp: {theirs['command']}")
    print(f"kimi-stream: {ours['command']}")
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
