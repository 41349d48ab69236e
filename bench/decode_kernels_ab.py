"""GPU decoding with and without the decoding step's kernels, in one process, interleaved.

    python bench/decode_kernels_ab.py [CONFIG ...]    (default: tiny base-lite base; needs CuPy
                                                      and a GPU)

Times greedy and beam 4 over the bench's decoding sentences (bench.py's, as its decoding rows:
untrained weights, maximum output length = source length) with a step's attention in
``cuda_kernels.decode_attention``, each post-norm sub-layer's end in
``bias_residual_layer_norm`` and the first feed-forward bias and ReLU in ``bias_relu_``, and
without them (``DECODE_STEP_KERNELS = False``: the CuPy calls they replaced, the other fused
kernels on), alternating the two six times (the first pair a warm-up), and says whether the
two give the same translations.
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

    def decode(model, srcs, kind, on):
        cuda_kernels.DECODE_STEP_KERNELS = on
        if kind == "greedy":
            return [search.greedy_search(model, s, max_len_a=0) for s in srcs]
        return [search.beam_search(model, s, beam=4, max_len_a=0) for s in srcs]

    for name, model, srcs in common.gpu_decoding_models(configs):
        for kind in ("greedy", "beam 4"):
            try:
                med, outs = common.interleaved(
                    {on: functools.partial(decode, model, srcs, kind, on)
                     for on in (True, False)}, sync)
            finally:
                cuda_kernels.DECODE_STEP_KERNELS = True
            print(common.ab_line(name, f"{kind} (the step kernels)", med, outs, True, False),
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiny", "base-lite", "base"])
