"""The whole model on a GPU: CuPy against NumPy, float16 against float32, train.py in float16.

Marked ``gpu``: on a real GPU, or else on the CUDA-on-CPU stand-in (tests/cuda_on_cpu). On a
GPU the float32 products use TF32 (10-bit significands, minitransformer.backend sets
CUPY_TF32=1 unless the environment says otherwise), so CuPy and NumPy agree to about 1e-3,
not to float32 rounding; the stand-in's products are NumPy's.
"""
import json
import os

import numpy as np
import pytest

from minitransformer import backend
from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import train as train_cli
from minitransformer.nn.transformer import Transformer, TransformerConfig

from conftest import small_corpus
from test_cli import SMALL
from test_mixed_precision import _batch

DEVICE = "cuda"
pytestmark = pytest.mark.gpu
TF32_RTOL = 5e-3


def _loss_and_grads(device, compute_dtype=None):
    cfg = TransformerConfig(vocab_size=60, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)  # (the two devices draw different dropout masks)
    model = Transformer(cfg, seed=0, device=device, compute_dtype=compute_dtype)
    loss, n = model.loss(*_batch())
    loss.backward(64.0)
    grads = {k: backend.to_numpy(p.grad) / 64.0 for k, p in model.named_parameters()}
    return float(loss.data), grads


def _close(a, b, rtol):
    diff = np.sqrt(sum(np.sum((a[k] - g) ** 2) for k, g in b.items()))
    norm = np.sqrt(sum(np.sum(g ** 2) for g in b.values()))
    return diff <= rtol * norm, f"gradients differ by {diff:.3e}, norm {norm:.3e}"


def test_cupy_model_matches_numpy():
    loss_np, g_np = _loss_and_grads("cpu")
    loss_gpu, g_gpu = _loss_and_grads(DEVICE)
    assert abs(loss_gpu - loss_np) <= TF32_RTOL * loss_np, (loss_gpu, loss_np)
    ok, msg = _close(g_gpu, g_np, TF32_RTOL)
    assert ok, msg


def test_float16_model_on_the_gpu_matches_float32():
    loss32, g32 = _loss_and_grads(DEVICE)
    loss16, g16 = _loss_and_grads(DEVICE, np.float16)
    assert abs(loss16 - loss32) <= 5e-3 * loss32, (loss16, loss32)
    ok, msg = _close(g16, g32, 2e-2)
    assert ok, msg


