"""Write bench/RESULTS.md from the raw results in bench/results/ (bench.py's
``<config>-<device>.json`` and attention_scaling.py's ``attention_scaling.json``).

Each script re-renders the whole report, so results of earlier runs of the other script (or of
another config) stay in it, each with the date and machine it was measured on.
"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


TARGETS = dict(train=1.5, memory=1.0)
# decoding, ours / torch sentences/s: twice as fast on tiny, where the per-step work outside the
# products counts most, 1.3x on base-lite, where the products dominate
DECODE_TARGETS = {"tiny": 2.0, "base-lite": 1.3, "base": 1.3}


def target(kind, config):
    """The target ratio of ``kind`` (train, greedy, beam, memory) for ``config``."""
    if kind in ("greedy", "beam"):
        return DECODE_TARGETS.get(config, 1.5)
    return TARGETS[kind]


def results_dir(report_path):
    """Raw results live in results/ beside the report (bench/results/ for bench/RESULTS.md)."""
    return os.path.join(os.path.dirname(os.path.abspath(report_path)), "results")


def _load(results):
    runs = []
    for path in sorted(glob.glob(os.path.join(results, "run-*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    order = {"tiny": 0, "base-lite": 1, "base": 2}
    runs.sort(key=lambda r: (r["device"], -r["settings"]["threads"],
                             order.get(r["config"], 9)))
    scaling = []
    for path in sorted(glob.glob(os.path.join(results, "attention_scaling*.json"))):
        with open(path) as f:
            scaling.append(json.load(f))
    scaling.sort(key=lambda s: -s.get("threads", 0))
    return runs, scaling


def _met(kind, ratio, config=None):
    if ratio is None:
        return ""
    goal = target(kind, config)
    ok = ratio <= goal if kind == "memory" else ratio >= goal
    return "met" if ok else "**not met**"


FLOAT16_NOTE = (
    "The float16 rows on a GPU are no valid comparison yet. PyTorch's float16 training steps "
    "took 0.16-4.2 s where its float32 ones took 0.013-0.022 s on the same batches: its "
    "float16 path misbehaved (perhaps a new fused-attention plan for each new batch shape; "
    "not confirmed), and until a fix in bench.py its float16 decoding ran in float32 "
    "(no autocast) while ours decoded in float16. Their MFU is also against a float32 (TF32) "
    "GEMM rate in runs made before that fix.")


def _float16_gpu(run):
    return run["settings"].get("precision", "float32") == "float16"


def _fmt(x, spec=",.0f"):
    return "–" if x is None else format(x, spec)


def summary(runs):
    lines = ["| config | device, threads, 1-min load (start -> end) | what | ours | torch "
             "| ours / torch | target |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in runs:
        q = r.get("ratios") or {}
        judge = _met if not _float16_gpu(r) else (
            lambda kind, ratio, config=None: _met(kind, ratio, config) if kind == "memory"
            else "no valid comparison (see the float16 note below)")
        tr, dec, mem = r["train"], r["decode"], r["memory"]
        has_t = "torch" in tr
        t = (lambda d, *k: _get(d, "torch", *k)) if has_t else (lambda *a: None)
        c, d = r["config"], _where(r)
        lines.append(f"| {c} | {d} | training, target tokens/s (median) | "
                     f"{_fmt(tr['ours']['tokens_per_s'])} | {_fmt(t(tr, 'tokens_per_s'))} | "
                     f"{_x(q.get('train'))} | >= 1.5x: {judge('train', q.get('train'))} |")
        lines.append(f"| {c} | {d} | MFU (training) | {100 * tr['ours']['mfu']:.1f}% | "
                     f"{_fmt(t(tr, 'mfu') and 100 * t(tr, 'mfu'), '.1f')}"
                     f"{'%' if has_t else ''} | | |")
        if "ours_ranks" in tr:
            n = r["settings"]["ranks"]
            a = tr["ours_ranks"]["tokens_per_s"]
            b = tr["torch_ranks"]["tokens_per_s"] if "torch_ranks" in tr else None
            lines.append(f"| {c} | {n} ranks x 1 thread | training, target tokens/s (median; "
                         f"ours: mpiexec as train.py, torch: DDP over gloo) | {_fmt(a)} | "
                         f"{_fmt(b)} | {_x(q.get('train_ranks'))} | |")
            if "train_best" in q:
                lines.append(f"| {c} | best set-up of each | training, target tokens/s | "
                             f"{_fmt(max(tr['ours']['tokens_per_s'], a))} | "
                             f"{_fmt(max(tr['torch']['tokens_per_s'], b))} | "
                             f"{_x(q['train_best'])} | >= 1.5x: "
                             f"{judge('train', q['train_best'])} |")
        for kind, label in (("greedy", "greedy"), ("beam", f"beam {r['settings']['beam']}")):
            a, b = dec["ours"][kind]["sentences_per_s"], t(dec, kind, "sentences_per_s")
            n = dec["ours"][kind]["reps"]
            lines.append(f"| {c} | {d} | {label} decoding, sentences/s (median of {n}) | "
                         f"{a:.1f} | {_fmt(b, '.1f')} | {_x(q.get(kind))} | "
                         f">= {target(kind, c)}x: {judge(kind, q.get(kind), c)} |")
            if "best_sentences_per_s" in dec["ours"][kind]:
                a, b = (dec["ours"][kind]["best_sentences_per_s"],
                        t(dec, kind, "best_sentences_per_s"))
                lines.append(f"| {c} | {d} | {label} decoding, sentences/s (best of {n}) | "
                             f"{a:.1f} | {_fmt(b, '.1f')} | {_x(q.get(kind + '_best'))} | "
                             f">= {target(kind, c)}x: "
                             f"{judge(kind, q.get(kind + '_best'), c)} |")
            if "ours_ranks" in dec:
                n = r["settings"]["ranks"]
                a = dec["ours_ranks"][kind]["sentences_per_s"]
                b = (dec["torch_ranks"][kind]["sentences_per_s"] if "torch_ranks" in dec
                     else None)
                lines.append(f"| {c} | {n} ranks x 1 thread | {label} decoding, sentences/s "
                             f"(median; rank r translates sentences r, r + {n}, ... of each "
                             f"batch) | {a:.1f} | {_fmt(b, '.1f')} | "
                             f"{_x(q.get(kind + '_ranks'))} | |")
                if kind + "_best_setup" in q:
                    lines.append(
                        f"| {c} | best set-up of each | {label} decoding, sentences/s | "
                        f"{max(dec['ours'][kind]['sentences_per_s'], a):.1f} | "
                        f"{max(dec['torch'][kind]['sentences_per_s'], b):.1f} | "
                        f"{_x(q[kind + '_best_setup'])} | >= {target(kind, c)}x: "
                        f"{judge(kind, q[kind + '_best_setup'], c)} |")
        a, b = mem["ours"]["max_rss_mib"], t(mem, "max_rss_mib")
        lines.append(f"| {c} | {d} | peak memory (ru_maxrss), MiB | {_fmt(a)} | {_fmt(b)} | "
                     f"{_x(q.get('memory'))} | <= 1x: {judge('memory', q.get('memory'))} |")
        a2 = a - mem["ours"]["rss_setup_mib"]
        b2 = b - mem["torch"]["rss_setup_mib"] if b is not None else None
        lines.append(f"| {c} | {d} | peak memory above imports + data, MiB | {_fmt(a2)} | "
                     f"{_fmt(b2)} | {_x(q.get('memory_above_setup'), bold=False)} | |")
        if "gpu_reserved_mib" in mem["ours"]:
            lines.append(f"| {c} | {d} | GPU memory reserved (peak), MiB | "
                         f"{mem['ours']['gpu_reserved_mib']:.0f} | "
                         f"{_fmt(t(mem, 'gpu_reserved_mib'))} | "
                         f"{_x(q.get('gpu_memory'), bold=False)} | <= 1x |")
    return "\n".join(lines)


def _where(r):
    n = r["settings"]["threads"]
    load = [x[0] for x in (r["machine"].get("loadavg"), r.get("loadavg_end")) if x]
    load = f", load {' -> '.join(f'{x:.1f}' for x in load)}" if load else ""
    prec = r["settings"].get("precision", "float32")
    prec = "" if prec == "float32" else f", {prec} mixed precision"
    return f"{r['device']}{prec}, {n} thread{'s' if n > 1 else ''}{load}"


def _code_str(code):
    if not code:
        return ""
    mod = code["modified"]
    return (f" on commit {code['commit']}"
            + (f" with uncommitted changes to {len(mod)} package file(s)" if mod else ""))


def _load_str(load):
    return "?" if not load else ", ".join(f"{x:.1f}" for x in load)


def _x(ratio, bold=True):
    if ratio is None:
        return "–"
    return f"**{ratio:.2f}x**" if bold else f"{ratio:.2f}x"


def _get(d, *keys):
    for k in keys:
        d = d[k]
    return d


def _machine_key(run):
    """What tells two runs' machines apart: the CPU, its cores and SIMD, memory, the OS and
    Python, NumPy and its BLAS as set up for the run, and the GPU (None where the run did
    not record one)."""
    m = run["machine"]
    blas = m.get("blas", {})
    gpu = run["setup"].get("ours", {}).get("gpu")
    return (m["cpu"], m["usable_cpus"], m["logical_cpus"], tuple(m["simd"]), m["mem_gib"],
            m["python"], m["platform"], m["numpy"], blas.get("config"), blas.get("corename"),
            blas.get("OPENBLAS_CORETYPE"), tuple(sorted(gpu.items())) if gpu else None)


def machine(runs):
    """One block per machine the runs were measured on (the CPU rows and a GPU's come from
    different machines), each naming its runs, then each run's load and GEMM peak."""
    groups = {}
    for run in runs:
        groups.setdefault(_machine_key(run), []).append(run)
    lines = []
    for i, members in enumerate(groups.values()):
        m = members[0]["machine"]
        blas = m.get("blas", {})
        if len(groups) > 1:
            if i:
                lines.append("")
            lines += [f"Machine {i + 1} of {len(groups)}, for "
                      + ", ".join(f"{r['config']} ({_where(r)})" for r in members) + ":", ""]
        lines += [f"* CPU: {m['cpu']}; {m['usable_cpus']} usable CPUs ({m['logical_cpus']} "
                  f"logical); SIMD: {', '.join(m['simd'])}; {m['mem_gib']} GiB memory",
                  f"* Python {m['python']}, {m['platform']}",
                  f"* NumPy {m['numpy']}, BLAS: {blas.get('config', '?')}; core type in use "
                  f"{blas.get('corename', '?')}, OPENBLAS_CORETYPE="
                  f"{blas.get('OPENBLAS_CORETYPE')}, {blas.get('threads', '?')} threads"]
        gpu = members[0]["setup"].get("ours", {}).get("gpu")  # (part of the key)
        if gpu:
            lines.append(f"* GPU: {gpu['name']}; CuPy {gpu['cupy']}, CUDA runtime "
                         f"{gpu['cuda_runtime']}")
        ts = next((r["setup"]["torch"] for r in members if "torch" in r["setup"]), {})
        if ts:
            lines.append(f"* {ts['framework']}; intra-op threads set equal to numpy's BLAS "
                         f"threads in each run (see the run's label); "
                         + "; ".join(s.strip() for s in ts["parallel_info"]
                                     if "Math Kernel" in s or "MKL-DNN" in s or "OpenMP" in s))
        for run in members:
            g = run.get("gemm", {})
            extra = ", ".join(f"{fw} {v['gflops']:.0f}" for fw, v in g.items())
            lines.append(f"* {run['config']} ({_where(run)}), {run['date']}: load average at "
                         f"start {_load_str(run['machine']['loadavg'])}, at the end "
                         f"{_load_str(run.get('loadavg_end'))}; float32 GEMM peak (MFU "
                         f"denominator, {run['peak']['how']}) {run['peak']['gflops']:.0f} "
                         f"GFLOP/s; measured again after training (GFLOP/s): {extra}")
    return "\n".join(lines)


