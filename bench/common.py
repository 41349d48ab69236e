"""Shared pieces of the benchmark: configs, synthetic batches, FLOP counts, machine facts.

Imported by both benchmark workers (ours and PyTorch). Nothing here imports torch; the
batching helpers come from minitransformer.mt (a few MiB of modules), so the torch worker
also runs under the package's start-up settings (minitransformer/_malloc.py keeps freed
blocks in glibc's heap, which spares torch's CPU allocator page faults too).

Shape letters as in the package: B batch, S source length, T target length, D d_model,
H heads, F d_ff, V vocabulary, N layers (encoder and decoder each).
"""
import ctypes
import hashlib
import os
import platform
import resource
import statistics
import time

import numpy as np

from minitransformer.mt.data import split_batch
from minitransformer.mt.translation import length_batches
from minitransformer.mt.translation import pad_batch as pad  # (B, L) int64, padded

# The benchmark models. All use the paper's recipe: post-norm, shared embeddings scaled by
# sqrt(D), sinusoidal positions, dropout 0.1, label smoothing 0.1 (eps/(V-1) on non-targets).
# "base" is the paper's base model with its 37000-token joint vocabulary (Table 3, En-De), for
# GPUs: --all runs it only with --device cuda.
GPU_ONLY = {"base"}
CONFIGS = {
    "tiny": dict(model=dict(n_layers=2, d_model=128, n_heads=4, d_ff=512, vocab_size=8000),
                 max_tokens=2000, warmup=3, steps=20, decode_sentences=128, decode_reps=9),
    "base-lite": dict(model=dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048, vocab_size=8000),
                      max_tokens=4000, warmup=3, steps=8, decode_sentences=64, decode_reps=3),
    "base": dict(model=dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048, vocab_size=37000),
                 max_tokens=12000, warmup=5, steps=20, decode_sentences=256, decode_reps=3),
}
MODEL_COMMON = dict(dropout=0.1, label_smoothing=0.1, smoothing="others", norm="post",
                    positions="sinusoidal", sinusoid_layout="interleaved", share_embeddings=True,
                    attention_dropout=0.0, relu_dropout=0.0, ln_eps=1e-5,
                    pad_id=0, bos_id=2, eos_id=3)
FIRST_WORD_ID = 4  # ids 0..3 are pad, unk, bos, eos (as in the sentencepiece set-up)


def model_config(name):
    """The full TransformerConfig fields of a benchmark config, as a plain dict."""
    return {**MODEL_COMMON, **CONFIGS[name]["model"]}


# ---- synthetic data --------------------------------------------------------------------------
def synthetic_pairs(n_pairs, V, seed, min_len=10, max_len=30):
    """Random sentence pairs with a realistic length distribution.

    Source length ~ uniform{min_len..max_len}; target length = source length times a factor
    ~ uniform(0.8, 1.2) (rounded, at least 1), as for a close language pair. Token ids are
    uniform over the non-special vocabulary. -> list of (src ids, tgt ids), no BOS/EOS.
    """
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n_pairs):
        s = int(rng.integers(min_len, max_len + 1))
        t = max(1, int(round(s * rng.uniform(0.8, 1.2))))
        pairs.append((rng.integers(FIRST_WORD_ID, V, s).tolist(),
                      rng.integers(FIRST_WORD_ID, V, t).tolist()))
    return pairs


def training_batches(n_batches, V, max_tokens, seed, pad_id=0, bos_id=2, eos_id=3):
    """``n_batches`` batches of up to ``max_tokens`` padded source and target tokens each.

    Like the package's loader: pairs sorted by length and packed while B * max(S) and
    B * max(T) stay within ``max_tokens`` (source = x + EOS, tgt_in = BOS + y,
    tgt_out = y + EOS). The batches are then shuffled, so consecutive steps see different
    shapes. -> list of dicts with int64 arrays src (B, S), tgt_in, tgt_out (B, T).
    """
    rng = np.random.default_rng(seed)
    per_batch = max_tokens // 20  # about how many 10-30-token sentences fit
    pairs = synthetic_pairs(n_batches * per_batch * 2, V, seed)
    pairs.sort(key=lambda p: (len(p[0]), len(p[1])))
    groups, cur, S, T = [], [], 0, 0
    for x, y in pairs:
        s2, t2 = max(S, len(x) + 1), max(T, len(y) + 1)
        if cur and (s2 * (len(cur) + 1) > max_tokens or t2 * (len(cur) + 1) > max_tokens):
            groups.append(cur)
            cur, s2, t2 = [], len(x) + 1, len(y) + 1
        cur.append((x, y))
        S, T = s2, t2
    if cur:
        groups.append(cur)
    # Spread the picks over all lengths (short, medium and long batches), then shuffle.
    picks = np.linspace(0, len(groups) - 1, n_batches).round().astype(int)
    chosen = [groups[i] for i in picks]
    rng.shuffle(chosen)
    batches = []
    for g in chosen:
        batches.append(dict(src=pad([x + [eos_id] for x, _ in g], pad_id),
                            tgt_in=pad([[bos_id] + y for _, y in g], pad_id),
                            tgt_out=pad([y + [eos_id] for _, y in g], pad_id)))
    return batches


