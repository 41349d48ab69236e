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
