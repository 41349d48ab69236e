"""The threads of a search on the CPU: how many the BLAS runs with (``cpu_threads``), and
the pools that mt/search.py's ``shared_out`` (one search a thread) and mt/selection.py's
``by_rows`` (chunks of rows a thread) hand their work to, each created once per process.
"""
import contextlib
import functools
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

# by_rows' pool and shared_out's pool: two, so that work in one never waits for threads busy
# in the other
row_pool = {"pid": None, "executor": None, "size": 0}
search_pool = {"pid": None, "executor": None, "size": 0}
_pools_lock = threading.Lock()


def cpu_threads():
    """The threads NumPy's BLAS runs with (threadpoolctl reads it from the library, so it
    follows ``threadpool_limits`` and OPENBLAS_NUM_THREADS); 1 when it cannot tell."""
    return max([1] + [lib.num_threads for lib in blas().lib_controllers])


@functools.cache
def blas():
    """threadpoolctl's controller of NumPy's BLAS (made once: finding it scans the loaded
    libraries)."""
    import threadpoolctl
    return threadpoolctl.ThreadpoolController().select(user_api="blas")


_one_at_a_time = threading.Lock()  # (one_blas_thread)


@contextlib.contextmanager
def one_blas_thread():
    """The BLAS limited to one thread (a setting of the whole process) while a search shared
    out to threads runs. Such searches run one at a time: two at once, from two threads of a
    server, would each set and restore the limit, and the last to restore could put back the
    other's 1, leaving the process at one BLAS thread. The thread that sets the limit also
    restores it, in a ``with`` (threadpoolctl lets one thread at a time control OpenBLAS's
    threads, until it leaves its last ``with``; while another thread of the process holds
    such a limit, this one is not applied, and the search's threads run with the BLAS's
    threads as they are: slower, the same results). Each such search uses every core
    already, so running them in turn costs little."""
    with _one_at_a_time, blas().limit(limits=1):
        yield


def _after_fork_in_child():
    """New locks in a forked child (a lock another thread held at the fork stays held)."""
    global _pools_lock, _one_at_a_time
    _pools_lock, _one_at_a_time = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def executor(pool, threads, pin=False):
    """The executor of ``pool`` (``row_pool`` or ``search_pool``), with at least ``threads``
    threads in this process; with ``pin``, each of its threads pinned to a CPU of its own
    where ``pinned_cpus`` says so. A smaller one is replaced, not shut down (a search in
    another thread may still hand it work); its threads end once it is no longer used."""
    with _pools_lock:
        if pool["pid"] != os.getpid() or pool["size"] < threads:
            # (a pool's threads do not survive a fork: translate.py's workers make their own)
            cpus = pinned_cpus(threads) if pin else None
            made = (ThreadPoolExecutor(threads) if cpus is None else
                    ThreadPoolExecutor(threads, initializer=_pin_thread,
                                       initargs=(cpus, itertools.count())))
            pool.update(pid=os.getpid(), executor=made, size=threads)
        return pool["executor"]


def pinned_cpus(threads):
    """The CPUs that shared_out's ``threads`` threads are pinned to, one each: the CPUs this
    process may run on, when there are exactly as many as threads (the process has the
    cores to itself, one thread per core); else None (threads are left to the scheduler:
    another process may be using the other cores). Unpinned, the threads woken for a
    search after the process has been idle for more than ~0.1 s were often run on one core
    until the scheduler spread them: a tiny model's greedy search of 128 sentences on 2
    cores took 0.101 s instead of 0.082 s after a 0.25 s pause, pinned 0.088 s."""
    if threads < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus if len(cpus) == threads else None


def _pin_thread(cpus, counter):
    """ThreadPoolExecutor initializer: pin this new thread to the next of ``cpus``."""
    try:
        os.sched_setaffinity(0, {cpus[next(counter) % len(cpus)]})  # (0: this thread)
    except OSError:
        pass
