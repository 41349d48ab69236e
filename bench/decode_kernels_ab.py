"""GPU decoding with and without the decoding step's kernels, in one process, interleaved.

    python bench/decode_kernels_ab.py [CONFIG ...]    (default: tiny base-lite base; needs CuPy
                                                      and a GPU)

Times greedy and beam 4 over the bench's decoding sentences (bench.py's, as its decoding rows:
untrained weights, maximum output length = source length) with a step's attention in
``cuda_kernels.decode_attention`` and each post-norm sub-layer's end in
``bias_residual_layer_norm``, and without them (``DECODE_STEP_KERNELS = False``: the CuPy
calls they replaced, the other fused kernels on), alternating the two six times (the first
pair a warm-up), and says whether the two give the same translations.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402
import minitransformer.nn.transformer as tr  # noqa: E402
from minitransformer import backend  # noqa: E402
from minitransformer.engine import cuda_kernels  # noqa: E402
from minitransformer.mt import search  # noqa: E402


def main(configs):
    cp = backend.get_xp("cuda")
    sync = cp.cuda.Device().synchronize
    for name in configs:
        spec = common.CONFIGS[name]
        cfg = {**common.model_config(name), "max_positions": 1024}
        model = tr.Transformer(tr.TransformerConfig.from_dict(cfg), seed=0, device="cuda")
        srcs = common.decode_batches(spec["decode_sentences"], cfg["vocab_size"], 1)
        for kind in ("greedy", "beam"):
            times, outs = {True: [], False: []}, {}
            try:
                for _ in range(6):
                    for on in (True, False):
                        cuda_kernels.DECODE_STEP_KERNELS = on
                        sync()
                        t0 = time.perf_counter()
                        outs[on] = [search.greedy_search(model, s, max_len_a=0)
                                    if kind == "greedy" else
                                    search.beam_search(model, s, beam=4, max_len_a=0)
                                    for s in srcs]
                        sync()
                        times[on].append(time.perf_counter() - t0)
            finally:
                cuda_kernels.DECODE_STEP_KERNELS = True
            med = {k: sorted(v[1:])[2] for k, v in times.items()}
            same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
            n = sum(len(x) for x in outs[True])
            print(f"{name}: {kind if kind == 'greedy' else 'beam 4'} over {n} sentences, "
                  f"median of 5: with the step kernels {med[True]:.3f} s, without "
                  f"{med[False]:.3f} s -> {med[False] / med[True]:.2f}x; identical "
                  f"translations {same}/{n}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny", "base-lite", "base"])
