"""The tape and the engine: accumulation, broadcasting, no_grad, errors, user Functions,
and gradcheck itself (it must pass right gradients and catch wrong ones)."""
import gc
import os
import weakref

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import Function, GradcheckError, Tensor, gradcheck, no_grad
from minitransformer.engine import is_grad_enabled


def leaf(arrays, *shape):
    return Tensor(arrays.randn(*shape), requires_grad=True)


# ---- accumulation -------------------------------------------------------------------------------
def test_tensor_used_twice_accumulates(xp, arrays, assert_close):
    x = leaf(arrays, 3, 4)
    (x * x).sum().backward()
    assert_close(x.grad, 2 * x.numpy(), 0, 0, "d(x*x)/dx")
    x.zero_grad()
    (x + x).sum().backward()
    assert_close(x.grad, np.full((3, 4), 2.0), 0, 0, "d(x+x)/dx")
    # used in several places of one graph, through intermediate nodes
    x.zero_grad()
    y = x * 3.0
    ((y * y) + y.exp() - x).sum().backward()
    xn = x.numpy()
    assert_close(x.grad, 18 * xn + 3 * np.exp(3 * xn) - 1, 1e-14, 1e-14, "shared intermediate")


def test_array_on_the_left_of_a_tensor_gives_a_tensor(xp, arrays, assert_close):
    # numpy and cupy arrays defer to the Tensor's reflected operators: the result is recorded
    a, w = arrays.randn(2, 3), arrays.randn(2, 3)
    x = mt.Tensor(a, requires_grad=True)
    for y in (w * x, w + x, w - x):
        assert isinstance(y, mt.Tensor)
    (w * x).sum().backward()
    assert_close(x.grad, w, 0, 0, "d(w * x)/dx")


def test_gradients_accumulate_across_backward_calls(xp, arrays, assert_close):
    x = leaf(arrays, 2, 3)
    w = arrays.randn(2, 3)
    (x * Tensor(w)).sum().backward()  # graph 1
    (x * x).sum().backward()          # graph 2, built fresh
    assert_close(x.grad, arrays.numpy(w) + 2 * x.numpy(), 1e-15, 0,
                 "sum of the two backward passes")


def test_zero_grad(xp, arrays):
    x = leaf(arrays, 2)
    (x * x).sum().backward()
    assert x.grad is not None
    x.zero_grad()
    assert x.grad is None
    lin = mt.nn.Linear(3, 2, device=Tensor(arrays.randn(1)).device)
    lin(Tensor(arrays.randn(4, 3).astype(np.float32))).sum().backward()
    assert all(p.grad is not None for p in lin.parameters())
    lin.zero_grad()
    assert all(p.grad is None for p in lin.parameters())
    opt = mt.optim.Adam(lin.parameters())
    lin(Tensor(arrays.randn(4, 3).astype(np.float32))).sum().backward()
    opt.zero_grad()
    if opt.flat is None:
        assert all(p.grad is None for p in lin.parameters())
    else:  # flat Adam (the default on CuPy): gradients stay zeroed views of one buffer
        assert all(float(abs(p.grad).max()) == 0 for p in lin.parameters())
        assert opt.flat_grad() is not None


def test_no_grad_records_nothing(xp, arrays):
    x = leaf(arrays, 3)
    assert is_grad_enabled()
    with no_grad():
        assert not is_grad_enabled()
        y = (x * 2.0).exp().sum()
        with no_grad():
            pass
        assert not is_grad_enabled()  # a nested block does not switch recording back on
    assert is_grad_enabled()
    assert y.requires_grad is False and y.node is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()
    # an exception inside the block still restores recording
    with pytest.raises(KeyError):
        with no_grad():
            raise KeyError
    assert is_grad_enabled()
    z = (x * 2.0).sum()
    assert z.requires_grad and z.node is not None


