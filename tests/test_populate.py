"""A growing table maps its next rows' pages ahead on a thread of its own
(``embstore-pages``, ``MADV_POPULATE_WRITE``): rows written on those
pages read back as written, a forked child that goes on growing an
inherited table starts its own thread, tables dropped while their pages are
being mapped do not crash the process, and a process under a memory limit
still fails an insert cleanly. Each case in a child interpreter under a
timeout (a hang fails the test)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from . import _child

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")

THREADS = """
import os, time
def populate_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return names.count("embstore-pages")

def grow(t, start, n, call, dim):
    # Row i holds i in every column, so any mix-up shows.
    for s in range(start, start + n, call):
        k = np.arange(s, min(s + call, start + n))
        t.assign(k, np.repeat(k.astype(np.float32)[:, None], dim, 1))

def check(t, n, dim, step=1):
    k = np.arange(0, n, step)
    rows = t.lookup(k, insert=False)
    assert (rows == k.astype(np.float32)[:, None]).all(), "rows differ from what was written"
"""


def test_rows_written_on_pages_mapped_ahead_read_back_and_the_thread_runs() -> None:
    out = _child.ok(
        THREADS
        + textwrap.dedent("""
        dim = 256  # 1 KiB rows: a shard maps ahead from 8,192 rows
        t = embstore.Table(dim, num_shards=2)
        grow(t, 0, 60_000, 256, dim)
        check(t, 60_000, dim)
        print("threads", populate_threads())
        """),
        timeout=120,
    )
    assert "threads 1" in out, out


def test_a_forked_child_growing_an_inherited_table_starts_its_own_thread() -> None:
    out = _child.ok(
        THREADS
        + _child.main_guard("""
        dim = 256
        t = embstore.Table(dim, num_shards=2)
        grow(t, 0, 40_000, 256, dim)
        assert populate_threads() == 1
        pid = os.fork()
        if pid == 0:
            grow(t, 40_000, 40_000, 256, dim)
            check(t, 80_000, dim)
            os._exit(0 if populate_threads() == 1 else 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.01)
        else:
            os.kill(pid, 9)
            print("child hung")
        grow(t, 40_000, 10_000, 256, dim)
        check(t, 50_000, dim)
        """),
        timeout=120,
    )
    assert "child 0" in out, out


def test_tables_dropped_while_their_pages_are_mapped_ahead() -> None:
    # Many threads grow tables past the point where pages are mapped ahead
    # and drop them at once, again and again: each drop marks its arena's
    # requests stale under the lock the populate thread maps them under.
    out = _child.ok(
        THREADS
        + textwrap.dedent("""
        import threading
        errors = []
        def worker(seed):
            try:
                for i in range(6):
                    t = embstore.Table(256, num_shards=1)
                    grow(t, 0, 12_000 + 500 * i, 400, 256)
                    if i % 3 == 0:
                        check(t, 12_000, 256)
                    del t
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
        ts = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(90)
        assert not any(th.is_alive() for th in ts), "a worker hung"
        assert not errors, errors
        print("done")
        """),
        timeout=150,
    )
    assert "done" in out, out


def test_an_insert_past_a_memory_limit_fails_cleanly_with_pages_mapped_ahead() -> None:
    out = _child.ok(
        THREADS
        + textwrap.dedent("""
        dim = 256
        t = embstore.Table(dim, num_shards=1)
        grow(t, 0, 20_000, 256, dim)
        limit_memory(64 << 20)
        try:
            grow(t, 20_000, 400_000, 256, dim)
        except MemoryError as e:
            print("refused", "keys" in str(e) or "rows" in str(e))
        n = len(t)
        check(t, n, dim, step=97)
        print("kept", n >= 20_000)
        """),
        timeout=120,
    )
    assert "refused True" in out, out
    assert "kept True" in out, out
