"""engine/explain.py: the tape listed in words (explain) and drawn as Graphviz DOT (to_dot).

The listing of a hand-built graph is checked cell by cell against a table written by hand;
the tiny model's totals against counts made here, independently of the module; the DOT text
by a small structural parser (braces, declared endpoints, clusters nested by module path)
and, where Graphviz is installed, by ``dot -Tsvg`` itself.
"""
import re
import shutil
import subprocess

import numpy as np
import pytest

from minitransformer.engine import explain as ex
from minitransformer.engine.attention import ScaledDotProductAttention
from minitransformer.engine.layernorm import LayerNorm
from minitransformer.engine.ops import Linear, Mul
from minitransformer.engine.tensor import Function, Tensor, _Edge
from minitransformer.nn.module import Module
from minitransformer.nn.transformer import Transformer, TransformerConfig


# ---- a small graph built by hand -----------------------------------------------------------
class Square(Function):
    """y = x^2;  dx = 2 x dy."""
    options = {}

    def forward(self, x):
        self.x = x
        return x * x

    def backward(self, dy):
        return 2 * self.x * dy


class Affine(Module):
    def __init__(self):
        self.w = Tensor(np.ones((3, 2), np.float32), requires_grad=True)
        self.b = Tensor(np.zeros(2, np.float32), requires_grad=True)

    def forward(self, x):
        return x @ self.w + self.b


class Net(Module):
    def __init__(self):
        self.proj = Affine()

    def forward(self, x):
        return Square.apply(self.proj(x).relu()).sum()


def small_graph():
    net = Net()
    return net, net(Tensor(np.arange(12, dtype=np.float32).reshape(4, 3)))


# what the tape's edges record of a result's dtype: nothing today (then shapes stand alone)
_EDGE_DTYPE = getattr(_Edge(Tensor(np.zeros(1, np.float32))), "dtype", None)
F = "" if _EDGE_DTYPE is None else " f32"


