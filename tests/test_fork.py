"""A process may fork at any moment (DataLoader workers, multiprocessing):
the child can use its tables and caches, and the fork itself is never held
up by a lock that another process holds. Each case runs in a child
interpreter under a timeout, the forked grandchild under a deadline."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from . import _child

WAIT_CHILD = """
def wait_child(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"
"""


@pytest.mark.slow
def test_a_child_forked_during_a_device_cache_call_can_use_the_cache() -> None:
    """Another thread is inside a DeviceCache call (holding its lock) when
    the process forks: the fork waits for the call, and the child's first
    cache call runs (it used to inherit the lock held, and hang)."""
    out = _child.ok(
        "import os, threading, time\nfrom embstore.gpu import DeviceCache\n"
        + WAIT_CHILD
        + textwrap.dedent("""
        t = embstore.Table(8, optimizer=optim.Adam(lr=0.01))
        cache = DeviceCache(t, rows=1000, xp=np)
        cache.lookup(np.arange(100))
        inside = threading.Event()
        def in_a_call():
            with cache._lock:  # as every DeviceCache call holds it
                inside.set()
                time.sleep(0.5)
        th = threading.Thread(target=in_a_call)
        th.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            rows = cache.lookup(np.arange(10))
            cache.apply_gradients(np.arange(10), np.ones((10, 8), np.float32))
            os._exit(0 if rows.shape == (10, 8) else 3)
        th.join()
        print("child", wait_child(pid, 20))
        """),
        timeout=60,
    )
    assert "child 0" in out, out


# Another process: takes a directory's writers' lock (flock on the
# directory, as a save does) and keeps it for argv[2] seconds.
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.slow
def test_fork_is_not_held_up_by_a_save_waiting_for_another_process(
    tmp_path: pathlib.Path,
) -> None:
    """Another process holds the checkpoint directory's writers' lock; a
    save in this process waits for it. A fork meanwhile goes ahead at once
    (it used to wait as long as the other process held the lock), and the
    save completes once the lock is free."""
    ck = tmp_path / "ck"
    out = _child.ok(
        "import os, subprocess, sys, threading, time\n"
        + WAIT_CHILD
        + textwrap.dedent(f"""
        ck = {str(ck)!r}
        t = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
        t.lookup(np.arange(100))
        t.save(ck)
        holder = subprocess.Popen([sys.executable, "-c", {HOLDER!r}, ck, "6"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        saved = threading.Event()
        def save():
            t.save(ck)
            saved.set()
        th = threading.Thread(target=save)
        th.start()
        time.sleep(0.5)  # the save is now waiting for the lock
        assert not saved.is_set()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if len(t.lookup(np.arange(10), insert=False)) == 10 else 3)
        fork_s = time.monotonic() - t0
        print("child", wait_child(pid, 20))
        print("fork took %.2f s" % fork_s, "fast" if fork_s < 2 else "slow")
        th.join(30)
        holder.wait()
        print("saved", saved.is_set())
        """),
        timeout=90,
    )
    assert "child 0" in out, out
    assert "fast" in out, out
    assert "saved True" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_child_forked_during_calls_can_use_its_tables() -> None:
    out = _child.ok(
        """
        import os, threading, time
        t = embstore.Table(32, optimizer=optim.Adam(lr=0.01))
        t.lookup(np.arange(100_000))
        stop = False
        def busy():
            rng = np.random.default_rng(threading.get_ident() % 1000)
            while not stop:
                k = rng.integers(0, 200_000, 50_000)
                t.lookup(k)
                t.apply_gradients(k, np.ones((len(k), 32), np.float32))
        ths = [threading.Thread(target=busy) for _ in range(3)]
        for th in ths: th.start()
        ok = 0
        for i in range(10):
            time.sleep(0.05)
            pid = os.fork()
            if pid == 0:
                # The child's first calls: a lookup, a step, a save-free export.
                rows = t.lookup(np.arange(1000))
                t.apply_gradients(np.arange(1000), np.ones((1000, 32), np.float32))
                t.export()
                os._exit(0 if rows.shape == (1000, 32) else 3)
            deadline = time.monotonic() + 30
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ok += os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9); os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
        stop = True
        for th in ths: th.join()
        print("children ok", ok)
        """,
        timeout=240,
    )
    assert "children ok 10" in out, out


@pytest.mark.slow
def test_a_child_forked_beside_serving_calls_serves_from_its_cache() -> None:
    """Another thread serves 2,000-key calls through a ServingCache (whose
    native call hands partitions to the thread pool) while the process
    forks, ten times: each child serves 2,000-key calls of its own (the
    partitions on its own pool) whose rows equal the mapped table's."""
    out = _child.ok(
        "import os, tempfile, threading, time\nfrom embstore.gpu import ServingCache\n"
        + WAIT_CHILD
        + textwrap.dedent("""
        t = embstore.Table(16, seed=4)
        t.lookup(np.arange(50_000))
        d = tempfile.mkdtemp()
        t.save(d, with_optimizer=False)
        mapped = embstore.MappedTable(d)
        cache = ServingCache(mapped, 8_000, xp=np)
        stop = False
        def serve():
            rng = np.random.default_rng(1)
            while not stop:
                cache.lookup(np.minimum(rng.zipf(1.1, 2_000), 60_000) - 1)
        th = threading.Thread(target=serve)
        th.start()
        codes = []
        for i in range(10):
            time.sleep(0.03)
            pid = os.fork()
            if pid == 0:
                rng = np.random.default_rng(100 + i)
                for _ in range(5):
                    k = np.minimum(rng.zipf(1.1, 2_000), 60_000) - 1
                    rows, found = cache.lookup(k, default="zeros", return_found=True)
                    want, want_found = mapped.lookup(k, default="zeros", return_found=True)
                    if not (np.array_equal(rows, want) and np.array_equal(found, want_found)):
                        os._exit(3)
                os._exit(0)
            codes.append(wait_child(pid, 30))
        stop = True
        th.join()
        print("children", codes)
        """),
        timeout=240,
    )
    assert "children [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]" in out, out
