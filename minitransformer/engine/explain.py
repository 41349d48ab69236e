"""The tape in words and as a picture.

``explain(output, root)`` lists the graph recorded on the tape that produced ``output``, one
line per node; ``to_dot(output, root, collapse)`` draws the same graph in Graphviz's DOT
language, and ``render(dot_text, path)`` writes it and runs ``dot`` where it is installed.
Call them after a forward pass and before ``backward``, which releases the saved arrays.

Conventions of the listing:

- Nodes: those reachable from ``output.node`` through their inputs (the nodes backward
  visits), in tape order (the order the forward pass recorded them); ``#`` is the row.
- Module: the path in ``root`` of the innermost module whose forward applied the op
  (``encoder.0.self_attn.wq``; the root itself is ``(model)``), its class name where there is
  no ``root`` or the module is not below it, ``-`` for an op applied outside every forward.
- Inputs: ``#3 (2,7,16)`` is the result of row 3 and its shape; a parameter is named
  (``root.named_parameters()``, else its ``Tensor.name``, else ``leaf`` and its shape), and a
  name starting with ``.`` belongs to the row's module; a bare shape is a constant (ids, a
  positional table). dtypes (``f32``, ``i64``) are shown where the tape knows them: parameters,
  the output, and results only if the tape's edges record a dtype.
- Saved for backward: the node's attributes that have ``nbytes`` (arrays and NumPy scalars),
  exactly what ``Function.release`` drops. Bytes count memory: a view counts the array that
  owns its memory (its ``base``), each such array once, at the first row that holds it (later
  rows mark it ``^``). A parameter's own array is shown in parentheses and not counted: the
  model keeps it alive with or without the tape.
- Gradient: the first text ``d<name> = ...`` of the Function's class docstring that starts a
  line or follows ``;``, ``:`` or ``returns``, to the end of that line; where there is none and
  the class docstring points to its module docstring, the first line of that docstring that
  starts with ``d<name> =``; else ``-``. Listed once per Function class, below the table.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any, Iterable, Optional, Union

import numpy as np

from .scope import module_paths, path_of
from .tensor import Tensor, _reachable_nodes, contained_arrays

WIDTHS = {"module": 24, "inputs": 30, "saved": 22}  # the listing's longest columns, cut there
FORMULA_WIDTH = 70  # characters of a gradient formula in the listing


# ---- small formatting helpers --------------------------------------------------------------
def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (powers of 1024; bytes below 1024 as '512 B')."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def _dtype_text(dtype) -> str:
    """float32 -> 'f32', int64 -> 'i64', bool -> 'bool'."""
    d = np.dtype(dtype)
    return "bool" if d.kind == "b" else f"{d.kind}{8 * d.itemsize}"


def _shape_text(shape, dtype=None) -> str:
    """(2, 7, 16), float32 -> '(2,7,16) f32'; (16,) -> '(16,)'; the dtype only when known."""
    shape = tuple(shape)
    text = f"({shape[0]},)" if len(shape) == 1 else "(" + ",".join(map(str, shape)) + ")"
    return text if dtype is None else f"{text} {_dtype_text(dtype)}"


def _cut(text: str, width: int, middle: bool = False) -> str:
    """``text`` in at most ``width`` characters: '...' replaces its end (or its middle)."""
    if len(text) <= width:
        return text
    if not middle:
        return text[:width - 3] + "..."
    head = (width - 3) // 2
    return text[:head] + "..." + text[len(text) - (width - 3 - head):]


def _table(header: list, rows: list, right: Iterable[int] = ()) -> list:
    """Rows of strings as aligned lines (columns ``right`` right-aligned), the header first."""
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    lines = []
    for r in [header] + rows:
        cells = [r[c].rjust(w) if c in right else r[c].ljust(w) for c, w in enumerate(widths)]
        lines.append("  ".join(cells).rstrip())
    return lines


# ---- gradients, read from the docstrings ----------------------------------------------------
_GRADIENT = re.compile(r"(?:^|;\s+|:\s+|returns\s+)(d[A-Za-z_]\w*~?\s*=(?!=).*)$")
_GRADIENT_LINE = re.compile(r"^(d[A-Za-z_]\w*~?\s*=(?!=).*)$")


def _first_match(doc: Optional[str], pattern) -> Optional[str]:
    for line in (doc or "").splitlines():
        m = pattern.search(line.strip())
        if m:  # to the end of the line, or of its first sentence
            text = re.split(r"(?<=\.)\s+(?=[A-Z])", m.group(1).strip())[0]
            return re.sub(r"\s{3,}", "  ", text)
    return None


def gradient_formula(function_class: type) -> str:
    """The first line of the gradient formula in a Function's docstring (the module
    docstring's conventions), e.g. Mul -> 'da = dy * b, db = dy * a.'; '-' when none."""
    doc = function_class.__doc__
    found = _first_match(doc, _GRADIENT)
    if found is None and "module docstring" in " ".join((doc or "").split()):
        module = sys.modules.get(function_class.__module__)
        found = _first_match(getattr(module, "__doc__", None), _GRADIENT_LINE)
    return found or "-"


