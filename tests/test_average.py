"""python -m minitransformer.mt.average: the mean of a run's newest periodic checkpoints, and
the mistakes it refuses (one line, exit 2) without touching what is there."""
import hashlib
import os

import numpy as np
import pytest

from minitransformer.mt import average
from minitransformer.mt import checkpoint as ckpt
from minitransformer.nn.transformer import Transformer, TransformerConfig

CFG = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=1)


@pytest.fixture
def run(tmp_path):
    """A run directory with periodic checkpoints at updates 10, 20, 30 (models of seeds 1-3)
    and checkpoint_last.npz (with optimizer state: the one --resume needs)."""
    from minitransformer.optim import Adam
    d = tmp_path / "run"
    d.mkdir()
    for seed, update in ((1, 10), (2, 20), (3, 30)):
        ckpt.save_checkpoint(str(d / f"checkpoint_{update}.npz"), Transformer(CFG, seed=seed),
                             None, {"update": update})
    model = Transformer(CFG, seed=3)
    ckpt.save_checkpoint(str(d / "checkpoint_last.npz"), model, Adam(model.parameters()),
                         {"update": 30})
    return d


def digest(directory):
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(directory)) if (directory / n).is_file()}


def test_the_average_of_the_newest_checkpoints(run, capsys):
    assert average.main(["--run-dir", str(run), "--last", "2", "--output",
                         str(run / "avg.npz")]) == 0
    assert "average of 2 checkpoints" in capsys.readouterr().out
    got = ckpt.load_checkpoint(str(run / "avg.npz"), optimizer=False)[0]
    two = [ckpt.load_checkpoint(str(run / f"checkpoint_{u}.npz"), optimizer=False)[0]
           for u in (20, 30)]
    for name, value in got.items():
        expect = ((two[0][name].astype(np.float64) + two[1][name]) / 2).astype(np.float32)
        assert np.array_equal(value, expect), name
    # more than the run has: those it has, and a warning
    assert average.main(["--run-dir", str(run), "--last", "5", "--output",
                         str(run / "avg5.npz")]) == 0
    captured = capsys.readouterr()
    assert "warning: --last 5" in captured.err and "average of 3 checkpoints" in captured.out


@pytest.mark.parametrize("case", ["run-checkpoint", "existing", "directory", "no-parent",
                                  "no-periodic", "no-run", "run-file", "run-file-force"])
def test_mistakes_are_one_line_and_change_nothing(run, tmp_path, capsys, case):
    (run / "avg.npz").write_bytes(b"an earlier average")
    if case == "no-periodic":
        for u in (10, 20, 30):
            os.unlink(run / f"checkpoint_{u}.npz")
    output, run_dir, words = {
        "run-checkpoint": (run / "checkpoint_last.npz", run, "named like a run's own"),
        "existing": (run / "avg.npz", run, "exists; give another name, or --force"),
        "directory": (run, run, "is a directory"),
        "no-parent": (tmp_path / "nodir" / "avg.npz", run, "does not exist"),
        "no-periodic": (run / "new.npz", run, "no checkpoint_<update>.npz to average"),
        "no-run": (tmp_path / "avg.npz", tmp_path / "typo", "--run-dir"),
        "run-file": (run / "spm.model", run, "a .npz checkpoint; give a name ending in .npz"),
        "run-file-force": (run / "metrics.jsonl", run, "give a name ending in .npz"),
    }[case]
    for name in ("spm.model", "metrics.jsonl"):  # (a run's own files, not checkpoints)
        (run / name).write_bytes(b"the run's " + name.encode())
    before = digest(run)
    force = ["--force"] if case.endswith("-force") else []
    code = average.main(["--run-dir", str(run_dir), "--output", str(output), *force])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err, err
    assert len(err.splitlines()) == 1 and digest(run) == before
    assert not os.path.exists(tmp_path / "nodir")


def test_force_replaces_an_earlier_average_and_last_must_be_positive(run, capsys):
    (run / "avg.npz").write_bytes(b"an earlier average")
    assert average.main(["--run-dir", str(run), "--output", str(run / "avg.npz"),
                         "--force"]) == 0
    ckpt.load_checkpoint(str(run / "avg.npz"), optimizer=False)  # a checkpoint now
    for last in ("0", "-2"):
        with pytest.raises(SystemExit) as info:
            average.main(["--run-dir", str(run), "--last", last, "--output",
                          str(run / "x.npz")])
        assert info.value.code == 2 and "--last: must be an integer >= 1" in \
            capsys.readouterr().err


def test_checkpoints_of_different_vocabularies_are_not_averaged(tmp_path):
    # the same model shapes trained with other sentencepiece models: other words, so their
    # mean is no model at all; a checkpoint that does not record its vocabulary averages with
    # any, and the average carries the vocabulary the others record
    paths = []
    for seed, sha in ((1, None), (2, "a" * 64), (3, "a" * 64), (4, "b" * 64)):
        paths.append(str(tmp_path / f"c{seed}.npz"))
        ckpt.save_checkpoint(paths[-1], Transformer(CFG, seed=seed), None,
                             {} if sha is None else {"spm_sha256": sha})
    _, meta = ckpt.average_checkpoints(paths[:3])
    assert meta["spm_sha256"] == "a" * 64
    for order in (paths, [paths[3], paths[0], paths[1]]):
        with pytest.raises(ckpt.CheckpointError, match="different sentencepiece vocabularies") \
                as info:
            ckpt.average_checkpoints(order)
        assert paths[1] in str(info.value) and paths[3] in str(info.value)