def test_no_grad_and_the_running_module_are_per_thread(xp, arrays):
    # a thread decoding under no_grad (mt/search.py's shared_out) neither stops another
    # thread's recording nor, when it leaves the block, switches recording back on in a
    # thread that is inside its own; each thread has its own stack of running modules
    import threading

    from minitransformer.engine import scope
    x = leaf(arrays, 3)
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def decoding():
        with no_grad():
            scope.push("module of the other thread")
            inside.set()
            leave.wait(10)
            seen["other: recording"] = is_grad_enabled()
            scope.pop()
        seen["other: after its block"] = is_grad_enabled()

    thread = threading.Thread(target=decoding)
    thread.start()
    assert inside.wait(10)
    assert is_grad_enabled() and scope.current_module() is None
    y = (x * 2.0).sum()
    assert y.requires_grad and y.node is not None  # recorded here
    with no_grad():
        leave.set()
        thread.join(10)
        assert not is_grad_enabled()  # the other thread's exit did not switch it back on
        assert (x * 2.0).sum().node is None
    assert seen == {"other: recording": False, "other: after its block": True}
    assert is_grad_enabled()


@pytest.mark.parametrize("sa,sb", [((3, 4), (4,)), ((3, 4), (3, 1)), ((3, 4), (1, 1)),
                                   ((2, 1, 4), (3, 1)), ((3, 4), ())])
def test_broadcast_gradient_is_summed_back(xp, arrays, assert_close, sa, sb):
    a, b = leaf(arrays, *sa), leaf(arrays, *sb)
    w = arrays.randn(*np.broadcast_shapes(sa, sb))
    ((a * b) * Tensor(w)).sum().backward()
    an, bn, wn = a.numpy(), b.numpy(), arrays.numpy(w)
    full_a = np.broadcast_to(bn, wn.shape) * wn  # d/da before summing the broadcast axes
    full_b = np.broadcast_to(an, wn.shape) * wn
    assert a.grad.shape == sa and b.grad.shape == sb
    # sum by loops over the broadcast index map, not with the engine's axis logic
    exp_a, exp_b = np.zeros(sa), np.zeros(sb)
    for idx in np.ndindex(*wn.shape):
        exp_a[tuple(i if n > 1 else 0 for i, n in zip(idx[len(idx) - len(sa):], sa))] += full_a[idx]
        exp_b[tuple(i if n > 1 else 0 for i, n in zip(idx[len(idx) - len(sb):], sb))] += full_b[idx]
    assert_close(a.grad, exp_a, 1e-13, 1e-14, "da")
    assert_close(b.grad, exp_b, 1e-13, 1e-14, "db")


def test_float16_sums_add_up_in_float32(xp):
    """A float16 Sum along an axis, and the engine's sum of a broadcast gradient (a bias's),
    add up in float32 and round once: in float16 a running sum of 0.05s stops at 128 (and
    the bias gradient of 20000 rows came out 2048)."""
    x = xp.full((20000, 4), 0.05, xp.float16)
    y = Tensor(x).sum(axis=0)
    assert y.dtype == np.float16
    assert np.allclose(mt.backend.to_numpy(y.data), 20000 * 0.05, rtol=1e-3)
    b = Tensor(xp.zeros(4, xp.float16), requires_grad=True)
    (Tensor(x) + b).backward(xp.ones((20000, 4), xp.float16))
    assert b.grad.dtype == np.float16
    assert (mt.backend.to_numpy(b.grad) == 20000).all()
    v = Tensor(xp.full(3, 0.5, xp.float16), requires_grad=True)  # matrix @ vector: dv
    (Tensor(xp.full((20000, 3), 0.05, xp.float16)) @ v).backward(xp.ones(20000, xp.float16))
    assert np.allclose(mt.backend.to_numpy(v.grad), 1000, rtol=1e-3)


def test_numbers_with_integer_or_bool_tensors_promote_and_floats_keep_their_dtype():
    """A Python float with an integer or bool tensor promotes as NumPy does (it was cast to
    the integers: 0.5 * [1, 2, 3] gave [0, 0, 0]); with a float tensor it keeps the tensor's
    dtype (a weak number), also through a user Function's apply."""
    ints = Tensor(np.array([1, 2, 3]))
    assert (ints * 0.5).data.tolist() == [0.5, 1.0, 1.5]
    assert (ints + 0.5).data.tolist() == [1.5, 2.5, 3.5]
    assert (0.5 * ints).data.tolist() == [0.5, 1.0, 1.5]
    assert (ints + np.array([0.7, 0.7, 0.7])).data.tolist() == [1.7, 2.7, 3.7]
    assert (Tensor(np.array([True, False])) * 0.5).data.tolist() == [0.5, 0.0]
    assert (ints * 2).data.dtype == ints.dtype and (ints * 2).data.tolist() == [2, 4, 6]
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    assert (x * 0.5).dtype == np.float32 and (x + np.float64(0.5) * 1).dtype == np.float32

    class AddF(Function):
        def forward(self, a, b):
            return a + b

        def backward(self, dy):
            return dy, None

    assert AddF.apply(x, 1.0).dtype == np.float32


