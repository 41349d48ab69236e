"""gradcheck on the package's own Modules: a float32 or float16 model is checked on a float64
copy (the caller's model untouched), the copy still catches a wrong backward, a module that
cannot be copied is refused with the fix, and a failure with dropout on says so."""
import threading

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import Function, GradcheckError, Tensor, gradcheck
from minitransformer.nn.transformer import Transformer, TransformerConfig

CFG = dict(vocab_size=20, d_model=8, n_heads=2, d_ff=16, n_layers=1, pad_id=0, bos_id=1,
           eos_id=2, max_positions=16, dropout=0.1, attention_dropout=0.1)
FAST = dict(n_directions=2, full_max=0)


def config(**overrides):
    return TransformerConfig(**{**CFG, **overrides})


def batch(B=2, S=5, T=4):
    r = np.random.default_rng(0)
    src, tgt = r.integers(3, 20, (B, S)), r.integers(3, 20, (B, T + 1))
    src[0, -1] = 0  # one padding position
    return src, tgt[:, :-1], tgt[:, 1:]


def snapshot(model):
    """Everything gradcheck must leave as it was: the parameter objects, arrays and values,
    the dtype settings and buffers, the training flags and the dropout generator."""
    params = {n: (p, p.data, p.data.copy(), p.requires_grad, p.grad)
              for n, p in model.named_parameters()}
    return (params, model.dtype, model.compute_dtype, model.pe, model.pe.dtype,
            [m.training for m in model.modules()], model.rng.get_state())


def assert_unchanged(model, before):
    params, dtype, compute_dtype, pe, pe_dtype, flags, rng = before
    assert set(params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        obj, data, values, requires_grad, grad = params[name]
        assert p is obj and p.data is data, f"{name} replaced by gradcheck"
        assert p.dtype == values.dtype and (mt.backend.to_numpy(p.data) ==
                                            mt.backend.to_numpy(values)).all(), name
        assert p.requires_grad == requires_grad and p.grad is grad, name
    assert (model.dtype, model.compute_dtype) == (dtype, compute_dtype)
    assert model.pe is pe and model.pe.dtype == pe_dtype
    assert [m.training for m in model.modules()] == flags
    assert model.rng.get_state() == rng


@pytest.mark.parametrize("output", ["logits", "loss"])
def test_float32_transformer_is_checked_in_float64_and_left_untouched(xp, arrays, output):
    device = Tensor(arrays.randn(1)).device
    model = Transformer(config(), seed=1, device=device).eval()
    assert model.dtype == np.float32 and model.pe.dtype == np.float32
    before = snapshot(model)
    src, tin, tout = batch()
    if output == "logits":
        report = gradcheck(model, [src, tin], **FAST)
    else:
        report = gradcheck(model.loss, [src, tin, tout], **FAST)  # (loss, count): loss checked
    assert set(report) == {n for n, _ in model.named_parameters()}  # ids skipped
    bad = {n: r for n, r in report.items() if not r["ok"]}
    assert not bad, f"float64 copy fails: {bad}"
    assert max(r["max_rel"] for r in report.values()) < 1e-5  # float64 accuracy, not float32's
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", [dict(compute_dtype=np.float16), dict(dtype=np.float16)],
                         ids=["mixed-precision", "float16"])
def test_float16_transformer_is_checked_in_float64(kind):
    model = Transformer(config(), seed=2, **kind)
    model.eval()
    assert model.compute_dtype == np.float16
    before = snapshot(model)
    src, tin, tout = batch()
    report = gradcheck(model.loss, [src, tin, tout], **FAST)
    assert set(report) == {n for n, _ in model.named_parameters()}
    assert max(r["max_rel"] for r in report.values()) < 1e-5
    assert_unchanged(model, before)


def test_named_params_of_the_module_are_checked_on_the_copy():
    model = Transformer(config(), seed=3).eval()
    chosen = [(n, p) for n, p in model.named_parameters() if n.startswith("encoder.0.ff")]
    report = gradcheck(model, list(batch()[:2]), params=chosen, **FAST)
    assert list(report) == [n for n, _ in chosen]
    assert all(r["ok"] for r in report.values())
    assert all(p.dtype == np.float32 for _, p in chosen)


class WrongScale(Function):
    """y = 3 x with a backward that forgets the 3: a bug the copy must not hide."""
    options = {}

    def forward(self, x):
        return 3 * x

    def backward(self, dy):
        return dy


class Scaled(mt.nn.Module):
    """x -> Linear -> Dropout(rate) -> WrongScale (or a right 3 x) -> Linear, in float32."""

    def __init__(self, rate=0.0, wrong=True):
        rng = np.random.default_rng(0)
        self.l1 = mt.nn.Linear(4, 5, rng=rng)
        self.drop = mt.nn.Dropout(rate, mt.Generator(7))
        self.l2 = mt.nn.Linear(5, 2, rng=rng)
        self.wrong = wrong

    def forward(self, x):
        h = self.drop(self.l1(x))
        return self.l2(WrongScale.apply(h) if self.wrong else h * 3.0)