def decode_batches(n_sentences, V, seed, max_tokens=4096, pad_id=0, eos_id=3):
    """Source sentences for decoding, batched as ``mt.translation.translate_ids`` does: sorted
    by length, at most ``max_tokens`` padded source tokens a batch, EOS appended.
    -> list of (B, S) int64 arrays."""
    srcs = [x for x, _ in synthetic_pairs(n_sentences, V, seed)]
    return [pad([srcs[i] + [eos_id] for i in rows], pad_id)
            for rows in length_batches(srcs, max_tokens)]



def gpu_decoding_models(configs):
    """-> (name, model, decoding batches) of each config on the GPU: the untrained model
    (seed 0) and the sentences of bench.py's decoding rows, for the A/B scripts
    (bench/beam_kernel_ab.py, bench/decode_kernels_ab.py)."""
    import minitransformer.nn.transformer as tr
    for name in configs:
        cfg = {**model_config(name), "max_positions": 1024}
        model = tr.Transformer(tr.TransformerConfig.from_dict(cfg), seed=0, device="cuda")
        yield name, model, decode_batches(CONFIGS[name]["decode_sentences"], cfg["vocab_size"], 1)


def interleaved(runs, sync, rounds=6):
    """Each of ``runs`` ({label: function -> outputs}) in turn, ``rounds`` times (the first
    round a warm-up; the order reversed every other round, so none always runs first),
    timed between ``sync`` calls -> ({label: median seconds of the other rounds}, {label:
    its outputs})."""
    times, outputs = {label: [] for label in runs}, {}
    for r in range(rounds):
        for label, run in (list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]):
            sync()
            t0 = time.perf_counter()
            outputs[label] = run()
            sync()
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(t[1:]) for label, t in times.items()}, outputs


def ab_line(name, what, med, outputs, new, old, rounds=6):
    """The A/B scripts' line: ``what`` timed with (``new``) and without (``old``), the
    ratio (medians of ``rounds`` - 1 timed rounds, as ``interleaved`` ran them), and how
    many of the sentences (``outputs``: label -> batches of outputs) came out the same."""
    same = sum(a == b for x, y in zip(outputs[new], outputs[old]) for a, b in zip(x, y))
    n = sum(len(x) for x in outputs[new])
    return (f"{name}: {what} over {n} sentences, median of {rounds - 1}: with {med[new]:.3f} s, "
            f"without {med[old]:.3f} s -> {med[old] / med[new]:.2f}x; identical translations "
            f"{same}/{n}")

def shard_rows(batch, rank, size, pad_id=0):
    """Rank ``rank``'s share of a padded batch for ``size`` data-parallel ranks, as train.py
    takes it: the rows split by ``mt.data.split_batch`` (about equal target tokens), each
    array then cut to its own longest row. -> dict like ``batch``, or None for a rank left
    without rows (a batch of fewer rows than ranks)."""
    n_tgt = (batch["tgt_out"] != pad_id).sum(axis=1)
    pairs = [(i, range(int(n) - 1)) for i, n in enumerate(n_tgt)]  # costs len(tgt) + 1 = n
    rows = [i for i, _ in split_batch(pairs, size)[rank]]
    if not rows:
        return None
    return {key: trim(a[rows], pad_id) for key, a in batch.items()}


def trim(src, pad_id=0):
    """A padded (B, S) array (B may be 0) cut to the length of its longest row."""
    if not len(src):
        return src
    return np.ascontiguousarray(src[:, :int((src != pad_id).sum(axis=1).max())])


