"""How one self-attention layer's cost grows with sequence length n, at fixed D (ours).

    python bench/attention_scaling.py                       # D=512, H=8, n = 16 .. 2048
    python bench/attention_scaling.py --d 256 --max-n 4096

Times forward + backward of the two parts of a multi-head self-attention layer separately:
  projections     q = x Wq, k = x Wk, v = x Wv, out = a Wo       4 n D^2 multiply-adds forward
  attention core  split heads, s = q k^T / sqrt(K), p = softmax(s), a = p v, merge heads
                                                                2 n^2 D multiply-adds forward
(backward costs twice the forward in both), so per sequence the core overtakes the
projections at n = 2D. Batch B = tokens // n keeps the work of the projections constant.
Writes bench/results/attention_scaling-t<threads>.{json,csv,png} and re-renders
bench/RESULTS.md.
"""
import minitransformer

if __name__ == "__main__":
    minitransformer.configure_process()  # OPENBLAS_CORETYPE before numpy loads

import argparse
import csv
import datetime
import json
import math
import os
import time

import numpy as np

from minitransformer.engine import ops
from minitransformer.engine.attention import scaled_dot_product_attention
from minitransformer.engine.tensor import Tensor
from minitransformer.nn.module import Linear

import common
import report

HERE = os.path.dirname(os.path.abspath(__file__))


def flops(B, n, D):
    """(projections, core) FLOPs of forward + backward: 24 B n D^2 and 12 B n^2 D."""
    return 24 * B * n * D * D, 12 * B * n * n * D


def time_projections(layers, x, a, grads):
    """Forward and backward of the four projections; x, a (B, n, D) leaves."""
    t0 = time.perf_counter()
    outs = [layers[0](x), layers[1](x), layers[2](x), layers[3](a)]
    for y, g in zip(outs, grads):
        y.backward(g)
    return time.perf_counter() - t0


def time_core(q, k, v, H, grad):
    """Forward and backward of split heads -> attention -> merge heads; q, k, v (B, n, D)."""
    t0 = time.perf_counter()
    heads = [ops.split_heads(t, H) for t in (q, k, v)]  # (B, H, n, K)
    out = ops.merge_heads(scaled_dot_product_attention(*heads), H)  # (B, n, D)
    out.backward(grad)
    return time.perf_counter() - t0