def test_a_wrong_function_inside_a_module_still_fails():
    model = Scaled()
    with pytest.raises(GradcheckError, match=r"FAIL l1\.weight") as e:
        gradcheck(model, [np.random.default_rng(0).standard_normal((3, 4))])
    assert "dropout" not in str(e.value)
    report = gradcheck(Scaled(wrong=False), [np.random.default_rng(0).standard_normal((3, 4))])
    assert all(r["ok"] for r in report.values())


def test_a_module_that_cannot_be_copied_is_refused_with_the_fix():
    model = Scaled(wrong=False)
    model.lock = threading.Lock()  # deepcopy cannot copy it
    x = [np.random.default_rng(0).standard_normal((3, 4))]
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(Scaled\) failed.*deep-copyable.*"
                                        r"build the module in float64"):
        gradcheck(model, x)
    assert model.l1.weight.dtype == np.float32
    for p in model.parameters():  # already float64: nothing to cast, checked as it is
        p.data = p.data.astype(np.float64)
    report = gradcheck(model, x)
    assert all(r["ok"] for r in report.values())
    assert model.l1.weight.dtype == np.float64 and model.training


def test_dropout_in_a_closure_over_a_training_model_is_named():
    """gradcheck cannot see (or re-seed) a model a lambda closes over: fresh masks at every
    evaluation make the finite differences noise, and the message says why."""
    model = Transformer(config(), seed=4, dtype=np.float64)  # float64: only dropout is wrong
    assert model.training
    src, tin, tout = batch()
    with pytest.raises(GradcheckError) as e:
        gradcheck(lambda s: model.loss(s, tin, tout)[0], [src],
                  params=list(model.named_parameters()), n_directions=1, full_max=0)
    msg = str(e.value)
    assert "dropout was active" in msg and "rate 0.1" in msg and "module.eval()" in msg
    assert "output is" not in msg  # no precision note: the output is float64


def test_dropout_kept_on_in_a_failing_module_check_suggests_train_false():
    x = [np.random.default_rng(0).standard_normal((3, 4))]
    with pytest.raises(GradcheckError, match=r"dropout was active.*rate 0\.5.*train=False"):
        gradcheck(Scaled(rate=0.5), x, train=True)


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_dropout_note_only_when_masks_were_drawn(rate):
    """The same wrong module in training mode inside a lambda: with rate 0 no dropout note."""
    model = Scaled(rate=rate)
    with pytest.raises(GradcheckError) as e:
        gradcheck(lambda x: model(x), [np.random.default_rng(0).standard_normal((3, 4))],
                  params=list(model.named_parameters()))
    assert ("dropout was active" in str(e.value)) == (rate > 0)


def test_a_closure_over_a_float32_model_is_told_to_pass_the_module():
    model = Transformer(config(), seed=5).eval()
    src, tin, _ = batch()
    with pytest.raises(GradcheckError, match=r"output is float32, not float64.*bound method"):
        gradcheck(lambda s: model(s, tin), [src], params=list(model.named_parameters()),
                  n_directions=1, full_max=0)
    assert all(p.dtype == np.float32 for p in model.parameters())  # restored


def test_modules_and_parameters_in_lists_and_dicts_are_found():
    """A Module's parameters and submodules may sit in a list, tuple or dict attribute: they
    are its parameters (named by index or key), eval() reaches them, and gradcheck checks
    them (they were skipped: a dict's Dropout stayed in training mode, its Linear's
    gradients unchecked)."""
    rng = np.random.default_rng(0)

    class Heads(mt.nn.Module):
        def __init__(self):
            self.ws = [mt.nn.parameter(rng.normal(0, 0.5, (4, 4))) for _ in range(2)]
            self.by_name = {"proj": mt.nn.Linear(4, 3, rng=rng, dtype=np.float64),
                            "drop": mt.nn.Dropout(0.5, mt.Generator(0))}
            self.activations = []  # (not parameters: results of forward)

        def forward(self, x):
            h = (x @ self.ws[0]).relu() @ self.ws[1]
            self.activations.append(h)
            return self.by_name["proj"](self.by_name["drop"](h))

    m = Heads()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["ws.0", "ws.1", "by_name.proj.weight", "by_name.proj.bias"]
    assert [n for n, _ in m.named_modules()] == ["", "by_name.proj", "by_name.drop"]
    m.eval()
    assert not m.by_name["drop"].training
    m(Tensor(rng.normal(size=(2, 4))))
    assert len(m.parameters()) == 4  # the activation kept in a list is not one
    report = gradcheck(m, [rng.normal(size=(2, 4))], raise_on_failure=False)
    assert set(report) == {"input[0]", *names} and all(r["ok"] for r in report.values())


def test_a_frozen_parameter_stays_in_the_state_dict():
    """requires_grad turned off on a parameter (frozen): the optimizer's parameters leave it
    out, the state dict keeps it (it dropped it, and loading the earlier state then failed
    with 'unexpected')."""
    lin = mt.nn.Linear(3, 2, dtype=np.float64)
    before = lin.state_dict()
    lin.bias.requires_grad = False
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    assert set(lin.state_dict()) == {"weight", "bias"}
    before["bias"] = before["bias"] + 1.0
    lin.load_state_dict(before)
    assert (lin.bias.data == 1.0).all()
