"""Mixed precision: float16 activations and products, float32 master weights, loss scaling.

On a CPU NumPy's float16 products accumulate in float16, so these tests use small shapes
where that is exact enough; the same code runs in float16 on a GPU with float32 accumulation.
"""
import json
import os

import numpy as np
import pytest

import minitransformer.functional as F
from minitransformer import Tensor
from minitransformer.engine import ops
from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import train as train_cli
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import DynamicLossScaler, LossScaleCollapse

from test_cli import SMALL


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- the Cast node -------------------------------------------------------------------------
def test_cast_converts_forward_and_back():
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    y = ops.cast(x, np.float32)
    assert y.dtype == np.float32 and np.array_equal(y.data, x.data.astype(np.float32))
    seed = rng.standard_normal((3, 4)).astype(np.float32)
    (y * Tensor(seed)).sum().backward()
    assert x.grad.dtype == np.float64  # the gradient lands in the input's dtype
    assert np.array_equal(x.grad, seed.astype(np.float64))


# ---- ops with float16 inputs: statistics in float32, outputs in float16 ------------------
def test_layer_norm_float16_matches_float32():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 40)) * 30 + 100  # a large mean: float16 sums would lose it
    g, b = rng.uniform(0.5, 1.5, 40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    dy = rng.standard_normal((6, 40))
    out = {}
    for dt in (np.float32, np.float16):
        xt, gt, bt = Tensor(x.astype(dt), requires_grad=True), Tensor(g, requires_grad=True), \
            Tensor(b, requires_grad=True)
        y = F.layer_norm(xt, gt, bt)
        y.backward(dy.astype(dt))
        out[dt] = y, xt.grad, gt.grad, bt.grad
    y16, dx16, dg16, db16 = out[np.float16]
    y32, dx32, dg32, db32 = out[np.float32]
    assert y16.dtype == np.float16 and dx16.dtype == np.float16
    assert dg16.dtype == np.float32 and db16.dtype == np.float32  # the master weights' dtype
    assert rel_err(y16.data, y32.data) < 2e-3
    assert rel_err(dx16, dx32) < 5e-3
    assert rel_err(dg16, dg32) < 5e-3 and rel_err(db16, db32) < 1e-3


def test_attention_float16_matches_float32_with_masks():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 2, 5, 8)) for _ in range(3))
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    dout = rng.standard_normal((2, 2, 5, 8))
    res = {}
    for dt in (np.float32, np.float16):
        ts = [Tensor(a.astype(dt), requires_grad=True) for a in (q, k, v)]
        o = F.scaled_dot_product_attention(*ts, key_mask=mask, causal=True)
        o.backward(dout.astype(dt))
        res[dt] = [o.data] + [t.grad for t in ts]
    for a16, a32 in zip(res[np.float16], res[np.float32]):
        assert a16.dtype == np.float16 and np.isfinite(a16).all()
        assert rel_err(a16, a32) < 5e-3


def test_linear_cross_entropy_float16_loss_in_float32_and_scale_beyond_float16():
    rng = np.random.default_rng(3)
    h, w = rng.standard_normal((4, 6, 16)) * 0.05, rng.standard_normal((50, 16)) * 0.05
    t = rng.integers(1, 50, (4, 6))
    t[0, 4:] = 0
    res = {}
    for dt in (np.float32, np.float16):
        ht, wt = Tensor(h.astype(dt), requires_grad=True), Tensor(w.astype(dt), requires_grad=True)
        loss, n = F.linear_cross_entropy(ht, wt, t, 0.1, pad_id=0)
        # a loss scale above float16's largest value (65504): the scaling runs in float32,
        # and the scaled gradients (below 65504 here) come out finite
        loss.backward(np.float32(2.0 ** 16))
        res[dt] = loss, ht.grad, wt.grad
    l16, dh16, dw16 = res[np.float16]
    l32, dh32, dw32 = res[np.float32]
    assert l16.dtype == np.float32  # the loss sum is never rounded to float16
    assert abs(float(l16.data) - float(l32.data)) < 1e-3 * float(l32.data)
    assert dh16.dtype == np.float16 and dw16.dtype == np.float16
    assert np.isfinite(dh16).all() and np.isfinite(dw16).all()
    assert rel_err(dh16, dh32) < 5e-3 and rel_err(dw16, dw32) < 5e-3


# ---- the model --------------------------------------------------------------------------
def _batch():
    rng = np.random.default_rng(4)
    src, tgt = rng.integers(4, 60, (3, 7)), rng.integers(4, 60, (3, 6))
    src[0, 5:], tgt[1, 4:] = 0, 0
    tgt_in = np.concatenate([np.full((3, 1), 2), tgt[:, :-1]], 1)
    tgt_in[1, 5:] = 0
    return src, tgt_in, tgt


def test_float16_model_keeps_float32_master_weights_and_matches_float32():
    cfg = TransformerConfig(vocab_size=60, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)
    src, tgt_in, tgt = _batch()
    S = 256.0
    res = {}
    for cd in (None, np.float16):
        model = Transformer(cfg, seed=0, compute_dtype=cd)
        loss, n = model.loss(src, tgt_in, tgt)
        loss.backward(S)
        res[cd] = model, float(loss.data)
        assert loss.dtype == np.float32
        assert model.logits(model.decode(tgt_in, *model.encode(src))).dtype == np.float32
    m16, loss16 = res[np.float16]
    m32, loss32 = res[None]
    assert abs(loss16 - loss32) < 2e-3 * loss32, (loss16, loss32)
    g32 = dict(m32.named_parameters())
    norms = []
    for name, p in m16.named_parameters():
        assert p.dtype == np.float32 and p.grad.dtype == np.float32, name
        norms.append((np.linalg.norm(p.grad - g32[name].grad), np.linalg.norm(g32[name].grad)))
    diff, ref = np.sqrt(sum(d * d for d, _ in norms)), np.sqrt(sum(r * r for _, r in norms))
    assert diff < 5e-3 * ref, (diff, ref)


