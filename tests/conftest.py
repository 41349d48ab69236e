"""Shared fixtures: the array backend under test and helpers to build arrays on it.

``xp`` runs a test once per backend: NumPy, and CuPy (marked ``gpu``). Every test marked
``gpu`` runs the package's GPU code path: on CuPy and a real GPU where there is one, else
on the CUDA-on-CPU stand-in (tests/cuda_on_cpu: the CUDA kernels compiled for the host, a
CuPy that keeps CuPy's rules), so CI executes it. Where neither can run (no C++ compiler)
the test is skipped with the reason.
"""
import os

import minitransformer

minitransformer.configure_process()  # the process the command lines run in (BLAS, malloc, TF32)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minitransformer import Tensor, backend  # noqa: E402

REAL_GPU = backend.cupy_available()  # before any test puts the stand-in in place


def gpu_unavailable():
    """None when the GPU path can run here (a real GPU, or the stand-in), else why not."""
    if REAL_GPU:
        return None
    from cuda_on_cpu import kernels
    return kernels.compiler_missing()


def small_corpus(run_dir, n_train=1500, n_valid=40):
    """The synthetic corpus train.py would generate in ``run_dir``/data, with a short
    validation set: on the CPU harness a GPU run's validation costs as much as its updates."""
    from minitransformer.mt.synthetic import write_corpus
    write_corpus(os.path.join(run_dir, "data"), seed=1234, n_train=n_train, n_valid=n_valid,
                 n_test=10)
    return str(run_dir)


def synthetic_tokenizer(directory, n_valid, seed=7):
    """A 100-piece sentencepiece model trained in ``directory`` on a small synthetic corpus
    (300 training pairs) -> (Tokenizer, the corpus as ``synthetic.generate`` returns it)."""
    from minitransformer.mt.synthetic import generate
    from minitransformer.mt.tokenizer import Tokenizer, train_sentencepiece
    corpus = generate(n_train=300, n_valid=n_valid, n_test=1, seed=seed)
    text = directory / "train.txt"
    text.write_text("".join(s + "\n" for s in corpus["train"][0] + corpus["train"][1]),
                    encoding="utf-8")
    return Tokenizer(train_sentencepiece([str(text)], str(directory / "spm"), 100)), corpus


def sigint_as_a_terminal_gives_it():
    """preexec_fn for a child that a test stops with SIGINT as Ctrl-C would: its SIGINT at the
    default disposition and unblocked, as a shell in a terminal starts a program. A child
    inherits an ignored or blocked SIGINT from the test process, and Python then installs no
    KeyboardInterrupt handler; a shell starts a background job (`.ci/run &`, `nohup ... &`)
    with SIGINT ignored, so in a test run started that way the Ctrl-C tests' children
    ignored the Ctrl-C (translate.py read EOF and exited 0; the explorer never stopped)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def sigint_state():
    """This process's SIGINT handler and whether it is blocked, for an assertion message."""
    import signal
    return (f"SIGINT in the test process: handler {signal.getsignal(signal.SIGINT)!r}, "
            f"blocked {signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}")


def untrained_run(path, tok, **config):
    """A run directory translate.py can load at ``path`` (created): ``tok``'s spm.model and
    checkpoint_last.npz of an untrained 1-layer model (d_model 16; ``config`` overrides
    TransformerConfig fields) -> the model, in eval mode."""
    from minitransformer.mt import checkpoint as ckpt
    from minitransformer.nn.transformer import Transformer, TransformerConfig
    cfg = TransformerConfig(**{**dict(vocab_size=tok.vocab_size, d_model=16, n_heads=2,
                                      d_ff=32, n_layers=1, pad_id=tok.pad_id,
                                      bos_id=tok.bos_id, eos_id=tok.eos_id), **config})
    model = Transformer(cfg, seed=3)
    path.mkdir()
    (path / "spm.model").write_bytes(open(tok.model_path, "rb").read())
    ckpt.save_checkpoint(str(path / "checkpoint_last.npz"), model, None,
                         {"spm_sha256": ckpt.file_sha256(str(path / "spm.model"))})
    model.eval()
    return model


@pytest.fixture(autouse=True)
def _gpu_path(request):
    """For a test marked ``gpu`` without a real GPU: CuPy is the stand-in during the test."""
    if request.node.get_closest_marker("gpu") is None or REAL_GPU:
        yield
        return
    reason = gpu_unavailable()
    if reason:
        pytest.skip(reason)
    from cuda_on_cpu import fake_cupy
    undo = fake_cupy.install()
    try:
        yield
    finally:
        undo()


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module under test: numpy, or cupy (a real GPU's or the stand-in)."""
    if request.param == "numpy":
        return np
    return backend.get_xp("cuda")


class Arrays:
    """Seeded arrays on one backend: ``arrays.randn(2, 3)``, ``arrays.asarray(a)``.

    Values are drawn on the host with NumPy (so both backends see the same numbers) and
    moved to the backend; ``numpy(a)`` brings any array or Tensor back.
    """

    def __init__(self, xp, seed=0):
        self.xp = xp
        self.rng = np.random.default_rng(seed)

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def randn(self, *shape, dtype=np.float64):
        return self.asarray(self.rng.standard_normal(shape).astype(dtype))

    def uniform(self, low, high, *shape, dtype=np.float64):
        return self.asarray(self.rng.uniform(low, high, shape).astype(dtype))

    def integers(self, low, high, *shape):
        return self.asarray(self.rng.integers(low, high, shape))

    @staticmethod
    def numpy(a):
        return backend.to_numpy(a.data if isinstance(a, Tensor) else a)


@pytest.fixture
def arrays(xp):
    """An :class:`Arrays` on the backend of ``xp`` (same seed for every test)."""
    return Arrays(xp)


def _assert_close(actual, expected, rtol, atol, what=""):
    """assert_allclose that also says where the largest difference is."""
    actual = Arrays.numpy(actual).astype(np.float64)
    expected = Arrays.numpy(expected).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.size == 0:
        return
    diff = np.abs(actual - expected)
    bad = ~(diff <= atol + rtol * np.abs(expected))  # NaN counts as a mismatch
    if bad.any():
        rel = diff / np.maximum(np.abs(expected), 1e-300)
        where = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(rel, nan=np.inf), -1.0)),
                                 diff.shape)
        pytest.fail(f"{what}: {int(bad.sum())} of {diff.size} elements differ "
                    f"(rtol={rtol}, atol={atol}); max abs {np.nanmax(diff):.3e}, "
                    f"max rel {np.nanmax(rel):.3e}; worst at {tuple(map(int, where))}: "
                    f"got {actual[where]!r}, expected {expected[where]!r}; "
                    f"NaN in result: {bool(np.isnan(actual).any())}")


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, rtol, atol, what)``; reports max abs/rel and where."""
    return _assert_close
