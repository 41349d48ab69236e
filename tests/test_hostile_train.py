"""train.py against a hostile user and a hostile machine, at the command line.

Every case runs train.py in a subprocess and asserts: the exit status, that stderr holds no
traceback, that the message names the flag, file or line at fault, and that the files of the
run directory involved are unchanged (or, where the run goes on, still load). Cases that
need a trained run copy one trained once for the module.
"""
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
SMALL = ["--synthetic-pairs", "600", "--d-model", "16", "--n-heads", "2", "--d-ff", "32",
         "--n-layers", "1", "--max-tokens", "400", "--vocab-size", "100", "--no-progress",
         "--log-every", "2", "--warmup", "20", "--valid-bleu-sentences", "5", "--test-split",
         ""]


def train(*args, timeout=240, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def python(code, timeout=240):
    """Run ``code`` (which calls train.py's main) in a fresh interpreter, as train.py would."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def digest(directory, skip=("train.lock",)):
    """{name: sha256} of the files directly in ``directory`` (not data/, not ``skip``)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and name not in skip:
            with open(path, "rb") as fh:
                out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


def clean_failure(proc, status, *names):
    """Exit ``status``, no traceback, every one of ``names`` in stderr."""
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for name in names:
        assert name in proc.stderr, (name, proc.stderr[-3000:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run of 6 updates, validated (and saved) at 3 and 6."""
    run = str(tmp_path_factory.mktemp("hostile") / "run")
    proc = train(*SMALL, "--run-dir", run, "--max-updates", "6", "--valid-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run, free to damage."""
    dst = str(tmp_path / "run")
    shutil.copytree(trained, dst)
    return dst


# ---- flags refused as the command line is parsed, with the range in the message ------------
BAD_FLAGS = [
    (["--warmup", "0"], "--warmup: must be an integer >= 1"),
    (["--warmup", "-5"], "--warmup: must be an integer >= 1"),
    (["--warmup", "1.5"], "--warmup: must be an integer >= 1"),
    (["--update-freq", "0"], "--update-freq: must be an integer >= 1"),
    (["--lr-factor", "-1"], "--lr-factor: must be a number > 0"),
    (["--lr-factor", "nan"], "--lr-factor: must be a finite number > 0"),
    (["--label-smoothing", "1.5"], "--label-smoothing: must be a number in [0, 1)"),
    (["--dropout", "1"], "--dropout: must be a number in [0, 1)"),
    (["--clip-norm", "-1"], "--clip-norm: must be a number >= 0"),
    (["--beam", "0"], "--beam: must be an integer >= 1"),
    (["--alpha", "-0.1"], "--alpha: must be a number >= 0"),
    (["--average-last", "-2"], "--average-last: must be an integer >= 0"),
    (["--max-tokens", "0"], "--max-tokens: must be an integer >= 1"),
    (["--adam-betas", "0.9", "1.0"], "--adam-betas: must be a number in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps: must be a number > 0"),
    (["--max-time", "-1"], "--max-time: must be a number >= 0"),
    (["--keep-last", "-1"], "--keep-last: must be an integer >= 0"),
    (["--valid-every", "0"], "--valid-every: must be an integer >= 1"),
    (["--d-model", "abc"], "--d-model: must be an integer >= 1"),
    (["--max-positions", "1"], "--max-positions: must be an integer >= 2"),
    (["--vocab-size", "3"], "--vocab-size: must be an integer >= 8"),
    (["--max-bad-updates", "0"], "--max-bad-updates: must be an integer >= 1"),
    (["--loss-scale-init", "inf"], "--loss-scale-init: must be a finite number > 0"),
    (["--norm", "middle"], "argument --norm: invalid choice: 'middle' (choose from 'post', 'pre')"),
    (["--smoothing", "all"], "argument --smoothing: invalid choice: 'all'"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_number_is_refused_at_parse_time(tmp_path, flags, message):
    run = tmp_path / "run"
    proc = train("--run-dir", str(run), *flags)
    clean_failure(proc, 2, message)
    assert not run.exists()  # refused before anything was written


def test_help_shows_ranges_and_the_real_defaults():
    out = train("--help").stdout
    assert "(>= 1; default 1)" in out         # --update-freq
    assert "(> 0; default 1)" in out          # --lr-factor
    assert "(>= 0; default 5)" in out         # --keep-last
    assert "(in [0, 1))" in out               # the dropout rates and label smoothing


def test_heads_that_do_not_divide_the_model_are_refused_before_the_corpus_work(tmp_path):
    run = tmp_path / "run"
    proc = train("--run-dir", str(run), "--n-heads", "3")  # (the tiny preset's d_model 128)
    clean_failure(proc, 2, "the model's d_model 128 (--d-model) must be divisible by its "
                           "n_heads 3 (--n-heads)", "give, e.g., --n-heads 2")
    assert not (run / "spm.model").exists() and not (run / "data").exists()


# ---- config files ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,message", [
    ("list.json", "[1, 2]", "top level must be a table of options"),
    ("scalar.json", "4000", "top level must be a table of options"),
    ("broken.json", '{"warmup": ', "cannot parse"),
    ("broken.toml", "warmup = ", "cannot parse"),
    ("unknown.json", '{"warmpu": 10}', "unknown options ['warmpu']"),
    ("range.json", '{"warmup": -5}', "warmup (--warmup) must be an integer >= 1"),
    ("type.json", '{"lr_factor": "fast"}', "lr_factor (--lr-factor) must be a number > 0"),
    ("bool.json", '{"beam": true}', "beam (--beam) must be an integer >= 1"),
    ("switch.toml", 'share-embeddings = "false"',  # ("false" was taken as true)
     "share_embeddings (--share-embeddings) must be true or false (a boolean, not 'false')"),
    ("progress.json", '{"no_progress": "no"}', "no_progress (--no-progress) must be true or "
                                                "false"),
    ("choice.json", '{"norm": "middle"}', "norm (--norm) must be one of 'post', 'pre', not "
                                          "'middle'"),
])
def test_bad_config_file_is_refused(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    proc = train("--config", str(path), "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, f"--config {path}", message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("what", ["directory", "missing"])
def test_config_path_that_is_not_a_readable_file(tmp_path, what):
    path = tmp_path / "conf.json"
    if what == "directory":
        path.mkdir()
    proc = train("--config", str(path), "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, f"--config {path}", "cannot read it")


# ---- the run directory ------------------------------------------------------------------------
def test_run_dir_that_is_a_file(tmp_path):
    path = tmp_path / "notadir"
    path.write_text("mine\n")
    proc = train(*SMALL, "--run-dir", str(path), "--max-updates", "2")
    clean_failure(proc, 2, str(path), "a file is in the way")
    assert path.read_text() == "mine\n"


def test_run_dir_below_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("mine\n")
    proc = train(*SMALL, "--run-dir", str(path / "run"), "--max-updates", "2")
    clean_failure(proc, 2, str(path), "not a directory")
    assert path.read_text() == "mine\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        proc = train(*SMALL, "--run-dir", str(ro / "run"), "--max-updates", "2")
    finally:
        ro.chmod(0o755)
    clean_failure(proc, 2, str(ro / "run"), "ermission denied")


def test_new_run_into_a_finished_run_is_refused(run_copy):
    before = digest(run_copy)
    proc = train(*SMALL, "--run-dir", run_copy, "--max-updates", "2")
    clean_failure(proc, 2, run_copy, "already holds a run", "--resume")
    assert digest(run_copy) == before


def test_resume_into_an_empty_directory(tmp_path):
    proc = train(*SMALL, "--run-dir", str(tmp_path), "--resume")
    clean_failure(proc, 2, f"--resume: no checkpoint_last.npz and no config.json in --run-dir "
                           f"{tmp_path}; start without --resume")
    (tmp_path / "config.json").write_text("{}")  # a run that stopped before its checkpoint
    proc = train(*SMALL, "--run-dir", str(tmp_path), "--resume")
    clean_failure(proc, 2, f"--resume: no checkpoint_last.npz in --run-dir {tmp_path}; the run "
                           "there stopped before its first checkpoint: start it again without "
                           "--resume")


def test_an_empty_run_dir_is_named(tmp_path):
    clean_failure(train(*SMALL, "--run-dir", ""), 2, "--run-dir is empty: give the run's "
                                                     "directory")


def test_resume_of_a_run_dir_that_does_not_exist_creates_nothing(tmp_path):
    proc = train(*SMALL, "--run-dir", str(tmp_path / "typo"), "--resume")
    clean_failure(proc, 2, "--resume", "typo does not exist")
    assert os.listdir(tmp_path) == []


def test_resume_with_another_model_is_refused(run_copy):
    before = digest(run_copy)
    proc = train("--run-dir", run_copy, "--resume", "--d-model", "64", "--max-updates", "8")
    clean_failure(proc, 2, "--d-model 64 differs", "config.json")
    assert digest(run_copy) == before


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_resume_from_a_damaged_checkpoint(run_copy, damage):
    last = os.path.join(run_copy, "checkpoint_last.npz")
    with open(last, "rb") as fh:
        data = fh.read()
    with open(last, "wb") as fh:
        fh.write(data[: len(data) // 2] if damage == "truncate" else b"\0" * 100)
    before = digest(run_copy)
    proc = train("--run-dir", run_copy, "--resume", "--max-updates", "8", "--no-progress")
    clean_failure(proc, 2, "checkpoint_last.npz", "to resume from the newest checkpoint saved "
                  f"before it (update 6; the updates after it are trained again), copy "
                  f"{os.path.join(run_copy, 'checkpoint_6.npz')} over {last}")
    assert digest(run_copy) == before
    ckpt.load_checkpoint(os.path.join(run_copy, "checkpoint_best.npz"))  # the rest still loads


# ---- data ------------------------------------------------------------------------------------
def test_data_directory_missing(tmp_path):
    proc = train(*SMALL, "--data", str(tmp_path / "nope"), "--src-lang", "en", "--tgt-lang", "de",
                 "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, f"--data {tmp_path / 'nope'}: no such directory")
    # a file given for the directory: said so, with the directory it is in
    (tmp_path / "train.en").write_text("a\n")
    proc = train(*SMALL, "--data", str(tmp_path / "train.en"), "--src-lang", "en",
                 "--tgt-lang", "de", "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, f"--data {tmp_path / 'train.en'}: a file, not a directory",
                  f"(e.g. {tmp_path})")


def test_data_without_languages(tmp_path):
    proc = train(*SMALL, "--data", str(tmp_path), "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, "--src-lang and --tgt-lang")


def test_data_missing_a_training_file(tmp_path):
    (tmp_path / "train.en").write_text("a b c\n")
    proc = train(*SMALL, "--data", str(tmp_path), "--src-lang", "en", "--tgt-lang", "de",
                 "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, "train.de")


def test_a_wrong_language_is_named_before_the_other_splits(tmp_path):
    """--src-lang fr for a corpus of en and de: the training file is named with the flag and
    the languages there (it was blamed on --valid-split, whose advice did not help)."""
    for split in ("train", "valid"):
        for lang in ("en", "de"):
            (tmp_path / f"{split}.{lang}").write_text("a b c\n")
    proc = train(*SMALL, "--data", str(tmp_path), "--src-lang", "fr", "--tgt-lang", "de",
                 "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, f"{tmp_path / 'train.fr'} not found (--src-lang fr); the "
                           f"--train-split train files in {tmp_path} are train.de, train.en: "
                           "give --src-lang and --tgt-lang as their suffixes")


def test_training_file_that_is_a_directory(tmp_path):
    (tmp_path / "train.en").write_text("a b c\n")
    (tmp_path / "train.de").mkdir()
    proc = train(*SMALL, "--data", str(tmp_path), "--src-lang", "en", "--tgt-lang", "de",
                 "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, "train.de")


def test_max_len_beyond_the_models_positions(tmp_path):
    proc = train(*SMALL, "--max-positions", "32", "--max-len", "64", "--run-dir",
                 str(tmp_path / "run"), "--max-updates", "2")
    clean_failure(proc, 2, "--max-len 64", "(--max-positions 32)", "give --max-len 32 or less")
    # the default --max-len (256) follows a smaller --max-positions: refused it, a default the
    # user never set
    proc = train(*SMALL, "--max-positions", "32", "--run-dir", str(tmp_path / "run2"),
                 "--max-updates", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "longer than --max-len 32 dropped" in proc.stdout


def test_overlong_validation_pairs_are_counted_with_file_and_line(tmp_path):
    from minitransformer.mt.synthetic import write_corpus
    run = tmp_path / "run"
    write_corpus(str(run / "data"), seed=1234, n_train=600, n_valid=20, n_test=5)
    valid = run / "data" / "valid.src"
    lines = valid.read_text().splitlines()
    lines[6] = " ".join(["the small dog"] * 40)  # 120 words: more than 64 positions
    valid.write_text("\n".join(lines) + "\n")
    proc = train(*SMALL, "--max-positions", "64", "--max-len", "64", "--run-dir", str(run),
                 "--max-updates", "2", "--valid-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "valid: 1 of 20 pairs longer than the model's 64 positions left out" in proc.stdout
    assert f"{valid}, first at line 7" in proc.stdout


# ---- the machine -------------------------------------------------------------------------------
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    from minitransformer import backend
    if backend.cupy_available():
        pytest.skip("a GPU is here")
    proc = train(*SMALL, "--device", "cuda", "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, "--device cuda", "CuPy")
    # the device from the environment: the message names the variable, not a flag not given
    proc = train(*SMALL, "--run-dir", str(tmp_path / "run"),
                 env={**os.environ, "MINITRANSFORMER_DEVICE": "cuda"})
    clean_failure(proc, 2, "error: MINITRANSFORMER_DEVICE=cuda (the default of --device): ",
                  "CuPy")


def test_bleu_tokenize_scores_validation_and_test_and_a_missing_tokenizer_is_one_line(
        tmp_path):
    run = tmp_path / "run"
    proc = train(*SMALL[:-2], "--bleu-tokenize", "char", "--run-dir", str(run),
                 "--max-updates", "2", "--valid-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    test = [r for r in records if "test_bleu" in r]
    assert len(test) == 1 and "tok:char" in test[0]["test_signature"], records
    assert "tok:char" in proc.stdout
    assert json.loads((run / "config.json").read_text())["train"]["bleu_tokenize"] == "char"
    try:
        import MeCab  # noqa: F401
    except ImportError:  # (sacrebleu[ja] not installed: refused before any work)
        proc = train(*SMALL, "--bleu-tokenize", "ja-mecab", "--run-dir", str(tmp_path / "ja"))
        clean_failure(proc, 2, "error: --bleu-tokenize ja-mecab: ", "pip install sacrebleu[ja]")
        assert not (tmp_path / "ja" / "config.json").exists()  # (no training started)


def test_float16_on_the_cpu_is_refused(tmp_path):
    proc = train(*SMALL, "--precision", "float16", "--run-dir", str(tmp_path / "run"))
    clean_failure(proc, 2, "--precision float16 needs a GPU")


def test_disk_full_at_a_checkpoint_keeps_the_previous_ones(run_copy):
    """The next checkpoint's write fails with ENOSPC (os.fsync made to fail, as on a full
    disk): one line naming the file and what to do, exit 2, no temporary left, the
    checkpoints saved before unchanged and loadable (metrics.jsonl has the new log lines;
    config.json, which takes the --max-updates given again only with a checkpoint, too)."""
    skip = ("train.lock", "metrics.jsonl")
    before = digest(run_copy, skip)
    code = (
        "import errno, os, sys\n"
        "def full(fd): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "os.fsync = full\n"
        "from minitransformer.mt.train import main\n"
        f"sys.exit(main(['--run-dir', {run_copy!r}, '--resume', '--max-updates', '8', "
        "'--valid-every', '2']))\n")
    proc = python(code)
    clean_failure(proc, 2, "checkpoint_8.npz: No space left on device", "free some space",
                  "--resume")
    assert digest(run_copy, skip) == before
    assert not [n for n in os.listdir(run_copy) if n.startswith(".tmp-")]
    for name in ("checkpoint_last.npz", "checkpoint_best.npz"):
        ckpt.load_checkpoint(os.path.join(run_copy, name))


def test_os_errors_are_one_line_with_the_path_and_what_to_do():
    from minitransformer.mt.fileio import describe_os_error
    text = describe_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/ckpt.npz"))
    assert text.startswith("/x/ckpt.npz: No space left on device; the disk is full")
    # a hint that begins with what happened does not say it twice
    text = describe_os_error(OSError(errno.EACCES, "Permission denied", "/x/model"))
    assert text == "/x/model: Permission denied: fix the permissions or choose another path"


def test_ctrl_c_while_training_sentencepiece(tmp_path):
    run = str(tmp_path / "run")
    code = (
        "import sys\n"
        "from minitransformer.mt import corpus_setup, train as t\n"
        "def interrupted(*a, **k): raise KeyboardInterrupt\n"
        "corpus_setup.train_sentencepiece = interrupted\n"
        f"sys.exit(t.main({SMALL + ['--run-dir', run]!r}))\n")
    proc = python(code)
    clean_failure(proc, 130, "interrupted while setting up the run", run)
    assert not os.path.exists(os.path.join(run, "spm.model"))


# ---- a stopped, killed, or doubled run -------------------------------------------------------
def _start(run, *extra):
    return subprocess.Popen([sys.executable, TRAIN, *SMALL, "--run-dir", run, "--max-updates",
                             "100000", "--valid-every", "100000", "--save-every", "5", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    pytest.fail("timed out")


def test_second_run_and_resume_into_a_running_run_are_refused(tmp_path):
    run = str(tmp_path / "run")
    first = _start(run)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "checkpoint_last.npz")), first)
        second = train(*SMALL, "--run-dir", run, "--max-updates", "3")
        clean_failure(second, 2, f"--run-dir {run} is in use by another training run",
                      f"PID {first.pid}", "since ")
        resumed = train("--run-dir", run, "--resume", "--max-updates", "3")
        clean_failure(resumed, 2, f"PID {first.pid}")
        assert first.poll() is None  # the first run goes on
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "SIGINT: stopped at update" in out and "--resume" in out
    ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))
    # the lock died with the run: resuming now works
    proc = train("--run-dir", run, "--resume", "--max-updates", "1", "--test-split", "")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kill_9_then_resume_cleans_up_and_logs_each_update_once(tmp_path):
    run = str(tmp_path / "run")
    proc = _start(run)
    try:
        _wait_for(lambda: len(ckpt.periodic_checkpoints(run)) >= 2, proc)
        time.sleep(0.3)  # a few more updates logged past the checkpoint
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    with open(os.path.join(run, ".tmp-k1ll3d9xcheckpoint_last.npz"), "wb") as fh:
        fh.write(b"half a checkpoint")  # as a save killed midway leaves it
    saved = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    res = train("--run-dir", run, "--resume", "--max-updates", str(saved + 4))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "temporary file(s) left by an interrupted save" in res.stdout
    assert not [n for n in os.listdir(run) if n.startswith(".tmp-")]
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    logged = [r["update"] for r in records if "loss" in r]
    assert logged == sorted(set(logged)), logged  # no update recorded twice
    assert max(logged) <= saved + 4 and any(u > saved for u in logged), (saved, logged)


# ---- divergence --------------------------------------------------------------------------------
def test_absurd_learning_rate_stops_with_the_first_bad_op(run_copy):
    before = digest(run_copy)
    params_before = ckpt.load_checkpoint(os.path.join(run_copy, "checkpoint_best.npz"))[0]
    proc = train("--run-dir", run_copy, "--resume", "--lr-factor", "1e30", "--max-updates", "40",
                 "--valid-every", "2")
    clean_failure(proc, 3, "training diverged", "--max-bad-updates 5", "replayed with every op "
                  "checked", "forward made a NaN or Inf output from finite values",
                  "checkpoints in", "--lr-factor")
    skip = ("train.lock", "metrics.jsonl")
    assert digest(run_copy, skip) == {k: v for k, v in before.items() if k not in skip}
    params_after = ckpt.load_checkpoint(os.path.join(run_copy, "checkpoint_best.npz"))[0]
    for k in params_before:
        assert np.array_equal(params_before[k], params_after[k]), k


def test_divergence_in_a_new_run_saves_nothing(tmp_path):
    run = str(tmp_path / "run")
    proc = train(*SMALL, "--run-dir", run, "--lr-factor", "1e30", "--max-updates", "40",
                 "--valid-every", "20", "--max-bad-updates", "3")
    clean_failure(proc, 3, "3 updates in a row", "no checkpoint was written")
    assert not [n for n in os.listdir(run) if n.endswith(".npz")]


# ---- one's own corpus: splits, leftovers, resuming from elsewhere --------------------------------
def corpus(path, n_valid=20, n_test=6):
    """A small corpus in ``path`` (train/valid/test .src/.tgt), as --data takes it."""
    from minitransformer.mt.synthetic import write_corpus
    write_corpus(str(path), seed=1234, n_train=600, n_valid=n_valid, n_test=n_test)
    return ["--data", str(path), "--src-lang", "src", "--tgt-lang", "tgt"]


def cut_last_line(path):
    lines = open(path).read().splitlines()
    with open(path, "w") as fh:
        fh.write("".join(line + "\n" for line in lines[:-1]))


def test_a_new_run_sets_aside_what_a_run_that_never_saved_left(tmp_path):
    # the first start diverges before its first checkpoint, leaving its vocabulary, config
    # and log; started again with another --vocab-size, the run makes a vocabulary of that
    # size and logs only itself, and the first start's files are set aside, not lost
    data, run = corpus(tmp_path / "data"), str(tmp_path / "run")
    flags = [*SMALL, *data, "--run-dir", run, "--max-updates", "4", "--valid-every", "4"]
    clean_failure(train(*flags, "--lr-factor", "1e30", "--max-bad-updates", "2"), 3,
                  "no checkpoint was written")
    left = {"config.json", "spm.model", "spm.vocab", "metrics.jsonl"}
    assert left <= set(os.listdir(run))
    old_spm = open(os.path.join(run, "spm.model"), "rb").read()
    proc = train(*flags, "--vocab-size", "90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = [n for n in os.listdir(run) if n.startswith("unsaved-")]
    assert len(aside) == 1 and f"moved to {os.path.join(run, aside[0])}" in proc.stdout
    assert left <= set(os.listdir(os.path.join(run, aside[0])))
    assert open(os.path.join(run, aside[0], "spm.model"), "rb").read() == old_spm
    from minitransformer.mt.tokenizer import Tokenizer
    assert Tokenizer(os.path.join(run, "spm.model")).vocab_size == 90
    updates = [json.loads(line)["update"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert updates == sorted(updates)  # one run's records


def test_a_new_run_without_data_generates_its_own_corpus_again(tmp_path):
    # the generated corpus (RUN_DIR/data) of a run that never saved is set aside too, so
    # that --synthetic-pairs of the new run is what it trains on
    run = str(tmp_path / "run")
    flags = [*SMALL, "--run-dir", run, "--max-updates", "2", "--valid-every", "2"]
    clean_failure(train(*flags, "--lr-factor", "1e30", "--max-bad-updates", "2"), 3,
                  "no checkpoint was written")
    proc = train(*[a if a != "600" else "700" for a in flags])  # --synthetic-pairs 700
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train: 700 pairs" in proc.stdout, proc.stdout[-2000:]
    aside = [n for n in os.listdir(run) if n.startswith("unsaved-")]
    assert len(aside) == 1 and "data" in os.listdir(os.path.join(run, aside[0]))


@pytest.mark.parametrize("case", ["named-split-missing", "one-file-missing",
                                  "valid-misaligned", "test-misaligned", "test-empty"])
def test_a_split_that_cannot_be_used_stops_the_run_before_any_work(tmp_path, case):
    data = corpus(tmp_path / "data")
    extra, names = {
        "named-split-missing": (["--valid-split", "dev"], ["--valid-split dev", "dev.src",
                                                           "dev.tgt", "not found"]),
        "one-file-missing": ([], ["--valid-split valid", "valid.tgt not found"]),
        "valid-misaligned": ([], ["valid.src has 20 lines", "valid.tgt has 19"]),
        "test-misaligned": ([], ["test.src has 6 lines", "test.tgt has 5"]),
        "test-empty": ([], ["--test-split test", "have no lines", "--test-split ''"]),
    }[case]
    if case == "one-file-missing":
        os.unlink(tmp_path / "data" / "valid.tgt")
    if case.endswith("misaligned"):
        cut_last_line(tmp_path / "data" / f"{case.split('-')[0]}.tgt")
    if case == "test-empty":
        for side in ("src", "tgt"):
            (tmp_path / "data" / f"test.{side}").write_text("")
    run = tmp_path / "run"
    flags = [a for a in SMALL if a not in ("--test-split", "")]
    proc = train(*flags, *data, *extra, "--run-dir", str(run), "--max-updates", "4")
    clean_failure(proc, 2, *names)
    assert not os.path.exists(run / "spm.model") and not os.path.exists(run / "config.json")


def test_without_validation_files_the_run_says_so_and_trains(tmp_path):
    data = corpus(tmp_path / "data")
    for side in ("src", "tgt"):
        os.unlink(tmp_path / "data" / f"valid.{side}")
    proc = train(*SMALL, *data, "--run-dir", str(tmp_path / "run"), "--max-updates", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no validation set" in proc.stdout and "valid.src" in proc.stdout


def test_the_test_translations_keep_every_line_of_the_test_source(tmp_path):
    data = corpus(tmp_path / "data")
    src = tmp_path / "data" / "test.src"
    lines = src.read_text().splitlines()
    lines[2] = ""  # an empty source line: an empty translation, as translate.py gives it
    src.write_text("\n".join(lines) + "\n")
    flags = [a for a in SMALL if a not in ("--test-split", "")]
    proc = train(*flags, *data, "--run-dir", str(tmp_path / "run"), "--max-updates", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hyps = open(tmp_path / "run" / "test.hyp").read().split("\n")[:-1]
    assert len(hyps) == 6 and hyps[2] == "" and "test (test, 6 sentences" in proc.stdout
    # the training split as the test split is scored too
    proc = train(*flags, *data, "--test-split", "train", "--run-dir", str(tmp_path / "run2"),
                 "--max-updates", "2")
    assert proc.returncode == 0 and "test (train, 600 sentences" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]


def test_resume_from_another_directory_and_flags_that_change_the_data(tmp_path):
    # a relative --data is saved as an absolute path: the run resumes from anywhere; the
    # same corpus written another way is accepted; another training split or sentencepiece
    # type is refused; an option given again is saved with the next checkpoint
    corpus(tmp_path / "data")
    run = str(tmp_path / "run")
    proc = train(*SMALL, "--data", "data", "--src-lang", "src", "--tgt-lang", "tgt",
                 "--run-dir", run, "--max-updates", "4", "--valid-every", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run, "config.json")) as fh:
        assert json.load(fh)["train"]["data"] == str(tmp_path / "data")
    proc = train("--run-dir", run, "--resume", "--max-updates", "6", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]  # (from ROOT: another directory)
    with open(os.path.join(run, "config.json")) as fh:
        assert json.load(fh)["train"]["max_updates"] == 6  # saved for the next --resume
    proc = train("--run-dir", run, "--resume", "--data", "data/", "--max-updates", "8",
                 "--no-progress", cwd=tmp_path)  # (the same corpus, written another way)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run, "config.json")) as fh:
        assert json.load(fh)["train"]["data"] == str(tmp_path / "data")  # (still absolute)
    before = digest(run)
    for flag, value in (("--train-split", "valid"), ("--spm-type", "bpe"),
                        ("--bleu-tokenize", "char")):  # (other BLEUs: the best is not comparable)
        proc = train("--run-dir", run, "--resume", flag, value, "--max-updates", "10")
        clean_failure(proc, 2, f"{flag} '{value}' differs from the run being resumed")
    assert digest(run) == before
    # a copy of the corpus elsewhere, while the run's own is still there: used (it was
    # refused); another corpus there is refused by its training pairs
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    proc = train("--run-dir", run, "--resume", "--data", str(tmp_path / "copy"),
                 "--max-updates", "10", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"using {tmp_path / 'copy'} (its training pairs must be the run's)" in proc.stdout
    with open(tmp_path / "copy" / "train.src", "a") as fh:
        fh.write("one more line\n")
    with open(tmp_path / "copy" / "train.tgt", "a") as fh:
        fh.write("noch eine Zeile\n")
    proc = train("--run-dir", run, "--resume", "--data", str(tmp_path / "copy"),
                 "--max-updates", "12", "--no-progress")
    clean_failure(proc, 2, "the run trained on")


def test_a_float16_run_resumed_on_the_cpu_is_refused(run_copy):
    # the run's saved precision, not only the one on the command line, is checked
    with open(os.path.join(run_copy, "config.json")) as fh:
        config = json.load(fh)
    config["train"]["precision"] = "float16"  # (as a run trained on a GPU in float16 saves)
    with open(os.path.join(run_copy, "config.json"), "w") as fh:
        json.dump(config, fh)
    before = digest(run_copy)
    proc = train("--run-dir", run_copy, "--resume", "--max-updates", "8", "--device", "cpu")
    clean_failure(proc, 2, "--precision float16", "needs a GPU", "--precision float32")
    assert digest(run_copy) == before
    proc = train("--run-dir", run_copy, "--resume", "--max-updates", "8", "--device", "cpu",
                 "--precision", "float32", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_resume_on_a_changed_corpus_is_refused(tmp_path):
    # the run's number of training pairs is saved with each checkpoint: a corpus cut since
    # is refused on --resume (it went on, no longer an exact continuation)
    data, run = corpus(tmp_path / "data"), str(tmp_path / "run")
    proc = train(*SMALL, *data, "--run-dir", run, "--max-updates", "2", "--valid-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for side in ("src", "tgt"):
        cut_last_line(tmp_path / "data" / f"train.{side}")
    before = digest(run)
    proc = train("--run-dir", run, "--resume", "--max-updates", "4")
    clean_failure(proc, 2, "the run trained on 600 pairs", "now hold 599",
                  "resume with the run's training data")
    assert digest(run) == before


def test_resume_on_an_edited_corpus_of_as_many_pairs_is_refused(tmp_path):
    # one target line edited, the count unchanged: the pairs' fingerprint, saved with each
    # checkpoint, tells; the corpus put back, the run resumes
    data, run = corpus(tmp_path / "data"), str(tmp_path / "run")
    proc = train(*SMALL, *data, "--run-dir", run, "--max-updates", "2", "--valid-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "data" / "train.tgt"
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    path.write_text("".join(lines[:5] + ["edited\n"] + lines[6:]), encoding="utf-8")
    before = digest(run)
    proc = train("--run-dir", run, "--resume", "--max-updates", "4")
    clean_failure(proc, 2, "hold 600 pairs, as when the run started, but not the same text",
                  "resume with the run's training data")
    assert digest(run) == before
    path.write_text(text, encoding="utf-8")
    proc = train("--run-dir", run, "--resume", "--max-updates", "4", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_subword_nbest_is_checked_when_the_flags_are_read(tmp_path):
    for nbest in ("1", "600"):
        proc = train(*SMALL, "--run-dir", str(tmp_path / "run"), "--subword-alpha", "0.1",
                     "--subword-nbest", nbest)
        clean_failure(proc, 2, "--subword-nbest: must be an integer in [2, 512]")
        assert not os.path.exists(tmp_path / "run")


# ---- stops between the writes of a validation, and signals during the closing work ---------
def test_a_stop_before_the_best_checkpoint_is_written_loses_no_best(trained, tmp_path):
    """The first validation's checkpoint_best.npz fails to write (a full disk; a kill there
    is alike): checkpoint_last.npz, written before it, says a best is due, and --resume
    writes it from last first. The run then ends with the uninterrupted run's checkpoints
    (before, last kept the new best_bleu and no validation came again: the best was lost)."""
    run = str(tmp_path / "run")
    args = SMALL + ["--run-dir", run, "--max-updates", "6", "--valid-every", "3"]
    code = (
        "import errno, os, sys\n"
        "from minitransformer.mt import checkpoint as ckpt\n"
        "real = ckpt.save_checkpoint\n"
        "def save(path, *a):\n"
        "    if path.endswith('checkpoint_best.npz'):\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)\n"
        "    return real(path, *a)\n"
        "ckpt.save_checkpoint = save\n"
        "from minitransformer.mt.train import main\n"
        f"sys.exit(main({args!r}))\n")
    clean_failure(python(code), 2, "checkpoint_best.npz: No space left on device")
    meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    assert (meta["update"], meta.get("best_due")) == (3, True)
    assert not os.path.exists(os.path.join(run, "checkpoint_best.npz"))
    proc = train("--run-dir", run, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("valid update 3") == 0  # (not validated again)
    for name in ("checkpoint_best.npz", "checkpoint_last.npz", "checkpoint_3.npz"):
        mine, ref = (ckpt.load_checkpoint(os.path.join(d, name)) for d in (run, trained))
        assert mine[2]["update"] == ref[2]["update"], name
        assert all(np.array_equal(mine[0][k], ref[0][k]) for k in ref[0]), name


def _signal_during(update, signame):
    """Code that runs train.py's main with validate() sending ``signame`` to this process
    at ``update`` (the signal lands while a validation runs)."""
    return (
        "import os, signal, sys\n"
        "from minitransformer.mt import train as t\n"
        "real = t.Trainer.validate\n"
        "def validate(self):\n"
        f"    if self.update == {update}:\n"
        f"        os.kill(os.getpid(), signal.{signame})\n"
        "    return real(self)\n"
        "t.Trainer.validate = validate\n")


def test_a_signal_during_a_validation_stops_before_another_update(tmp_path):
    """One process, SIGTERM while the validation of update 3 runs: the run stops at 3 (it
    made one more update first; ranks already stopped at once)."""
    run = str(tmp_path / "run")
    args = SMALL + ["--run-dir", run, "--max-updates", "8", "--valid-every", "3"]
    code = _signal_during(3, "SIGTERM") + f"sys.exit(t.main({args!r}))\n"
    proc = python(code)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "SIGTERM: stopped at update 3;" in proc.stdout
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == 3


def test_a_signal_during_the_closing_validation_says_the_test_waits_for_resume(tmp_path):
    """SIGINT during the closing validation (update 5, not a multiple of --valid-every): the
    run says the test was skipped and --resume scores it; --resume does not validate update
    5 again (metrics.jsonl had it twice) and runs the test."""
    run = str(tmp_path / "run")
    args = SMALL + ["--run-dir", run, "--max-updates", "5", "--valid-every", "3",
                    "--test-split", "test"]
    proc = python(_signal_during(5, "SIGINT") + f"sys.exit(t.main({args!r}))\n")
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    assert "training finished (reached --max-updates 5)" in proc.stdout
    assert ("SIGINT during the closing validation and checkpoint: the test of --test-split "
            "test is skipped; --resume scores it") in proc.stdout
    res = train("--run-dir", run, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "valid update 5" not in res.stdout and "test (test, " in res.stdout
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        valid = [r["update"] for r in map(json.loads, fh) if "valid_loss" in r]
    assert valid == [3, 5]


def test_a_full_disk_while_logging_names_metrics_jsonl(tmp_path):
    from minitransformer.mt.fileio import describe_os_error
    from minitransformer.mt.log import Log
    path = str(tmp_path / "metrics.jsonl")
    log = Log(path, 10, progress=False)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # (no file name, as write)

    log.file = Full()
    with pytest.raises(OSError) as err:
        log.metrics({"update": 1})
    assert describe_os_error(err.value).startswith(f"{path}: No space left on device")


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    """The first SIGINT says the run will stop once the work in progress is done and how to
    stop at once; a second one (during the validation of update 6, here) stops there,
    without saving (extra Ctrl-Cs were ignored until the validation, and one more update,
    were done): exit 130, the checkpoints as saved at update 3, and --resume goes on."""
    run = str(tmp_path / "run")
    args = SMALL + ["--run-dir", run, "--max-updates", "8", "--valid-every", "3"]
    code = ("import os, signal, sys, time\n"
            "from minitransformer.mt import train as t\n"
            "real = t.Trainer.validate\n"
            "def validate(self):\n"
            "    if self.update == 6:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        os.kill(os.getpid(), signal.SIGINT)  # (the same stop, delivered twice)\n"
            "        os.kill(os.getpid(), signal.SIGTERM)  # (a machine's: never forces)\n"
            "        time.sleep(1.1)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(self)\n"
            "t.Trainer.validate = validate\n"
            f"sys.exit(t.cli({args!r}))\n")
    proc = python(code)
    clean_failure(proc, 130, "a second SIGINT: stopped at once, without saving; "
                  f"{run} holds the run as last saved (checkpoint_last.npz at update 3); "
                  "continue with --resume")
    assert ("SIGINT: stopping once the update, validation or checkpoint in progress is done, "
            "and saving; Ctrl-C again stops at once, without saving") in proc.stdout
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == 3
    assert not [n for n in os.listdir(run) if n.startswith(".tmp-")]
    res = train("--run-dir", run, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == 8


def test_a_second_ctrl_c_during_the_save_names_the_checkpoint_on_disk(tmp_path):
    """The first SIGINT after update 7, the second while checkpoint_last.npz is being saved
    for it: the message names update 4, what checkpoint_last holds (it named 7)."""
    run = str(tmp_path / "run")
    args = SMALL + ["--run-dir", run, "--max-updates", "20", "--save-every", "4",
                    "--valid-every", "100"]
    code = ("import os, signal, sys, time\n"
            "from minitransformer.mt import checkpoint as ckpt, train as t\n"
            "real_update, real_save = t.Trainer.train_update, ckpt.save_checkpoint\n"
            "def train_update(self):\n"
            "    out = real_update(self)\n"
            "    if self.update == 7:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return out\n"
            "def save(path, *a):\n"
            "    if path.endswith('checkpoint_last.npz') and a[-1]['update'] == 7:\n"
            "        time.sleep(1.1)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real_save(path, *a)\n"
            "t.Trainer.train_update, ckpt.save_checkpoint = train_update, save\n"
            f"sys.exit(t.cli({args!r}))\n")
    proc = python(code)
    clean_failure(proc, 130, "(checkpoint_last.npz at update 4)")
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == 4


def test_a_run_rolled_back_to_an_older_checkpoint_keeps_its_better_best(trained, tmp_path):
    """Periodic checkpoints do not say a best is due (a run rolled back to one rewrote
    checkpoint_best with that older model), and a last put back by hand that says so does
    not replace a best at least as good."""
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    assert "best_due" not in ckpt.load_checkpoint(os.path.join(run, "checkpoint_3.npz"))[2]
    best = ckpt.load_checkpoint(os.path.join(run, "checkpoint_best.npz"))
    assert best[2]["update"] == 3
    # a checkpoint_last of update 6 (not the best) that says a best is due, with a lower
    # best_bleu than checkpoint_best's
    code = ("import json, sys, numpy as np\n"
            "from minitransformer.mt import checkpoint as ckpt\n"
            f"p, o, m = ckpt.load_checkpoint({os.path.join(run, 'checkpoint_6.npz')!r})\n"
            f"m.update(best_due=True, best_bleu={best[2]['best_bleu'] - 1.0})\n"
            "arrays = {**{'model/' + k: v for k, v in p.items()},\n"
            "          **{'optim/' + k: v for k, v in o.items()}, 'meta': json.dumps(m)}\n"
            f"np.savez({os.path.join(run, 'checkpoint_last.npz')!r}, **arrays)\n")
    assert python(code).returncode == 0
    proc = train("--run-dir", run, "--resume", "--max-updates", "6")  # (nothing to train)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = ckpt.load_checkpoint(os.path.join(run, "checkpoint_best.npz"))
    assert kept[2]["update"] == best[2]["update"]
    assert all(np.array_equal(kept[0][k], best[0][k]) for k in best[0])


def test_a_save_into_a_removed_run_directory_says_so(tmp_path):
    """The run directory deleted between saves: the message names the checkpoint and says
    the directory was removed (it named a temporary file)."""
    from minitransformer.mt.fileio import atomic_write, describe_os_error
    path = str(tmp_path / "gone" / "checkpoint_last.npz")
    with pytest.raises(OSError) as err:
        atomic_write(path, lambda f: f.write(b"x"))
    assert describe_os_error(err.value) == (
        f"{path}: the directory {tmp_path / 'gone'} was removed (No such file or directory)")
