"""Beam search on a GPU with and without its candidate kernel, in one process, interleaved.

    python bench/beam_kernel_ab.py [CONFIG ...]      (default: tiny base-lite base; needs CuPy
                                                      and a GPU)

Times beam 4 over the bench's decoding sentences (bench.py's, as its decoding rows: untrained
weights, maximum output length = source length) with ``cuda_kernels.top_m_log_softmax``
choosing each step's candidates, and with the CuPy route it replaced (``TOP_M_MAX = 0`` makes
search.py fall back to selection.top_m and log_softmax_at), alternating the two six times
(the first pair a warm-up), and says whether the two give the same translations.
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
    kernel_max = cuda_kernels.TOP_M_MAX
    for name in configs:
        spec = common.CONFIGS[name]
        cfg = {**common.model_config(name), "max_positions": 1024}
        model = tr.Transformer(tr.TransformerConfig.from_dict(cfg), seed=0, device="cuda")
        srcs = common.decode_batches(spec["decode_sentences"], cfg["vocab_size"], 1)
        times, outs = {"kernel": [], "primitives": []}, {}
        try:
            for _ in range(6):
                for label, m_max in (("kernel", kernel_max), ("primitives", 0)):
                    cuda_kernels.TOP_M_MAX = m_max
                    sync()
                    t0 = time.perf_counter()
                    outs[label] = [search.beam_search(model, s, beam=4, max_len_a=0)
                                   for s in srcs]
                    sync()
                    times[label].append(time.perf_counter() - t0)
        finally:
            cuda_kernels.TOP_M_MAX = kernel_max
        med = {k: sorted(v[1:])[2] for k, v in times.items()}
        same = sum(a == b for x, y in zip(outs["kernel"], outs["primitives"])
                   for a, b in zip(x, y))
        n = sum(len(x) for x in outs["kernel"])
        print(f"{name}: beam 4 over {n} sentences, median of 5: with the kernel "
              f"{med['kernel']:.3f} s, without {med['primitives']:.3f} s -> "
              f"{med['primitives'] / med['kernel']:.2f}x; identical translations {same}/{n}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny", "base-lite", "base"])
