"""The project's lint configuration (pyproject.toml, [tool.ruff]) holds for the whole tree, so
the habits it encodes are checked on every CI run, not just written down."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, ("ruff check (pyproject.toml's rules) failed; run `ruff check "
                                 "--fix` or fix by hand:\n"
                                 + res.stdout[-4000:] + res.stderr[-2000:])


def test_the_public_api_has_type_hints():
    import inspect
    import typing

    import minitransformer as mt
    from minitransformer.mt.search import beam_search, greedy_search
    from minitransformer.nn.transformer import Transformer
    public = [mt.Tensor.__init__, mt.Tensor.backward, mt.Tensor.numpy, mt.Tensor.item,
              mt.Function.apply, mt.gradcheck, mt.optim.Adam.__init__, mt.optim.Adam.step,
              mt.optim.Adam.zero_grad, Transformer.__init__, Transformer.encode,
              Transformer.decode, Transformer.loss, Transformer.logits,
              Transformer.start_decoding, Transformer.next_scores, greedy_search, beam_search]
    for fn in public:
        hints = typing.get_type_hints(fn)  # every annotation resolves
        params = [n for n, p in inspect.signature(fn).parameters.items()
                  if n not in ("self", "cls")]
        missing = [n for n in params + ["return"] if n not in hints]
        assert not missing, f"{fn.__qualname__}: no type hint for {missing}"
