"""Numeric flags with their valid ranges, checked when the command line is parsed.

``add_number(group, "--warmup", int, ">= 1", default=4000, help=...)`` declares a flag whose
value argparse converts and checks (the range is appended to its ``--help`` text, with the
default), and records the range so that values from a config file, which argparse does not
convert, are checked the same way by ``check_ranges(parser, options, source)``. A bad value
is refused with the flag, the range and the value::

    train.py: error: argument --warmup: must be an integer >= 1, got '0'
"""
import argparse
import math

RANGE_ATTR = "valid_range"  # set on the argparse action: (kind, text), for check_ranges


def _predicate(text):
    """'>= 1', '> 0', '[0, 1)', '[0, 1]', 'any' -> (test, description)."""
    if text == "any":
        return (lambda v: True), "a number"
    if text.startswith("["):
        lo, hi = (float(s) for s in text[1:-1].split(","))
        closed = text.endswith("]")
        return ((lambda v: lo <= v <= hi) if closed else (lambda v: lo <= v < hi)), f"in {text}"
    op, bound = text.split()
    bound = float(bound)
    tests = {">=": lambda v: v >= bound, ">": lambda v: v > bound}
    return tests[op], f"{op} {bound:g}"


def number(kind, valid, auto=False):
    """An argparse ``type``: converts to ``kind`` (int or float), then checks ``valid``;
    with ``auto`` the word 'auto' is taken as it is."""
    test, where = _predicate(valid)
    noun = "an integer" if kind is int else "a number"
    if auto:
        where += " or 'auto'"

    def convert(text):
        if auto and str(text).strip().lower() == "auto":
            return "auto"
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {noun} {where}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {where}, got {text!r}")
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {noun} {where}, got {text!r}")
        return value
    convert.__name__ = f"{kind.__name__} {where}"
    return convert


def add_number(group, flag, kind, valid, help=None, auto=False, **kw):
    """``group.add_argument(flag, type=number(kind, valid, auto), ...)``, the range and the
    default in the help text; ``auto``: the flag also takes the word 'auto'."""
    extra = [] if valid == "any" else [_predicate(valid)[1] + (" or 'auto'" if auto else "")]
    if kw.get("default") is not None and kw.get("nargs") is None:
        extra.append(f"default {kw['default']:g}" if isinstance(kw["default"], float)
                     else f"default {kw['default']}")
    text = (help + " " if help else "") + (f"({'; '.join(extra)})" if extra else "")
    action = group.add_argument(flag, type=number(kind, valid, auto), help=text or None, **kw)
    setattr(action, RANGE_ATTR, (kind, valid, auto))
    return action


def check_ranges(parser, options, source):
    """Check numeric options that do not come through argparse's conversion (a config file's
    values), ``options`` a dict {dest: value}: -> the options with those values converted to
    the flag's type (10.0 for an integer option becomes 10), or SystemExit naming the option,
    ``source`` and the range. None values (unset, filled in later) pass."""
    options = dict(options)
    for action in parser._actions:
        kind, valid, auto = getattr(action, RANGE_ATTR, (None, None, False))
        value = options.get(action.dest)
        if kind is None or value is None or (auto and value == "auto"):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        converted = []
        for v in values:
            ok_type = isinstance(v, (int, float)) and not isinstance(v, bool) and \
                (kind is float or float(v).is_integer())
            text = (str(int(v)) if kind is int else str(v)) if ok_type else repr(v)
            try:
                converted.append(number(kind, valid)(text))
            except argparse.ArgumentTypeError as exc:
                flag = action.option_strings[0]
                raise SystemExit(f"error: {source}: {action.dest} ({flag}) {exc}") from None
        options[action.dest] = converted if isinstance(value, (list, tuple)) else converted[0]
    for action in parser._actions:  # switches take booleans, choices one of theirs
        if action.dest not in options or options[action.dest] is None or not action.option_strings:
            continue
        value, flag = options[action.dest], action.option_strings[0]
        switch = isinstance(action, argparse.BooleanOptionalAction) or (
            isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool))
        if switch and not isinstance(value, bool):  # ("false" would read as true)
            raise SystemExit(f"error: {source}: {action.dest} ({flag}) must be true or false "
                             f"(a boolean, not {value!r})")
        if action.choices is not None and value not in action.choices:
            raise SystemExit(f"error: {source}: {action.dest} ({flag}) must be one of "
                             f"{', '.join(map(repr, action.choices))}, not {value!r}")
    return options
