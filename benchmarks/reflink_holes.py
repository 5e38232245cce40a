"""A copy of a sparse file whose holes are real disk blocks of zeros, written once and shared by
reflink, so that reading them costs what a disk read costs.

    python benchmarks/reflink_holes.py SPARSE.kst DEST.kst [--chunk 64M]

Why: a synthetic Kimi K2 file (`kimi-convert --synthetic ... --sparse`) keeps its 290 GiB of routed
experts as holes. Reading a hole costs no disk time but a CPU zero-fill of the reader's buffer in the
kernel (`rep stos`, about as much CPU per byte as a memset), on the same two cores as the computation,
where a real disk's DMA would cost almost none. In this copy every hole is cloned (FICLONERANGE) from
one file of --chunk zeros written to the disk, so the copy takes the source's data plus one chunk of
space however large its holes, and an O_DIRECT read of an expert is a real read of the device.

DEST must be on a filesystem with reflinks (XFS made with `-m reflink=1`, btrfs). On a machine whose
disks have none, a loop device over an image file does, with direct I/O so that the loop device does
not copy through the page cache:

    apt-get install xfsprogs
    truncate -s 64G /var/tmp/xfs.img && mkfs.xfs -m reflink=1 /var/tmp/xfs.img
    dev=$(losetup --direct-io=on -f --show /var/tmp/xfs.img) && mkdir -p /mnt/kx && mount $dev /mnt/kx

The copy is written under DEST.partial and renamed when complete (the zero block is cloned once
before any data is copied, so a filesystem without reflinks is found at once); a DEST that exists is
left alone, and nothing is left beside it on failure.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import struct
import sys
import time
from pathlib import Path

from kimistream.formats.sizes import fmt, parse_size

FICLONERANGE = 0x4020940D        # _IOW(0x94, 13, struct file_clone_range)
BLOCK = 4096


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The file's data as (start, end) ranges, from SEEK_DATA / SEEK_HOLE."""
    out, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:                      # ENXIO: no data past pos
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, end))
        pos = end
    return out


def clone(src_fd: int, src_off: int, length: int, dst_fd: int, dst_off: int) -> None:
    fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_off, length, dst_off))


def copy_range(src_fd: int, dst_fd: int, start: int, end: int, step: int = 16 << 20) -> None:
    """Bytes start..end copied to the same offsets (read and write: copy_file_range does not cross
    filesystems of different types)."""
    pos = start
    while pos < end:
        buf = os.pread(src_fd, min(step, end - pos), pos)
        if not buf:
            raise OSError(f"unexpected end of file at byte {pos}")
        os.pwrite(dst_fd, buf, pos)
        pos += len(buf)


def reflink_holes(src: Path, dest: Path, chunk: int = 64 << 20) -> None:
    part = dest.with_name(dest.name + ".partial")
    zeros = dest.with_name(dest.name + ".zeros")
    sfd = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(sfd).st_size
        data = data_ranges(sfd, size)
        holes, pos = [], 0
        for start, end in data + [(size, size)]:
            if start > pos:
                holes.append((pos, start))
            pos = end
        with open(zeros, "wb") as f:         # the one chunk of zeros every hole shares
            f.write(bytes(chunk))
            f.flush()
            os.fsync(f.fileno())
        zfd = os.open(zeros, os.O_RDONLY)
        dfd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(dfd, size)
            clone(zfd, 0, BLOCK, dfd, 0)      # the filesystem takes clones: known before any data is copied
            t0, done = time.monotonic(), 0
            for start, end in data:
                copy_range(sfd, dfd, start, end)
                done += end - start
            print(f"reflink_holes: {done / 2**30:.2f} GiB of data copied in {time.monotonic() - t0:.0f} s",
                  file=sys.stderr)
            clones = 0
            for start, end in holes:
                # whole blocks inside the hole; its ragged edges stay holes (a few KiB at most)
                a, b = -(-start // BLOCK) * BLOCK, end // BLOCK * BLOCK
                while a < b:
                    n = min(chunk, b - a)
                    clone(zfd, 0, n, dfd, a)
                    a += n
                    clones += 1
            os.fsync(dfd)
        finally:
            os.close(dfd)
            os.close(zfd)
        os.rename(part, dest)
        shared = sum(e - s for s, e in holes)
        print(f"reflink_holes: {dest}: {size / 2**30:.2f} GiB, {shared / 2**30:.2f} GiB of holes as {clones} clones "
              f"of one {fmt(chunk)} block of zeros", file=sys.stderr)
    finally:
        os.close(sfd)
        part.unlink(missing_ok=True)
        zeros.unlink(missing_ok=True)         # its blocks stay, shared by the copy's clones


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--chunk", default="64MiB", help="size of the shared zero file (a multiple of 4 KiB)")
    a = ap.parse_args(argv)
    try:
        chunk = parse_size(a.chunk)
    except ValueError as e:
        ap.error(f"--chunk: {e}")
    if chunk <= 0 or chunk % BLOCK:
        ap.error("--chunk: a positive multiple of 4 KiB")
    if a.dest.exists():
        print(f"reflink_holes: {a.dest} exists; left as it is", file=sys.stderr)
        return 0
    try:
        reflink_holes(a.src, a.dest, chunk)
    except OSError as e:
        hint = (" (the destination's filesystem takes no reflinks: XFS with reflink=1 or btrfs do)"
                if e.errno in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL) else "")
        print(f"reflink_holes: {e.filename or a.dest}: {e.strerror or e}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
