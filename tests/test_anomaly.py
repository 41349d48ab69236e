"""engine/anomaly.py: detect_anomaly names the first op that makes a NaN or an Inf."""
import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import Tensor
from minitransformer.mt.guard import DivergenceGuard, first_bad_op
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam


def test_forward_names_the_op_its_inputs_and_the_phase():
    x = Tensor(np.array([[1.0, 0.0, 2.0]]), requires_grad=True)
    y = x * 2.0  # finite
    with mt.detect_anomaly():
        with pytest.raises(mt.AnomalyError) as err:
            F.log(y)
    assert (err.value.op, err.value.phase, err.value.shapes) == ("Log", "forward", [(1, 3)])
    assert "Log forward made a NaN or Inf output from finite values" in str(err.value)
    assert "(1, 3) float64" in str(err.value)


def test_backward_names_the_op_whose_gradient_is_not_finite():
    x = Tensor(np.array([0.0, 4.0]), requires_grad=True)
    with mt.detect_anomaly():
        y = (x ** 0.5).sum()  # forward finite: sqrt(0) = 0
        with pytest.raises(mt.AnomalyError) as err:
            y.backward()  # d sqrt(x)/dx = 0.5 / sqrt(x): inf at 0
    assert (err.value.op, err.value.phase) == ("Power", "backward")


def test_values_that_came_in_non_finite_are_told_apart():
    x = Tensor(np.array([np.nan, 1.0]), requires_grad=True)
    with mt.detect_anomaly(), pytest.raises(mt.AnomalyError, match=r"Exp forward was given "
                                            r"non-finite values \(from outside the tape: a "
                                            r"parameter or the data\), and its output is not "
                                            r"finite; it was given \(2,\) float64"):
        F.exp(x)


def test_off_outside_the_block_and_restored_after_an_error():
    x = Tensor(np.array([0.0]), requires_grad=True)
    with np.errstate(divide="ignore"):
        assert np.isneginf(F.log(x).data).all()  # not checked: no error
        with pytest.raises(mt.AnomalyError), mt.detect_anomaly():
            F.log(x)
        assert np.isneginf(F.log(x).data).all()  # the mode ended with its block


def test_integer_outputs_are_not_checked():
    ids = Tensor(np.array([[1, 2]]))
    table = Tensor(np.ones((4, 3)), requires_grad=True)
    with mt.detect_anomaly():
        out = F.embedding(ids, table)
        out.sum().backward()
    assert np.all(table.grad[1:3] == 1)


def test_guard_counts_bad_updates_in_a_row():
    guard = DivergenceGuard(3)
    assert [guard.record(ok) for ok in (False, False, True, False, False, False)] == \
        [False, False, False, False, False, True]


def test_first_bad_op_finds_the_op_in_a_models_batch():
    cfg = TransformerConfig(vocab_size=30, d_model=8, n_heads=2, d_ff=16, n_layers=1)
    model = Transformer(cfg, seed=0)
    optim = Adam(model.parameters())
    emb = dict(model.named_parameters())["embedding"]
    emb.data[6] = np.finfo(emb.dtype).max / 2  # finite; scaled by sqrt(d_model) it overflows
    src = np.array([[5, 6, 7, 3]])
    batch = dict(src=src, tgt_in=np.array([[2, 5, 6]]), tgt_out=np.array([[5, 6, 3]]))
    found, where = first_bad_op(model, optim, [batch], model.rng.get_state())
    assert found
    assert where.startswith("in batch 1 of 1 (1 sentences, source length 4, target length 3)")
    assert "forward made a NaN or Inf output from finite values" in where
    assert all(p.grad is None or not np.any(p.grad) for p in model.parameters())


def test_first_bad_op_says_so_when_every_op_is_finite():
    cfg = TransformerConfig(vocab_size=30, d_model=8, n_heads=2, d_ff=16, n_layers=1)
    model = Transformer(cfg, seed=0)
    batch = dict(src=np.array([[5, 6, 3]]), tgt_in=np.array([[2, 5]]),
                 tgt_out=np.array([[5, 3]]))
    found, where = first_bad_op(model, Adam(model.parameters()), [batch], model.rng.get_state())
    assert not found and "found no op that made a NaN or an Inf" in where


def test_the_module_that_ran_the_op_is_named():
    cfg = TransformerConfig(vocab_size=30, d_model=8, n_heads=2, d_ff=16, n_layers=2)
    model = Transformer(cfg, seed=0)
    w1 = dict(model.named_parameters())["decoder.1.ff.w1.weight"]
    w1.data[...] = np.finfo(w1.dtype).max  # (post-norm: its input sums are not all 0)
    args = np.array([[5, 6, 7, 3]]), np.array([[2, 5, 6]]), np.array([[5, 6, 3]])
    with mt.detect_anomaly(model), pytest.raises(mt.AnomalyError) as err:
        model.loss(*args)
    assert err.value.module == "decoder.1.ff.w1" and err.value.phase == "forward"
    assert "(in decoder.1.ff.w1)" in str(err.value)
    with mt.detect_anomaly(), pytest.raises(mt.AnomalyError) as err:  # no root: no path
        model.loss(*args)
    assert err.value.module is None


def test_a_python_number_that_is_not_finite_counts_as_a_non_finite_input():
    class AddNumber(mt.Function):
        def forward(self, x, b):
            return x + b

        def backward(self, dy):
            return dy, None

    with mt.detect_anomaly(), pytest.raises(mt.AnomalyError, match="was given non-finite"):
        AddNumber.apply(Tensor(np.ones(3), requires_grad=True), float("nan"))
