"""--max-tokens auto (mt/memfit.py): the memory budget, the worst batch for a token budget,
the fit, and a measurement that leaves the model as it found it."""
import numpy as np
import pytest

from minitransformer.mt import memfit
from minitransformer.mt.data import Batches, DataError
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam


def test_parse_memory():
    assert memfit.parse_memory("8G") == 8 << 30
    assert memfit.parse_memory("1.5GiB") == 3 << 29
    assert memfit.parse_memory("800m") == 800 << 20
    assert memfit.parse_memory("123456") == 123456
    for bad in ("", "G", "-1G", "0", "8 parsecs"):
        with pytest.raises(ValueError, match="--memory"):
            memfit.parse_memory(bad)


def test_default_budget_is_half_of_available_memory_shared_by_ranks(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n")
    assert memfit.default_budget(meminfo=str(meminfo)) == 8000000 * 1024
    assert memfit.default_budget(ranks_here=2, meminfo=str(meminfo)) == 4000000 * 1024


def _pairs(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(4, 50, int(s)).tolist(), rng.integers(4, 50, int(t)).tolist())
            for s, t in rng.integers(1, 40, (n, 2))]


@pytest.mark.parametrize("max_tokens", [30, 256, 1000, 5000])
def test_longest_batch_is_the_worst_batch_the_budget_allows(max_tokens):
    pairs = _pairs()
    batch = memfit.longest_batch(pairs, max_tokens)
    S = max(len(s) for s, _ in batch) + 1
    T = max(len(t) for _, t in batch) + 1
    assert len(batch) == 1 or (len(batch) * S <= max_tokens and len(batch) * T <= max_tokens)
    # no batch data.Batches cuts at this budget is longer, or has more tokens
    b = Batches([s for s, _ in pairs], [t for _, t in pairs], max_tokens, shuffle=False)
    for idx in b.epoch_batches(0):
        cut = b.pairs(idx)
        assert max(max(len(s), len(t)) for s, t in cut) <= max(S, T) - 1
        padded = len(cut) * max(max(len(s) + 1 for s, _ in cut), max(len(t) + 1 for _, t in cut))
        assert padded <= max(max_tokens, len(batch) * max(S, T))


def test_fit_finds_the_largest_budget_that_fits():
    # a step whose memory grows like n * S (activations) + n * S^2 (attention)
    pairs = _pairs(3000, seed=1)
    calls = []

    def measure(batch):
        calls.append(len(batch))
        S = max(max(len(s), len(t)) for s, t in batch) + 1
        return 1000 * len(batch) * S + 30 * len(batch) * S * S

    budget, held = 50_000_000, 5_000_000
    tokens, probes = memfit.fit_max_tokens(measure, pairs, budget, held)
    assert held + measure(memfit.longest_batch(pairs, tokens)) <= budget
    # within a few percent of the largest that fits
    assert held + measure(memfit.longest_batch(pairs, int(tokens * 1.08))) > budget
    assert len(probes) <= 6 and tokens % 64 == 0
    assert memfit.report(tokens, probes, budget).startswith(
        f"--max-tokens auto: {tokens} (memory budget 48 MiB; ")


def test_fit_refuses_a_budget_too_small_for_any_batch():
    with pytest.raises(DataError, match="raise --memory"):
        memfit.fit_max_tokens(lambda batch: 10**9, _pairs(), 10**8, 0)


def test_a_measured_step_leaves_the_model_as_it_was():
    cfg = TransformerConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1)
    model = Transformer(cfg, seed=1)
    optim = Adam(model.parameters(), lr=0.0)
    state = model.rng.get_state()
    pairs = _pairs()
    small = memfit.step_peak(model, optim, memfit.longest_batch(pairs, 100), cfg)
    large = memfit.step_peak(model, optim, memfit.longest_batch(pairs, 2000), cfg)
    assert 0 < small < large
    assert model.rng.get_state() == state
    assert all(not np.any(g) for g in optim.gradients() if g is not None)


