"""Adam against hand computation, the paper's learning-rate schedule, gradient clipping."""
import math

import numpy as np
import pytest

from minitransformer import Tensor
from minitransformer.optim import Adam, clip_grad_norm, linear_decay_lr, noam_lr

THETA0 = [0.5, -1.0, 2.0, 0.25]
GRADS = [[0.5, -2.0, 1e-3, 0.0],   # step 1 (a zero gradient: no move at all)
         [0.1, 1.0, -3.0, 0.0],
         [-0.4, 0.5, 0.2, 1.0]]
LRS = [0.1, 0.05, 0.2]             # a schedule sets lr before every step


def adam_by_hand(theta, grads, lrs, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0):
    """Adam with bias correction on Python floats, one coordinate at a time."""
    theta, m, v, out = list(theta), [0.0] * len(theta), [0.0] * len(theta), []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        for i in range(len(theta)):
            gi = g[i] + weight_decay * theta[i]
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            theta[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
        out.append(list(theta))
    return out


def run_adam(dtype, grads=GRADS, lrs=LRS, **kw):
    p = Tensor(np.array(THETA0, dtype=dtype), requires_grad=True)
    opt = Adam([p], **kw)
    out = []
    for g, lr in zip(grads, lrs):
        p.grad = np.array(g, dtype=dtype)
        opt.lr = lr
        opt.step()
        out.append(p.numpy().copy())
    return out, p, opt


def test_adam_defaults_are_the_papers():
    opt = Adam([Tensor(np.zeros(2), requires_grad=True)])
    assert (opt.beta1, opt.beta2, opt.eps) == (0.9, 0.98, 1e-9)


def test_adam_first_step_is_lr_times_sign():
    """After bias correction, step 1 moves every coordinate by lr * g / (|g| + eps)."""
    steps, _, _ = run_adam(np.float64, GRADS[:1], LRS[:1])
    expected = [th - 0.1 * g / (abs(g) + 1e-9) for th, g in zip(THETA0, GRADS[0])]
    assert expected[3] == THETA0[3]
    np.testing.assert_allclose(steps[0], expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-14), (np.float32, 2e-6)])
def test_adam_three_steps_match_hand_computation(dtype, rtol):
    steps, p, opt = run_adam(dtype)
    for t, (got, expected) in enumerate(zip(steps, adam_by_hand(THETA0, GRADS, LRS)), start=1):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=0, err_msg=f"step {t}")
    assert p.dtype == dtype and opt.m[0].dtype == dtype and opt.v[0].dtype == dtype
    assert opt.t == 3


def test_adam_weight_decay_and_custom_betas():
    kw = dict(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    steps, _, _ = run_adam(np.float64, **kw)
    expected = adam_by_hand(THETA0, GRADS, LRS, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.01)
    np.testing.assert_allclose(steps, expected, rtol=1e-14, atol=0)


def test_adam_skips_parameters_without_gradient():
    a, b = (Tensor(np.ones(2), requires_grad=True) for _ in range(2))
    opt = Adam([a, b], lr=0.1)
    a.grad = np.array([1.0, -1.0])
    opt.step()
    assert (b.numpy() == 1).all() and (opt.m[1] == 0).all()
    assert not (a.numpy() == 1).any()


def _flat_case(seed=0):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 4), (7,), (2, 2, 3))]
    grads = [[rng.standard_normal(a.shape).astype(np.float32) for a in init] for _ in range(4)]
    return init, grads


