#!/usr/bin/env python3
"""A FUSE filesystem over a backing directory that behaves like a disk whose fsync can fail, for
the held-out storage checks (`.ci/heldout/storage eio-kill-cut`). Not a test of bucketd's own
rules: a device model, with Linux's real page cache above it.

The layers, top down:
  - the kernel's page cache (real, in writeback mode: a write stays in it until fsync or the
    kernel's writeback sends it down, and its pages outlive the process and the next open
    (kernel_cache), as on a local filesystem);
  - this process: what the device took but has not made durable (writes since the last fsync
    of the file, page by page), read back as written;
  - the backing directory: the medium.

A successful fsync of a file puts its pending pages on the medium (and fsyncs the backing
file). A failing one (armed through the control file) drops them: the device never wrote
them, and reports EIO. The kernel keeps its copies of those pages, marked clean (Linux's
behaviour after a failed fsync), so a process that reads through the page cache still sees
them, and one that drops its cached pages (posix_fadvise DONTNEED) reads the medium. A power
cut drops every pending page of every file; the caller then unmounts (the page cache goes with
it) and mounts again.

Control: write a line to `<mountpoint>/.eiofs`:
  fail SUFFIX N   the next N fsyncs of files whose name ends with SUFFIX fail with EIO
  cut             the power fails: every pending page is gone, and from then on every write is
                  dropped and every fsync fails (the dirty pages the kernel writes back while
                  the caller unmounts never reach the medium); a new mount powers it on
Reading `<mountpoint>/.eiofs` gives counters: "fsyncs N failed N cut N".

Usage: eiofs.py BACKING MOUNTPOINT   (runs in the foreground; needs root and /dev/fuse)
"""

import errno
import os
import sys
import threading

import mfusepy as fuse

PAGE = 4096
CONTROL = "/.eiofs"


class File:
    """One file's pending pages (the device's unpersisted writes) and visible size."""

    def __init__(self, size):
        self.pages = {}
        self.size = size


