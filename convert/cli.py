"""kimi-convert: turn a Hugging Face DeepseekV3/Kimi-K2 checkpoint into one kimi-stream weight file,
with a rich progress bar and a summary of bytes and bits per weight by tensor class. The checkpoint is
a local directory, or REPO_ID[@REVISION] on the hub (or a mirror), or a list of URLs: downloaded first,
resumably and hash-checked, into a directory that kimi-verify can check later."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kimistream.formats import interrupts

interrupts.hold_from_import("kimi-convert", __name__)
from kimistream.formats.constants import DEFAULT_ALIGNMENT, MAX_ALIGNMENT
from kimistream.formats.presets import PRESETS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?",
                   help="checkpoint directory (config.json, *.safetensors, tokenizer files), a llama.cpp GGUF file "
                        "(deepseek2; --quant keep keeps its F32/F16/BF16/Q8_0 tensors' values, a preset quantizes "
                        "them again), or "
                        "REPO_ID[@REVISION] to download from the hub first (REVISION: branch, tag or commit; default main)")
    p.add_argument("-o", "--output", help="weight file to write (e.g. model.kst)")
    g = p.add_argument_group("downloading")
    g.add_argument("--download-only", action="store_true", help="download and verify the checkpoint, do not convert")
    g.add_argument("--dir", type=Path, help="download directory (default: ORG--NAME@COMMIT next to the output, "
                                            "or in the current directory with --download-only)")
    g.add_argument("--urls", type=Path, metavar="FILE", help="download the checkpoint from plain http(s) URLs: "
                                                             "one 'URL [SHA256]' per line (needs --dir)")
    g.add_argument("--endpoint", help="hub endpoint or mirror (default: $HF_ENDPOINT or the public hub); "
                                      "the token comes from $HF_TOKEN or a saved login")
    g.add_argument("--jobs", type=int, default=4, help="files downloaded in parallel (default 4)")
    g.add_argument("--retries", type=int, default=5, help="attempts per file before giving up (default 5)")
    g.add_argument("--retry-wait", type=float, default=2.0, metavar="SECONDS",
                   help="first back-off between attempts, doubled each time (default 2)")
    g.add_argument("--checksums", type=Path, metavar="DIR",
                   help="folder of ORG--NAME@COMMIT.sha256 manifests (default: this project's checksums/)")
    g.add_argument("--manifest", type=Path, metavar="FILE",
                   help="sha256sum-format manifest the downloaded files must also match")
    p.add_argument("--quant", default=None, choices=sorted(PRESETS),
                   help="precision preset (default bf16); keep: a GGUF source's own types, unchanged")
    p.add_argument("--override", action="append", default=[], metavar="REGEX=CODEC",
                   help="codec for tensors whose name matches REGEX (repeatable, first match wins)")
    p.add_argument("--alignment", type=int, default=None,
                   help=f"extent alignment in bytes, power of two 4096..{MAX_ALIGNMENT} (default {DEFAULT_ALIGNMENT})")
    c = p.add_argument_group("conversion")
    c.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="encode on a Ray cluster: its address (e.g. 10.0.0.5:6379), or none for a local one on "
                        "this machine's cores; the source directory must be at the same path on every node "
                        "(needs pip install 'kimi-stream[cluster]')")
    c.add_argument("--delete-source", action="store_true",
                   help="delete each source shard once all its tensors are written (disk stays near the output size)")
    c.add_argument("--calibration", metavar="TEXT_FILE|self|none",
                   help="measure the model's activations and fit quantization to them: over this text, or 'self' "
                        "(text the model samples itself, no data needed), or 'none' (data-free fit). Default: "
                        "self for the 1-2-bit presets (q2, t1, q1), none otherwise. The measurement runs on a "
                        "data-free conversion in the same preset (deleted afterwards); the importance matrix is "
                        "kept as OUT.imatrix.npz for --imatrix")
    c.add_argument("--imatrix", type=Path, metavar="PATH", help="reuse a saved importance matrix")
    c.add_argument("--self-tokens", type=int, default=None, metavar="N",
                   help="with self-calibration: tokens the model samples for its own calibration (default 16384)")
    c.add_argument("--max-context", type=int, metavar="N",
                   help="with calibration: tokens per window of text measured or sampled; with --memory-budget: the "
                        "context the plan must hold (default as kimi-run: min(4096, the model's "
                        "max_position_embeddings))")
    c.add_argument("--moment-budget", default=None, metavar="SIZE",
                   help="with calibration: memory for full input second moments, which let the quantizer "
                        "round with error feedback (GPTQ-style); routed experts first; 0 = off (default 2G)")
    c.add_argument("--synthetic", type=Path, metavar="CONFIG_JSON",
                   help="write a random-weight file of this config's geometry instead of converting")
    c.add_argument("--sparse", action="store_true", help="with --synthetic: leave routed experts as holes")
    c.add_argument("--seed", type=int, default=None,
                   help="with --synthetic: random seed; with self-calibration: sampling seed (default 0)")
    m = p.add_argument_group("memory")
    m.add_argument("--memory-budget", metavar="SIZE",
                   help="choose the precision of each resident class (routers, attention, shared experts, dense "
                        "layers, lm_head) so that kimi-run fits this budget, e.g. 8.24G: classes go one rung lower "
                        "at a time, the least KL per byte first; --override still wins")
    m.add_argument("--kv-dtype", choices=("f32", "f16"), default=None,
                   help="with --memory-budget: the KV cache kimi-run will keep (default f16, its choice when f32 "
                        "does not fit)")
    m.add_argument("--dry-run", action="store_true",
                   help="show the precision chosen and the predicted sizes and memory plan, write nothing")
    r = p.add_argument_group("releases")
    r.add_argument("--publish", type=Path, metavar="DIR",
                   help="also split the weight file into zstd chunks with a manifest in DIR (SOURCE may be a .kst)")
    r.add_argument("--chunk-size", default="2GiB", help="with --publish: raw bytes per chunk (default 2GiB, at least 16MiB)")
    r.add_argument("--assemble", type=Path, metavar="RELEASE_DIR",
                   help="rebuild a weight file from a downloaded release (chunks + *.release.json) into -o")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    # Parsing and imports (rich, the hub client, the quantizers: only after the arguments parse) run to
    # their end; Ctrl-C at any point ends with one line.
    parsed = []

    def start():
        args = build_parser().parse_args(argv)
        parsed.append(args)
        from .commands import run
        return lambda: run(args)

    def interrupted() -> str:
        """What an interrupted run left to resume from: its partial output, a download."""
        args = parsed[0] if parsed else None
        partial = kept_output(args) if args is not None else None
        if partial is not None:
            return f"error: interrupted; partial output kept as {partial}, run the same command to resume"
        if args is not None and not args.dry_run and (args.urls or (args.source and not Path(args.source).exists())):
            return "error: interrupted; run the same command to resume the download"
        return "error: interrupted"
    return interrupts.command("kimi-convert", start, interrupted)


def kept_output(args) -> Path | None:
    """The partial output an interrupted run of these arguments resumes from, if there is one: the
    output's .partial (a conversion's) or .assembling (--assemble's); both may be there, and the run's
    own kind comes first."""
    if not args.output or args.dry_run:
        return None
    out = Path(args.output)
    kept = [out.with_name(out.name + ".partial"), out.with_name(out.name + ".assembling")]
    if getattr(args, "assemble", None):
        kept.reverse()
    return next((p for p in kept if p.is_file()), None)


if __name__ == "__main__":
    sys.exit(main())