def test_a_gradient_has_its_leafs_dtype():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    (x * Tensor(np.full(3, 2.0))).sum().backward()  # float64 values reach a float32 leaf
    assert x.grad.dtype == np.float32 and x.grad.tolist() == [2.0, 2.0, 2.0]


def test_integer_data_cannot_require_grad():
    with pytest.raises(TypeError, match="requires_grad=True needs floating-point data, not "
                                        "int64"):
        Tensor(np.array([1, 2, 3]), requires_grad=True)


def test_a_tensor_exponent_that_requires_grad_is_refused():
    x = Tensor(np.array([1.5, 2.0]), requires_grad=True)
    with pytest.raises(TypeError, match="exponent t is a Tensor that requires grad"):
        x ** Tensor(np.array(2.0), requires_grad=True)
    (x ** Tensor(np.array(2.0))).sum().backward()  # a constant Tensor exponent: its value
    assert x.grad.tolist() == [3.0, 4.0]


def test_a_functions_contract_is_checked():
    """backward must return one gradient per input of forward (a forgotten one was silently
    dropped); a list is taken as a tuple; forward returns one array (a tuple was stacked
    into one Tensor); a None input reaches forward as None."""
    class Forgot(Function):
        def forward(self, a, b):
            self.b = b
            return a * b

        def backward(self, dy):
            return dy * self.b

    a, b = Tensor(np.ones(3), requires_grad=True), Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Forgot.backward returned 1 gradient for the 2 "
                                           r"inputs of Forgot.forward"):
        Forgot.apply(a, b).sum().backward()

    class AsList(Function):
        def forward(self, a, b):
            self.a, self.b = a, b
            return a * b

        def backward(self, dy):
            return [dy * self.b, dy * self.a]

    a, b = Tensor(np.array([2.0]), requires_grad=True), Tensor(np.array([3.0]), requires_grad=True)
    AsList.apply(a, b).sum().backward()
    assert (a.grad.tolist(), b.grad.tolist()) == ([3.0], [2.0])

    class Two(Function):
        def forward(self, a):
            return a * 2, a * 3

    with pytest.raises(TypeError, match="Two.forward returned a tuple; a Function has one "
                                        "output"):
        Two.apply(Tensor(np.ones(3), requires_grad=True))
    with pytest.raises(TypeError, match="Two.forward returned a tuple"), no_grad():
        Two.apply(Tensor(np.ones(3)))

    class MaybeBias(Function):
        def forward(self, x, b):
            self.none = b is None
            return x if b is None else x + b

        def backward(self, dy):
            return dy, None

    x = Tensor(np.ones(2), requires_grad=True)
    MaybeBias.apply(x, None).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0]


def test_indexing_comparisons_and_an_array_on_the_left_of_matmul(xp, arrays, assert_close):
    """x[...] is an op with a gradient (repeated places add up); <, <=, >, >= give constant
    bool Tensors; array @ Tensor is a Tensor (it raised TypeError); == compares objects."""
    x, w = leaf(arrays, 4, 3), arrays.randn(3, 2)
    rows = xp.asarray(np.array([0, 2, 0]))
    (x[rows, 1:] * Tensor(w)).sum().backward()
    expect, w = np.zeros((4, 3)), arrays.numpy(w)
    for r, i in enumerate([0, 2, 0]):
        expect[i, 1:] += w[r]
    assert_close(x.grad, expect, 1e-15, 0, "x[rows, 1:]")
    assert_close(x[-1], arrays.numpy(x.data)[-1], 0, 0, "x[-1]")
    m = x > 0
    assert not m.requires_grad and m.dtype == bool
    assert (arrays.numpy(m.data) == (arrays.numpy(x.data) > 0)).all()
    assert (arrays.numpy((x <= x).data)).all() and not (arrays.numpy((x < x).data)).any()
    a = arrays.randn(2, 4)
    y = a @ x
    assert isinstance(y, Tensor) and y.requires_grad
    assert_close(y, arrays.numpy(a) @ arrays.numpy(x.data), 1e-14, 0, "a @ x")
    assert (x == x) is True and (x == 1.0) is False  # (identity: x.data == 1.0 for values)


