"""Selection over the whole vocabulary, for beam search (mt/search.py): each row's m best
tokens (``top_m``, ``largest``), log-probabilities only where they are needed
(``log_softmax_at``, ``row_sums``), and that work run on chunks of rows that stay in cache,
in as many threads as the BLAS has (``by_rows``). Arrays are NumPy or CuPy (``xp``); the
faster NumPy routes are tested against the plain computations (tests/test_search.py,
tests/test_model.py).
"""
import numpy as np

from . import threads


def top_m(xp, x, m, groups_of=16, with_max=False):
    """Column indices (R, m) of the m largest entries of each row of x (R, V), in any order
    (``with_max``: and each row's largest entry, (R, 1), which the groups give for free).

    The columns are split into G = ceil(V / groups_of) groups, group g holding columns
    g, g + G, g + 2G, ...; a row's m largest entries all lie in its m groups with the largest
    maxima (an entry outside them has m group maxima at least as large above it). So one
    pass takes the group maxima, (R, groups_of, G).max(axis=1), an elementwise maximum of
    contiguous rows that vectorises well, and the exact selection runs on m * groups_of
    candidates a row instead of V: with NumPy about 7x faster than argpartition over rows.
    Groups of 16 beat 32 by a quarter for 16 rows of 8000 or 6000 (the group maxima's 16
    passes cost less than the 32, and the selection runs on half the candidates). Both
    selections (the groups, then the entries) are ``largest``'s: 64 rows of 8000 in 147 us,
    220 with argpartition.
    """
    R, V = x.shape
    G = -(-V // groups_of)
    if G <= m:  # a small vocabulary: select directly
        top = largest(xp, x, m)
        return (top, x.max(axis=1, keepdims=True)) if with_max else top
    padded = x
    if G * groups_of != V:  # pad to whole groups with -inf
        padded = xp.concatenate([x, xp.full((R, G * groups_of - V), -xp.inf, x.dtype)], 1)
    group_max = padded.reshape(R, groups_of, G).max(axis=1)  # (R, G)
    best_groups = largest(xp, group_max, m)  # (R, m)
    cols = (best_groups[:, :, None] + G * xp.arange(groups_of)).reshape(R, m * groups_of)
    top = along_rows(xp, cols, largest(xp, along_rows(xp, padded, cols), m))
    # A padding column can only be picked in a tie at -inf, when a row has fewer than m
    # entries above -inf: such rows are selected directly.
    short = (top >= V).any(axis=1)
    if bool(short.any()):
        top[short] = xp.argpartition(x[short], V - m, axis=1)[:, V - m:]
    return (top, group_max.max(axis=1, keepdims=True)) if with_max else top


def largest(xp, a, m):
    """Column indices (R, m) of the m largest entries of each row of a (R, n), in any order
    (argpartition's). On NumPy the m-th largest value of each row comes from sorting the
    values, which NumPy does with vector instructions (64 rows of 500: 19 us, where
    argpartition, which moves indices one row at a time, takes 80 us); the entries at or
    above it are then the m largest, unless a row ties there (or holds NaN): when a row
    has other than m, argpartition selects."""
    R, n = a.shape
    if xp is not np or m >= n:
        return xp.argpartition(a, n - m, axis=1)[:, n - m:]
    above = np.flatnonzero(a >= np.sort(a, axis=1)[:, n - m, None])  # row by row
    if len(above) == R * m:
        rows, cols = np.divmod(above.reshape(R, m), n)
        if (rows == np.arange(R)[:, None]).all():  # m in each row
            return cols
    return np.argpartition(a, n - m, axis=1)[:, n - m:]


def along_rows(xp, a, cols):
    """a[i, cols[i, j]] for a C-contiguous (R, V) and cols (R, m): take_along_axis(a, cols, 1)
    as one gather from the flattened a (take_along_axis builds its index arrays in Python:
    23 against 10 us for 64 rows of 128 columns)."""
    R, V = a.shape
    return a.reshape(-1)[cols + (xp.arange(R) * V)[:, None]]


def log_softmax_at(xp, z, cols, zmax=None):
    """log_softmax(z) (engine/softmax.py) at the columns ``cols`` (R, m) of z (R, V) only:
    (z - max) - log(sum(exp(z - max))) on those entries, without writing out the other
    V - m. z is overwritten (exp(z - max)). ``zmax``: each row's largest entry (R, 1), when
    the caller has it (one pass over z fewer). The sum is ``row_sums``'. Where NumPy's
    float32 exp2 runs vector instructions (``EXP2_VECTORISED``), the exponentials are
    2 ** ((z - max) log2(e)): on an AVX-512 CPU exp2 takes 0.19 ns a float32 where exp
    takes 0.34, so with the extra multiply the whole vocabulary's exponentials cost a fifth
    less (each one within a few float32 roundings of exp's, far below what a sum of V terms
    keeps). Elsewhere exp2 is a scalar loop, twice exp's time (AVX2 only: 4.9 against
    2.3 ns), and exp is used, as on CuPy arrays."""
    m = z.max(axis=-1, keepdims=True) if zmax is None else zmax
    picked = along_rows(xp, z, cols) - m
    z -= m
    if xp is np and EXP2_VECTORISED:
        z *= z.dtype.type(LOG2_E)
        xp.exp2(z, out=z)
    else:
        xp.exp(z, out=z)
    picked -= xp.log(row_sums(xp, z))
    return picked


LOG2_E = 1.4426950408889634  # log2(e): exp(x) = 2 ** (x log2(e))


def exp2_vectorised():
    """Whether this NumPy runs float32 exp2 with vector instructions on this CPU: it has
    them only for AVX-512 (where exp2 beats exp), exp for AVX2 too. NumPy 2.0 and later say
    which of a loop's versions is in use (numpy.lib.introspect: a dispatched one, or the
    baseline, which is AVX-512 itself in a build for such CPUs only); older ones which CPU
    features they found. Where neither answers, no (exp, never slower than a scalar exp2)."""
    try:
        from numpy.lib.introspect import opt_func_info
    except ImportError:  # NumPy 1.x: its exp2 has AVX-512 loops only
        try:
            from numpy.core._multiarray_umath import __cpu_features__
            return bool(__cpu_features__.get("AVX512_SKX"))
        except Exception:
            return False
    try:
        loops = opt_func_info(func_name="^exp2$", signature="float32").get("exp2", {})
        current = [str(v.get("current", "baseline")) for v in loops.values()]
    except Exception:  # (an answer of another shape)
        return False
    return any(not c.startswith("baseline") or "AVX512" in c or "X86_V4" in c
               for c in current)


EXP2_VECTORISED = exp2_vectorised()


def row_sums(xp, z):
    """The sums of the rows of z (R, V) -> (R, 1). On NumPy each row is summed as up to 16
    contiguous blocks (einsum's vectorised loop), then the block sums: as accurate as
    NumPy's pairwise ``sum`` (relative error about 1e-7 for V = 8000 in float32) and 2.3x
    faster; a row's sum depends on that row alone, not on the rows summed with it."""
    if xp is not np:
        return z.sum(axis=-1, keepdims=True)
    R, V = z.shape
    blocks = next(c for c in (16, 8, 4, 2, 1) if V % c == 0)
    return np.einsum("ijk->ij", z.reshape(R, blocks, V // blocks)).sum(axis=-1, keepdims=True)


# Row blocks smaller than this many scores are not worth a thread (a hand-off costs ~50 us).
MIN_BLOCK = 1 << 18
# by_rows hands fn chunks of rows of about this many bytes: fn's passes over a chunk (the
# group maxima, subtract, exp, sum) then find it in cache, not in memory, and each of fn's
# ~35 NumPy calls is made once per chunk. 2 MiB (64 rows of 8000) beat 512 KiB (which fits
# a core's L2) by 3-4%: tiny's beam half 0.221 -> 0.212 s, the recipe model's beam search of
# 500 test2016 sentences 2.10 -> 2.04 s (one thread; one chunk per step: 0.207 s and 2.06 s).
CHUNK_BYTES = 1 << 21


def by_rows(xp, fn, z):
    """fn(z) for z (R, V) whose rows are independent -> fn's tuple of (R, ...) arrays.

    On NumPy, fn runs on chunks of rows of about CHUNK_BYTES, each small enough to stay in
    the caches through fn's several passes over it, and the chunks are shared among as
    many threads as the BLAS has, at least one each (NumPy releases the GIL inside its
    loops, so they run at once): the search's work on the whole vocabulary (top_m, exp
    and sums over every score) otherwise streams the scores from memory several times, on
    one core, while the products around it use them all. Each row's numbers are those of
    one call on all of z (nothing is summed across rows). CuPy arrays: one call."""
    R, V = z.shape
    if xp is not np:
        return fn(z)
    step = max(1, CHUNK_BYTES // max(1, V * z.itemsize))
    n_threads = min(threads.cpu_threads(), R * V // MIN_BLOCK)
    if n_threads > 1:  # at least one chunk a thread
        step = min(step, -(-R // n_threads))
    chunks = [(a, min(a + step, R)) for a in range(0, R, step)]
    n_threads = min(n_threads, len(chunks))

    def run(part):
        return [fn(z[a:b]) for a, b in part]

    if n_threads <= 1:
        parts = run(chunks)
    else:
        edges = [len(chunks) * i // n_threads for i in range(n_threads + 1)]
        groups = [chunks[a:b] for a, b in zip(edges, edges[1:])]
        pool = threads.executor(threads.row_pool, n_threads)
        parts = [out for group in pool.map(run, groups) for out in group]
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(arrays) for arrays in zip(*parts))
