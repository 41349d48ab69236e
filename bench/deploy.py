"""Translation throughput of a trained run: minitransformer's translate.py search against
CTranslate2 on the same weights (exported with ``python -m minitransformer.export``).

    python bench/deploy.py --run-dir runs/multi30k --average-last 5 \\
        --input data/multi30k/test2016.en --reference data/multi30k/test2016.de

For each of greedy and beam search it translates the whole input, ``--reps`` times after one
warm-up pass, with ours
(``mt.translation.translate_ids``: sorted by length, batches of ``--max-tokens`` padded
source tokens) and with CTranslate2 float32 and int8 (the same
sentencepiece pieces, ``translate_batch`` with ``export.translate_options`` and batches of
``--max-tokens`` tokens, which CTranslate2 sorts by length itself; one maximum output length
for the whole input, the longest source's), and reports sentences/s (median of the reps), cased
sacreBLEU, and how many outputs are token-identical to ours. Tokenizing and detokenizing are
outside the timed region on both sides. Both use ``--threads`` cores, each in the ways it
offers: ours as translate.py does (``--workers`` processes, each with threads / workers
OpenBLAS threads; 0 = one per core, translate.py's default; and, for comparison, in one
process with ``--threads`` OpenBLAS threads), CTranslate2 both as one
translator with ``--threads`` intra_threads ("1x2 threads" on 2 cores) and as ``--threads``
translators with one thread each (inter_threads, "2x1"), which it splits a call's batches
between. The beam rows use the power length penalty (our ``--length-penalty power``), the
one CTranslate2 implements, with exponent ``--alpha``. Writes a Markdown table
(``--results``) and the raw numbers beside it as JSON.

To time an older checkout of minitransformer, copy this file into its bench/ and run it
there with ``--no-ct2 --workers 1`` (it imports the package beside it).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--average-last", type=int, default=0)
    p.add_argument("--input", required=True, help="source text, one sentence a line")
    p.add_argument("--reference", required=True, help="reference translations")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.0,
                   help="power length penalty exponent of the beam rows (default 1.0)")
    p.add_argument("--max-len-a", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--workers", type=int, default=0,
                   help="ours: translating processes (default 0: one per core, as "
                        "translate.py; 1 = one process with --threads BLAS threads)")
    p.add_argument("--no-ct2", dest="ct2", action="store_false",
                   help="ours only (e.g. to time an older checkout of the package)")
    p.add_argument("--label", default="", help="a name for this run in the results")
    p.add_argument("--results", default=os.path.join(HERE, "DEPLOY.md"))
    return p.parse_args(argv)


def ours(args, model, tok, lines, workers):
    """-> run(search options) -> output ids, translate.py's way with ``workers``."""
    from minitransformer.mt.translation import translate_ids
    ids = tok.encode([line.strip() for line in lines])
    extra = {} if workers == 1 else {"workers": workers}  # (older versions: one process)
    return lambda opts: translate_ids(model, ids, max_len_a=args.max_len_a,
                                      max_tokens=args.max_tokens, **opts, **extra)


def ct2(args, model_dir, tok, lines, inter, intra):
    """-> run(search options) -> output ids, with a CTranslate2 translator of ``inter``
    replicas of ``intra`` threads."""
    import ctranslate2

    from minitransformer.export import translate_options
    tr = ctranslate2.Translator(model_dir, device="cpu", inter_threads=inter,
                                intra_threads=intra)
    pieces = [tok.sp.encode(line.strip(), out_type=str) for line in lines]
    longest = max(map(len, pieces))  # one maximum output length per call: the longest's

    def run(opts):
        kw = dict(translate_options(model_dir, longest, opts.get("beam", 1),
                                    opts.get("alpha", 0.0), args.max_len_a),
                  max_batch_size=args.max_tokens, batch_type="tokens")
        return [[tok.sp.piece_to_id(p) for p in r.hypotheses[0]]
                for r in tr.translate_batch(pieces, **kw)]
    return run