# ---- the graph behind a tensor ---------------------------------------------------------------
def _is_parameter(t) -> bool:
    """A leaf that needs a gradient: the engine keeps it as the Tensor itself."""
    return isinstance(t, Tensor) and t.node is None and t.requires_grad


def saved_arrays(fn) -> list:
    """(attribute, array) pairs a node holds for backward: its attributes with ``nbytes``
    (arrays, NumPy scalars), and the arrays in its tuple, list and dict attributes (named
    ``attr[i]`` / ``attr[key]``): what ``Function.release`` drops."""
    out = []
    for k, v in vars(fn).items():
        if k == "inputs":
            continue
        if hasattr(v, "nbytes") and hasattr(v, "shape"):
            out.append((k, v))
        else:
            out += [(f"{k}[{i}]", x) for i, x in contained_arrays(v)]
    return out


def _owner(a):
    """The array that owns ``a``'s memory: ``a``, or the end of its chain of bases."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


class _Tape:
    """What the listing and the picture need of the graph behind ``output``: its nodes in
    tape order, the shape of each node's result, the parameters reached and their names."""

    def __init__(self, output: Tensor, root: Any = None) -> None:
        self.output, self.has_root = output, root is not None
        self.nodes = [] if output.node is None else _reachable_nodes(output.node)[::-1]
        self.row = {id(fn): i for i, fn in enumerate(self.nodes)}
        self.paths = module_paths(root)
        self.names = {} if root is None else {id(p): n for n, p in root.named_parameters()}
        self.results = self._results()
        self.params = list({id(t): t for fn in self.nodes for t in fn.inputs
                            if _is_parameter(t)}.values())

    def _results(self) -> dict:
        """id(node) -> (shape, dtype or None) of its result, read from its consumers' edges."""
        results = {}
        for fn in self.nodes:
            for t in fn.inputs:
                if t.node is not None:
                    results[id(t.node)] = (tuple(t.shape), getattr(t, "dtype", None))
        if self.nodes:
            results[id(self.output.node)] = (tuple(self.output.shape), self.output.dtype)
        return results

    def module(self, fn) -> Optional[str]:
        """The node's module path, its class name, or None (see the module docstring)."""
        return path_of(getattr(fn, "module", None), self.paths)

    def param_name(self, p: Tensor, where: Optional[str] = None) -> str:
        """The parameter's name, relative ('.weight') when it belongs to module ``where``."""
        name = self.names.get(id(p)) or p.name
        if name is None:
            return "leaf " + _shape_text(p.shape, p.dtype)
        if where and self.names and name.startswith(where + "."):
            return name[len(where):]
        return name

    def result_text(self, fn) -> str:
        return _shape_text(*self.results[id(fn)])

    def input_text(self, t, where: Optional[str]) -> str:
        """One input of a node in the row of module ``where``: '#3 (2,7,16)', a name, a shape."""
        if _is_parameter(t):
            return self.param_name(t, where)
        shape = _shape_text(t.shape, getattr(t, "dtype", None))
        return shape if t.node is None else f"#{self.row[id(t.node)]} {shape}"

    def saved(self) -> tuple:
        """([(labels, new bytes)] per node, total bytes, distinct arrays): the saved-arrays
        accounting of the module docstring."""
        kept = {id(p.data) for p in self.params} | {id(_owner(p.data)) for p in self.params}
        counted, per_node, total = set(), [], 0
        for fn in self.nodes:
            labels, new = [], 0
            for name, a in saved_arrays(fn):
                key = id(_owner(a))
                if id(a) in kept or key in kept:
                    labels.append(f"({name})")
                elif key in counted:
                    labels.append(name + "^")
                else:
                    counted.add(key)
                    new += int(_owner(a).nbytes)
                    labels.append(name)
            per_node.append((labels, new))
            total += new
        return per_node, total, len(counted)


