"""O_DIRECT reads of one weight file into buffers of 4 KiB pages against runtime.pager.read_buffer's
(private memory asking for transparent huge pages): random expert-sized reads, two at a time (as the
pread pager's prefetch threads issue them), and sequential 8 MiB reads (the benchmarks' disk bound).

A read reaches the device as one scatter-gather entry per physically contiguous run of its buffer.
Before the buffers are made, memory is scattered on purpose (every other page of a block of 4 KiB
allocations freed), as it is late in a run; the 4 KiB buffers then take pages from all over.

    python benchmarks/bench_read_buffer.py WEIGHTS.kst [--read-size 1MiB] [--reads 600] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import sys
import threading
import time

import numpy as np

from kimistream.formats.sizes import fmt, parse_size
from kimistream.runtime.pager import read_buffer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory_cap import disk_read_bandwidth  # noqa: E402  (a script beside this one)

PAGE = mmap.PAGESIZE


def small_pages(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return buf


def scatter_memory(pages: int = 20000) -> list:
    """Allocate `pages` single pages, touch them, free every other one: the free lists now hold
    scattered pages, which the next 4 KiB allocations take first. Returns the kept ones (hold them)."""
    held = [mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(pages)]
    for m in held:
        m[0:1] = b"x"
    for m in held[::2]:
        m.close()
    return held[1::2]


def random_reads(path: str, buf: mmap.mmap, size: int, reads: int, seed: int) -> float:
    """Bytes/s of `reads` random page-aligned reads of `size` bytes, two threads each with its half of buf."""
    end = os.path.getsize(path) - size
    rng = random.Random(seed)
    offsets = [rng.randrange(0, end) // PAGE * PAGE for _ in range(reads)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def worker(i: int) -> None:
        view = memoryview(buf)[i * size:(i + 1) * size]
        for off in offsets[i::2]:
            os.preadv(fd, [view], off)
    try:
        t = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return reads * size / (time.perf_counter() - t)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights")
    ap.add_argument("--read-size", default="1MiB", help="bytes per random read (an expert's size)")
    ap.add_argument("--reads", type=int, default=600, help="random reads per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each measuring both buffers")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    size = parse_size(a.read_size) // PAGE * PAGE
    seq = min(os.path.getsize(a.weights), 1 << 30) // (8 << 20) * (8 << 20)
    if size <= 0 or a.reads < 2 or a.rounds < 1 or seq == 0:
        sys.exit("bench_read_buffer: --read-size, --reads (>= 2), --rounds or the file is too small")
    held = scatter_memory()           # kept until the end: their pages stay taken
    makers = {"4 KiB pages": small_pages, "read_buffer": read_buffer}
    rows = {name: {"random": [], "sequential": []} for name in makers}
    for r in range(a.rounds):
        for name, make in makers.items():
            rnd, sq = make(2 * size), make(8 << 20)
            np.frombuffer(rnd, np.uint8)[::PAGE] = 1          # the pages exist before the reads
            np.frombuffer(sq, np.uint8)[::PAGE] = 1
            rows[name]["random"].append(random_reads(a.weights, rnd, size, a.reads, seed=r))
            rows[name]["sequential"].append(disk_read_bandwidth(a.weights, seq, sq))
            rnd.close()
            sq.close()
    del held
    med = {n: {k: statistics.median(v) for k, v in row.items()} for n, row in rows.items()}
    if a.json:
        print(json.dumps({"read_size": size, "runs": rows, "median": med}, indent=1))
        return
    print(f"{a.weights}: O_DIRECT reads, median of {a.rounds} rounds (GB/s)\n")
    print(f"| buffer | random {fmt(size)} reads, two at a time | sequential 8 MiB reads |")
    print("| --- | --- | --- |")
    for name in makers:
        print(f"| {name} | {med[name]['random'] / 1e9:.2f} | {med[name]['sequential'] / 1e9:.2f} |")
    base = med["4 KiB pages"]
    print(f"\nread_buffer / 4 KiB pages: random {med['read_buffer']['random'] / base['random']:.2f}x, "
          f"sequential {med['read_buffer']['sequential'] / base['sequential']:.2f}x")


if __name__ == "__main__":
    main()