@pytest.mark.parametrize("chunk", [1 << 20, 5])
def test_flat_adam_equals_per_parameter_adam_bit_for_bit(monkeypatch, chunk):
    """flat=True: parameters, gradients, m and v are views of four buffers and one update
    runs over each (in chunks of FLAT_CHUNK elements); the result is the per-parameter one."""
    import minitransformer.optim.adam as adam_mod
    monkeypatch.setattr(adam_mod, "FLAT_CHUNK", chunk)
    init, grads = _flat_case()
    runs = []
    for flat in (False, True):
        params = [Tensor(a.copy(), requires_grad=True) for a in init]
        opt = Adam(params, lr=1e-2, weight_decay=0.01, flat=flat)
        assert (opt.flat is not None) == flat
        for g in grads:
            opt.zero_grad()
            for p, gi in zip(params, g):
                if flat:  # backward adds into the zeroed views of the flat buffer
                    assert p.grad is not None and not p.grad.any()
                    p.grad += gi
                else:
                    p.grad = gi.copy()
            opt.step()
        runs.append((params, opt))
    (ref, opt_ref), (flat, opt_flat) = runs
    for a, b, m1, m2 in zip(ref, flat, opt_ref.m, opt_flat.m):
        assert np.array_equal(a.data, b.data) and np.array_equal(m1, m2)
    assert np.shares_memory(flat[1].data, opt_flat.flat[0])  # the parameter is a view


def test_flat_adam_backward_lands_in_the_buffer_and_replaced_arrays_fall_back():
    init, grads = _flat_case(1)
    params = [Tensor(a.copy(), requires_grad=True) for a in init]
    opt = Adam(params, lr=1e-2, flat=True)
    (params[0] * Tensor(grads[0][0])).sum().backward()  # d/dp0 = grads[0][0]
    assert np.array_equal(opt.flat[1][:12], grads[0][0].ravel())
    assert not opt.flat[1][12:].any()  # the other parameters got no gradient
    # an array assigned over a view: step notices and updates parameter by parameter
    ref = [Tensor(a.copy(), requires_grad=True) for a in init]
    opt_ref = Adam(ref, lr=1e-2, flat=False)
    for p, q, g in zip(params, ref, grads[1]):
        p.grad, q.grad = g.copy(), g.copy()
    params[2].data = params[2].data.copy()
    opt.step()
    opt_ref.step()
    for a, b in zip(params, ref):
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("flat", [False, True])
def test_a_gradient_computed_before_the_optimizer_is_made_is_stepped(flat):
    """backward, then Adam(...), then step (the README's engine example): the flat buffers
    take the gradients the parameters already have (they were zeroed: no step at all)."""
    init, grads = _flat_case(2)
    params = [Tensor(a.copy(), requires_grad=True) for a in init]
    (params[0] * Tensor(grads[0][0])).sum().backward()
    (params[2] * Tensor(grads[0][2])).sum().backward()
    opt = Adam(params, lr=0.1, flat=flat)
    assert np.array_equal(params[0].grad, grads[0][0])
    opt.step()
    expect = init[0] - np.float32(0.1) * np.sign(grads[0][0])  # Adam's first step: lr * sign
    assert np.allclose(params[0].data, expect, rtol=1e-5)
    assert np.allclose(params[2].data, init[2] - np.float32(0.1) * np.sign(grads[0][2]),
                       rtol=1e-5)
    assert np.array_equal(params[1].data, init[1])  # no gradient: not moved


def test_a_parameter_given_twice_is_refused():
    p = Tensor(np.zeros(2), requires_grad=True)
    with pytest.raises(ValueError, match="parameter 2 is parameter 0 again"):
        Adam([p, Tensor(np.ones(2), requires_grad=True), p])


def test_flat_grad_is_the_buffer_only_while_every_gradient_is_a_view_of_it():
    init, grads = _flat_case(3)
    params = [Tensor(a.copy(), requires_grad=True) for a in init]
    opt = Adam(params, lr=1e-2, flat=True)
    flat = opt.flat_grad()
    assert flat is opt.flat[1] and flat.size == sum(a.size for a in init)
    flat *= 0.0  # scaling the buffer scales every p.grad
    assert len(opt.gradients()) == 1 and opt.gradients()[0] is flat
    params[1].grad = grads[0][1].copy()  # replaced (as the all-reduce does): no buffer
    assert opt.flat_grad() is None
    assert [g is p.grad for g, p in zip(opt.gradients(), params)] == [True] * len(params)
    opt.zero_grad()
    assert opt.flat_grad() is flat
    assert Adam([Tensor(a.copy(), requires_grad=True) for a in init], flat=False).flat_grad() \
        is None


