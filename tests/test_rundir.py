"""mt/rundir.py: the run directory's file names, the checkpoint a translation uses, and the
vocabulary check (shared by train.py, translate.py and averaging)."""
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt.rundir import RunDir


def _touch(path, text=""):
    path.write_text(text)
    return str(path)


def test_translation_uses_the_best_else_the_last_checkpoint(tmp_path):
    rd = RunDir(tmp_path)
    _touch(tmp_path / "checkpoint_last.npz")
    assert rd.choose_checkpoints() == [rd.last]
    _touch(tmp_path / "checkpoint_best.npz")
    assert rd.choose_checkpoints() == [rd.best]


def test_averaging_takes_the_newest_periodic_checkpoints_in_update_order(tmp_path):
    rd = RunDir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="--average-last: no checkpoint_<update>.npz"):
        rd.choose_checkpoints(average_last=2)
    for update in (9, 10, 100, 20):  # 100 sorts before 20 as text, not as a number
        _touch(tmp_path / f"checkpoint_{update}.npz")
    _touch(tmp_path / "checkpoint_best.npz")  # neither best nor last is periodic
    _touch(tmp_path / "checkpoint_last.npz")
    assert rd.choose_checkpoints(average_last=2) == [rd.periodic(20), rd.periodic(100)]
    rd.prune(keep_last=3)
    assert [u for u, _ in rd.periodic_checkpoints()] == [10, 20, 100]


def test_a_checkpoint_from_another_vocabulary_is_refused(tmp_path):
    rd = RunDir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="no spm.model"):
        rd.check_vocabulary("x.npz", {})
    _touch(tmp_path / "spm.model", "pieces")
    sha = ckpt.file_sha256(rd.spm_model)
    rd.check_vocabulary("x.npz", {"spm_sha256": sha, "config": {"vocab_size": 7}}, 7)
    rd.check_vocabulary("old.npz", {})  # saved before checkpoints recorded the vocabulary
    with pytest.raises(ckpt.CheckpointError, match="x.npz was trained with another"):
        rd.check_vocabulary("x.npz", {"spm_sha256": "0" * 64})
    with pytest.raises(ckpt.CheckpointError, match="has 8 pieces but .* vocab_size 7"):
        rd.check_vocabulary("x.npz", {"spm_sha256": sha, "config": {"vocab_size": 7}}, 8)


def test_config_round_trip_and_holds_run(tmp_path):
    rd = RunDir(tmp_path / "run")
    (tmp_path / "run").mkdir()
    assert not rd.holds_run()
    rd.write_config({"d_model": 8}, {"seed": 1})
    assert rd.read_config() == {"model": {"d_model": 8}, "train": {"seed": 1}}
    _touch(tmp_path / "run" / "checkpoint_last.npz")
    assert rd.holds_run()