def table_cells(text):
    """The listing's table as rows of cells (columns are separated by 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  function"))
    end = lines.index("", start)
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end]], lines[start:end]


def test_listing_of_a_hand_built_graph():
    net, out = small_graph()
    text = ex.explain(out, root=net)
    assert text.splitlines()[:2] == ["output () f32: made by #4 Sum in (model)", "5 nodes, in "
                                     "tape order (backward visits them last to first)"]
    cells, lines = table_cells(text)
    # MatMul keeps a = x (4*3 float32 = 48 B) and b = w (a parameter: not counted); ReLU
    # keeps its output y (4*2*4 = 32 B); Square keeps its input, the same array (x^, 0 B)
    assert cells == [
        ["#", "function", "module", "inputs", "output", "saved for backward", "bytes"],
        ["0", "MatMul", "proj", f"(4,3){F}, .w", f"(4,2){F}", "a (b)", "48 B"],
        ["1", "Add", "proj", f"#0 (4,2){F}, .b", f"(4,2){F}", "-"],
        ["2", "ReLU", "(model)", f"#1 (4,2){F}", f"(4,2){F}", "y", "32 B"],
        ["3", "Square", "(model)", f"#2 (4,2){F}", f"(4,2){F}", "x^", "0 B"],
        ["4", "Sum", "(model)", f"#3 (4,2){F}", "() f32", "-"],
    ]
    column = lines[0].index("module")  # aligned: every row's module starts under its header
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in lines)
    assert "  Square  dx = 2 x dy." in text.splitlines()
    assert "  MatMul  da = dy @ b^T, db = a^T @ dy." in text.splitlines()
    assert text.endswith("nodes: 5\nsaved for backward: 80 B (80 bytes in 2 distinct arrays, "
                         "parameters excluded)\nparameters reached: 2 (8 elements)\n")


def test_listing_without_a_root_names_classes_and_leaves():
    _, out = small_graph()
    cells, _ = table_cells(ex.explain(out))
    assert [c[2] for c in cells[1:]] == ["Affine", "Affine", "Net", "Net", "Net"]
    assert cells[1][3] == f"(4,3){F}, leaf (3,2) f32"


def test_leaf_and_released_graphs_are_described():
    text = ex.explain(Tensor(np.ones(3, np.float32)))
    assert "a leaf, nothing was recorded" in text and "nodes: 0" in text
    text = ex.explain(Tensor(np.ones(3, np.float32), requires_grad=True))
    assert "a leaf that requires grad (a parameter or an input): no op made it" in text
    net, out = small_graph()
    out.backward()
    text = ex.explain(out, root=net)
    assert "backward has run: the saved arrays were released" in text
    assert "saved for backward: 0 B" in text


class Flat(Function):
    """y = x.reshape(-1), keeping a view of x (to test the accounting); dx = dy.reshape(x)."""
    options = {}

    def forward(self, x):
        self.flat = x.reshape(-1)
        return self.flat.copy()

    def backward(self, dy):
        return dy.reshape(self.flat.base.shape)


def test_a_view_counts_the_array_that_owns_its_memory_once():
    w = Tensor(np.ones((4, 2), np.float32), requires_grad=True, name="w")
    cells, _ = table_cells(text := ex.explain(Flat.apply(w.relu()).sum()))
    assert [c[5:] for c in cells[1:]] == [["y", "32 B"], ["flat^", "0 B"], ["-"]]
    assert "saved for backward: 32 B (32 bytes in 1 distinct array," in text


class Pair(Function):
    """y = 3 x, keeping its arrays in a tuple (to test the accounting); dx = 3 dy."""
    options = {}

    def forward(self, x):
        self.saved = (x, np.full_like(x, 3.0))
        return x * 3.0

    def backward(self, dy):
        return dy * self.saved[1]


def test_arrays_saved_in_a_tuple_are_counted_and_released():
    w = Tensor(np.ones((10, 10), np.float32), requires_grad=True, name="w")
    out = Pair.apply(w * 1.0).sum()
    text = ex.explain(out)
    assert "saved[0]" in text and "saved[1]" in text, text
    node = out.node.inputs[0].node  # (the Pair node)
    assert isinstance(node, Pair) and node.saved is not None
    out.backward()
    assert node.released and node.saved is None  # (the tuple went with its arrays)


def test_gradient_formulas_come_from_the_docstrings():
    assert ex.gradient_formula(Mul) == "da = dy * b, db = dy * a."
    assert ex.gradient_formula(Linear) == "dx = dy W^T;  dW = x^T dy;  db = sum_n dy."
    assert ex.gradient_formula(LayerNorm).startswith("dx = rstd * (dxh - mean(dxh)")
    assert ex.gradient_formula(ScaledDotProductAttention).startswith("dv = p~^T dout")

    class Undocumented(Function):
        pass
    assert ex.gradient_formula(Undocumented) == "-"


def test_human_bytes():
    assert [ex.human_bytes(n) for n in (0, 1023, 1536, 12.3 * 2 ** 20)] == \
        ["0 B", "1023 B", "1.5 KiB", "12.3 MiB"]


# ---- the tiny model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = TransformerConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1)
    model = Transformer(cfg, seed=0)
    rng = np.random.default_rng(0)
    src, tgt_in, tgt_out = (rng.integers(3, 40, shape) for shape in ((2, 7), (2, 6), (2, 6)))
    src[1, 5:] = 0  # padding, so the key mask is real
    loss, _ = model.loss(src, tgt_in, tgt_out)
    return model, loss


def reachable(loss):
    """The nodes behind ``loss``, found here by a walk of our own, in tape order."""
    seen, todo = {id(loss.node): loss.node}, [loss.node]
    while todo:
        for t in todo.pop().inputs:
            if t.node is not None and id(t.node) not in seen:
                seen[id(t.node)] = t.node
                todo.append(t.node)
    return sorted(seen.values(), key=lambda n: n.tape_index)


def saved_bytes(nodes, params):
    """Bytes of the distinct arrays the nodes hold (a view counts its owner), parameters'
    arrays left out: the module docstring's rule, computed from NumPy's own attributes."""
    def owner(a):
        while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
            a = a.base
        return a
    skip = {id(owner(p.data)) for p in params} | {id(p.data) for p in params}
    held = {}
    for node in nodes:
        for v in vars(node).values():
            if isinstance(v, (np.ndarray, np.generic)) and id(v) not in skip \
                    and id(owner(v)) not in skip:
                held[id(owner(v))] = owner(v).nbytes
    return sum(held.values()), len(held)


def test_tiny_model_listing_matches_independent_counts(tiny):
    model, loss = tiny
    text = ex.explain(loss, root=model)
    nodes = reachable(loss)
    cells, _ = table_cells(text)
    assert [c[1] for c in cells[1:]] == [type(n).__name__ for n in nodes]  # tape order
    modules = {c[2] for c in cells[1:]}
    assert {"encoder.0.self_attn", "decoder.0.cross_attn", "encoder.0.ff.w1", "-"} <= modules
    params = model.parameters()
    n_bytes, n_arrays = saved_bytes(nodes, params)
    assert f"\nnodes: {len(nodes)}\n" in text
    assert f"({n_bytes:,} bytes in {n_arrays} distinct arrays" in text
    assert f"parameters reached: {len(params)} ({sum(p.size for p in params):,} elements)" \
        in text
    assert n_bytes > 4 * 2 * 7 * 16 * 3  # at least the encoder's three dropout masks


def test_explain_leaves_the_graph_usable(tiny):
    model, _ = tiny
    rng = np.random.default_rng(1)
    loss, _ = model.loss(rng.integers(3, 40, (2, 5)), rng.integers(3, 40, (2, 4)),
                         rng.integers(3, 40, (2, 4)))
    first = ex.explain(loss, root=model)
    ex.to_dot(loss, root=model, collapse=2)
    assert ex.explain(loss, root=model) == first
    model.zero_grad()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- DOT ------------------------------------------------------------------------------------
Q = r'"(?:[^"\\]|\\.)*"'  # a DOT quoted string


def parse_dot(text):
    """-> (nodes {id: attributes}, edges [(from, to)], clusters {path: enclosing path},
    node_cluster {id: innermost cluster path or None}); fails on any other statement."""
    lines = text.strip().splitlines()
    assert lines[0] == "digraph tape {" and lines[-1] == "}"
    nodes, edges, clusters, where, stack = {}, [], {}, {}, []
    unq = lambda s: re.sub(r"\\(.)", r"\1", s[1:-1])  # noqa: E731
    for line in lines[1:-1]:
        s = line.strip()
        if m := re.fullmatch(rf"subgraph ({Q}) {{", s):
            path = unq(m[1])
            assert path.startswith("cluster_")
            clusters[path[8:]] = stack[-1] if stack else None
            stack.append(path[8:])
        elif s == "}":
            assert stack, "unbalanced braces"
            stack.pop()
        elif m := re.fullmatch(rf"({Q}) -> ({Q});", s):
            edges.append((unq(m[1]), unq(m[2])))
        elif m := re.fullmatch(rf"({Q}) \[(.*)\];", s):
            nodes[unq(m[1])] = m[2]
            where[unq(m[1])] = stack[-1] if stack else None
        else:
            assert re.fullmatch(r"(rankdir|label)=.*;|(node|graph|edge) \[.*\];", s), s
    assert not stack, "unbalanced braces"
    return nodes, edges, clusters, where


def check_structure(text):
    nodes, edges, clusters, where = parse_dot(text)
    for a, b in edges:
        assert a in nodes and b in nodes and a != b, (a, b)
    assert len(set(edges)) == len(edges), "an edge drawn twice"
    for path, enclosing in clusters.items():  # 'encoder.0.ff' sits in 'encoder.0'
        assert enclosing == (path.rsplit(".", 1)[0] if "." in path else None), path
    for node, attrs in nodes.items():  # each op in its module's cluster
        m = re.search(rf"tooltip=({Q})", attrs)
        if node.startswith("n") and m and m[1] not in ('"-"', '"(model)"'):
            assert where[node] == m[1][1:-1], node
    return nodes, edges, clusters


def test_dot_of_the_hand_built_graph():
    net, out = small_graph()
    nodes, edges, clusters = check_structure(ex.to_dot(out, root=net))
    assert set(edges) == {("c0.0", "n0"), ("p:proj.w", "n0"), ("n0", "n1"), ("p:proj.b", "n1"),
                          ("n1", "n2"), ("n2", "n3"), ("n3", "n4")}
    assert clusters == {"proj": None}
    assert 'label="#3 Square\\n(4,2)' in nodes["n3"]


def test_dot_of_the_tiny_model_and_its_collapsed_views(tiny):
    model, loss = tiny
    full = check_structure(ex.to_dot(loss, root=model))
    assert sum(n.startswith("n") for n in full[0]) == len(reachable(loss))
    assert sum(n.startswith("p:") for n in full[0]) == len(model.parameters())
    assert {"encoder", "encoder.0", "encoder.0.self_attn", "decoder.0.cross_attn.wq"} \
        <= set(full[2])
    two = check_structure(ex.to_dot(loss, root=model, collapse=2))
    one = check_structure(ex.to_dot(loss, root=model, collapse=1))
    assert len(one[0]) <= len(two[0]) < len(full[0])  # equal with one layer a side
    assert set(two[2]) == {"encoder", "decoder", "emb_drop"} and one[2] == {}
    assert ("m:encoder.0", "m:decoder.0") in two[1] and ("m:encoder", "m:decoder") in one[1]
    assert ("m:decoder.0", "n51") in two[1]  # into the loss, outside every module
    assert "m:emb_drop/1" in one[0] and "m:emb_drop/2" in one[0]  # applied twice, unrelated
    attn = check_structure(ex.to_dot(loss, root=model, collapse={"encoder.0.self_attn"}))
    assert ("m:encoder.0.self_attn", "n13") in attn[1]  # -> #13 DropoutResidual (sub1)
    assert "n10" not in attn[0] and "p:encoder.0.self_attn.wq.weight" not in attn[0]


def test_dot_quotes_names_and_checks_collapse():
    w = Tensor(np.ones((2, 2), np.float32), requires_grad=True, name='w "odd" \\ name')
    text = ex.to_dot((Tensor(np.ones((3, 2), np.float32)) @ w).sum())
    nodes, _, _ = check_structure(text)
    assert 'label="w \\"odd\\" \\\\ name\\n(2,2) f32"' in nodes["p0"]
    with pytest.raises(ValueError):
        ex.to_dot((w * 2).sum(), collapse=0)
    with pytest.raises(TypeError):
        ex.to_dot((w * 2).sum(), collapse="encoder")
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg"], input=text, text=True, check=True, capture_output=True)


def test_render_with_graphviz(tiny, tmp_path):
    model, loss = tiny
    text = ex.to_dot(loss, root=model, collapse=2)
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (apt-get install graphviz): "
                    "DOT checked by the structural parser only")
    assert ex.render(text, str(tmp_path / "g.svg")) is True
    assert "<svg" in (tmp_path / "g.svg").read_text()
    assert (tmp_path / "g.dot").read_text() == text
    full = tmp_path / "full.svg"  # the whole graph, nested clusters and all
    assert ex.render(ex.to_dot(loss, root=model), str(full)) and full.stat().st_size > 0


def test_render_says_what_to_do_without_dot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert ex.render("digraph tape {\n}\n", str(tmp_path / "g.png")) is False
    assert (tmp_path / "g.dot").exists()
    assert "apt-get install graphviz" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ex.render("digraph tape {\n}\n", str(tmp_path / "g.txt"))


def test_the_readmes_explain_example_runs_and_prints_what_it_shows(capsys):
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    code, shown = re.search(r"```python\n((?:(?!```).)*?"  # (one block: no ``` inside)
                            r"print\(mt\.explain\(loss, root=model\)\)\n)```\n```\n(.*?)```",
                            readme, re.S).groups()
    exec(code, {})
    printed = capsys.readouterr().out.splitlines()
    for line in shown.splitlines():
        assert line == "..." or line in printed, line


def test_an_input_that_requires_grad_is_not_counted_as_a_parameter():
    """A leaf input with requires_grad reaches the graph like a parameter; with a root the
    totals tell them apart (it was counted among the parameters), without one they say
    what the count holds."""
    net, _ = small_graph()
    x = Tensor(np.ones((4, 3), np.float32), requires_grad=True)
    out = (net(x) * 2.0).sum()
    assert ex.explain(out, root=net).endswith(
        "parameters reached: 2 (8 elements); inputs that require grad: 1 (12 elements)\n")
    assert ex.explain(out).endswith(
        "leaves that require grad reached (parameters or inputs): 3 (20 elements)\n")
