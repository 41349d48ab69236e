"""mt/rundir.py: the run directory's file names, the checkpoint a translation uses, and the
vocabulary check (shared by train.py, translate.py and averaging)."""
import json
import os

import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt.rundir import RunDir, RunDirBusy


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


def test_one_training_run_holds_the_directory(tmp_path):
    """The lock is exclusive (a second holder, even in this process, is refused with who
    holds it) and released by unlock (and by the OS when the process ends)."""
    first, second = RunDir(tmp_path), RunDir(tmp_path)
    first.lock()
    try:
        with pytest.raises(RunDirBusy, match=rf"PID {os.getpid()}, since "):
            second.lock()
    finally:
        first.unlock()
    second.lock()  # free again
    second.unlock()


def test_trim_metrics_keeps_each_update_once(tmp_path):
    rd = RunDir(tmp_path)
    records = [{"update": u, "loss": 1.0} for u in (1, 2, 4, 6)] + \
        [{"update": 4, "valid_loss": 2.0}, {"update": 8, "loss": 0.5}]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"update": 9, "lo'  # cut by a kill
    with open(rd.metrics, "w") as fh:
        fh.write(text)
    assert rd.trim_metrics(4) == 3
    with open(rd.metrics) as fh:
        assert [json.loads(line)["update"] for line in fh] == [1, 2, 4, 4]
    assert rd.trim_metrics(4) == 0  # nothing more to drop: the file is left alone
    with open(rd.metrics, "a") as fh:  # a whole record that lost its newline
        fh.write('{"update": 5, "loss": 1.0}')
    assert rd.trim_metrics(6) == 0
    with open(rd.metrics) as fh:
        assert fh.read().endswith('{"update": 5, "loss": 1.0}\n')  # the next one goes below


def test_trim_metrics_keeps_the_scores_translate_py_recorded(tmp_path):
    """A score translate.py --record added carries the last logged update, which a run
    killed after it and resumed from an earlier checkpoint drops: kept (it was deleted)."""
    rd = RunDir(tmp_path)
    records = [{"update": 4, "loss": 1.0}, {"update": 6, "loss": 0.9},
               {"update": 6, "test_bleu": 20.0, "recorded_by": "translate.py"}]
    with open(rd.metrics, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    assert rd.trim_metrics(4) == 1
    with open(rd.metrics) as fh:
        assert [json.loads(line) for line in fh] == [records[0], records[2]]


def test_append_record_puts_the_record_on_a_line_of_its_own(tmp_path):
    """A last line without its newline: a whole record (an edited file) is kept and ended,
    one cut short by a kill is cut off; either way the new record is a line of its own."""
    rd = RunDir(tmp_path)
    new = {"update": 9, "test_bleu": 1.0, "recorded_by": "translate.py"}
    for before, kept in (('{"update": 4, "loss": 1.0}\n', [{"update": 4, "loss": 1.0}]),
                         ('{"update": 4, "loss": 1.0}', [{"update": 4, "loss": 1.0}]),
                         ('{"update": 4, "loss": 1.0}\n{"update": 5, "lo',
                          [{"update": 4, "loss": 1.0}]),
                         ('{"upd', []), ("", [])):
        with open(rd.metrics, "w") as fh:
            fh.write(before)
        rd.append_record(new)
        with open(rd.metrics) as fh:
            text = fh.read()
        assert text.endswith("\n") and [json.loads(line) for line in text.splitlines()] == \
            kept + [new], (before, text)
    # train.py's own test record goes through it too
    with open(rd.metrics, "w") as fh:
        fh.write('{"update": 4, "loss": 1.0}\n{"update": 5, "lo')
    test = {"update": 4, "test_split": "test", "test_bleu": 2.0, "test_checkpoints": "x"}
    rd.add_test_record(test)
    with open(rd.metrics) as fh:
        assert [json.loads(line) for line in fh] == [{"update": 4, "loss": 1.0}, test]


def test_a_test_scored_again_the_same_way_replaces_its_record(tmp_path):
    """A finished run resumed to be tested again (same update, split, checkpoints, beam and
    alpha): one record (each resume appended another); scored another way: a new one."""
    rd = RunDir(tmp_path)
    test = {"update": 6, "test_split": "test", "test_bleu": 20.0, "test_signature": "s",
            "test_checkpoints": "checkpoint_best.npz", "beam": 4, "alpha": 0.6, "time": 9.0}
    with open(rd.metrics, "w") as fh:
        fh.write(json.dumps({"update": 6, "loss": 1.0}) + "\n")
    rd.add_test_record(test)
    rd.add_test_record({**test, "time": 9.5})
    rd.add_test_record({**test, "beam": 1, "test_bleu": 19.0})
    with open(rd.metrics) as fh:
        recs = [json.loads(line) for line in fh]
    assert recs == [{"update": 6, "loss": 1.0}, {**test, "time": 9.5},
                    {**test, "beam": 1, "test_bleu": 19.0}]


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    rd = RunDir(tmp_path)
    ours = [".tmp-a1b2c3d4checkpoint_last.npz", ".tmp-_x9Yq0z_config.json",
            ".tmp-abcdefghcheckpoint_1200.npz", ".tmp-abcdefghmetrics.jsonl"]
    others = ["checkpoint_last.npz", "notes.tmp", ".tmp-abcdefghavg.npz",  # another writer's
              ".tmp-short.npz"]
    for name in ours + others:
        (tmp_path / name).write_text("x")
    assert rd.remove_stale_temporaries() == sorted(ours)
    assert sorted(os.listdir(tmp_path)) == sorted(others)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_files_written_atomically_get_the_permissions_of_open(tmp_path, mask):
    # atomic_write's temporary (mkstemp: 0600) takes the mode open() would give the file,
    # 0666 less the umask, so that a run directory can be shared with a group
    from minitransformer.mt.fileio import atomic_write_text, umask
    saved = os.umask(mask)
    try:
        assert umask() == mask
        atomic_write_text(str(tmp_path / "config.json"), "{}\n")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(saved)
    modes = {name: os.stat(tmp_path / name).st_mode & 0o777
             for name in ("config.json", "plain.txt")}
    assert modes == {"config.json": 0o666 & ~mask, "plain.txt": 0o666 & ~mask}, modes


def test_a_file_system_that_refuses_chmod_still_gets_the_file(tmp_path, monkeypatch):
    # vfat and some mounts refuse chmod: the file is written all the same (mkstemp's mode)
    import errno
    from minitransformer.mt import fileio

    def refuse(fd, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(fileio.os, "fchmod", refuse)
    fileio.atomic_write_text(str(tmp_path / "config.json"), "{}\n")
    assert (tmp_path / "config.json").read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary left
