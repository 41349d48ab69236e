"""mt/step.py: the one training update that train.py and the benchmark share."""
import numpy as np
import pytest

from minitransformer.mt.step import train_step
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam, DynamicLossScaler
from minitransformer.optim import adam as adam_module

CFG = TransformerConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout=0.0)


def _batches():
    rng = np.random.default_rng(7)
    out = []
    for B, S, T in ((3, 7, 6), (2, 4, 9)):  # different sizes: different token counts
        src, tgt = rng.integers(4, 40, (B, S)), rng.integers(4, 40, (B, T))
        src[0, S - 2:], tgt[-1, T - 3:] = 0, 0
        tgt_in = np.concatenate([np.full((B, 1), 2), tgt[:, :-1]], 1)
        tgt_in[-1, T - 2:] = 0
        out.append(dict(src=src, tgt_in=tgt_in, tgt_out=tgt))
    return out


def _model():
    return Transformer(CFG, seed=0, dtype=np.float64)


@pytest.fixture
def seen_gradients(monkeypatch):
    """The gradients Adam.step is handed, per parameter."""
    seen = []
    step = adam_module.Adam.step

    def recording(self):
        seen.append([p.grad.copy() for p in self.params])
        return step(self)
    monkeypatch.setattr(adam_module.Adam, "step", recording)
    return seen


def test_the_summed_gradient_is_divided_by_all_tokens(seen_gradients):
    model = _model()
    optim = Adam(model.parameters(), flat=False)
    result = train_step(model, optim, iter(_batches()), lr=1e-3)
    # the reference: backward of (L_1 + L_2) / (n_1 + n_2) on a fresh copy
    ref = _model()
    losses = [ref.loss(b["src"], b["tgt_in"], b["tgt_out"]) for b in _batches()]
    n = sum(k for _, k in losses)
    ((losses[0][0] + losses[1][0]) * (1.0 / n)).backward()
    assert result.applied and result.tokens == n
    assert result.loss_sum == pytest.approx(sum(float(loss.data) for loss, _ in losses), rel=1e-14)
    for g, p in zip(seen_gradients[0], ref.parameters()):
        np.testing.assert_allclose(g, p.grad, rtol=1e-12, atol=1e-15)
    assert all(float(np.abs(p.grad).max()) == 0 if p.grad is not None else True
               for p in model.parameters())  # zeroed for the next update
    assert optim.lr == 1e-3 and optim.t == 1


def test_clipping_bounds_the_applied_gradient(seen_gradients):
    for clip in (0.0, 0.05):
        model = _model()
        train_step(model, Adam(model.parameters()), _batches(), lr=1e-3, clip_norm=clip)
    raw, norm = (np.sqrt(sum(float((g ** 2).sum()) for g in grads)) for grads in seen_gradients)
    assert raw > 0.5
    assert 0.05 * (1 - 1e-4) < norm <= 0.05  # (clip_grad_norm divides by norm + 1e-6)


def test_an_overflowing_update_is_skipped_and_drops_its_gradients(seen_gradients):
    model = _model()
    before = {k: v.copy() for k, v in model.state_dict().items()}
    optim = Adam(model.parameters())
    scaler = DynamicLossScaler(init_scale=1e308)  # S * dL overflows float64
    result = train_step(model, optim, _batches(), lr=1e-3, scaler=scaler)
    assert not result.applied and result.tokens > 0 and seen_gradients == []
    assert scaler.scale < 1e308 and optim.t == 0
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    assert all(p.grad is None or float(np.abs(p.grad).max()) == 0 for p in model.parameters())
    # the next update, at a sane scale, goes through
    scaler.scale = 128.0
    assert train_step(model, optim, _batches(), lr=1e-3, scaler=scaler).applied


@pytest.mark.parametrize("flat", [False, True])
def test_a_non_finite_gradient_never_reaches_the_parameters(flat):
    """float32 (no scaler): a gradient holding a NaN skips the update, whole: parameters,
    Adam's moments and step count unchanged, gradients dropped."""
    model = _model()
    optim = Adam(model.parameters(), flat=flat)
    before = [p.data.copy() for p in model.parameters()]
    emb = model.parameters()[0]
    saved = emb.data[5].copy()
    emb.data[5] = np.nan  # a poisoned embedding row: its tokens give NaN losses and gradients
    batches = _batches()
    batches[0]["src"][0, 0] = 5
    result = train_step(model, optim, iter(batches), lr=1e-3)
    emb.data[5] = saved
    assert not result.applied and optim.t == 0
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)
        assert p.grad is None or not np.any(p.grad)
    moments = (optim.flat[2:] if flat else optim.m + optim.v)
    assert all(not np.any(m) for m in moments)


def test_a_non_finite_loss_alone_skips_the_update(monkeypatch):
    """A loss that is not finite skips the update even when the gradients look finite."""
    model = _model()
    optim = Adam(model.parameters(), flat=False)
    loss_of = Transformer.loss

    def infinite_loss(self, *args):
        loss, n = loss_of(self, *args)
        loss.data = loss.data * np.inf
        return loss, n
    monkeypatch.setattr(Transformer, "loss", infinite_loss)
    before = [p.data.copy() for p in model.parameters()]
    assert not train_step(model, optim, iter(_batches()), lr=1e-3).applied
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)