def test_train_py_float16_on_the_gpu(tmp_path):
    run = small_corpus(tmp_path / "r")  # a short validation set, small batches: on the
    # CPU harness each CUDA thread of a kernel is a fiber
    assert train_cli.main(SMALL + ["--run-dir", run, "--device", DEVICE, "--precision", "float16",
                                   "--max-updates", "40", "--valid-every", "40",
                                   "--max-tokens", "200", "--valid-bleu-sentences", "8"]) == 0
    params, _, meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))
    assert meta["update"] == 40 and "loss_scale" in meta
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in params.values())
    losses = [json.loads(line)["loss"] for line in open(os.path.join(run, "metrics.jsonl"))
              if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.5, losses


def test_host_and_device_targets_give_the_same_loss():
    # train.py hands the model NumPy batches: the targets are checked on the host, then copied
    cfg = TransformerConfig(vocab_size=60, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)
    model = Transformer(cfg, seed=0, device=DEVICE)
    src, tgt_in, tgt_out = _batch()
    xp = model.xp()
    loss_host, n_host = model.loss(src, tgt_in, tgt_out)
    loss_dev, n_dev = model.loss(xp.asarray(src), xp.asarray(tgt_in), xp.asarray(tgt_out))
    assert n_host == n_dev == int((np.asarray(tgt_out) != cfg.pad_id).sum())
    assert float(loss_host.data) == float(loss_dev.data)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.loss(src, tgt_in, np.where(np.asarray(tgt_out) > 0, 60, 0))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_decoding_steps_with_the_attention_kernel_match_forward(dtype, monkeypatch):
    """On the device a decoding step's attention is cuda_kernels.decode_attention (the cache's
    append, attention and merge_heads in one kernel): its scores equal, to the summation
    order, those of the same step without it (fused kernels off) and of the decoder's
    forward with its cache (the uncached route), through greedy rows, three beams a
    sentence with reordered histories, a sentence gone, and a cache grown past its first
    capacity; greedy and beam search give the same outputs either way."""
    from minitransformer.engine import cuda_kernels
    from minitransformer.nn.decoder_state import SelfCache
    from minitransformer.settings import SETTINGS
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)
    model = Transformer(cfg, seed=5, device=DEVICE, dtype=dtype)
    model.eval()
    rng = np.random.default_rng(3)
    src = rng.integers(4, 40, (3, 7))
    src[1, 4:] = 0  # padding: the source mask's bias reaches the kernel
    history = rng.integers(4, 40, (3, 5))
    history[:, 0] = cfg.bos_id
    nxt = rng.integers(4, 40, (6, 2))
    calls = []
    real = cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(SelfCache, "BUFFER_BYTES", 2 * 32 * 4 * dtype().itemsize)  # cap 2

    def run(fused):
        monkeypatch.setattr(SETTINGS, "fused", fused)
        state = model.start_decoding(src)
        out = []
        for t in range(history.shape[1]):
            out.append(model.next_scores(history[:, t:t + 1], state))
        state.keep_sentences(np.array([2, 0]), rows=np.array([2, 2, 2, 0, 0, 0]), group=3)
        out.append(model.next_scores(nxt[:, :1], state))
        state.reorder_beams(np.array([1, 0, 0, 5, 3, 4]))
        out.append(model.next_scores(nxt[:, 1:], state))
        return [backend.to_numpy(o) for o in out]

    plain = run(False)
    assert not calls
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    monkeypatch.setattr(cuda_kernels, "DECODE_STEP_KERNELS", False)  # (decode_kernels_ab.py)
    for a, b in zip(run(True), plain):  # the other fused kernels only
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)
    assert not calls
    monkeypatch.setattr(cuda_kernels, "DECODE_STEP_KERNELS", True)
    fused = run(True)
    assert len(calls) == 2 * cfg.n_layers * 7  # self and cross, each layer, each step
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)
    memory, mask = model.encode(src)  # the first steps against forward, uncached
    whole = model.logits(model.decode(history, memory, mask)).data[:, -1]
    np.testing.assert_allclose(fused[history.shape[1] - 1], backend.to_numpy(whole),
                               rtol=rtol, atol=rtol)
    assert _searches_alike(model, src, monkeypatch, SETTINGS, "fused")


def test_a_float16_model_decodes_with_the_step_kernels(monkeypatch):
    """A model whose parameters are float16 (not mixed precision: its biases are float16
    too): the step kernels take the biases widened to float32 (exactly), and greedy and
    beam search give the outputs of the step without them (the projection biases were
    refused: float16, not the accumulation dtype)."""
    from minitransformer.engine import cuda_kernels
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)
    model = Transformer(cfg, seed=5, device=DEVICE, dtype=np.float16)
    src = np.random.default_rng(3).integers(4, 40, (3, 7))
    assert _searches_alike(model, src, monkeypatch, cuda_kernels, "DECODE_STEP_KERNELS")


def _searches_alike(model, src, monkeypatch, owner, switch):
    """Whether greedy and beam 3 give the same outputs with ``owner.switch`` on and off."""
    from minitransformer.mt.search import beam_search, greedy_search
    outputs = []
    for on in (True, False):
        monkeypatch.setattr(owner, switch, on)
        outputs.append((greedy_search(model, src, max_len_a=6),
                        beam_search(model, src, beam=3, max_len_a=6)))
    return outputs[0] == outputs[1]