def measure(args, runners, searches, tok):
    """Each engine in turn, each search once to warm up and then ``--reps`` times ->
    {engine: {search: dict(seconds (median), times, ids, text)}}. (Not interleaved: the
    thread pools of one engine spin for a while after a call and would slow the next.)"""
    results = {}
    for engine, run in runners.items():
        results[engine] = {}
        for name, opts in searches.items():
            out, times = run(opts), []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                run(opts)
                times.append(time.perf_counter() - t0)
            results[engine][name] = dict(ids=out, text=tok.decode(out), times=times,
                                         seconds=statistics.median(times))
    return results


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    import minitransformer as mt
    mt.configure_process()
    from minitransformer.mt.translate import load_model
    from minitransformer.mt.translation import corpus_bleu
    model, tok, what = load_model(args.run_dir, average_last=args.average_last)
    lines = open(args.input, encoding="utf-8").read().splitlines()
    refs = open(args.reference, encoding="utf-8").read().splitlines()
    searches = {"greedy": dict(beam=1),
                f"beam {args.beam}": dict(beam=args.beam, alpha=args.alpha,
                                          length_penalty="power")}
    workers = args.workers or args.threads
    runners = {"ours": ours(args, model, tok, lines, workers)}
    if workers != 1:  # what the workers add
        runners["ours, 1 process"] = ours(args, model, tok, lines, 1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.ct2:
            from minitransformer.export import export_ctranslate2
            for q in ("float32", "int8"):
                out = export_ctranslate2(args.run_dir, os.path.join(tmp, q),
                                         average_last=args.average_last or None,
                                         quantization=None if q == "float32" else q)
                n = args.threads
                for inter, intra in ((1, n), (n, 1)) if n > 1 else ((1, 1),):
                    runners[f"CTranslate2 {q}, {inter}x{intra} threads"] = ct2(
                        args, out, tok, lines, inter, intra)
        results = measure(args, runners, searches, tok)
    report(args, results, lines, refs, what, corpus_bleu)


def report(args, results, lines, refs, what, corpus_bleu):
    table, raw = [], dict(settings=vars(args), checkpoint=what, machine=platform.platform())
    ref_ids = results["ours"]
    for engine, rows in results.items():
        for name, r in rows.items():
            bleu, sig = corpus_bleu(r["text"], refs)
            same = sum(a == b for a, b in zip(r["ids"], ref_ids[name]["ids"]))
            table.append((name, engine, bleu, len(lines) / r["seconds"], same, r["times"]))
            raw.setdefault(engine, {})[name] = dict(bleu=bleu, signature=sig,
                                                    seconds=r["seconds"], times=r["times"],
                                                    identical_to_ours=same)
    base = {name: len(lines) / results["ours"][name]["seconds"] for name in results["ours"]}
    md = ["| search | engine | BLEU | sentences/s | ours / this | token-identical to ours |",
          "|---|---|---:|---:|---:|---:|"]
    for name, engine, bleu, sps, same, _ in sorted(table, key=lambda r: (r[0], r[1] != "ours")):
        md.append(f"| {name} | {engine} | {bleu:.2f} | {sps:.1f} | {base[name] / sps:.2f}x | "
                  f"{same}/{len(lines)} |")
    text = "\n".join(md)
    print(text)
    stem = os.path.splitext(args.results)[0] + (f"-{args.label}" if args.label else "")
    with open(stem + ".json", "w") as f:
        json.dump(raw, f, indent=1)
    with open(args.results if not args.label else stem + ".md", "w") as f:
        workers = args.workers or args.threads
        f.write(f"{args.label or 'run'}: {what}; {args.threads} threads (ours: {workers} "
                f"process(es), each with cores / {workers} BLAS threads); "
                f"{platform.processor() or platform.machine()}\n\n{text}\n")


if __name__ == "__main__":
    main()