def test_flat_adam_state_and_model_loading_keep_the_views():
    init, grads = _flat_case(2)
    params = [Tensor(a.copy(), requires_grad=True) for a in init]
    opt = Adam(params, lr=1e-2, flat=True)
    for p, g in zip(params, grads[0]):
        p.grad += g
    opt.step()
    state = opt.state_dict()
    params2 = [Tensor(np.zeros_like(a), requires_grad=True) for a in init]
    opt2 = Adam(params2, lr=0.0, flat=True)
    opt2.load_state_dict(state)
    for m1, m2 in zip(opt.m, opt2.m):
        assert np.array_equal(m1, m2)
    assert np.array_equal(opt2.flat[2], opt.flat[2])  # loaded into the flat m buffer itself
    assert opt2._flat_intact()


def test_adam_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 2), (4,))]
    grads = [[rng.standard_normal(a.shape).astype(np.float32) for a in init] for _ in range(5)]

    def steps(params, opt, gs, lr):
        for g in gs:
            for p, gi in zip(params, g):
                p.grad = gi.copy()
            opt.lr = lr
            opt.step()

    params = [Tensor(a.copy(), requires_grad=True) for a in init]
    opt = Adam(params, lr=1e-2)
    steps(params, opt, grads[:2], 1e-2)
    saved_params = [p.numpy().copy() for p in params]
    state = opt.state_dict()
    steps(params, opt, grads[2:], 3e-3)  # the original run goes on after the snapshot

    resumed = [Tensor(a, requires_grad=True) for a in saved_params]
    opt2 = Adam(resumed, lr=123.0)
    opt2.load_state_dict(state)
    assert opt2.t == 2 and opt2.lr == 1e-2
    steps(resumed, opt2, grads[2:], 3e-3)
    for i, (a, b) in enumerate(zip(params, resumed)):
        assert a.dtype == b.dtype == np.float32
        assert (a.numpy() == b.numpy()).all(), f"parameter {i}: max diff " \
            f"{np.abs(a.numpy() - b.numpy()).max():.3e} after resuming"
    with pytest.raises(ValueError, match="belongs to another model"):
        Adam([Tensor(np.zeros((2, 3)), requires_grad=True),
              Tensor(np.zeros(4), requires_grad=True)]).load_state_dict(state)


# ---- the schedule (§5.3) ------------------------------------------------------------------------
def test_noam_lr_formula_and_shape():
    d, w = 512, 4000
    for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
        assert noam_lr(step, d, w) == pytest.approx(d ** -0.5 * min(step ** -0.5,
                                                                    step * w ** -1.5), rel=1e-15)
    peak = noam_lr(w, d, w)
    assert peak == pytest.approx(1 / math.sqrt(512 * 4000), rel=1e-15)  # 6.99e-4
    assert peak == pytest.approx(6.987712429686844e-4, rel=1e-12)
    steps = np.arange(1, 20_000)
    lrs = np.array([noam_lr(s, d, w) for s in steps])
    assert steps[lrs.argmax()] == w, "the peak is at step == warmup"
    # linear rise: lr(s) = s * lr(1) up to the warm-up
    np.testing.assert_allclose(lrs[:w], steps[:w] * lrs[0], rtol=1e-12)
    # inverse square-root decay after it: four times the steps, half the rate
    for s in (4000, 5000, 12_345):
        assert noam_lr(4 * s, d, w) == pytest.approx(noam_lr(s, d, w) / 2, rel=1e-12)
    assert noam_lr(100, d, w, factor=2.0) == pytest.approx(2 * noam_lr(100, d, w), rel=1e-15)
    assert noam_lr(0, d, w) == noam_lr(1, d, w)  # step 0 is read as step 1, never 0 / inf