def test_a_tensors_truth_and_numpy_conversion_are_its_values():
    """bool(t) is the array's (it was len(t): (x > 1) of [0.0] was true); np.asarray(t) of
    a Tensor without a gradient is its values (indexing made NumPy convert it element by
    element), and of one that requires grad is refused rather than losing the gradient."""
    assert not bool(Tensor(np.array([0.0])) > 1) and bool(Tensor(np.array(2.0)) > 1)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(Tensor(np.ones(3)) > 0)
    a = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(np.asarray(Tensor(a)), a) and np.asarray(Tensor(a)).dtype == a.dtype
    with pytest.raises(TypeError, match="requires grad cannot become a NumPy array"):
        np.asarray(Tensor(a, requires_grad=True))
    y = np.ones(3) * Tensor(np.arange(3.0), requires_grad=True)  # (ops still give Tensors)
    assert isinstance(y, Tensor) and y.requires_grad


# ---- backward's contract and its errors ---------------------------------------------------------
def test_backward_on_non_scalar_needs_a_seed(xp, arrays):
    y = leaf(arrays, 2, 3) * 2.0
    with pytest.raises(RuntimeError, match=r"non-scalar tensor of shape \(2, 3\) needs a seed "
                                           r"gradient"):
        y.backward()


def test_backward_with_explicit_seed(xp, arrays, assert_close):
    x = leaf(arrays, 2, 3)
    y = x * 3.0 + 1.0
    g = arrays.randn(2, 3)
    y.backward(g)
    assert_close(x.grad, 3 * arrays.numpy(g), 1e-15, 0, "seeded backward")
    x.zero_grad()
    (x * x).backward(Tensor(g))  # a Tensor seed works too
    assert_close(x.grad, 2 * x.numpy() * arrays.numpy(g), 1e-15, 0, "Tensor seed")
    with pytest.raises(ValueError, match="seed gradient has shape"):
        (x * 1.0).backward(arrays.randn(3, 2))
    # a leaf's own backward just stores the seed
    x.zero_grad()
    x.backward(g)
    assert_close(x.grad, g, 0, 0, "leaf seed")


def test_second_backward_through_released_graph_raises(xp, arrays):
    x = leaf(arrays, 3)
    loss = (x.exp() * x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"second backward through \w+: its saved arrays were "
                                           r"released.*run the forward pass again"):
        loss.backward()
    # the graph built again works
    (x.exp() * x).sum().backward()


def test_saved_arrays_are_released_after_backward(xp, arrays):
    x = leaf(arrays, 3)
    y = x.exp()
    node = y.node
    assert node.y is not None
    y.sum().backward()
    assert node.released and node.y is None


def test_the_graph_does_not_keep_intermediate_arrays_alive(xp, arrays, assert_close):
    # h is an input of ReLU, which saves only its output: once the caller drops h, its
    # array must be freed even though the graph through it is still waiting for backward
    # (holding every intermediate doubled a model's activation memory).
    x = leaf(arrays, 64, 64)
    h = x + 1.0
    array_ref = weakref.ref(h.data)
    y = h.relu()
    del h
    gc.collect()
    assert array_ref() is None, "the tape kept an intermediate array that no op saved"
    y.sum().backward()
    assert_close(x.grad, (x.numpy() + 1.0 > 0).astype(np.float64), 0, 0, "d relu(x + 1)/dx")


# ---- user-defined Functions ---------------------------------------------------------------------
class Sin(Function):
    """y = sin(x) * scale;  dx = dy * cos(x) * scale."""
    def forward(self, x):
        self.x = x
        return mt.get_array_module(x).sin(x) * self.scale

    def backward(self, dy):
        return dy * mt.get_array_module(dy).cos(self.x) * self.scale


