"""What this CPU's vector units sustain, for reading the kernel tables: throughput of the AVX2
instructions the integer kernels (runtime/_qdot.c) are made of, in core cycles; of the two ways a t1
span could be multiplied; and of a q2 block of four spans as the one-token kernel runs it and two ways
it could run instead (how far the whole mix sits from its multiplies' own bound). A small C program is
written to a temporary directory, built with the system's gcc (-O2, the instructions in inline
assembly, so the compiler schedules nothing) and run.

    python benchmarks/bench_isa.py [--iterations 50000000]

Cycles: each test's seconds times the core clock, measured just before it as a chain of dependent
scalar adds (one a cycle on every x86 core of the last decade). Each throughput test issues independent
instructions (no result feeds another), so it reports how many a cycle the ports take; "latency
chain" rows feed each result into the next. A VM's other tenants show up as noise: run it twice.
AVX2 only (x86-64); it exits with a message elsewhere.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

# (name, instructions (or spans) per iteration, body). %0 is a 64-byte aligned buffer; ymm1, ymm2,
# ymm8, ymm9 hold inputs and ymm12 the gather's offsets, none of them written by a test, so the independent tests
# carry no dependency from one iteration to the next.
TESTS = [
    ("vpaddb (independent)", 8, "".join(f"vpaddb %%ymm1, %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vpaddb (latency chain)", 8, "vpaddb %%ymm3, %%ymm3, %%ymm3\\n" * 8),
    ("vpmaddubsw", 8, "".join(f"vpmaddubsw %%ymm1, %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vpmaddwd", 8, "".join(f"vpmaddwd %%ymm1, %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vpmaddubsw + vpmaddwd, half each", 8,
     "".join(f"{'vpmaddubsw' if r % 2 else 'vpmaddwd'} %%ymm1, %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vpmaddubsw, one operand from memory", 8,
     "".join(f"vpmaddubsw {32 * (r - 3)}(%0), %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vmovdqu (32-byte load, aligned)", 8, "".join(f"vmovdqu {32 * (r - 3)}(%0), %%ymm{r}\\n" for r in range(3, 11))),
    ("vmovdqu (32-byte load, half across lines)", 8,
     "".join(f"vmovdqu {32 * (r - 3) + 16}(%0), %%ymm{r}\\n" for r in range(3, 11))),
    ("vpbroadcastd from memory", 8, "".join(f"vpbroadcastd {4 * (r - 3)}(%0), %%ymm{r}\\n" for r in range(3, 11))),
    ("vcvtdq2ps", 8, "".join(f"vcvtdq2ps %%ymm1, %%ymm{r}\\n" for r in range(3, 11))),
    ("vcvtph2ps from memory (8 binary16 values)", 8,
     "".join(f"vcvtph2ps {16 * (r - 3)}(%0), %%ymm{r}\\n" for r in range(3, 11))),
    ("vfmadd231ps (8 accumulators)", 8, "".join(f"vfmadd231ps %%ymm1, %%ymm2, %%ymm{r}\\n" for r in range(3, 11))),
    ("vpgatherdd, 8 lanes (one instruction)", 1,
     "vpxor %%ymm3, %%ymm3, %%ymm3\\nvpcmpeqd %%ymm5, %%ymm5, %%ymm5\\nvpgatherdd %%ymm5, (%0,%%ymm12,4), %%ymm3\\n"),
    ("8 scalar loads + 7 inserts (one instruction's worth)", 1,
     "vmovss (%0), %%xmm3\\nvinsertps $0x10, 4(%0), %%xmm3, %%xmm3\\nvinsertps $0x20, 8(%0), %%xmm3, %%xmm3\\n"
     "vinsertps $0x30, 12(%0), %%xmm3, %%xmm3\\nvmovss 16(%0), %%xmm4\\nvinsertps $0x10, 20(%0), %%xmm4, %%xmm4\\n"
     "vinsertps $0x20, 24(%0), %%xmm4, %%xmm4\\nvinsertps $0x30, 28(%0), %%xmm4, %%xmm4\\n"
     "vinsertf128 $1, %%xmm4, %%ymm3, %%ymm3\\n"),
    # a t1 span as the kernel does it (y by 3x and 3 y by x: two byte products, their difference as
    # words, one word product by the scale words, one sum; the next field's bytes 3 y in two byte adds),
    # as it did with inputs to 63 (P and Q: two word products, two sums), and taking the trits out by
    # two compares
    ("t1 span by 3x and x (2 vpmaddubsw, 1 vpmaddwd)", 1,
     "vpaddb %%ymm1, %%ymm1, %%ymm3\\nvpaddb %%ymm3, %%ymm1, %%ymm4\\nvpmaddubsw 32(%0), %%ymm2, %%ymm5\\n"
     "vpmaddubsw (%0), %%ymm4, %%ymm6\\nvpsubw %%ymm6, %%ymm5, %%ymm5\\nvpbroadcastd 4(%0), %%ymm7\\n"
     "vpmaddwd %%ymm7, %%ymm5, %%ymm5\\nvpaddd %%ymm5, %%ymm8, %%ymm10\\n"),
    ("t1 span by 3 P - Q (2 vpmaddubsw, 2 vpmaddwd)", 1,
     "vpaddb %%ymm1, %%ymm1, %%ymm3\\nvpaddb %%ymm3, %%ymm1, %%ymm4\\nvpmaddubsw (%0), %%ymm2, %%ymm5\\n"
     "vpmaddubsw (%0), %%ymm4, %%ymm6\\nvpbroadcastd 4(%0), %%ymm7\\nvpmaddwd %%ymm7, %%ymm5, %%ymm5\\n"
     "vpmaddwd %%ymm7, %%ymm6, %%ymm6\\nvpaddd %%ymm5, %%ymm8, %%ymm10\\nvpaddd %%ymm6, %%ymm8, %%ymm11\\n"),
    ("t1 span by compares (1 vpmaddubsw, 1 vpmaddwd)", 1,
     "vpaddb %%ymm1, %%ymm1, %%ymm3\\nvpaddb %%ymm3, %%ymm1, %%ymm4\\nvpcmpgtb %%ymm8, %%ymm1, %%ymm5\\n"
     "vpcmpgtb %%ymm9, %%ymm1, %%ymm6\\nvpaddb %%ymm5, %%ymm6, %%ymm6\\nvpabsb %%ymm6, %%ymm6\\n"
     "vpmaddubsw (%0), %%ymm6, %%ymm6\\nvpbroadcastd 4(%0), %%ymm7\\nvpmaddwd %%ymm7, %%ymm6, %%ymm6\\n"
     "vpaddd %%ymm6, %%ymm8, %%ymm10\\n"),
    # a q2 block of four spans as row_x8 runs it with int8 inputs (one code load, a shift, four masks,
    # four byte products with their inputs from memory, four word products by each span's scale words,
    # three sums, the conversion and the block's factor), with the scale words broadcast from memory as
    # the kernel does and from a register; "per" counts spans
    ("q2 block of 4 spans (scale words broadcast)", 4,
     "vmovdqu (%0), %%ymm3\\nvpsrlw $4, %%ymm3, %%ymm4\\nvpand %%ymm1, %%ymm3, %%ymm5\\nvpmaddubsw 32(%0), %%ymm5, %%ymm5\\n"
     "vpbroadcastd 4(%0), %%ymm6\\nvpmaddwd %%ymm6, %%ymm5, %%ymm5\\nvpand %%ymm2, %%ymm3, %%ymm6\\n"
     "vpmaddubsw 64(%0), %%ymm6, %%ymm6\\nvpbroadcastd 8(%0), %%ymm7\\nvpmaddwd %%ymm7, %%ymm6, %%ymm6\\n"
     "vpaddd %%ymm6, %%ymm5, %%ymm5\\nvpand %%ymm1, %%ymm4, %%ymm6\\nvpmaddubsw 96(%0), %%ymm6, %%ymm6\\n"
     "vpbroadcastd 12(%0), %%ymm7\\nvpmaddwd %%ymm7, %%ymm6, %%ymm6\\nvpand %%ymm2, %%ymm4, %%ymm7\\n"
     "vpmaddubsw 128(%0), %%ymm7, %%ymm7\\nvpbroadcastd 16(%0), %%ymm10\\nvpmaddwd %%ymm10, %%ymm7, %%ymm7\\n"
     "vpaddd %%ymm7, %%ymm6, %%ymm6\\nvpaddd %%ymm6, %%ymm5, %%ymm5\\nvcvtdq2ps %%ymm5, %%ymm5\\n"
     "vbroadcastss 20(%0), %%ymm6\\nvfmadd213ps %%ymm9, %%ymm6, %%ymm5\\n"),
    ("q2 block of 4 spans (scale words in a register)", 4,
     "vmovdqu (%0), %%ymm3\\nvpsrlw $4, %%ymm3, %%ymm4\\nvpand %%ymm1, %%ymm3, %%ymm5\\nvpmaddubsw 32(%0), %%ymm5, %%ymm5\\n"
     "vpmaddwd %%ymm8, %%ymm5, %%ymm5\\nvpand %%ymm2, %%ymm3, %%ymm6\\n"
     "vpmaddubsw 64(%0), %%ymm6, %%ymm6\\nvpmaddwd %%ymm8, %%ymm6, %%ymm6\\n"
     "vpaddd %%ymm6, %%ymm5, %%ymm5\\nvpand %%ymm1, %%ymm4, %%ymm6\\nvpmaddubsw 96(%0), %%ymm6, %%ymm6\\n"
     "vpmaddwd %%ymm8, %%ymm6, %%ymm6\\nvpand %%ymm2, %%ymm4, %%ymm7\\n"
     "vpmaddubsw 128(%0), %%ymm7, %%ymm7\\nvpmaddwd %%ymm8, %%ymm7, %%ymm7\\n"
     "vpaddd %%ymm7, %%ymm6, %%ymm6\\nvpaddd %%ymm6, %%ymm5, %%ymm5\\nvcvtdq2ps %%ymm5, %%ymm5\\n"
     "vbroadcastss 20(%0), %%ymm6\\nvfmadd213ps %%ymm9, %%ymm6, %%ymm5\\n"),
    # the same block with each span's digits turned into digit x scale by a byte table (vpshufb of a
    # 16-byte row of products per scale), two spans' byte products summed as words before one word product
    ("q2 block of 4 spans (scales by byte tables)", 4,
     "vmovdqu (%0), %%ymm3\\nvpsrlw $4, %%ymm3, %%ymm4\\nvpand %%ymm1, %%ymm3, %%ymm5\\n"
     "vbroadcasti128 16(%0), %%ymm6\\nvpshufb %%ymm5, %%ymm6, %%ymm5\\n"
     "vpmaddubsw 32(%0), %%ymm5, %%ymm5\\nvpand %%ymm2, %%ymm3, %%ymm6\\nvbroadcasti128 48(%0), %%ymm7\\n"
     "vpshufb %%ymm6, %%ymm7, %%ymm6\\nvpmaddubsw 64(%0), %%ymm6, %%ymm6\\n"
     "vpaddw %%ymm6, %%ymm5, %%ymm5\\nvpmaddwd %%ymm8, %%ymm5, %%ymm5\\nvpand %%ymm1, %%ymm4, %%ymm6\\n"
     "vbroadcasti128 80(%0), %%ymm7\\nvpshufb %%ymm6, %%ymm7, %%ymm6\\n"
     "vpmaddubsw 96(%0), %%ymm6, %%ymm6\\nvpand %%ymm2, %%ymm4, %%ymm7\\n"
     "vbroadcasti128 112(%0), %%ymm10\\nvpshufb %%ymm7, %%ymm10, %%ymm7\\n"
     "vpmaddubsw 128(%0), %%ymm7, %%ymm7\\nvpaddw %%ymm7, %%ymm6, %%ymm6\\n"
     "vpmaddwd %%ymm8, %%ymm6, %%ymm6\\nvpaddd %%ymm6, %%ymm5, %%ymm5\\nvcvtdq2ps %%ymm5, %%ymm5\\n"
     "vbroadcastss 20(%0), %%ymm6\\nvfmadd213ps %%ymm9, %%ymm6, %%ymm5\\n"),
]

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    int *buf = aligned_alloc(64, 4096);
    for (int i = 0; i < 1024; i++) buf[i] = i % 61;
    /* inputs; ymm12: eight distinct word offsets for the gather (buf[i] = i for i < 61) */
    __asm__ volatile("vpxor %%ymm1, %%ymm1, %%ymm1\n vpxor %%ymm2, %%ymm2, %%ymm2\n vpxor %%ymm3, %%ymm3, %%ymm3\n"
                     "vpxor %%ymm8, %%ymm8, %%ymm8\n vpxor %%ymm9, %%ymm9, %%ymm9\n vmovdqu (%0), %%ymm12"
                     :: "r"(buf) : "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm12");
    long x = 0;
    double hz = 0;
    /* the clock, measured again before each test: a VM's clock moves with its neighbours */
#define CLOCK() { double t0 = now(); \
    for (long i = 0; i < n / 4; i++) __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0" : "+r"(x)); \
    hz = n / (now() - t0); }
    CLOCK();
    printf("clock %.3f\n", hz / 1e9);
#define T(name, per, body) { CLOCK(); double s = now(); \
    for (long i = 0; i < n; i++) __asm__ volatile(body :: "r"(buf) : "memory", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11"); \
    printf("%s\t%d\t%.4f\n", name, per, (now() - s) * hz / n); }
TESTS
    return (int)(x & 1);
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=50_000_000)
    a = ap.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit("bench_isa: x86-64 only")
    with open("/proc/cpuinfo") as f:
        info = f.read()
    if " avx2" not in info:
        sys.exit("bench_isa: this CPU has no AVX2")
    cpu = {}                            # the first processor's fields
    for ln in info.splitlines():
        key, _, value = ln.partition(":")
        cpu.setdefault(key.strip(), value.strip())
    tests = "\n".join(f'    T("{name}", {per}, "{body}")' for name, per, body in TESTS)
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "isa.c"), os.path.join(d, "isa")
        with open(src, "w") as f:
            f.write(PROGRAM.replace("TESTS", tests))
        build = subprocess.run(["gcc", "-O2", "-mavx2", src, "-o", exe], capture_output=True, text=True)
        if build.returncode:
            sys.exit(f"bench_isa: gcc failed: {build.stderr.strip().splitlines()[-1] if build.stderr.strip() else build.returncode}")
        out = subprocess.run([exe, str(a.iterations)], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    clock = float(lines[0].split()[1])
    print(f"{cpu.get('model name', '?')} (family {cpu.get('cpu family', '?')} model {cpu.get('model', '?')}), core clock {clock:.2f} GHz (dependent scalar adds), "
          f"{a.iterations:,} iterations per test\n")
    print("| instructions | cycles per iteration | per cycle |\n| --- | --- | --- |")
    for ln in lines[1:]:
        name, per, cycles = ln.split("\t")
        cyc = float(cycles)
        print(f"| {name} (x{per}) | {cyc:.2f} | {int(per) / cyc:.2f} |")


if __name__ == "__main__":
    main()