def _memory_str(fw, m):
    ranks = m.get("per_rank_mib")
    if ranks:  # a worker of several processes
        return (f"{fw} peak {m['max_rss_mib']:.0f} MiB (ranks summed: "
                f"{' + '.join(f'{x:.0f}' for x in ranks)}), setup {m['rss_setup_mib']:.0f} MiB "
                f"(rank 0)")
    return f"{fw} peak {m['max_rss_mib']:.0f} MiB, setup {m['rss_setup_mib']:.0f} MiB"


def details(r):
    s, cfg = r["settings"], r["model"]
    out = [f"### {r['config']} ({_where(r)})", "",
           f"N={cfg['n_layers']}, D={cfg['d_model']}, H={cfg['n_heads']}, F={cfg['d_ff']}, "
           f"V={cfg['vocab_size']}; {r['setup']['ours']['n_params']:,} parameters; batches of "
           f"at most {s['max_tokens']} padded source and {s['max_tokens']} padded target tokens; "
           f"{s['warmup']} warm-up + {s['steps']} timed steps; measured {r['date']}"
           + _code_str(r.get("code")) + ".", ""]
    il = r.get("initial_loss", {})
    if "rel_diff" in il:
        out += [f"Same model check: loss per token on the first batch, no dropout, same "
                f"initial weights: ours {il['ours']['loss_per_token']:.6f}, torch "
                f"{il['torch']['loss_per_token']:.6f} (relative difference "
                f"{il['rel_diff']:.1e}; the smoothed loss written out by hand in torch: "
                f"{il['torch']['by_hand_per_token']:.6f}).", ""]
    fws = list(r["train"])
    steps = r["train_steps"]
    vs = "torch" in fws
    out += ["| step | B x S / B x T | target tokens | " + " | ".join(f"{fw} s" for fw in fws)
            + (" | torch s / ours s |" if vs else " |"),
            "|---:|---|---:|" + "---:|" * len(fws) + ("---:|" if vs else "")]
    for i, a in enumerate(steps["ours"]):
        tag = " (warm-up)" if i < s["warmup"] else ""
        row = f"| {i + 1}{tag} | {a['B']} x {a['S']} / {a['B']} x {a['T']} | {a['tokens']} | " \
              + " | ".join(f"{steps[fw][i]['seconds']:.3f}" for fw in fws)
        if vs:
            row += f" | {steps['torch'][i]['seconds'] / a['seconds']:.2f}"
        out.append(row + " |")
    tr = r["train"]["ours"]
    out += ["", f"Model FLOPs per target token (median batch): "
                f"{tr['flops_per_target_token'] / 1e6:.1f} MFLOP; achieved: "
            + ", ".join(f"{fw} {r['train'][fw]['flops_per_s'] / 1e9:.1f} GFLOP/s "
                        f"(MFU {100 * r['train'][fw]['mfu']:.1f}%)" for fw in fws)
            + (f"; median of the per-step speed ratios ours/torch "
               f"{r['ratios']['train_per_step_median']:.2f}x." if r.get("ratios") else "."), ""]
    mem = r["memory"]
    out.append("Memory (ru_maxrss of each worker process after the training steps; 'setup' = "
               "after imports and building the batches, before the model): "
               + "; ".join(_memory_str(fw, mem[fw]) for fw in fws) + ".")
    out.append("")
    d = r["decode"]
    fws = list(d)  # one process per framework, and (--ranks) its ranks
    out.append(f"Decoding {d['ours']['greedy']['sentences']} sentences (source 10-30 tokens + "
               f"EOS, batches of at most {s['decode_max_tokens']} padded source tokens, maximum "
               f"output length = source length + {s['max_len_a']}), median of "
               f"{d['ours']['greedy']['reps']} runs: "
               + "; ".join(f"{fw} greedy {d[fw]['greedy']['seconds']:.2f} s "
                           f"({d[fw]['greedy']['out_tokens']} tokens out), beam "
                           f"{d[fw]['beam']['seconds']:.2f} s "
                           f"({d[fw]['beam']['out_tokens']} tokens out)" for fw in fws) + ".")
    if "decode_agreement" in r:
        a = r["decode_agreement"]
        out.append(f"Identical outputs ours vs torch: greedy {a['greedy']['identical']}/"
                   f"{a['greedy']['of']}, beam {a['beam']['identical']}/{a['beam']['of']} "
                   f"sentences (same weights; differences come from float rounding in near-ties).")
    for fw, a in r.get("decode_agreement_ranks", {}).items():
        out.append(f"Identical outputs {fw} vs {fw[:-len('_ranks')]} in one process: greedy "
                   f"{a['greedy']['identical']}/{a['greedy']['of']}, beam "
                   f"{a['beam']['identical']}/{a['beam']['of']} sentences.")
    if "decode_agreement_ctranslate2" in r:
        a = r["decode_agreement_ctranslate2"]
        out.append(f"Identical outputs ours vs CTranslate2 float32: greedy "
                   f"{a['greedy']['identical']}/{a['greedy']['of']}, beam "
                   f"{a['beam']['identical']}/{a['beam']['of']} sentences.")
    out.append("")
    return "\n".join(out)