class Gather(Function):
    """y = a[ids] * b: an integer input (no gradient) between two float ones."""
    def forward(self, a, ids, b):
        self.a, self.ids, self.b = a, ids, b
        return a[ids] * b

    def backward(self, dy):
        xp = mt.get_array_module(dy)
        da = xp.zeros_like(self.a)
        mt.backend.scatter_add(da, self.ids, dy * self.b)
        return da, None, dy * self.a[self.ids]


class WrongSin(Sin):
    """A deliberately wrong backward: the derivative's sign is flipped."""
    def backward(self, dy):
        return -super().backward(dy)


def test_user_function_works_and_passes_gradcheck(xp, arrays, assert_close):
    x = leaf(arrays, 3, 4)
    y = Sin.apply(x, scale=2.0)
    assert_close(y, 2 * np.sin(x.numpy()), 1e-15, 0, "Sin forward")
    report = gradcheck(lambda x: Sin.apply(x, scale=2.0), [arrays.randn(3, 4)])
    assert list(report) == ["input[0]"] and report["input[0]"]["ok"]
    ids = arrays.asarray(np.array([0, 2, 2, 1]))
    report = gradcheck(lambda a, i, b: Gather.apply(a, i, b), [arrays.randn(3), ids,
                                                               arrays.randn(4)])
    assert sorted(report) == ["input[0]", "input[2]"]  # the integer input[1] is skipped


def test_gradcheck_detects_a_wrong_backward(xp, arrays):
    with pytest.raises(GradcheckError) as info:
        gradcheck(lambda a, b: WrongSin.apply(a, scale=1.0) * b, [arrays.randn(3, 2),
                                                                    arrays.randn(3, 2)])
    msg = str(info.value)
    lines = {line.split()[1]: line for line in msg.splitlines()[1:]}
    assert lines["input[0]"].lstrip().startswith("FAIL"), msg
    assert lines["input[1]"].lstrip().startswith("ok"), msg  # b's gradient is right
    assert "max abs" in lines["input[0]"] and "max rel" in lines["input[0]"], msg
    # and it says by how much: the sign flip gives a relative error of 2 somewhere
    rel = float(lines["input[0]"].split("max rel")[1].split()[0])
    assert rel > 1.0, msg
    # raise_on_failure=False returns the same report instead
    report = gradcheck(lambda a: WrongSin.apply(a, scale=1.0), [arrays.randn(3, 2)],
                       raise_on_failure=False)
    assert not report["input[0]"]["ok"] and report["input[0]"]["max_abs"] > 0.1


def test_gradcheck_detects_a_small_error(xp, arrays):
    """An error of 1e-3 relative is far above float64 finite-difference noise."""
    class Almost(Sin):
        def backward(self, dy):
            return super().backward(dy) * 1.001
    with pytest.raises(GradcheckError, match="FAIL input"):
        gradcheck(lambda a: Almost.apply(a, scale=1.0), [arrays.randn(4)])


def test_gradcheck_reports_where_the_largest_error_is():
    # errors of 1e-3 at element (0, 1) and of 5 at (1, 2): "where" is the second
    class TwoErrors(Function):
        def forward(self, x):
            return x * 1.0

        def backward(self, dy):
            d = dy.copy()
            d[0, 1] += 1e-3
            d[1, 2] += 5.0
            return d
    report = gradcheck(lambda x: TwoErrors.apply(x), [np.ones((2, 5))], n_directions=0,
                       raise_on_failure=False)["input[0]"]
    assert not report["ok"] and report["where"] == (1, 2), report