# ---- train.py --max-tokens auto / --memory, and the out-of-memory message ------------------
SMALL = ["--synthetic-pairs", "800", "--d-model", "32", "--n-heads", "2", "--d-ff", "64",
         "--vocab-size", "120", "--no-progress", "--log-every", "5", "--warmup", "10",
         "--valid-bleu-sentences", "10", "--test-split", "", "--max-updates", "12",
         "--valid-every", "6"]


def _train(*args):
    from minitransformer.mt import train as train_cli
    return train_cli.main(SMALL + list(args))


def _params(path):
    from minitransformer.mt import checkpoint as ckpt
    return ckpt.load_checkpoint(path)[0]


def test_auto_trains_as_the_budget_it_chose(tmp_path, capsys):
    import json
    import re
    from minitransformer.mt import memfit
    auto = tmp_path / "auto"
    # the budget: what this (test) process holds now, which grows over the suite, plus 200M
    memory = f"{memfit.in_use() // 2**20 + 200}M"
    assert _train("--run-dir", str(auto), "--max-tokens", "auto", "--memory", memory) == 0
    err = "".join(capsys.readouterr())
    budget = re.escape(memfit.describe(memfit.parse_memory(memory)))
    chosen = int(re.search(rf"--max-tokens auto: (\d+) \(memory budget {budget}", err).group(1))
    saved = json.loads((auto / "config.json").read_text())["train"]
    assert saved["max_tokens"] == chosen and saved["memory"] == memory
    # the measuring steps left nothing behind: the same run with that number given
    given = tmp_path / "given"
    assert _train("--run-dir", str(given), "--max-tokens", str(chosen)) == 0
    a, b = (_params(str(d / "checkpoint_last.npz")) for d in (auto, given))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # a resumed run keeps its number; auto is refused there
    assert _train("--run-dir", str(auto), "--resume", "--max-updates", "14") == 0
    with pytest.raises(SystemExit, match="--max-tokens auto chooses the batch size"):
        _train("--run-dir", str(auto), "--resume", "--max-tokens", "auto")


def test_a_memory_budget_too_small_is_refused_clearly(tmp_path, capsys):
    code = _train("--run-dir", str(tmp_path / "r"), "--max-tokens", "auto", "--memory", "1M")
    assert code == 2
    assert "raise --memory" in "".join(capsys.readouterr())


def test_bad_values_name_the_flag(tmp_path, capsys):
    for flag, value, says in (("--max-tokens", "lots", "'auto'"),
                              ("--memory", "8 parsecs", "8G, 800M")):
        with pytest.raises(SystemExit):
            _train("--run-dir", str(tmp_path / "r"), flag, value)
        err = capsys.readouterr().err
        assert flag in err and says in err


def test_out_of_memory_names_the_batch_and_what_to_pass(tmp_path, capsys, monkeypatch):
    from minitransformer.mt import train as train_cli
    run = tmp_path / "r"
    real, calls = train_cli.train_step, []

    def step(*args, **kwargs):  # the 8th update runs out of memory
        calls.append(1)
        if len(calls) == 8:
            batches = list(args[2])  # (the batch is collated, as in a real step)
            raise MemoryError(f"{len(batches)} batches")
        return real(*args, **kwargs)
    monkeypatch.setattr(train_cli, "train_step", step)
    assert _train("--run-dir", str(run), "--max-tokens", "300") == 1
    err = "".join(capsys.readouterr())
    m = __import__("re").search(r"out of memory at update 8, on a batch of (\d+) pairs padded "
                                r"to (\d+) source and (\d+) target tokens \((\d+) of "
                                r"--max-tokens 300\): pass --max-tokens (\d+)", err)
    assert m, err
    pairs, S, T, tokens, lower = map(int, m.groups())
    assert tokens == pairs * max(S, T) <= 300 and 64 <= lower < tokens
    assert "checkpoints in" in err and "intact" in err
    assert (run / "checkpoint_last.npz").exists()  # (the checkpoint of update 6)
