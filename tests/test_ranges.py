"""mt/ranges.py: numeric flags with their valid ranges, for the command line and config files."""
import argparse

import pytest

from minitransformer.mt.ranges import add_number, check_ranges, number


@pytest.mark.parametrize("kind,valid,text,value", [
    (int, ">= 1", "3", 3), (int, ">= 0", "0", 0), (float, "> 0", "1e-9", 1e-9),
    (float, "[0, 1)", "0", 0.0), (float, "[0, 1]", "1", 1.0), (float, "any", "-7.5", -7.5)])
def test_values_in_range_convert(kind, valid, text, value):
    assert number(kind, valid)(text) == value


@pytest.mark.parametrize("kind,valid,text,message", [
    (int, ">= 1", "0", "must be an integer >= 1, got '0'"),
    (int, ">= 1", "2.5", "must be an integer >= 1, got '2.5'"),
    (float, "> 0", "0", "must be a number > 0, got '0'"),
    (float, "> 0", "nan", "must be a finite number > 0, got 'nan'"),
    (float, ">= 0", "-inf", "must be a finite number >= 0"),
    (float, "[0, 1)", "1", "must be a number in [0, 1), got '1'"),
    (float, "[0, 1]", "1.01", "must be a number in [0, 1], got '1.01'"),
])
def test_values_out_of_range_are_refused_with_the_range(kind, valid, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        number(kind, valid)(text)


def _parser():
    p = argparse.ArgumentParser()
    add_number(p, "--warmup", int, ">= 1", default=4000, help="warm-up updates")
    add_number(p, "--betas", float, "[0, 1)", nargs=2, default=[0.9, 0.98])
    p.add_argument("--name")
    return p


def test_help_carries_range_and_default():
    text = _parser().format_help()
    assert "warm-up updates (>= 1; default 4000)" in text


def test_config_values_are_checked_like_flags():
    p = _parser()
    options = {"warmup": 10, "betas": [0.5, 0.9], "name": "x", "other": -1}
    assert check_ranges(p, options, "here") == options
    converted = check_ranges(p, {"warmup": 10.0, "betas": [0, 1e-1]}, "here")
    assert converted == {"warmup": 10, "betas": [0.0, 0.1]}  # an integer written as 10.0
    assert type(converted["warmup"]) is int and type(converted["betas"][0]) is float
    for options, message in (({"warmup": 0}, r"here: warmup \(--warmup\) must be an integer"),
                             ({"warmup": True}, "must be an integer >= 1, got 'True'"),
                             ({"warmup": "10"}, "must be an integer >= 1"),
                             ({"betas": [0.5, 1.0]}, r"betas \(--betas\) must be a number in")):
        with pytest.raises(SystemExit, match=message):
            check_ranges(p, options, "here")