# ---- explain ------------------------------------------------------------------------------------
_HEADER = ["#", "function", "module", "inputs", "output", "saved for backward", "bytes"]


def _rows(tape: _Tape, per_node: list) -> list:
    rows = []
    for i, fn in enumerate(tape.nodes):
        where = tape.module(fn)
        inputs = ", ".join(tape.input_text(t, where) for t in fn.inputs)
        labels, new = per_node[i]
        rows.append([str(i), type(fn).__name__, _cut(where or "-", WIDTHS["module"], True),
                     _cut(inputs, WIDTHS["inputs"]), tape.result_text(fn),
                     _cut(" ".join(labels) or "-", WIDTHS["saved"]),
                     human_bytes(new) if labels else ""])
    return rows


def _gradients(tape: _Tape) -> list:
    """'  Linear  dx = dy W^T; ...' once per Function class, in order of first use."""
    classes = list({type(fn): None for fn in tape.nodes})
    width = max((len(c.__name__) for c in classes), default=0)
    return [f"  {c.__name__.ljust(width)}  {_cut(gradient_formula(c), FORMULA_WIDTH)}"
            for c in classes]


def _headline(tape: _Tape) -> list:
    out = tape.output
    if out.node is None and out.requires_grad:
        return [f"output {_shape_text(out.shape, out.dtype)}: a leaf that requires grad (a "
                "parameter or an input): no op made it, so nothing was recorded"]
    if out.node is None:
        return [f"output {_shape_text(out.shape, out.dtype)}: a leaf, nothing was recorded "
                "(no input needed a gradient, or it was computed under no_grad())"]
    fn = out.node
    lines = [f"output {_shape_text(out.shape, out.dtype)}: made by #{tape.row[id(fn)]} "
             f"{type(fn).__name__} in {tape.module(fn) or '-'}",
             f"{len(tape.nodes)} nodes, in tape order (backward visits them last to first)"]
    if any(getattr(n, "released", False) for n in tape.nodes):
        lines.append("backward has run: the saved arrays were released (run the forward "
                     "pass again to see them)")
    return lines


def _leaves(tape: _Tape) -> str:
    """The totals' last line: the parameters reached (the root's; without a root, every leaf
    that requires grad, which may be an input as well) and their elements."""
    def count(ts):
        return f"{len(ts)} ({sum(int(t.size) for t in ts):,} elements)"
    if not tape.has_root:
        return f"leaves that require grad reached (parameters or inputs): {count(tape.params)}"
    params = [p for p in tape.params if id(p) in tape.names]
    others = [p for p in tape.params if id(p) not in tape.names]
    return f"parameters reached: {count(params)}" + (
        f"; inputs that require grad: {count(others)}" if others else "")


