"""A run that sizes itself (mt/autosize.py): given only --data, the languages and --max-time,
train.py chooses the vocabulary, the model, the batch, the peak rate and subword
regularization from the corpus and the measured update rate; flags still win."""
import json
import math

import pytest

from minitransformer.mt import autosize, options
from minitransformer.mt import train as train_cli
from minitransformer.mt.synthetic import write_corpus


def test_vocabulary_grows_with_the_square_root_of_the_pairs():
    assert autosize.vocab_size(29000) == 6000  # the Multi30k recipe's
    assert autosize.vocab_size(29000 * 4) == 12000
    assert autosize.vocab_size(7250) == 3000
    assert autosize.vocab_size(10) == autosize.MIN_VOCAB
    assert autosize.vocab_size(10 ** 9) == autosize.MAX_VOCAB
    sizes = [autosize.vocab_size(n) for n in (1000, 5000, 20000, 100000, 500000)]
    assert sizes == sorted(sizes) and all(v % 500 == 0 for v in sizes)


def fake_measure(seconds, params, tokens=3000.0):
    """measure(fields) for choose_model from per-rung seconds and parameters."""
    calls = []

    def measure(fields):
        i = autosize.LADDER.index(fields)
        calls.append(i)
        return seconds[i], tokens, params[i]
    return measure, calls


PARAMS = [1e6, 5e6, 20e6, 60e6]
SECONDS = [1.0, 2.0, 4.0, 8.0]  # per update, rung by rung


def test_the_time_budget_limits_the_model():
    # a corpus large enough for every rung; the budget just enough for rung k
    for k in range(4):
        need = autosize.TOKENS_PER_PARAM * PARAMS[k] * SECONDS[k] / 3000
        budget = 1.01 * need / autosize.BUDGET_SHARE
        measure, calls = fake_measure(SECONDS, PARAMS)
        index, notes = autosize.choose_model(1e12, budget, measure)
        assert index == k, notes
        assert calls == list(range(min(k + 2, 4)))  # stops at the first rung too large
        assert all(why is None for *_, why in notes[:k + 1])
        if k < 3:
            assert "trained tokens per parameter" in notes[-1][4]
    # too little time even for the smallest: it is taken all the same
    measure, _ = fake_measure(SECONDS, PARAMS)
    index, notes = autosize.choose_model(1e12, 1.0, measure)
    assert index == 0 and len(notes) == 1 and notes[0][4] is not None


def test_a_small_corpus_limits_the_model():
    for k in range(4):  # time is no limit; the corpus just large enough for rung k
        measure, _ = fake_measure([1e-6] * 4, PARAMS)
        index, notes = autosize.choose_model(1.01 * PARAMS[k] / autosize.PARAMS_PER_TOKEN,
                                             3600, measure)
        assert index == k, notes
        if k < 3:
            assert "parameters per corpus token" in notes[-1][4]


def test_sizing_needs_data_and_a_budget_and_no_preset():
    def sizes(*argv):
        args = options.parse_args(list(argv))
        options.fill_defaults(args)
        return options.sizes_itself(args), args
    on, args = sizes("--data", "d", "--max-time", "30")
    assert on and args.vocab_size is None  # (chosen from the corpus when it is read)
    assert args.subword_alpha == autosize.SUBWORD_ALPHA and args.lr_factor == autosize.LR_FACTOR
    assert args.lr_schedule == "linear"
    # a --warmup given: the factor that keeps the recipe's peak (2 would give 2x it at 1000)
    from minitransformer.optim import noam_lr
    on, chosen = sizes("--data", "d", "--max-time", "30", "--warmup", "1000")
    assert on and chosen.lr_factor == pytest.approx(1.0)
    assert noam_lr(1000, 256, 1000, chosen.lr_factor) == pytest.approx(
        noam_lr(4000, 256, 4000, autosize.LR_FACTOR)) == pytest.approx(2e-3, rel=0.02)
    on, args = sizes("--data", "d", "--max-time", "30", "--subword-alpha", "0",
                     "--lr-factor", "1", "--vocab-size", "4000")
    assert on and (args.subword_alpha, args.lr_factor, args.vocab_size) == (0.0, 1.0, 4000)
    for argv in (["--data", "d"], ["--max-time", "30"],
                 ["--data", "d", "--max-time", "30", "--preset", "tiny"]):
        on, args = sizes(*argv)
        assert not on and args.vocab_size is not None and args.subword_alpha == 0.0, argv


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(str(d), seed=5, n_train=1500, n_valid=30, n_test=5)
    return d


COMMON = ["--src-lang", "src", "--tgt-lang", "tgt", "--max-time", "0.05", "--no-progress",
          "--test-split", "", "--valid-bleu-sentences", "10"]


def run_config(corpus, run_dir, *extra):
    assert train_cli.main(["--data", str(corpus), "--run-dir", str(run_dir), *COMMON,
                           *extra]) == 0
    with open(run_dir / "config.json", encoding="utf-8") as f:
        return json.load(f)


def test_a_run_sizes_itself_and_resumes_with_its_choices(corpus, tmp_path, capsys):
    config = run_config(corpus, tmp_path / "run")
    out = capsys.readouterr().out
    train, model = config["train"], config["model"]
    assert "vocabulary for 1500 training pairs" in out and "model for " in out
    # the rule's 1500 pieces are more than this small synthetic text makes: it gets them all
    limit = train["vocab_size"]
    assert limit == model["vocab_size"] < autosize.vocab_size(1500)
    assert f"the text makes at most {limit} pieces" in out
    rung = {k: model[k] for k in ("d_model", "n_heads", "d_ff", "n_layers")}
    assert rung in autosize.LADDER
    # 1500 short pairs are too few tokens for more than the smallest rung
    assert rung == autosize.LADDER[0] and "parameters per corpus token" in out
    assert train["max_tokens"] == autosize.CPU_TOKENS
    assert train["subword_alpha"] == autosize.SUBWORD_ALPHA
    assert train["lr_factor"] == autosize.LR_FACTOR and train["lr_schedule"] == "linear"
    # --resume keeps every choice (it does not size itself again)
    assert train_cli.main(["--run-dir", str(tmp_path / "run"), "--resume", "--max-time",
                           "0.1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model for " not in out and "vocabulary for " not in out


def test_flags_win_over_the_sizing(corpus, tmp_path):
    config = run_config(corpus, tmp_path / "run", "--d-model", "64", "--n-heads", "2",
                        "--vocab-size", "300", "--max-tokens", "700", "--subword-alpha", "0")
    train, model = config["train"], config["model"]
    assert (model["d_model"], model["n_heads"]) == (64, 2)
    # the fields not given come from the rung chosen
    assert (model["d_ff"], model["n_layers"]) == (autosize.LADDER[0]["d_ff"],
                                                  autosize.LADDER[0]["n_layers"])
    assert (train["vocab_size"], train["max_tokens"], train["subword_alpha"]) == (300, 700, 0)


def test_a_preset_turns_the_sizing_off(corpus, tmp_path, capsys):
    config = run_config(corpus, tmp_path / "run", "--preset", "tiny", "--vocab-size", "300")
    assert "model for " not in capsys.readouterr().out
    assert config["model"]["n_layers"] == 2 and config["train"]["max_tokens"] == 4096
    assert not math.isclose(config["train"]["lr_factor"], autosize.LR_FACTOR)