def ctranslate2_table(runs):
    """Decoding sentences/s of ours, torch and CTranslate2 float32 (where it ran)."""
    rows = ["| config | device, threads | search | ours | torch | CTranslate2 float32 | "
            "ours / CTranslate2 |", "|---|---|---|---:|---:|---:|---:|"]
    for r in runs:
        d = r["decode"]
        if "ctranslate2" not in d:
            continue
        for kind, label in (("greedy", "greedy"), ("beam", f"beam {r['settings']['beam']}")):
            a, c = d["ours"][kind]["sentences_per_s"], d["ctranslate2"][kind]["sentences_per_s"]
            t = d["torch"][kind]["sentences_per_s"] if "torch" in d else None
            rows.append(f"| {r['config']} | {_where(r)} | {label}, sentences/s (median of "
                        f"{d['ours'][kind]['reps']}) | {a:.1f} | "
                        f"{_fmt(t, '.1f')} | {c:.1f} | "
                        f"{a / c:.2f}x |")
    return "\n".join(rows) if len(rows) > 2 else None


def profile(r):
    p = r["profile"]
    if p.get("profiler"):  # the package's profiler (engine/profiler.py); older results: cProfile
        return _op_profile(r, p)
    lines = [f"### Where our training step spends its time ({r['config']}, {_where(r)})", "",
             f"cProfile over {p['steps']} training steps (forward, backward, Adam), top "
             f"{len(p['rows'])} functions by own time (tottime: time in the function itself, "
             f"including the NumPy calls and `@` products it makes, excluding Python functions "
             f"it calls). Total profiled time {p['total_tt']:.2f} s for {p['steps']} steps "
             f"(cProfile adds overhead to the many small calls). The pre-softmax projection "
             f"h E^T (D x V) is {100 * _out_share(r['model']):.0f}% of this model's matmul "
             f"FLOPs per token; it is counted in the row of the op that computes it "
             f"(`LinearCrossEntropy` where projection and loss are fused, else `Linear`).", "",
             "| function | calls | tottime s | share | cumtime s |", "|---|---:|---:|---:|---:|"]
    for row in p["rows"]:
        lines.append(f"| `{row['function']}` | {row['calls']} | {row['tottime']:.3f} | "
                     f"{100 * row['tottime'] / p['total_tt']:.1f}% | {row['cumtime']:.3f} |")
    return "\n".join(lines) + "\n"