class EioFs(fuse.Operations):
    use_ns = True

    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.mutex = threading.RLock()
        self.files = {}  # path -> File, for files with pending pages or a changed size
        self.fail = []  # [suffix, remaining]
        self.fsyncs = self.failed = self.cuts = 0
        self.off = False

    # -- helpers

    def real(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    def state(self, path):
        f = self.files.get(path)
        if f is None:
            try:
                size = os.path.getsize(self.real(path))
            except FileNotFoundError:
                size = 0
            f = self.files[path] = File(size)
        return f

    def medium_page(self, path, n):
        try:
            with open(self.real(path), "rb") as fh:
                fh.seek(n * PAGE)
                data = fh.read(PAGE)
        except FileNotFoundError:
            data = b""
        return bytearray(data.ljust(PAGE, b"\0"))

    def persist(self, path):
        f = self.files.get(path)
        if f is None:
            return
        fd = os.open(self.real(path), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for n, page in sorted(f.pages.items()):
                end = min(PAGE, max(0, f.size - n * PAGE))
                if end > 0:
                    os.pwrite(fd, bytes(page[:end]), n * PAGE)
            os.ftruncate(fd, f.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        del self.files[path]

    def drop(self, path):
        """The device lost what it had not made durable of `path`."""
        self.files.pop(path, None)

    # -- the control file

    def control(self, text):
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["fail"] and len(words) == 3:
                self.fail = [words[1], int(words[2])]
            elif words == ["cut"]:
                self.cuts += 1
                self.files.clear()
                self.fail = []
                self.off = True

    def control_text(self):
        return f"fsyncs {self.fsyncs} failed {self.failed} cut {self.cuts}\n".encode()

    # -- operations

    def init_with_config(self, conn, config):
        # The kernel's page cache in writeback mode, kept across opens.
        writeback = 1 << 16  # FUSE_CAP_WRITEBACK_CACHE
        if conn.capable & writeback:
            conn.want |= writeback
        config.kernel_cache = 1

    def getattr(self, path, fh=None):
        with self.mutex:
            if path == CONTROL:
                return {"st_mode": 0o100644, "st_nlink": 1, "st_size": 4096}
            st = os.lstat(self.real(path))
            attrs = {
                k: getattr(st, k)
                for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                          "st_atime", "st_mtime", "st_ctime")
            }
            f = self.files.get(path)
            if f is not None:
                attrs["st_size"] = f.size
            attrs["st_blocks"] = (attrs["st_size"] + 511) // 512
            return attrs

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self.real(path))

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}

    def open(self, path, fi):
        with self.mutex:
            if path == CONTROL:
                # Past the page cache: each read asks this process.
                fi.direct_io = 1
                return 0
            if not os.path.exists(self.real(path)):
                raise fuse.FuseOSError(errno.ENOENT)
            # The kernel keeps its cached pages across opens, as for a local filesystem.
            fi.keep_cache = 1
            return 0

    def create(self, path, mode, fi=None):
        with self.mutex:
            fd = os.open(self.real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            os.close(fd)
            self.files.pop(path, None)
            if fi is not None:
                fi.keep_cache = 1
            return 0

    def read(self, path, size, offset, fi):
        with self.mutex:
            if path == CONTROL:
                return self.control_text()[offset:offset + size]
            f = self.files.get(path)
            file_size = f.size if f else os.path.getsize(self.real(path))
            end = min(offset + size, file_size)
            out = bytearray()
            at = offset
            while at < end:
                n = at // PAGE
                page = f.pages.get(n) if f else None
                if page is None:
                    page = self.medium_page(path, n)
                take = min(end, (n + 1) * PAGE) - at
                out += page[at - n * PAGE: at - n * PAGE + take]
                at += take
            return bytes(out)

    def write(self, path, data, offset, fi):
        with self.mutex:
            if path == CONTROL:
                self.control(data.decode())
                return len(data)
            if self.off:
                return len(data)
            f = self.state(path)
            at, i = offset, 0
            while i < len(data):
                n = at // PAGE
                page = f.pages.get(n)
                if page is None:
                    page = f.pages[n] = self.medium_page(path, n)
                start = at - n * PAGE
                take = min(PAGE - start, len(data) - i)
                page[start:start + take] = data[i:i + take]
                at += take
                i += take
            f.size = max(f.size, offset + len(data))
            return len(data)

    def truncate(self, path, length, fh=None):
        with self.mutex:
            if path == CONTROL:
                return 0
            f = self.state(path)
            f.size = length
            for n in [n for n in f.pages if n * PAGE >= length]:
                del f.pages[n]
            return 0

    def fallocate(self, path, mode, offset, length, fi):
        with self.mutex:
            f = self.state(path)
            if not mode & 1:  # FALLOC_FL_KEEP_SIZE
                f.size = max(f.size, offset + length)
            return 0

    def fsync(self, path, datasync, fi):
        with self.mutex:
            if path == CONTROL:
                return 0
            self.fsyncs += 1
            if self.off:
                raise fuse.FuseOSError(errno.EIO)
            if self.fail and self.fail[1] > 0 and path.endswith(self.fail[0]):
                self.fail[1] -= 1
                self.failed += 1
                self.drop(path)
                raise fuse.FuseOSError(errno.EIO)
            self.persist(path)
            return 0

    def flush(self, path, fi):
        return 0

    def release(self, path, fi):
        return 0

    def unlink(self, path):
        with self.mutex:
            self.files.pop(path, None)
            os.unlink(self.real(path))

    def rename(self, old, new):
        with self.mutex:
            # Metadata goes to the medium at once (ext4's rename of a synced file is ordered).
            self.persist(old)
            self.files.pop(new, None)
            os.rename(self.real(old), self.real(new))

    def mkdir(self, path, mode):
        os.mkdir(self.real(path), mode)

    def rmdir(self, path):
        os.rmdir(self.real(path))

    def chmod(self, path, mode):
        os.chmod(self.real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.chown(self.real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        return 0

    def access(self, path, amode):
        return 0

    def opendir(self, path):
        return 0

    def releasedir(self, path, fi):
        return 0

    def fsyncdir(self, path, datasync, fi):
        return 0


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    backing, mountpoint = sys.argv[1], sys.argv[2]
    fuse.FUSE(EioFs(backing), mountpoint, foreground=True, raw_fi=True, nothreads=True)


if __name__ == "__main__":
    main()