def test_linear_decay_lr_warms_up_like_noam_then_falls_to_zero():
    d, w, total = 256, 500, 3000
    for step in (1, 100, 499, 500):
        assert linear_decay_lr(step, d, w, total) == noam_lr(step, d, w)
    peak = noam_lr(w, d, w, factor=0.7)
    # a straight line from the peak at the warm-up to 0 at total, and 0 after it
    for step in (501, 1000, 1750, 2999, 3000, 3500):
        expected = peak * max(total - step, 0) / (total - w)
        assert linear_decay_lr(step, d, w, total, factor=0.7) == pytest.approx(expected, rel=1e-12,
                                                                               abs=0)
    assert linear_decay_lr(1750, d, w, total) == pytest.approx(noam_lr(w, d, w) / 2, rel=1e-12)
    assert linear_decay_lr(total, d, w, total) == 0.0


# ---- gradient clipping --------------------------------------------------------------------------
def _params_with_grads(*grads, dtype=np.float64):
    ps = []
    for g in grads:
        p = Tensor(np.zeros(np.shape(g), dtype=dtype), requires_grad=True)
        p.grad = np.array(g, dtype=dtype)
        ps.append(p)
    return ps


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip_grad_norm_scales_to_max_norm(dtype):
    ps = _params_with_grads([[3.0, 0.0], [0.0, 4.0]], [12.0], dtype=dtype)  # norm 13
    before = [p.grad.copy() for p in ps]
    norm = clip_grad_norm(ps, 1.3)
    assert norm == pytest.approx(13.0, rel=1e-7)
    after = math.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum()) for p in ps))
    assert after == pytest.approx(1.3, rel=1e-6)
    for p, g in zip(ps, before):
        assert p.grad.dtype == dtype
        np.testing.assert_allclose(p.grad, g * (1.3 / 13.0), rtol=1e-6)  # same direction


def test_clip_grad_norm_of_the_flat_buffer_clips_every_gradient():
    # train.py hands over Adam's flat gradient buffer: one array, the same norm and clipping
    ps = [Tensor(np.zeros(s), requires_grad=True) for s in ((2, 2), (1,))]
    opt = Adam(ps, flat=True)
    ps[0].grad += np.array([[3.0, 0.0], [0.0, 4.0]])
    ps[1].grad += 12.0
    assert clip_grad_norm(ps, 1.3, grads=[opt.flat_grad()]) == pytest.approx(13.0, rel=1e-15)
    np.testing.assert_allclose(ps[0].grad, [[0.3, 0.0], [0.0, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(ps[1].grad, [1.2], rtol=1e-6)


def test_clip_grad_norm_leaves_small_gradients_and_measures():
    ps = _params_with_grads([3.0, 4.0])
    assert clip_grad_norm(ps, 10.0) == pytest.approx(5.0, rel=1e-15)
    assert (ps[0].grad == [3.0, 4.0]).all()
    assert clip_grad_norm(ps, 0.0) == pytest.approx(5.0, rel=1e-15)  # <= 0: only measure
    assert (ps[0].grad == [3.0, 4.0]).all()
    none = Tensor(np.zeros(2), requires_grad=True)
    assert clip_grad_norm([none], 1.0) == 0.0
    assert clip_grad_norm(ps + [none], 1.0) == pytest.approx(5.0, rel=1e-15)  # grad None ignored


def test_loading_a_model_writes_into_the_flat_buffer():
    from minitransformer.nn.module import Linear
    model = Linear(3, 4, rng=np.random.default_rng(0))
    other = Linear(3, 4, rng=np.random.default_rng(1))
    opt = Adam(model.parameters(), flat=True)
    model.load_state_dict(other.state_dict())
    assert opt._flat_intact()  # the flat update still reaches the model's parameters
    assert np.array_equal(model.weight.data, other.weight.data)
    assert np.array_equal(opt.flat[0][:12], other.weight.data.ravel())
