"""--max-tokens auto: the largest token budget whose training step fits in a memory budget.

A training step's memory is what the process holds before it (parameters, Adam's moments,
gradients, the corpus, the libraries) plus what forward and backward allocate on top, and
the second part grows with the batch's padded tokens and, through attention, with its
length. So the budget is fitted on the worst batches the corpus can make: for a token budget
T, the batch of the longest pairs that T allows (as ``data.Batches`` would cut it). Its step
is measured (peak bytes allocated during forward and backward: NumPy's allocations as
``tracemalloc`` sees them on the CPU, CuPy's memory pool on a GPU) at two budgets, the
growth per token is fitted as a straight line through the two largest measurements, the
largest T under the budget is predicted and measured, up to three times; the largest T
measured to fit is taken (a probe that runs out of memory counts as over the budget).

The measuring steps leave no trace: the gradients are zeroed after each and the dropout
generator is put back, so a run with ``--max-tokens auto`` that picked T trains exactly as
one given ``--max-tokens T``. The memory budget (``--memory``) defaults to half of the
memory the machine has available (MemAvailable), shared by the ranks on this machine, or
80% of a GPU's free memory.
"""
import os
import re
import tracemalloc

from .data import DataError, collate

LOW, HIGH = 256, 1 << 16   # the token budgets --max-tokens auto chooses between
CPU_SHARE, GPU_SHARE = 0.5, 0.8


def parse_memory(text):
    """'12G', '800M', '1.5GiB', '2000000000' -> bytes (K, M, G, T are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--memory {text!r}: expected a size such as 8G, 800M or 1.5GiB")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024 ** power)


def describe(n_bytes):
    """Bytes as '1.5 GiB' / '800 MiB'."""
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.0f} MiB"


def available_memory(device="cpu", meminfo="/proc/meminfo"):
    """Bytes this process could still get: the GPU's free memory, or the machine's
    MemAvailable (Linux; elsewhere the physical memory)."""
    if device != "cpu":
        import cupy
        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(free + cupy.get_default_memory_pool().free_bytes())
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(device="cpu", ranks_here=1, meminfo="/proc/meminfo"):
    """The memory one rank may use when --memory is not given: half of what the machine
    has available, shared by the ``ranks_here`` ranks on it, or 80% of a GPU's free memory
    (one rank per GPU)."""
    if device != "cpu":
        return int(GPU_SHARE * available_memory(device))
    return int(CPU_SHARE * available_memory(device, meminfo) / max(1, ranks_here))


def in_use(device="cpu"):
    """Bytes this process holds now: its resident memory, or CuPy's pool in use."""
    if device != "cpu":
        import cupy
        return int(cupy.get_default_memory_pool().used_bytes())
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def longest_batch(pairs, max_tokens):
    """The largest batch of the longest pairs (src_ids, tgt_ids) that ``max_tokens`` allows,
    as data.Batches cuts one: n pairs of at most S source and T target tokens (EOS / BOS
    counted) with n * S and n * T within the budget, or the longest pair alone."""
    cost = sorted(pairs, key=lambda p: max(len(p[0]), len(p[1])), reverse=True)
    S = T = 0
    for n, (s, t) in enumerate(cost, 1):
        S, T = max(S, len(s) + 1), max(T, len(t) + 1)
        if n > 1 and (n * S > max_tokens or n * T > max_tokens):
            return cost[:n - 1]
    return cost


class _PoolPeak:
    """Peak bytes allocated from CuPy's memory pool while active (a cupy MemoryHook)."""

    def __init__(self):
        import cupy
        hook = cupy.cuda.MemoryHook
        peak = self

        class Hook(hook):
            name = "minitransformer-peak"

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                peak.now += mem_size
                peak.peak = max(peak.peak, peak.now)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                peak.now -= mem_size

        self.now = self.peak = 0
        self.hook = Hook()


def step_peak(model, optim, pairs, cfg, device="cpu"):
    """Peak bytes allocated during a forward and backward pass over ``pairs``, on top of
    what the process held before. Leaves the gradients zeroed and the dropout generator as
    it was."""
    if not pairs:  # (this rank's share of a batch of fewer pairs than ranks)
        return 0
    b = collate(pairs, cfg.pad_id, cfg.bos_id, cfg.eos_id)
    state = model.rng.get_state()
    model.train()
    try:
        if device == "cpu":
            tracemalloc.start()
            try:
                loss, _ = model.loss(b["src"], b["tgt_in"], b["tgt_out"])
                loss.backward()
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        meter = _PoolPeak()
        with meter.hook:
            loss, _ = model.loss(b["src"], b["tgt_in"], b["tgt_out"])
            loss.backward()
        return meter.peak
    finally:
        optim.zero_grad()
        model.rng.set_state(state)


def fit_max_tokens(measure, pairs, budget, held, low=LOW, high=HIGH, rounds=3):
    """The largest token budget in [low, high] (a multiple of 64) whose worst batch fits:
    ``held`` (bytes the process holds now) + ``measure(batch pairs)`` (step_peak) within
    ``budget`` -> (max_tokens, probes: a list of (tokens, sentences, bytes)). A line
    through the two largest measurements predicts the budget, ``rounds`` times at most,
    until a prediction falls within 5% of it; then the largest budget measured to fit is
    taken. Raises DataError when even ``low`` does not fit."""
    probes = []

    def probe(tokens):
        batch = longest_batch(pairs, tokens)
        try:
            need = held + measure(batch)
        except MemoryError:  # (NumPy's, or CuPy's OutOfMemoryError): over any budget
            _free_pool()
            need = float("inf")
        probes.append((tokens, len(batch), need))
        return need

    if probe(low) > budget:
        raise DataError(f"a training step of the {probes[0][1]} longest pairs ({low} tokens) "
                        f"needs {describe(probes[0][2])}, more than the memory budget of "
                        f"{describe(budget)}: raise --memory, or lower --max-len or the model "
                        "size")
    probe(4 * low)
    for _ in range(rounds):
        (t1, _, m1), (t2, _, m2) = sorted(probes)[-2:]
        per_token = max((m2 - m1) / (t2 - t1), 1.0)
        guess = max(low, min(high, int(t2 + (budget - m2) / per_token) // 64 * 64))
        if guess in [t for t, _, _ in probes]:
            break
        m = probe(guess)
        if m <= budget and (m >= 0.95 * budget or guess == high):
            break
    return max(t for t, _, m in probes if m <= budget), probes


def _free_pool():
    """Hand CuPy's cached blocks back after a probe ran out of GPU memory (no-op without)."""
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()


def report(tokens, probes, budget):
    """One log line: the choice and what it rests on."""
    measured = ", ".join(f"{t} tokens ({n} sentences): "
                         f"{describe(m) if m != float('inf') else 'out of memory'}"
                         for t, n, m in probes)
    return (f"--max-tokens auto: {tokens} (memory budget {describe(budget)}; a step on the "
            f"longest pairs measured at {measured})")

