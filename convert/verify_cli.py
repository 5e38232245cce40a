"""kimi-verify: check checkpoint directories (every shard present, headers sane, SHA-256 against a
manifest or a hub listing) and converted weight files (header, every extent checksum, the recorded
source hashes). Exit 0 only when all is verified; 3 = something missing, 4 = something corrupt,
5 = something could not be verified."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kimistream.formats import interrupts

interrupts.hold_from_import("kimi-verify", __name__)


def build_parser():
    p = argparse.ArgumentParser(prog="kimi-verify", description=__doc__)
    p.add_argument("paths", nargs="+", help="checkpoint directories, .kst weight files and/or llama.cpp GGUF files")
    p.add_argument("--manifest", help="sha256sum-format manifest for a checkpoint directory (or, for a weight "
                                      "file, of the sources it should have been built from)")
    p.add_argument("--hub", metavar="REPO@REV", help="check against the hub's listing of REPO at REV: sizes, LFS "
                                                    "SHA-256 of shards, git blob ids of the small files")
    p.add_argument("--endpoint", help="hub endpoint or mirror for --hub (default: $HF_ENDPOINT or the public hub)")
    p.add_argument("--checksums", metavar="DIR", type=Path, default=None,
                   help="folder of ORG--NAME@COMMIT.sha256 manifests (default: this project's checksums/)")
    p.add_argument("--write-manifest", metavar="FILE", help="write the SHA-256 of a directory's files to FILE")
    p.add_argument("--jobs", type=int, default=2, help="files hashed in parallel (default 2)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p


def main(argv=None) -> int:
    # Parsing and imports (rich, the hub client: only after the arguments parse) run to their end;
    # Ctrl-C at any point ends with one line.
    def start():
        args = build_parser().parse_args(argv)
        from .verify_report import run
        return lambda: run(args)
    return interrupts.command("kimi-verify", start, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
