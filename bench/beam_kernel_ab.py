"""Beam search on a GPU with and without its candidate kernel, in one process, interleaved.

    python bench/beam_kernel_ab.py [CONFIG ...]      (default: tiny base-lite base; needs CuPy
                                                      and a GPU)

Times beam 4 over the bench's decoding sentences (bench.py's, as its decoding rows: untrained
weights, maximum output length = source length) with ``cuda_kernels.top_m_log_softmax``
choosing each step's candidates, and with the CuPy route it replaced (``TOP_M_MAX = 0`` makes
search.py fall back to selection.top_m and log_softmax_at), alternating the two six times
(the first pair a warm-up), and says whether the two give the same translations.
"""
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402
from minitransformer import backend  # noqa: E402
from minitransformer.engine import cuda_kernels  # noqa: E402
from minitransformer.mt import search  # noqa: E402


def main(configs):
    sync = backend.get_xp("cuda").cuda.Device().synchronize
    kernel_max = cuda_kernels.TOP_M_MAX

    def beam(model, srcs, m_max):
        cuda_kernels.TOP_M_MAX = m_max
        return [search.beam_search(model, s, beam=4, max_len_a=0) for s in srcs]

    for name, model, srcs in common.gpu_decoding_models(configs):
        try:
            med, outs = common.interleaved(
                {"kernel": functools.partial(beam, model, srcs, kernel_max),
                 "primitives": functools.partial(beam, model, srcs, 0)}, sync)
        finally:
            cuda_kernels.TOP_M_MAX = kernel_max
        print(common.ab_line(name, "beam 4 (the candidate kernel)", med, outs, "kernel",
                             "primitives"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny", "base-lite", "base"])