def explain(output: Tensor, root: Any = None) -> str:
    """The recorded graph behind ``output`` as text: a headline (the output's shape and the
    node that made it), one row per node in tape order (module docstring), the gradient
    formula of each Function used, and the totals: nodes, bytes saved for backward,
    parameters reached. ``root``: the model, for module paths and parameter names."""
    tape = _Tape(output, root)
    per_node, total, n_arrays = tape.saved()
    lines = _headline(tape)
    if tape.nodes:
        lines += [""] + _table(_HEADER, _rows(tape, per_node), right=(0, 6))
        lines += ["", "module -: applied outside every module's forward; inputs #i: the "
                  "result of row i", "saved: (name) a leaf's own array (a parameter's, or "
                  "an input's that requires grad), not counted; name^ counted at an earlier "
                  "row", "",
                  "gradients (from each Function's docstring):"]
        lines += _gradients(tape)
    lines += ["", f"nodes: {len(tape.nodes)}",
              f"saved for backward: {human_bytes(total)} ({total:,} bytes in {n_arrays} "
              f"distinct array{'s' * (n_arrays != 1)}, parameters excluded)", _leaves(tape)]
    return "\n".join(lines) + "\n"


# ---- to_dot -------------------------------------------------------------------------------------
def _quote(text: str) -> str:
    """A DOT quoted string: backslashes and quotes escaped, newlines as DOT's centred '\\n'."""
    text = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + text.replace("\n", "\\n") + '"'


def _attrs(**attrs: Any) -> str:
    return "[" + ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items()) + "]"


def _collapse_key(path: Optional[str], collapse: Any) -> Optional[str]:
    """The module path whose box stands for an op of module ``path``, or None (drawn as it
    is): its first ``collapse`` components (an int), or its shortest prefix in ``collapse``."""
    if path is None or collapse is None or path == "(model)":
        return None
    parts = path.split(".")
    if isinstance(collapse, int):
        return ".".join(parts[:collapse]) if len(parts) >= collapse else None
    for k in range(1, len(parts) + 1):
        if ".".join(parts[:k]) in collapse:
            return ".".join(parts[:k])
    return None


def _check_collapse(collapse: Any) -> Any:
    """``collapse`` as a depth >= 1 or a set of paths; TypeError / ValueError otherwise."""
    if collapse is None:
        return None
    if isinstance(collapse, bool) or not isinstance(collapse, (int, set, frozenset, list, tuple)):
        raise TypeError(f"collapse must be a depth (int) or a set of module paths, got "
                        f"{collapse!r}")
    if isinstance(collapse, int):
        if collapse < 1:
            raise ValueError(f"collapse depth must be >= 1, got {collapse}")
        return collapse
    return set(collapse)


def _parent(path: Optional[str]) -> Optional[str]:
    return path.rsplit(".", 1)[0] if path and "." in path else None


class _Boxes:
    """The boxes of the collapsed modules: one per piece of a module's ops and parameters
    connected through each other (a module applied twice to unrelated inputs, like the
    shared embedding dropout, gives two boxes; its parameters hold the calls of one layer
    together)."""

    def __init__(self, tape: _Tape, collapse: Any) -> None:
        self.key = {id(fn): _collapse_key(tape.module(fn), collapse) for fn in tape.nodes}
        for p in tape.params:
            self.key[id(p)] = _collapse_key(_parent(tape.names.get(id(p))), collapse)
        self.parent = {i: i for i, k in self.key.items() if k is not None}
        for fn in tape.nodes:
            for t in fn.inputs:
                source = id(t.node) if t.node is not None else id(t)
                if self.key[id(fn)] is not None and self.key.get(source) == self.key[id(fn)]:
                    self.parent[self._find(source)] = self._find(id(fn))
        self.box, self.ops, self.path = {}, {}, {}  # id -> box; box -> ops; box -> path
        members = [id(fn) for fn in tape.nodes] + [id(p) for p in tape.params]
        self._name_boxes([i for i in members if i in self.parent])

    def _find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _name_boxes(self, members: list) -> None:
        """Box ids 'm:encoder.0', or 'm:emb_drop/1', 'm:emb_drop/2' for a module in pieces."""
        pieces = {}  # module path -> [piece roots, in order of first member]
        for i in members:
            roots = pieces.setdefault(self.key[i], [])
            if self._find(i) not in roots:
                roots.append(self._find(i))
        for i in members:
            path, roots = self.key[i], pieces[self.key[i]]
            k = roots.index(self._find(i))
            box = f"m:{path}" if len(roots) == 1 else f"m:{path}/{k + 1}"
            self.box[i], self.path[box] = box, (path, k, len(roots))
            self.ops.setdefault(box, 0)

    def count_op(self, fn) -> None:
        self.ops[self.box[id(fn)]] += 1

    def items(self, home) -> dict:
        """{box id: (attributes, cluster path)}: each box in its parent module's cluster."""
        items = {}
        for box, (path, k, n) in self.path.items():
            ops = self.ops[box]
            title = path if n == 1 else f"{path} ({k + 1} of {n})"
            label = f"{title}\n{ops} op{'s' * (ops != 1)}"
            items[box] = (_attrs(label=label, shape="box3d", fillcolor="#dde7f7", tooltip=path),
                          home(_parent(path)))
        return items