def test_gradcheck_takes_zero_tolerances_as_given_and_refuses_what_cannot_work():
    # atol=0 is a real setting, not "the default": a gradient off by 5e-9 fails under it
    class Off(Function):
        def forward(self, x):
            return x * 0.0

        def backward(self, dy):
            return dy * 0.0 + 5e-9
    check = lambda **kw: gradcheck(lambda x: Off.apply(x), [np.ones(3)],  # noqa: E731
                                   raise_on_failure=False, **kw)["input[0]"]["ok"]
    assert check() and not check(atol=0.0)
    for bad in (dict(eps=0.0), dict(eps=-1e-6), dict(rtol=-1.0), dict(atol=0.0, rtol=0.0)):
        with pytest.raises(ValueError, match="eps > 0, rtol >= 0 and atol >= 0, not both 0"):
            check(**bad)
    with pytest.raises(ValueError, match="float64 .* or float32, not float16"):
        check(dtype=np.float16)
    # an input no setting would check, and an fn that gives nothing to check
    with pytest.raises(ValueError, match=r"input\[0\] has 80 elements, more than full_max=64, "
                                         r"and n_directions=0: nothing would check it"):
        gradcheck(lambda x: x * 2.0, [np.ones(80)], n_directions=0)
    with pytest.raises(ValueError, match="fn's output does not depend on any float input or "
                                         "parameter"):
        gradcheck(lambda x: x.detach() * 2.0, [np.ones(3)])
    with pytest.raises(ValueError, match="output does not depend"):
        gradcheck(lambda ids: Tensor(np.ones(3)) * 2.0, [np.array([1, 2])])
    with pytest.raises(TypeError, match="fn returned a ndarray, not a Tensor"):
        gradcheck(lambda x: x.data * 2.0, [np.ones(3)])


def test_gradcheck_leaves_the_callers_gradients_on_its_params():
    w = Tensor(np.ones((3, 2), np.float32), requires_grad=True)
    w.grad = np.full((3, 2), 7.0, np.float32)
    grad = w.grad
    report = gradcheck(lambda x: x @ w, [np.ones((2, 3))], params=[w])
    assert report["param[0]"]["ok"] and w.grad is grad and w.dtype == np.float32