def _op_profile(r, p):
    """The profile section from the package's profiler: per op, forward and backward time,
    FLOPs and MFU against the measured GEMM rate."""
    lines = [f"### Where our training step spends its time ({r['config']}, {_where(r)})", "",
             f"`minitransformer.profile` over {p['steps']} training steps (forward, backward, "
             f"Adam): {p['total_tt']:.2f} s inside ops of {p['wall_seconds']:.2f} s, "
             f"{p['gflop']:.1f} GFLOP; MFU against this device's measured GEMM rate "
             f"({p['peak_gflops']:.0f} GFLOP/s). The pre-softmax projection h E^T (D x V) is "
             f"{100 * _out_share(r['model']):.0f}% of this model's matmul FLOPs per token; it is "
             f"counted in `LinearCrossEntropy` where projection and loss are fused.", "",
             "| op | calls | forward s | backward s | share | GFLOP | MFU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in p["rows"]:
        lines.append(f"| `{row['function']}` | {row['calls']} | {row['forward_s']:.3f} | "
                     f"{row['backward_s']:.3f} | {100 * row['tottime'] / p['total_tt']:.1f}% | "
                     f"{row['gflop']:.2f} | {100 * row['mfu']:.0f}% |")
    return "\n".join(lines) + "\n"


def _out_share(cfg):
    import common
    p = common.matmul_params(cfg)
    return p["out"] / sum(p.values())


def scaling_section(s):
    n = s.get("threads", "?")
    lines = [f"### D = {s['d']}, {n} BLAS thread{'s' if n != 1 else ''}", "",
             f"`python bench/attention_scaling.py`, measured {s['date']}: one self-attention "
             f"layer, D={s['d']}, H={s['h']}, forward + backward, batch B = "
             f"{s['tokens']} // n sequences (so every row processes the same number of tokens), "
             f"median of {s['reps']} runs, {s.get('threads', '?')} BLAS thread(s), load average "
             f"{_load_str(s.get('loadavg'))} at the end. 'Projections' = the four D x D matrices "
             f"(q, k, v from x; the output projection); 'attention core' = split heads, "
             f"q k^T, softmax, p v, merge heads.", "",
             "| n | B | projections ms | attention core ms | core / projections | "
             "projections GFLOP/s | core GFLOP/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in s["rows"]:
        lines.append(f"| {row['n']} | {row['B']} | {1e3 * row['proj_s']:.1f} | "
                     f"{1e3 * row['core_s']:.1f} | {row['core_s'] / row['proj_s']:.2f} | "
                     f"{row['proj_gflops']:.0f} | {row['core_gflops']:.0f} |")
    m = s["measured_crossover"]
    lines += ["", f"FLOPs per sequence of length n (multiply-add = 2): projections "
              f"3 x 2 x 4 n D^2 = 24 n D^2 (forward 8 n D^2, backward twice that); attention "
              f"core 3 x 2 x 2 n^2 D = 12 n^2 D (q k^T and p v, 2 n^2 D each forward). They are "
              f"equal at **n = 2D = {2 * s['d']}** (the ratio core/projections = n / 2D); "
              f"softmax and the head reshapes add O(n^2 H) and O(n D) memory-bound work that the "
              f"FLOP count leaves out.", "",
              (f"Measured: the attention core overtakes the projections at **n ~ {m:.0f}** "
               f"(log-log interpolation between the grid points)" if m else
               "Measured: no crossover inside the measured range")
              + f"; theory {2 * s['d']}. " + s.get("comment", ""), ""]
    if s.get("png"):
        lines += [f"![attention scaling]({s['png']})", ""]
    return "\n".join(lines)


METHOD = """## Method

* **Models.** The package's `Transformer` and `bench/torch_reference.py`, the same model written in
  PyTorch: post-norm, one embedding shared by source, target and the pre-softmax projection,
  scaled by sqrt(D), interleaved sinusoidal positions, dropout 0.1 on embedding sums and
  sub-layer outputs, label smoothing 0.1 with eps/(V-1) on the non-target classes (torch:
  `F.cross_entropy(label_smoothing=eps*V/(V-1))`, which gives exactly q_t = 1 - eps and
  q_v = eps/(V-1); checked against the formula written out), attention by
  `torch.nn.functional.scaled_dot_product_attention`. Torch starts from our initial weights, and
  the two no-dropout losses on the first batch are compared (see each config).
* **Training step.** Forward, backward of loss_sum / n_target_tokens, Adam (0.9, 0.98, 1e-9;
  torch's default implementation) at the paper's learning rate for that step (warm-up 4000).
  Ours is `train.py`'s own update (`mt/step.py`: the backward of the summed loss, then the
  gradients scaled by 1/n in a separate pass, as `--update-freq` needs); torch's scales the
  loss by 1/n before its backward.
* **Data.** Synthetic random-token pairs: source length uniform in 10..30, target length
  source x U(0.8, 1.2); sorted by length and packed into batches of at most `max_tokens` padded
  source and target tokens (as the package's loader does), shuffled. Both frameworks get the
  identical batches (hashes compared). Tokens/s counts non-padding target tokens.
* **Fair timing on a shared machine.** Each framework in its own process; the parent alternates
  them step by step (ours, torch, then torch, ours, ...), medians over the timed steps, and
  each timed call starts 0.25 s after the previous one ended (a worker's BLAS threads keep
  spinning for about 0.1 s after its last call; NumPy's OpenBLAS does, and would take a core
  from the worker timed next). torch gets as many threads as numpy's OpenBLAS uses. On a
  GPU the timers are bracketed by `cupy.cuda.Device().synchronize()` /
  `torch.cuda.synchronize()`.
* **Data-parallel ranks** (`--ranks N`, where shown). On a CPU a NumPy process keeps its
  elementwise work on one core, so `train.py` can instead run as N processes with one BLAS
  thread each (`OPENBLAS_NUM_THREADS=1 mpiexec -n N --bind-to core python train.py ...`).
  The benchmark times that set-up too: ours under mpiexec with the package's all-reduce of
  one flat gradient buffer, torch as `DistributedDataParallel` over gloo, one intra-op
  thread per rank, both bound to one core per rank. Every rank takes its share of each batch
  (rows split for equal target tokens, padding cut to the share's longest row); the step is
  timed on rank 0 and includes the all-reduce. "Best set-up of each" compares the faster of
  one process and N ranks for each framework; that is the ratio held against the 1.5x
  target. Memory of a ranked worker is the sum of its ranks' peaks. The same ranks then
  decode, as `translate.py` does with its worker processes: each rank searches every N-th
  sentence of each batch (its share cut to its longest source) with one thread, between two
  barriers, timed on rank 0; the outputs are gathered back and compared with the
  one-process ones. For decoding too the best set-up of each is held against the target.
* **Peak memory.** `resource.getrusage(RUSAGE_SELF).ru_maxrss` of each worker after the
  training steps (before decoding and before the GEMM measurement); it includes the framework's
  own libraries (torch's are large), so the increase over the after-imports-and-data value is
  shown too. GPU: CuPy's memory-pool size (it keeps freed blocks, so it is the high-water mark)
  against `torch.cuda.max_memory_reserved()`.
* **Noise.** While these were measured, other jobs shared the 2 cores (the load average is in
  each run's label). When more threads want to run than there are cores, multi-threaded
  OpenBLAS and torch's OpenMP wait for descheduled threads, and a step can take several times
  longer; decoding, with its many small products, suffers most, so it is reported as the
  median and the best of its repetitions. `--threads 1` is steadier on a busy machine.
* **Decoding.** Initial (untrained) weights reloaded; greedy and beam search (beam 4, GNMT length
  penalty alpha 0.6) with key/value caches, finished sentences leaving the batch, on the same
  source batches. Maximum length = source length + `--max-len-a` (0 by default): an untrained
  model almost never emits EOS, so both decode every sentence to that length, a realistic
  translation length and identical work for both (the tokens generated are listed, and the
  outputs compared).
* **MFU** = model FLOPs per second (median over the timed steps) / measured float32 GEMM
  peak (numpy, 2048^3, the best of 5 products at the start of the run and 5 after training, with
  the run's thread count; on a GPU: CuPy, 8192^3). Model FLOPs of a training step on a (B, S)
  source and (B, T) target batch:
  `6 * (B*S*(P_enc + P_mem) + B*T*(P_dec + P_out)) + 12*N*D*B*(S^2 + T^2 + T*S)`, with
  P_enc = N (4 D^2 + 2 D F), P_mem = N 2 D^2 (cross-attention keys/values of the memory),
  P_dec = N (6 D^2 + 2 D F), P_out = D V (the shared output projection); i.e. about
  6 x (weights in matrix products) + attention terms per token, counted on the padded shapes,
  causal self-attention in full (ours computes it so; torch's fused attention may skip the
  masked half, which would only lower its MFU here). Softmax, LayerNorm, dropout, embedding
  look-ups and Adam are not counted.
"""


def write(path):
    results = results_dir(path)
    runs, scaling = _load(results)
    try:  # from the repository's root, when it is inside it
        shown = os.path.relpath(results, os.path.dirname(HERE))
    except ValueError:  # (another drive)
        shown = results
    if shown == os.pardir or shown.startswith(os.pardir + os.sep):
        shown = results
    parts = ["# Benchmark results", "",
             "Written by `python bench/bench.py` (training, decoding, memory; ours against "
             "PyTorch in the same run) and `python bench/attention_scaling.py`. Raw numbers in "
             f"`{shown}/`. Ratios are ours / torch: above 1 means ours is faster "
             "(for memory, below 1 means ours uses less). The machine was shared with other "
             "jobs while measuring, so absolute numbers are noisy; the ratios come from "
             "interleaved measurements in one run.", ""]
    if runs:
        parts += ["## Summary", "", summary(runs), ""]
        if any(_float16_gpu(r) for r in runs):
            parts += ["**The float16 note.** " + FLOAT16_NOTE, ""]
        ct2 = ctranslate2_table(runs)
        if ct2:
            parts += ["Decoding against CTranslate2 as well (the same weights exported with "
                      "`python -m minitransformer.export`; each batch split by maximum output "
                      "length, which CTranslate2 takes once per call). These untrained models "
                      "never end a sentence, so each must stop at its own length, and "
                      "CTranslate2 then runs a few sentences a call (3-6 here) where ours and "
                      "torch run the whole batch: its batching is lost, so this column "
                      "flatters ours (one call over a whole base-lite batch ran about 3.5x "
                      "faster per token). The fair comparison is bench/deploy.py's, on a "
                      "trained model whose sentences end by themselves:", "", ct2, ""]
        parts += ["## Machine", "", machine(runs), "", "## Details", ""]
        parts += [details(r) for r in runs]
        parts += [profile(r) for r in runs if "profile" in r]
    if scaling:
        parts.append("## Self-attention cost against sequence length (ours)\n")
        parts += [scaling_section(s) for s in scaling]
    parts.append(METHOD)
    with open(path, "w") as f:
        f.write("\n".join(parts))
