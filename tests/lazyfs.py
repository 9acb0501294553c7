"""A FUSE file system that loses what was not fsynced, as a power loss does (after Jepsen's LazyFS).

    python tests/lazyfs.py BACKING MOUNTPOINT

Everything below MOUNTPOINT is BACKING's, except data: a write stays in this process's
memory (the "page cache") until the file is fsynced, and reads see it meanwhile. SIGUSR1 is
the power loss: every write not yet fsynced is dropped, as if the machine had lost power;
the process then serves on (kill and restart the programs above it, as a reboot would).
SIGUSR2 is the operating system's writeback (what `sync`, or dirty pages aging out after
half a minute, does): every pending write reaches BACKING.

What it models and what it does not:
- data written but not fsynced is lost, whole writes at a time (a torn sector is not);
- a file's creation, rename, removal and truncation reach BACKING at once, as if every
  directory operation were journalled before it returned (real file systems may lose those
  too); a truncation first writes the file's pending data (it is then durable);
- one process's view: nothing here models several disks or a write that reordered.

Needs libfuse 2 (Debian's libfuse2 and fuse) and fusepy.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

from fuse import FUSE, FuseOSError, Operations


class LazyFS(Operations):
    def __init__(self, backing: str) -> None:
        self.backing = os.path.realpath(backing)
        self._guard = threading.RLock()
        self.pending: dict[str, list[tuple[int, bytes]]] = {}  # backing path → writes not fsynced, in order
        self.lost_writes = 0

    # --- the power loss ---------------------------------------------------------------

    def write_back_all(self) -> None:
        with self._guard:
            for full in list(self.pending):
                self._write_back(full)

    def lose_unsynced(self) -> None:
        with self._guard:
            self.lost_writes += sum(len(writes) for writes in self.pending.values())
            self.pending.clear()

    # --- helpers -----------------------------------------------------------------------

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _logical_size(self, full: str, backing_size: int) -> int:
        writes = self.pending.get(full)
        if not writes:
            return backing_size
        return max(backing_size, max(offset + len(data) for offset, data in writes))

    def _write_back(self, full: str, fd: int | None = None) -> None:
        writes = self.pending.pop(full, None)
        if not writes:
            return
        own = fd is None
        if own:
            fd = os.open(full, os.O_WRONLY)
        try:
            for offset, data in writes:
                os.pwrite(fd, data, offset)
        finally:
            if own:
                os.close(fd)

    # --- metadata: straight through ---------------------------------------------------

    def access(self, path, mode):
        if not os.access(self._full(path), mode):
            raise FuseOSError(errno.EACCES)

    def chmod(self, path, mode):
        return os.chmod(self._full(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._full(path), uid, gid)

    def getattr(self, path, fh=None):
        full = self._full(path)
        try:
            st = os.lstat(full)
        except OSError as error:
            raise FuseOSError(error.errno) from None
        attrs = {key: getattr(st, key) for key in (
            "st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")}
        with self._guard:
            attrs["st_size"] = self._logical_size(full, st.st_size)
        return attrs

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def readlink(self, path):
        return os.readlink(self._full(path))

    def mknod(self, path, mode, dev):
        return os.mknod(self._full(path), mode, dev)

    def rmdir(self, path):
        return os.rmdir(self._full(path))

    def mkdir(self, path, mode):
        return os.mkdir(self._full(path), mode)

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        return {key: getattr(st, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize",
            "f_namemax")}

    def unlink(self, path):
        full = self._full(path)
        with self._guard:
            self.pending.pop(full, None)
            return os.unlink(full)

    def symlink(self, name, target):
        return os.symlink(target, self._full(name))

    def rename(self, old, new):
        old_full, new_full = self._full(old), self._full(new)
        with self._guard:
            os.rename(old_full, new_full)
            self.pending.pop(new_full, None)
            if old_full in self.pending:
                self.pending[new_full] = self.pending.pop(old_full)
            # A directory renamed carries its files' pending writes along.
            prefix = old_full + os.sep
            for key in [key for key in self.pending if key.startswith(prefix)]:
                self.pending[new_full + key[len(old_full):]] = self.pending.pop(key)

    def link(self, target, name):
        return os.link(self._full(name), self._full(target))

    def utimens(self, path, times=None):
        return os.utime(self._full(path), times)

    # --- data: held until fsync -------------------------------------------------------

    def open(self, path, flags):
        return os.open(self._full(path), flags & ~os.O_APPEND)

    def create(self, path, mode, fi=None):
        return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        full = self._full(path)
        with self._guard:
            data = bytearray(os.pread(fh, size, offset))
            writes = self.pending.get(full)
            if writes:
                end = min(offset + size, self._logical_size(full, os.fstat(fh).st_size))
                if len(data) < end - offset:
                    data.extend(bytes(end - offset - len(data)))
                for write_offset, chunk in writes:
                    start, stop = max(write_offset, offset), min(write_offset + len(chunk), end)
                    if start < stop:
                        data[start - offset:stop - offset] = chunk[start - write_offset:stop - write_offset]
            return bytes(data)

    def write(self, path, data, offset, fh):
        with self._guard:
            self.pending.setdefault(self._full(path), []).append((offset, bytes(data)))
        return len(data)

    def truncate(self, path, length, fh=None):
        full = self._full(path)
        with self._guard:
            self._write_back(full)
            with open(full, "r+b") as handle:
                handle.truncate(length)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        return os.close(fh)

    def fsync(self, path, datasync, fh):
        full = self._full(path)
        with self._guard:
            self._write_back(full, fh)
            os.fsync(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        return 0


def main() -> None:
    backing, mountpoint = sys.argv[1], sys.argv[2]
    filesystem = LazyFS(backing)
    # The main thread stays inside libfuse's loop, where a Python signal handler never runs:
    # the signals are blocked in every thread (libfuse's inherit the mask) and taken by one of ours.
    signals = {signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def take_signals() -> None:
        while True:
            if signal.sigwait(signals) == signal.SIGUSR1:
                filesystem.lose_unsynced()
            else:
                filesystem.write_back_all()

    threading.Thread(target=take_signals, daemon=True, name="power-loss").start()
    FUSE(filesystem, mountpoint, foreground=True, nothreads=False)


if __name__ == "__main__":
    main()