def test_gradcheck_says_when_no_gradient_reached_an_input():
    # backward returns None for a float input: the check fails for it, and says why and
    # how to hold such an input constant
    class Masked(Function):
        def forward(self, x, mask):
            self.mask = mask
            return x * mask

        def backward(self, dy):
            return dy * self.mask, None
    x, mask = np.random.default_rng(0).standard_normal(4), np.array([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(GradcheckError, match=r"no gradient reached input\[1\].*close over it"):
        gradcheck(lambda a, m: Masked.apply(a, m), [x, mask])
    report = gradcheck(lambda a: Masked.apply(a, Tensor(mask)), [x])
    assert report["input[0]"]["ok"] and report["input[0]"]["reached"]


def test_gradcheck_reseeds_a_modules_generators_whatever_their_name():
    # a custom module drawing dropout from self.gen (not self.rng), checked with train=True
    class Gated(mt.nn.Module):
        def __init__(self):
            self.w = mt.nn.parameter(np.random.default_rng(0).standard_normal((4, 3)))
            self.gen = mt.Generator(1)

        def forward(self, x):
            return mt.functional.dropout(x @ self.w, 0.5, self.gen, self.training)
    report = gradcheck(Gated(), [np.random.default_rng(1).standard_normal((2, 4))],
                       train=True)
    assert all(r["ok"] for r in report.values()), report


def test_wrong_gradient_shape_is_an_error(xp, arrays):
    """A transposed gradient has the right size: the engine must not reshape it silently."""
    class Transposed(Function):
        def forward(self, x):
            return x * 2

        def backward(self, dy):
            return (2 * dy).T.copy()
    x = leaf(arrays, 3, 4)
    with pytest.raises(RuntimeError, match=r"Transposed.backward returned a gradient of shape "
                                           r"\(4, 3\) for an input of shape \(3, 4\)"):
        Transposed.apply(x).sum().backward()
    with pytest.raises(RuntimeError, match="Transposed.backward returned"):
        (Transposed.apply(x * 1.0) * 1.0).sum().backward()  # for an inner node as well


# ---- gradcheck on Modules and integer inputs ----------------------------------------------------
class MLP(mt.nn.Module):
    """x -> Linear -> LayerNorm -> ReLU -> Dropout -> Linear."""
    def __init__(self, device):
        rng = np.random.default_rng(0)
        self.l1 = mt.nn.Linear(4, 6, rng=rng, device=device)
        self.norm = mt.nn.LayerNorm(6, device=device)
        self.drop = mt.nn.Dropout(0.3, mt.Generator(5, device=device))
        self.l2 = mt.nn.Linear(6, 3, bias=False, rng=rng, device=device)

    def forward(self, x):
        return self.l2(self.drop(F.relu(self.norm(self.l1(x)))))


@pytest.mark.parametrize("train", [False, True])
def test_gradcheck_on_a_module_checks_and_restores_parameters(xp, arrays, train):
    device = Tensor(arrays.randn(1)).device
    model = MLP(device)
    model.norm.gamma.data += model.norm.gamma.xp.asarray(np.linspace(-0.5, 0.5, 6),
                                                         dtype=np.float32)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    x = arrays.randn(5, 4)
    report = gradcheck(model, [x], train=train)
    assert sorted(report) == ["input[0]", "l1.bias", "l1.weight", "l2.weight", "norm.beta",
                              "norm.gamma"]
    assert all(r["ok"] for r in report.values())
    for name, p in model.named_parameters():
        assert p.dtype == np.float32, f"{name} left as {p.dtype}"
        assert (p.numpy() == before[name]).all(), f"{name} changed by gradcheck"
        assert p.requires_grad and p.grad is None
    assert model.training is True and model.drop.training is True  # mode restored


def test_gradcheck_on_a_module_detects_a_wrong_parameter_gradient(xp, arrays, monkeypatch):
    model = MLP(Tensor(arrays.randn(1)).device)
    original = mt.engine.ops.Linear.backward

    def no_bias_grad(self, dy):  # a Linear whose bias gradient is wrong, the rest right
        g = original(self, dy)
        return g if len(g) == 2 else (g[0], g[1], 2 * g[2])
    monkeypatch.setattr(mt.engine.ops.Linear, "backward", no_bias_grad)
    report = gradcheck(model, [arrays.randn(5, 4)], raise_on_failure=False)
    assert {n for n, r in report.items() if not r["ok"]} == {"l1.bias"}


def test_gradcheck_skips_integer_inputs(xp, arrays):
    ids = arrays.asarray(np.array([[1, 2], [3, 1]]))
    report = gradcheck(lambda ids, w: F.embedding(ids, w), [ids, arrays.randn(4, 3)])
    assert list(report) == ["input[1]"]


def test_embedding_padding_row_gets_zero_gradient(xp, arrays, assert_close):
    ids = arrays.asarray(np.array([[1, 0, 3], [3, 0, 0]]))
    w = leaf(arrays, 5, 2)
    y = F.embedding(ids, w, pad_id=0)
    assert_close(y.numpy()[0, 1], w.numpy()[0], 0, 0, "the padding id still looks up its row")
    g = arrays.randn(2, 3, 2)
    y.backward(g)
    gn = arrays.numpy(g)
    expected = np.zeros((5, 2))
    expected[1] = gn[0, 0]
    expected[3] = gn[0, 2] + gn[1, 0]  # a repeated id sums its rows
    assert_close(w.grad, expected, 1e-15, 0, "embedding dW with pad_id=0")
    assert (arrays.numpy(w.grad)[0] == 0).all()


def test_function_options_are_declared_and_others_refused():
    from minitransformer.engine.layernorm import LayerNorm
    x, g, b = np.ones((2, 3)), np.ones(3), np.zeros(3)
    assert LayerNorm().eps == 1e-5  # the declared default, visible on the class
    assert LayerNorm.options == {"eps": 1e-5}
    LayerNorm.apply(x, g, b, eps=1e-3)
    with pytest.raises(TypeError,
                       match=r"LayerNorm takes the options \['eps'\], not \['epsilon'\]"):
        LayerNorm.apply(x, g, b, epsilon=1e-3)  # a misspelt option used to be set silently

    class Scale(mt.Function):  # a user's Function that declares nothing takes any option
        def forward(self, x):
            return x * self.k

        def backward(self, dy):
            return dy * self.k
    assert float(Scale.apply(Tensor(np.ones(2)), k=3.0).sum().data) == 6.0


def test_the_readmes_gradient_check_examples_run_as_written():
    # the blocks of README's "Check your own layer" that call gradcheck, run in order in one
    # namespace, as a reader pasting them would
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        section = f.read().split("### Check your own layer", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "gradcheck" in b]
    assert len(blocks) >= 2
    namespace = {}
    exec("\n".join(blocks), namespace)
    assert {"input[0]", "w", "v"} <= set(namespace["report"])
    assert all(r["ok"] for r in namespace["report"].values())