def fingerprint(arrays):
    """A short hash of a list of arrays (to check both workers got identical batches)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


# ---- FLOPs -----------------------------------------------------------------------------------
def matmul_params(cfg):
    """Weights that take part in matrix products, split by where they are applied.

    enc: per source token, N (4 D^2 + 2 D F)  (self-attention q, k, v, o; FFN)
    dec: per target token, N (6 D^2 + 2 D F)  (self-attention q, k, v, o; cross q, o; FFN)
    mem: per source token, N 2 D^2            (cross-attention k, v, applied to the memory)
    out: per target token, D V                (pre-softmax projection = shared embedding)
    """
    N, D, F, V = cfg["n_layers"], cfg["d_model"], cfg["d_ff"], cfg["vocab_size"]
    return dict(enc=N * (4 * D * D + 2 * D * F), dec=N * (6 * D * D + 2 * D * F),
                mem=N * 2 * D * D, out=D * V)


def train_flops(cfg, B, S, T):
    """Model FLOPs of one training step (forward + backward = 3 x forward) on a (B, S) source
    and (B, T) target batch, counted on the padded shapes that both frameworks compute:

        6 * [B S (enc + mem) + B T (dec + out)]             matrix products with weights
      + 12 * N * D * B * (S^2 + T^2 + T S)                  attention: q k^T and p v

    (a multiply-add is 2 FLOPs; forward = 2 * params * tokens, backward twice that. Attention:
    per layer 2 * 2 * B * Tq * Tk * D forward for the scores and the weighted sum, the causal
    self-attention counted in full as both frameworks compute it.) Per target token with
    S = T this is 6 * (all matmul params) + 36 * N * D * T. Softmax, LayerNorm, dropout,
    embeddings and Adam are not counted.
    """
    p = matmul_params(cfg)
    N, D = cfg["n_layers"], cfg["d_model"]
    dense = 6 * (B * S * (p["enc"] + p["mem"]) + B * T * (p["dec"] + p["out"]))
    attn = 12 * N * D * B * (S * S + T * T + T * S)
    return dense + attn


# ---- machine ---------------------------------------------------------------------------------
def gemm_gflops(matmul, make, n=2048, reps=5, sync=lambda: None):
    """Best float32 GEMM rate of ``matmul`` on n x n x n (2 n^3 FLOPs), in GFLOP/s."""
    a, b = make(n), make(n)
    matmul(a, b)
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def numpy_gemm_gflops(n=2048, reps=5):
    rng = np.random.default_rng(0)
    return gemm_gflops(np.matmul, lambda n: rng.standard_normal((n, n), dtype=np.float32), n, reps)


def openblas_info():
    """OpenBLAS's core type and thread count as seen from this process (numpy's copy)."""
    info = {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}
    try:
        libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
                       if "openblas" in line.lower() and ".so" in line})
    except OSError:
        libs = []
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
            f = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            if f is None:
                continue
            info["threads"] = int(f())
            for key, fn in (("corename", "get_corename"), ("config", "get_config")):
                g = getattr(lib, f"{prefix}{fn}{suffix}", None)
                if g is not None:
                    g.restype = ctypes.c_char_p
                    info[key] = g().decode()
            info["library"] = os.path.basename(path)
            return info
    return info


def _openblas_call(fn, *args):
    for path in sorted({line.split()[-1] for line in open("/proc/self/maps")
                        if "openblas" in line.lower() and ".so" in line}):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
            f = getattr(lib, f"{prefix}{fn}{suffix}", None)
            if f is not None:
                return f(*args)
    raise RuntimeError(f"OpenBLAS's {fn} not found in this process")


def set_blas_threads(n):
    """Set numpy's OpenBLAS thread count at run time (openblas_set_num_threads)."""
    _openblas_call("set_num_threads", int(n))


def blas_threads():
    """Threads numpy's BLAS uses (the number PyTorch gets too)."""
    return openblas_info().get("threads") or len(os.sched_getaffinity(0))


def machine_info():
    cpu, flags, ident = platform.processor() or "unknown", set(), {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name":
                cpu = value
            elif key in ("vendor_id", "cpu family", "model", "stepping", "cpu MHz",
                         "cache size") and key not in ident:
                ident[key] = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    mem = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                        "avx512_bf16", "amx_tile") if f in flags]
    if ident:
        cpu += " (" + ", ".join(f"{k} {v}" for k, v in ident.items()) + ")"
    return dict(cpu=cpu, logical_cpus=os.cpu_count(), usable_cpus=len(os.sched_getaffinity(0)),
                simd=simd, mem_gib=mem, loadavg=load, python=platform.python_version(),
                numpy=np.__version__, platform=platform.platform(), blas=openblas_info())


def max_rss_mib():
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(xs):
    return statistics.median(xs) if xs else float("nan")