def measure(n, D, H, tokens, reps, rng):
    B = max(1, tokens // n)
    f32 = np.float32
    layers = [Linear(D, D, rng=rng) for _ in range(4)]
    leaf = lambda: Tensor(rng.standard_normal((B, n, D), dtype=f32), requires_grad=True)  # noqa
    x, a, q, k, v = (leaf() for _ in range(5))
    grads = [rng.standard_normal((B, n, D), dtype=f32) for _ in range(4)]
    tp, tc = [], []
    for rep in range(reps + 1):  # the first run of each is a warm-up
        for t in [x, a, q, k, v] + [p for m in layers for p in m.parameters()]:
            t.grad = None
        # alternate the order, so that noise on the shared machine hits both parts alike
        if rep % 2:
            c = time_core(q, k, v, H, grads[0])
            p = time_projections(layers, x, a, grads)
        else:
            p = time_projections(layers, x, a, grads)
            c = time_core(q, k, v, H, grads[0])
        if rep:
            tp.append(p)
            tc.append(c)
    fp, fc = flops(B, n, D)
    ps, cs = common.median(tp), common.median(tc)
    return dict(n=n, B=B, proj_s=ps, core_s=cs, proj_flops=fp, core_flops=fc,
                proj_gflops=fp / ps / 1e9, core_gflops=fc / cs / 1e9,
                theory_ratio=n / (2 * D))


def crossover(rows):
    """n where core_s / proj_s crosses 1, interpolating log(ratio) linearly in log(n)."""
    for r1, r2 in zip(rows, rows[1:]):
        a, b = r1["core_s"] / r1["proj_s"], r2["core_s"] / r2["proj_s"]
        if a < 1 <= b:
            la, lb = math.log(a), math.log(b)
            t = -la / (lb - la)
            return math.exp(math.log(r1["n"]) + t * (math.log(r2["n"]) - math.log(r1["n"])))
    if rows and rows[0]["core_s"] >= rows[0]["proj_s"]:
        return float(rows[0]["n"])
    return None


def plot(rows, D, measured, path):
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib); "
              "the table is in bench/results/attention_scaling.csv")
        return None
    n = [r["n"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    per_tok = lambda key: [1e6 * r[key] / (r["B"] * r["n"]) for r in rows]  # noqa: E731
    ax1.loglog(n, per_tok("proj_s"), "o-", label="projections (n D^2)")
    ax1.loglog(n, per_tok("core_s"), "s-", label="attention core (n^2 D)")
    ax1.set_xlabel("sequence length n")
    ax1.set_ylabel("forward + backward, microseconds per token")
    ax1.set_title(f"one self-attention layer, D = {D}")
    ax2.loglog(n, [r["core_s"] / r["proj_s"] for r in rows], "o-", label="measured")
    ax2.loglog(n, [r["theory_ratio"] for r in rows], "--", label="FLOPs: n / 2D")
    ax2.axhline(1, color="gray", lw=0.8)
    ax2.axvline(2 * D, color="C1", lw=0.8, ls=":", label=f"theory crossover n = 2D = {2 * D}")
    if measured:
        ax2.axvline(measured, color="C0", lw=0.8, ls=":",
                    label=f"measured crossover n ~ {measured:.0f}")
    ax2.set_xlabel("sequence length n")
    ax2.set_ylabel("time(core) / time(projections)")
    for ax in (ax1, ax2):
        ax.set_xticks(n, [str(v) for v in n])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=512, help="d_model (default 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--min-n", type=int, default=16)
    p.add_argument("--max-n", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4096, help="B * n for every n (default 4096)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--threads", type=int, help="OpenBLAS threads (default: its own choice)")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"),
                   help="report to write; raw results go to results/ beside it")
    args = p.parse_args(argv)
    if args.threads:
        common.set_blas_threads(args.threads)
    D, H = args.d, args.heads
    rng = np.random.default_rng(0)
    ns, n = [], args.min_n
    while n <= args.max_n:
        ns.append(n)
        n *= 2
    load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if common.blas_threads() > 1 and load > cpus:
        print(f"warning: load average {load:.1f} > {cpus} CPUs: multi-threaded BLAS waits for "
              f"descheduled threads on a busy machine (timings mostly noise); consider "
              f"--threads 1")
    print(f"self-attention layer, D={D}, H={H}, B*n={args.tokens}, {args.reps} reps; "
          f"{common.blas_threads()} BLAS threads, load {os.getloadavg()}")
    print(f"{'n':>6} {'B':>5} {'proj ms':>9} {'core ms':>9} {'core/proj':>9} {'n/2D':>6} "
          f"{'proj GF/s':>9} {'core GF/s':>9}")
    rows = []
    for n in ns:
        r = measure(n, D, H, args.tokens, args.reps, rng)
        rows.append(r)
        print(f"{n:6d} {r['B']:5d} {1e3 * r['proj_s']:9.1f} {1e3 * r['core_s']:9.1f} "
              f"{r['core_s'] / r['proj_s']:9.2f} {r['theory_ratio']:6.2f} "
              f"{r['proj_gflops']:9.1f} {r['core_gflops']:9.1f}", flush=True)
    measured = crossover(rows)
    out_dir = report.results_dir(args.results)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"attention_scaling-t{common.blas_threads()}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    png = plot(rows, D, measured, stem + ".png")
    gp = common.median([r["proj_gflops"] for r in rows])
    gc = common.median([r["core_gflops"] for r in rows])
    if measured is None:
        where = "does not overtake the projections in the measured range"
    else:
        where = (f"overtakes the projections {'before' if measured < 2 * D else 'after'} the "
                 f"FLOP crossover ({measured:.0f} vs {2 * D})")
    comment = (f"Median rates: projections {gp:.0f} GFLOP/s (2-D GEMMs of B n x D by D x D), "
               f"attention core {gc:.0f} GFLOP/s (products batched over B x H matrices with "
               f"inner size K = {D // H} or n, plus the softmax and its backward: memory-bound "
               f"passes over the (B, H, n, n) scores that the FLOP count leaves out). The core "
               f"{where}.")
    machine = common.machine_info()
    with open(stem + ".json", "w") as f:
        json.dump(dict(d=D, h=H, tokens=args.tokens, reps=args.reps, rows=rows,
                       threads=common.blas_threads(), loadavg=os.getloadavg(),
                       measured_crossover=measured, theory_crossover=2 * D, comment=comment,
                       png=os.path.relpath(png, os.path.dirname(os.path.abspath(args.results)))
                       if png else None, machine=machine,
                       date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
                  f, indent=1)
    print(f"crossover (core = projections): measured n ~ {measured:.0f}" if measured else
          "no crossover in the measured range", f"; theory n = 2D = {2 * D}")
    if png:
        print(f"plot: {os.path.relpath(png)}")
    report.write(args.results)
    print(f"wrote {os.path.relpath(args.results)}")


if __name__ == "__main__":
    main()
