"""A Recorder in a child process, so SQL writing runs on its own core.

The fold and the SQL drivers are both CPU-bound Python; in one process they take turns
on the GIL, so overlapping them in threads gains nothing. The child (`python -m
kvledger.store.writer`) owns the database connection; the parent sends each ChangeSet pickled
over the child's stdin and reads "committed" or the error from its stdout. The child
dies with its parent (PR_SET_PDEATHSIG), so a kill -9 of the projector also ends the
transaction in flight, which the database rolls back.

The child imports no SQLAlchemy: the parent resolves the URL into the driver's connect
arguments (store.database.driver_connect_args) and the child opens the connection with
the driver alone (store/transactions.py). Its start is the projection's head start: at
300 000 block events, a child importing SQLAlchemy was ready about 0.35 s after it was
started, while the fold waited with eight transactions made.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
from typing import BinaryIO

from kvledger.runtime.parent_death import end_with_parent
from kvledger.store.changes import ChangeSet

_LENGTH = struct.Struct(">Q")


class WriterError(RuntimeError):
    """The child could not write a transaction (database error, or it died); the SQL checkpoint says what committed."""


def encode_changes(changes: ChangeSet) -> bytes:
    """A ChangeSet as it travels to the child; the caller encodes it, so that can happen ahead of the write."""
    return pickle.dumps(changes, protocol=pickle.HIGHEST_PROTOCOL)


def _send(stream: BinaryIO, value: object) -> None:
    _send_encoded(stream, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _send_encoded(stream: BinaryIO, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: BinaryIO) -> object:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("closed")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("closed mid-message")
    return pickle.loads(data)


def _die_with_parent(parent_pid: int) -> None:
    """In the child, first thing: be SIGKILLed when the projector dies (Linux), even by kill -9."""
    if not end_with_parent(signal.SIGKILL, parent_pid):  # the parent died before the death signal was armed
        os._exit(1)


def serve(stream_name: str, requests: BinaryIO, replies: BinaryIO, checkpoint_name: str = "events") -> int:
    """The child's loop: the connect arguments first, then one ChangeSet in, one transaction, one reply out;
    ends at EOF or on an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kvledger.store.gc_policy import defer_young_collections
    from kvledger.store.transactions import connect_driver, recorder_for

    defer_young_collections()  # each unpickled ChangeSet is some 10 000 lists at once

    try:
        dialect, args, kwargs = _receive(requests)
        recorder = recorder_for(dialect, connect_driver(dialect, args, kwargs), stream_name, checkpoint_name)
    except EOFError:
        return 0
    except Exception as error:
        _send(replies, ("error", f"{type(error).__name__}: {error}"))
        return 1
    _send(replies, ("ready", ""))
    try:
        while True:
            try:
                changes = _receive(requests)
            except EOFError:
                return 0
            try:
                # A transaction folds on from the checkpoint just below its first seq: SQL's must still be
                # there (a database restored from an older backup fails it, and the fold is rebuilt from SQL).
                recorder.write(changes, after=changes.first_seq - 1)
            except Exception as error:
                _send(replies, ("error", f"{type(error).__name__}: {error}"))
                return 1  # the parent starts a new writer once the database is back
            _send(replies, ("committed", ""))
    finally:
        recorder.close()


def _without_password(url: str) -> str:
    import sqlalchemy as sa  # the parent's: it has SQLAlchemy loaded already

    return sa.make_url(url).render_as_string(hide_password=True)


class RecorderProcess:
    """The Recorder interface (write, close), served by a child process."""

    # The child writes while the parent folds the next batch: two cores, no GIL between them.
    overlaps_folding = True

    def __init__(self, url: str, stream: str, checkpoint_name: str = "events") -> None:
        from kvledger.store.database import driver_connect_args

        connect_args = driver_connect_args(url)  # a URL it cannot open fails here, in the parent
        # Started from the event loop's thread: the death signal is tied to the starting thread.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvledger.store.writer", stream, _without_password(url), str(os.getpid()), checkpoint_name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        # The connect arguments may hold a database password: they go down the pipe, never
        # onto the command line, where any user could read them in `ps`.
        _send(self._process.stdin, connect_args)
        self.ready = False  # until the child says it holds its connection (wait_ready)

    def _reply(self) -> None:
        try:
            status, message = _receive(self._process.stdout)
        except (EOFError, OSError) as error:
            raise WriterError(f"the writer process died ({error})") from None
        if status == "error":
            raise WriterError(message)

    def wait_ready(self) -> None:
        """Block until the child holds its database connection (WriterError if it cannot)."""
        self._reply()
        self.ready = True

    def write(self, encoded: bytes) -> None:
        """Commit one ChangeSet, given as `encode_changes` made it; returns once the child committed."""
        try:
            _send_encoded(self._process.stdin, encoded)
        except OSError as error:
            raise WriterError(f"the writer process is gone ({error})") from None
        self._reply()

    def close(self) -> None:
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


if __name__ == "__main__":
    # argv: the stream, the URL without its password (only so `ps` shows which database), the parent
    # pid, and the checkpoint row the transactions advance (the shard's)
    _die_with_parent(int(sys.argv[3]))
    raise SystemExit(serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer, sys.argv[4]))
