"""Translate lines of text with a trained model: tokenize, batch by length, search, detokenize.

A source longer than the model can attend to (``max_source_tokens``: its ``max_positions``
less one for the EOS the source gets) is cut to its first ``max_source_tokens`` ids rather
than aborting the whole input; ``on_truncate`` tells the caller which lines were cut, so it
can warn. The output is capped by the search at ``max_positions - 1`` tokens (BOS + output
fit the decoder's positions), so no line of any length runs decoding past the positions.
"""
import atexit
import os
import signal
import threading
import time

import numpy as np

from .search import beam_search, greedy_search


def pad_batch(seqs, pad_id):
    """List of id lists -> (B, L) int64 array padded with ``pad_id``."""
    L = max(len(s) for s in seqs)
    out = np.full((len(seqs), L), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def max_source_tokens(cfg):
    """Source ids (EOS not counted) a model of config ``cfg`` can attend to:
    ``cfg.max_positions - 1``, since the source gets an EOS and nothing else."""
    return max(1, cfg.max_positions - 1)


def truncate_sources(src_ids, limit):
    """Cut each id list to at most ``limit`` ids -> (ids, cut) where ``cut`` lists
    (index, original length, kept length) of each list that was cut, in input order.
    Lists that fit are passed through unchanged (not copied)."""
    out, cut = [], []
    for i, ids in enumerate(src_ids):
        if len(ids) > limit:
            cut.append((i, len(ids), limit))
            ids = list(ids)[:limit]
        out.append(ids)
    return out, cut


def length_batches(src_ids, max_tokens):
    """Indices of the non-empty id lists, sorted by length (EOS counted) and cut into batches
    of at most ``max_tokens`` padded source tokens (a longer list is a batch of its own)
    -> list of index lists, shortest sources first."""
    order = sorted((i for i, s in enumerate(src_ids) if s), key=lambda i: len(src_ids[i]))
    batches, start = [], 0
    while start < len(order):
        end, longest = start, 0
        while end < len(order):
            longest_next = max(longest, len(src_ids[order[end]]) + 1)
            if end > start and longest_next * (end - start + 1) > max_tokens:
                break
            longest, end = longest_next, end + 1
        batches.append(order[start:end])
        start = end
    return batches


def translate_ids(model, src_ids, beam=4, alpha=0.6, max_len_a=50, max_tokens=4096,
                  length_penalty="gnmt", on_truncate=None, workers=1):
    """Token-id lists (no EOS) -> output id lists, same order. Sorted by length into batches
    of at most ``max_tokens`` padded source tokens; an empty input gives an empty output.

    A source longer than ``max_source_tokens(model.cfg)`` is translated from its first that
    many ids; ``on_truncate(index, n_tokens, n_kept)`` (0-based index into ``src_ids``) is
    called for each such source, in input order, before any decoding. Outputs are at most
    source length + 1 + ``max_len_a`` and at most ``max_positions - 1`` tokens long.

    ``workers`` > 1 (CPU only) shares the sources out to that many forked processes
    (``translate_in_workers``); the output is the same as with one.
    """
    src_ids, cut = truncate_sources(src_ids, max_source_tokens(model.cfg))
    if on_truncate is not None:
        for i, n, kept in cut:
            on_truncate(i, n, kept)
    search = dict(beam=beam, alpha=alpha, max_len_a=max_len_a, length_penalty=length_penalty)
    if workers > 1 and model.device == "cpu" and sum(map(len, src_ids)) > max_tokens:
        return translate_in_workers(model, src_ids, workers, max_tokens, search)
    out = [[] for _ in src_ids]
    for rows in length_batches(src_ids, max_tokens):
        for i, h in zip(rows, search_batch(model, [list(src_ids[i]) for i in rows], **search)):
            out[i] = h
    return out


def search_batch(model, seqs, beam, alpha, max_len_a, length_penalty):
    """One batch of id lists (no EOS) -> their outputs: greedy for beam <= 1."""
    src = pad_batch([s + [model.cfg.eos_id] for s in seqs], model.cfg.pad_id)
    if beam <= 1:
        return greedy_search(model, src, max_len_a=max_len_a)
    return beam_search(model, src, beam=beam, alpha=alpha, max_len_a=max_len_a,
                       length_penalty=length_penalty)


def cpu_count():
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


class WorkerDied(RuntimeError):
    """A translating worker process ended without its share (e.g. killed when memory ran
    out)."""


def translate_in_workers(model, src_ids, workers, max_tokens, search):
    """translate_ids in ``workers`` forked copies of this process, each with
    cpu_count() // workers BLAS threads (at least 1) -> the same outputs.

    On a CPU with few cores NumPy runs everything but the matrix products on one core, and a
    decoding step's products are small: two processes with one BLAS thread each keep both
    cores busy through the whole step (on 2 cores, translation runs about 1.2x faster greedy
    and 1.5x with beam 4). The sources, sorted by length, are dealt out in turn (worker w
    gets the w-th, the (w + workers)-th, ...), so every worker gets as much work; each batches
    its share as one process would. A sentence's output does not depend on its batch
    (padding adds exact zeros, and a product's rows are computed independently), so the
    output is that of one process; only a score can differ in its last bits (the BLAS sums a
    row in an order that depends on how many rows the product has), which changes a
    token only at a floating-point tie. The model is shared copy-on-write; only
    token lists travel.

    The workers stay for the next call with the same model (``WorkerPool``): a freshly
    forked worker runs its first batches slowly (every heap page it writes is first copied
    from this process), so a program that translates again and again pays that once. A
    worker's exception is raised here; a worker that dies raises WorkerDied; on any error or
    Ctrl-C (which workers ignore) the workers are terminated, and the next call forks new
    ones."""
    order = sorted((i for i, s in enumerate(src_ids) if s), key=lambda i: len(src_ids[i]))
    shares = [order[w::workers] for w in range(workers)]  # (a share may be empty)
    with _pool_lock:
        pool = WorkerPool.get(model, workers)
        try:
            results = pool.run([[list(src_ids[i]) for i in share] for share in shares],
                               max_tokens, search)
        except BaseException:
            pool.close()
            raise
    out = [[] for _ in src_ids]
    for share, result in zip(shares, results):
        for i, h in zip(share, result):
            out[i] = h
    return out


def model_fingerprint(model):
    """What the workers of a WorkerPool must agree on with this process to translate as it
    does: the model's identity and config, and for it (or each member of an Ensemble) its
    dtypes and every parameter's shape, dtype and checksum (CRC-32 of its bytes: training
    or loading a checkpoint in place changes it; about 5 ms for the Multi30k recipe's
    model)."""
    import zlib

    def weights(m):
        return (id(m), str(m.dtype), str(m.compute_dtype),
                tuple((p.data.shape, str(p.data.dtype),
                       zlib.crc32(memoryview(np.ascontiguousarray(p.data)).cast("B")))
                      for p in m.parameters()))
    return (id(model), repr(model.cfg),
            tuple(weights(m) for m in getattr(model, "models", [model])))


_pool_lock = threading.Lock()


class WorkerPool:
    """``workers`` forked processes translating for one model, kept between calls.

    ``WorkerPool.get(model, workers)`` returns the pool of the last call when it was forked
    by this process for the same number of workers and a model with the same fingerprint
    (``model_fingerprint``: the weights are checked on every call, so a model trained or
    reloaded in between gets new workers); otherwise it closes that pool and forks a new
    one. A worker holds the model and the code as they were when it was forked: state
    changed since in this process other than the model's (a monkeypatched function, say)
    reaches the workers only after ``close_workers()``. Kept workers also keep the memory
    they share with this process as it was then: a program that goes on to train, say,
    calls ``close_workers()`` first.

    Workers are plain forks of this process (``os.fork``), each holding only its own end of
    its pipe, so they end when this process's end closes: when it closes the pool, and when
    it exits or is killed, however. A worker in the middle of a search reads its pipe only
    when done, so it also watches its parent (``_end_with_parent``): killed by a signal, by
    PID, or by the out-of-memory killer, the process leaves no worker running. Workers
    ignore Ctrl-C. A process forked from this one does not inherit the pool
    (``os.register_at_fork``) and cannot end its workers.
    """

    current = None

    def __init__(self, model, workers, key):
        from multiprocessing.connection import Pipe

        import threadpoolctl  # noqa: F401  (imported before forking: a worker fails only in work)
        self.key, self.pid = key, os.getpid()
        self.workers = []  # [connection, pid or None once reaped], one per worker
        threads = max(1, cpu_count() // workers)
        try:
            for _ in range(workers):
                here, there = Pipe()
                pid = os.fork()
                if pid == 0:  # the worker: it never returns into the caller's code
                    code = 0
                    try:
                        here.close()  # (only this process may hold the other ends)
                        for conn, _ in self.workers:
                            conn.close()
                        _worker(there, model, threads, self.pid)
                    except BaseException:
                        code = 1
                    finally:
                        os._exit(code)
                there.close()
                self.workers.append([here, pid])
        except BaseException:
            self.close()
            raise

    @classmethod
    def get(cls, model, workers):
        key = (workers, model_fingerprint(model))
        pool = cls.current
        if pool is not None and (pool.key != key or not pool.alive()):
            pool.close()
            pool = None
        if pool is None:
            pool = cls.current = cls(model, workers, key)
        return pool

    def alive(self):
        """Whether every worker is still running (one that ended is reaped here)."""
        for worker in self.workers:
            try:
                ended = worker[1] is None or os.waitpid(worker[1], os.WNOHANG)[0]
            except ChildProcessError:  # (reaped by someone else)
                ended = True
            if ended:
                worker[1] = None
                return False
        return True

    def run(self, shares, max_tokens, search):
        """Worker w translates ``shares[w]`` (lists of ids) -> their outputs, in order."""
        from multiprocessing.connection import wait
        pending = {}
        for w, share in enumerate(shares):
            conn = self.workers[w][0]
            try:
                conn.send((share, max_tokens, search))
            except OSError:  # (ended since the last call)
                raise self._died(w) from None
            pending[conn] = w
        results = [None] * len(shares)
        while pending:
            for conn in wait(list(pending)):
                w = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):  # (died before or while sending)
                    raise self._died(w) from None
                if not ok:
                    raise value
                results[w] = value
        return results

    def _died(self, w):
        """Reap worker w, which has ended -> the WorkerDied to raise."""
        code, pid = None, self.workers[w][1]
        if pid is not None:
            try:
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            except ChildProcessError:  # (reaped by someone else)
                pass
            self.workers[w][1] = None
        return WorkerDied(f"translation worker {w + 1} of {len(self.workers)} ended without "
                          f"its output (exit code {code}); if memory ran out, lower "
                          "--max-tokens or --workers")

    def close(self):
        """End the workers (when this process forked them) and forget the pool."""
        if os.getpid() == self.pid:
            for conn, pid in self.workers:
                conn.close()
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for _, pid in self.workers:
                if pid is not None:
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
        self.workers = []
        if WorkerPool.current is self:
            WorkerPool.current = None


def close_workers():
    """End the translating workers kept for the next call (``WorkerPool``), if any."""
    with _pool_lock:
        if WorkerPool.current is not None:
            WorkerPool.current.close()


def _forget_pool_in_child():
    """In a process just forked from this one: the pool is the parent's, not ours."""
    global _pool_lock
    _pool_lock = threading.Lock()
    WorkerPool.current = None


os.register_at_fork(after_in_child=_forget_pool_in_child)
atexit.register(lambda: WorkerPool.current is not None and WorkerPool.current.close())


def _end_with_parent(parent, every=0.5):
    """In a worker: a daemon thread that ends this process once ``parent`` (the pid that
    forked it) is gone, i.e. once this process has another parent (``os.getppid``: the
    orphan is handed to init or a subreaper). Checked every ``every`` seconds: about 1 us."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _worker(conn, model, threads, parent):
    """A worker process forked by ``parent``: for each (id lists, max_tokens, search
    options) received, translate with ``threads`` BLAS threads and send back (True,
    outputs), or (False, the exception); ends when the pipe closes or the parent is gone."""
    import threadpoolctl
    _end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threadpoolctl.threadpool_limits(threads, user_api="blas")
    while True:
        try:
            seqs, max_tokens, search = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = (True, translate_ids(model, seqs, max_tokens=max_tokens, **search))
        except BaseException as exc:  # (sent to the parent, which raises it)
            result = (False, exc)
        try:
            conn.send(result)
        except Exception:  # an exception that does not pickle: its text instead
            import traceback
            conn.send((False, RuntimeError("in a translation worker: " +
                                           "".join(traceback.format_exception(result[1])))))


def translate_lines(model, tokenizer, lines, on_truncate=None, **search_options):
    """Plain-text lines -> detokenized translations, one per line, in input order (an empty
    line gives an empty translation).

    A line of more than ``max_source_tokens(model.cfg)`` pieces is translated from its first
    that many; ``on_truncate(index, n_tokens, n_kept)`` is called for each such line (index
    0-based into ``lines``; the counts are sentencepiece pieces, EOS not included), so the
    caller can warn. ``search_options``: those of ``translate_ids``.
    """
    ids = tokenizer.encode([line.strip() for line in lines])
    hyps = translate_ids(model, ids, on_truncate=on_truncate, **search_options)
    return tokenizer.decode(hyps)


# sacreBLEU's tokenizations that need no download (--bleu-tokenize): 13a (its default, for
# most languages), intl (Unicode punctuation and symbols), zh (Chinese characters apart),
# ja-mecab and ko-mecab (Japanese, Korean: pip install "sacrebleu[ja]" / "sacrebleu[ko]"),
# char (every character a token), none (the text as it is, already tokenized)
BLEU_TOKENIZERS = ("13a", "intl", "zh", "ja-mecab", "ko-mecab", "char", "none")


def add_bleu_tokenize(p, scored):
    """--bleu-tokenize (translate.py, train.py): sacreBLEU's tokenization for ``scored``
    (what the help names)."""
    p.add_argument("--bleu-tokenize", default="13a", choices=BLEU_TOKENIZERS,
                   help=f"sacreBLEU's tokenization for {scored}: 13a (default; most "
                        "languages), intl, zh (Chinese), ja-mecab or ko-mecab (Japanese, "
                        "Korean; pip install 'sacrebleu[ja]' or 'sacrebleu[ko]'), char, none")


def bleu_metric(tokenize="13a"):
    """sacreBLEU's corpus BLEU (cased) with ``tokenize`` (one of BLEU_TOKENIZERS);
    ValueError saying what to install when that tokenizer's packages are missing."""
    import sacrebleu
    try:
        return sacrebleu.metrics.BLEU(tokenize=tokenize)
    except (RuntimeError, ImportError) as exc:  # (ja-mecab, ko-mecab without MeCab)
        raise ValueError(" ".join(str(exc).split())) from None


def corpus_bleu(hypotheses, references, tokenize="13a"):
    """sacreBLEU corpus score (``tokenize``: 13a by default, cased) -> (score, signature)."""
    metric = bleu_metric(tokenize)
    result = metric.corpus_score(hypotheses, [references])
    return result.score, str(metric.get_signature())