class _Picture:
    """The drawn items (ops, boxes of collapsed modules, parameters, constants), each with
    the module path of the cluster it sits in (None: top level), and the edges between them."""

    def __init__(self, tape: _Tape, collapse: Any) -> None:
        self.tape, self.boxes = tape, _Boxes(tape, collapse)
        self.items = {}  # id -> (attributes, module path or None)
        self.edges = {}  # (from id, to id) -> None, in order of appearance
        for fn in tape.nodes:
            self._add_node(fn)
        self.items.update(self.boxes.items(self.home))

    def home(self, path: Optional[str]) -> Optional[str]:
        """The cluster of an item of module ``path``: none without a root or for the model."""
        return path if self.tape.has_root and path != "(model)" else None

    def node_id(self, fn) -> str:
        return self.boxes.box.get(id(fn)) or f"n{self.tape.row[id(fn)]}"

    def _add_node(self, fn) -> None:
        tape, path, me = self.tape, self.tape.module(fn), self.node_id(fn)
        if id(fn) in self.boxes.box:
            self.boxes.count_op(fn)
        else:
            label = f"#{tape.row[id(fn)]} {type(fn).__name__}\n{tape.result_text(fn)}"
            bold = {"penwidth": "2"} if fn is tape.output.node else {}
            self.items[me] = (_attrs(label=label, tooltip=path or "-", **bold), self.home(path))
        for slot, t in enumerate(fn.inputs):
            source = self._source(fn, slot, t)
            if source is not None and source != me:
                self.edges[(source, me)] = None

    def _source(self, fn, slot: int, t) -> Optional[str]:
        """The id of the item input ``t`` comes from (declared here if new); None for a
        constant whose consumer is drawn in a box."""
        if t.node is not None:
            return self.node_id(t.node)
        if _is_parameter(t):
            return self.boxes.box.get(id(t)) or self._parameter(t)
        if id(fn) in self.boxes.box:
            return None
        me = f"c{self.tape.row[id(fn)]}.{slot}"  # a constant: drawn beside its consumer
        attrs = _attrs(label="const " + _shape_text(t.shape), shape="plaintext", style="")
        self.items[me] = (attrs, self.home(self.tape.module(fn)))
        return me

    def _parameter(self, p: Tensor) -> str:
        """A parameter's item, in the cluster of the module that owns it (its name's prefix),
        labelled by its name in that module."""
        name = self.tape.names.get(id(p))
        owner = _parent(name) if name else None
        me = f"p:{name}" if name else f"p{self.tape.params.index(p)}"
        label = self.tape.param_name(p, owner) if name else (p.name or "leaf")
        label = label.lstrip(".") + "\n" + _shape_text(p.shape, p.dtype)
        attrs = _attrs(label=label, shape="ellipse", fillcolor="#fff4d6")
        self.items[me] = (attrs, self.home(owner))
        return me


