import pytest

def test_zz():
    # two searches of a server's threads limit the BLAS to one thread at overlapping times
    # (A in, B in, A out, B out): afterwards the BLAS has its threads again (with each
    # search setting and restoring the limit itself, B put back A's 1)
    import threading
    pytest.importorskip("threadpoolctl")
    from minitransformer.mt import threads as mt_threads
    before = mt_threads.cpu_threads()
    if before < 2:
        with mt_threads.blas().limit(limits=2):
            if mt_threads.cpu_threads() != 2:
                pytest.skip("the BLAS does not take a thread limit here")
            return test_zz()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with mt_threads.one_blas_thread():
            a_in.set()
            b_in.wait(10)
            seen["a"] = mt_threads.cpu_threads()
        a_out.set()

    def b():
        a_in.wait(10)
        with mt_threads.one_blas_thread():
            b_in.set()
            a_out.wait(10)
            seen["b"] = mt_threads.cpu_threads()  # (A has left: still one thread for B)

    workers = [threading.Thread(target=f) for f in (a, b)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    assert seen == {"a": 1, "b": 1}
    assert mt_threads.cpu_threads() == before