# ---- the loss scaler --------------------------------------------------------------------------
def test_scaler_halves_on_overflow_and_grows_after_a_window():
    s = DynamicLossScaler(init_scale=64.0, growth_interval=3)
    s.update(False)
    assert s.scale == 32.0 and s.skipped_total == 1
    for _ in range(2):
        s.update(True)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 64.0 and s.good_steps == 0
    s.update(True)
    s.update(False)  # an overflow restarts the count
    assert s.scale == 32.0 and s.good_steps == 0
    restored = DynamicLossScaler()
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored.state_dict() == s.state_dict()


def test_scaler_unscales_in_place_and_finds_inf_and_nan():
    s = DynamicLossScaler(init_scale=8.0)
    g = [np.full((2, 3), 16.0, np.float32), None, np.arange(4, dtype=np.float32)]
    assert s.unscale_(g, multiplier=0.5)
    assert np.array_equal(g[0], np.ones((2, 3))) and np.array_equal(g[2], np.arange(4) / 16)
    for bad in (np.inf, np.nan):
        g = [np.ones(3, np.float32), np.array([1.0, bad], np.float32)]
        assert not s.unscale_(g)


def test_scaler_collapse_is_an_error_that_says_what_to_do():
    s = DynamicLossScaler(init_scale=1.0, min_scale=0.25)
    s.update(False)
    s.update(False)
    with pytest.raises(LossScaleCollapse, match=r"--precision float32") as info:
        s.update(False)
    assert "3 updates in a row" in str(info.value)
    with pytest.raises(ValueError, match="factor > 1"):
        DynamicLossScaler(factor=1.0)


# ---- train.py --------------------------------------------------------------------------------
def test_float16_on_a_cpu_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--precision float16 needs a GPU"):
        train_cli.main(SMALL + ["--run-dir", str(tmp_path / "r"), "--precision", "float16"])
    assert not os.path.exists(tmp_path / "r" / "checkpoint_last.npz")


@pytest.fixture
def float16_on_cpu(monkeypatch):
    monkeypatch.setattr(train_cli, "FLOAT16_DEVICES", ("cuda", "cpu"))


def test_float16_training_learns_and_resumes_its_loss_scale(tmp_path, float16_on_cpu, capsys):
    run = str(tmp_path / "r")
    opts = SMALL + ["--run-dir", run, "--precision", "float16", "--valid-every", "20",
                    "--loss-scale-window", "7"]
    assert train_cli.main(opts + ["--max-updates", "20"]) == 0
    params, _, meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))
    assert all(a.dtype == np.float32 for a in params.values())
    # no overflow at these sizes: 2^7 doubled after updates 7 and 14, 6 finite ones since
    assert meta["update"] == 20
    assert meta["loss_scale"] == dict(scale=512.0, good_steps=6, skipped_in_a_row=0,
                                      skipped_total=0)
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("loss_scale" in r for r in records if "loss" in r)
    assert train_cli.main(opts + ["--max-updates", "22", "--resume"]) == 0
    meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    assert meta["update"] == 22  # the resumed scaler doubles at its 7th finite update
    assert meta["loss_scale"]["scale"] == 1024.0 and meta["loss_scale"]["good_steps"] == 1


def test_overflowing_updates_are_skipped_then_the_collapse_stops_the_run(tmp_path,
                                                                        float16_on_cpu, capsys):
    """A loss scale of 1e38 overflows float16 in the first backward: each update is skipped
    (the parameters stay as they were), the scale halves, and below --min-loss-scale the run
    stops with exit code 3 and an error that names the way out; no checkpoint is written."""
    run = str(tmp_path / "r")
    code = train_cli.main(SMALL + ["--run-dir", run, "--precision", "float16", "--max-updates", "5",
                                   "--loss-scale-init", "1e38", "--min-loss-scale", "1e37"])
    assert code == 3
    out, err = capsys.readouterr()
    assert out.count("float16 gradients overflowed; update skipped") == 3, out
    assert "loss scale now 1.25e+37" in out
    assert "error: update 1:" in err and "--precision float32" in err, err
    assert not os.path.exists(os.path.join(run, "checkpoint_last.npz"))


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_train_py_scales_the_flat_gradient_buffer_as_it_scales_each_gradient(
        tmp_path, float16_on_cpu, monkeypatch, precision):
    """With Adam's flat buffers (the default on a GPU) train.py divides the gradients by the
    token count and, in float16, unscales and checks them, as one array: the same run bit
    for bit as with one array per parameter."""
    import functools
    from minitransformer.optim import Adam
    from minitransformer.optim import adam as adam_module
    seen = []
    flat_grad = adam_module.Adam.flat_grad

    def recording(self):
        seen.append(flat_grad(self))
        return seen[-1]
    monkeypatch.setattr(adam_module.Adam, "flat_grad", recording)
    params = {}
    for flat in (False, True):
        monkeypatch.setattr(train_cli, "Adam", functools.partial(Adam, flat=flat))
        run = str(tmp_path / f"r{flat}")
        assert train_cli.main(SMALL + ["--run-dir", run, "--precision", precision,
                                       "--max-updates", "6", "--valid-every", "6"]) == 0
        params[flat] = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[0]
    assert seen[:6] == [None] * 6 and all(g is not None for g in seen[6:]) and len(seen) == 12
    for name, a in params[False].items():
        assert np.array_equal(a, params[True][name]), name