def _cluster_tree(items: dict) -> dict:
    """{'items': [ids at this level], 'children': {path: subtree}} from the items' homes;
    each dotted prefix of a home is a cluster ('encoder' holds 'encoder.0')."""
    tree = {"items": [], "children": {}}
    for item, (_, home) in items.items():
        node, parts = tree, home.split(".") if home else []
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            node = node["children"].setdefault(prefix, {"items": [], "children": {}})
        node["items"].append(item)
    return tree


def _emit(tree: dict, items: dict, indent: str) -> list:
    lines = [f"{indent}{_quote(i)} {items[i][0]};" for i in tree["items"]]
    for path, sub in tree["children"].items():
        lines.append(f"{indent}subgraph {_quote('cluster_' + path)} {{")
        lines.append(f"{indent}  label={_quote(path)};")
        lines += _emit(sub, items, indent + "  ")
        lines.append(f"{indent}}}")
    return lines


def to_dot(output: Tensor, root: Any = None,
           collapse: Optional[Union[int, Iterable[str]]] = None) -> str:
    """The recorded graph behind ``output`` as Graphviz DOT text (render: ``render``).

    Ops are boxes ('#4 Linear' and the result's shape), parameters ellipses (by name),
    constants plain shapes; edges run with the data. With ``root`` each module is a cluster
    (nested: ``encoder`` > ``encoder.0`` > ``encoder.0.self_attn``). ``collapse``: a depth
    (2: ``encoder.0``, ``decoder.1``, ...) or a set of module paths, each drawn as one box.
    """
    collapse = _check_collapse(collapse)
    tape = _Tape(output, root)
    picture = _Picture(tape, collapse)
    lines = ["digraph tape {", "  rankdir=TB;",
             '  node [shape="box", style="rounded,filled", fillcolor="#eef3fb", '
             'fontname="Helvetica", fontsize="10"];',
             '  graph [fontname="Helvetica", fontsize="10", style="rounded", color="#7f8ea3"];',
             '  edge [arrowsize="0.6"];']
    if output.node is None:
        lines.append(f'  "output" {_attrs(label="leaf " + _shape_text(output.shape))};')
    lines += _emit(_cluster_tree(picture.items), picture.items, "  ")
    lines += [f"  {_quote(a)} -> {_quote(b)};" for a, b in picture.edges]
    return "\n".join(lines + ["}"]) + "\n"


# ---- render -------------------------------------------------------------------------------------
FORMATS = ("svg", "png", "pdf")


def render(dot_text: str, path: str) -> bool:
    """Write ``dot_text`` to ``path`` with the suffix .dot and, where Graphviz's ``dot`` is
    installed, render it to ``path`` in the format its extension names (.svg, .png, .pdf).
    -> whether it rendered; False with a message on stderr when ``dot`` is missing (and for
    a .dot ``path``, which is only written)."""
    stem, ext = os.path.splitext(path)
    fmt = ext.lstrip(".").lower()
    if fmt not in FORMATS + ("dot", "gv"):
        raise ValueError(f"render: {path!r} should end in .svg, .png, .pdf or .dot")
    dot_path = path if fmt in ("dot", "gv") else stem + ".dot"
    with open(dot_path, "w", encoding="utf-8") as f:
        f.write(dot_text)
    if dot_path == path:
        return False
    exe = shutil.which("dot")
    if exe is None:
        print(f"render: Graphviz's dot is not installed, so only {dot_path} was written; "
              f"install graphviz (apt-get install graphviz, brew install graphviz) and run: "
              f"dot -T{fmt} {dot_path} -o {path}", file=sys.stderr)
        return False
    res = subprocess.run([exe, f"-T{fmt}", dot_path, "-o", path], capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise RuntimeError(f"dot -T{fmt} {dot_path} failed: {res.stderr.strip()}")
    return True
