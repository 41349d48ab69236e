"""train.py and translate.py end to end: exact resume, bad input, signals, translation."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import options
from minitransformer.mt import train as train_cli
from minitransformer.mt import translate as translate_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--synthetic-pairs", "1500", "--d-model", "32", "--n-heads", "2", "--d-ff", "64",
         "--max-tokens", "600", "--vocab-size", "120", "--no-progress", "--log-every", "5",
         "--warmup", "50", "--valid-bleu-sentences", "20", "--test-split", ""]


def run_train(*args):
    code = train_cli.main(list(SMALL) + list(args))
    return code


def params_of(path):
    return ckpt.load_checkpoint(path)[0]


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_train("--run-dir", straight, "--max-updates", "24", "--valid-every", "8") == 0
    assert run_train("--run-dir", split, "--max-updates", "12", "--valid-every", "8") == 0
    assert run_train("--run-dir", split, "--max-updates", "24", "--valid-every", "8",
                     "--resume") == 0
    a = params_of(os.path.join(straight, "checkpoint_last.npz"))
    b = params_of(os.path.join(split, "checkpoint_last.npz"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k  # bit-for-bit on CPU
    meta = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))[2]
    assert meta["update"] == 24
    # the metrics log holds both halves
    updates = [json.loads(line)["update"] for line in open(os.path.join(split, "metrics.jsonl"))]
    assert max(updates) == 24


def test_a_bare_resume_keeps_every_option_of_the_run(tmp_path):
    """`--resume` alone continues with the run's own stopping rule, schedule and checkpoint
    settings (here given in a config file), not with the defaults."""
    conf = tmp_path / "recipe.json"
    conf.write_text(json.dumps({"max-updates": 70, "lr-schedule": "linear", "save-every": 9,
                                "keep-last": 20, "valid-every": 100}))
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_train("--config", str(conf), "--run-dir", straight) == 0
    # stopped after the first epoch (fewer than 30 updates), then resumed with no options
    assert run_train("--config", str(conf), "--run-dir", split, "--max-epochs", "1") == 0
    stopped = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))[2]["update"]
    assert 9 < stopped < 70
    assert train_cli.main(["--run-dir", split, "--resume", "--max-epochs", "0",
                           "--no-progress"]) == 0
    a = params_of(os.path.join(straight, "checkpoint_last.npz"))
    b = params_of(os.path.join(split, "checkpoint_last.npz"))
    for k in a:
        assert np.array_equal(a[k], b[k]), k  # same schedule to the same last update
    periodic = [{n for n in os.listdir(d) if n[11:-4].isdigit()} for d in (straight, split)]
    assert periodic[0] <= periodic[1]  # every 9 updates (+ the one written at the stop)
    assert "checkpoint_63.npz" in periodic[0]
    saved = json.load(open(os.path.join(split, "config.json")))["train"]
    assert saved["max_updates"] == 70 and saved["save_every"] == 9
    assert not {"run_dir", "resume", "config", "device"} & set(saved)


def test_subword_regularization_resumes_exactly_across_epochs(tmp_path):
    """--subword-alpha: a new segmentation every epoch, still bit-for-bit resumable."""
    opts = ["--synthetic-pairs", "200", "--spm-type", "unigram", "--subword-alpha", "0.3",
            "--valid-every", "8"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_train("--run-dir", straight, "--max-updates", "24", *opts) == 0
    assert run_train("--run-dir", split, "--max-updates", "11", *opts) == 0
    # (run_train's SMALL says --synthetic-pairs 1500: the run's 200 is given again, as it
    # may not change on --resume)
    assert run_train("--run-dir", split, "--max-updates", "24", "--resume",
                     "--synthetic-pairs", "200") == 0
    a = params_of(os.path.join(straight, "checkpoint_last.npz"))
    b = params_of(os.path.join(split, "checkpoint_last.npz"))
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    meta = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))[2]
    assert meta["data"]["epoch"] >= 2  # the run crossed epochs, each with its own segmentation
    cfg = json.load(open(os.path.join(split, "config.json")))
    assert cfg["train"]["subword_alpha"] == 0.3 and cfg["train"]["subword_nbest"] == 16
    # without sampling the same run trains on other tokens and ends elsewhere
    plain = str(tmp_path / "plain")
    assert run_train("--run-dir", plain, "--max-updates", "24", *opts[:-4], "--valid-every",
                     "8") == 0
    c = params_of(os.path.join(plain, "checkpoint_last.npz"))
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_subword_regularization_needs_a_unigram_model(tmp_path):
    # the synthetic corpus defaults to BPE: refused before any data work
    with pytest.raises(SystemExit, match="--spm-type is bpe: add --spm-type unigram"):
        run_train("--run-dir", str(tmp_path / "r"), "--max-updates", "2", "--subword-alpha", "0.5")
    assert not os.path.exists(tmp_path / "r" / "spm.model")


@pytest.mark.parametrize("alpha", ["-0.5", "nan"])
def test_subword_alpha_must_be_a_non_negative_number(tmp_path, alpha, capsys):
    with pytest.raises(SystemExit) as stop:  # refused as the command line is parsed
        run_train("--run-dir", str(tmp_path / "r"), "--max-updates", "2", "--spm-type",
                  "unigram", "--subword-alpha", alpha)
    assert stop.value.code == 2
    assert re.search(r"--subword-alpha: must be a (finite )?number >= 0",
                     capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "r")


def test_resuming_an_older_run_accepts_the_default_subword_flags(tmp_path):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "4", "--valid-every", "4") == 0
    cfg_path = os.path.join(run, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["train"]["subword_alpha"], cfg["train"]["subword_nbest"]  # as written before them
    json.dump(cfg, open(cfg_path, "w"))
    assert run_train("--run-dir", run, "--max-updates", "6", "--valid-every", "4", "--resume",
                     "--subword-alpha", "0") == 0
    with pytest.raises(SystemExit, match="--subword-alpha 0.5 differs"):
        run_train("--run-dir", run, "--max-updates", "8", "--resume", "--subword-alpha", "0.5")


def test_run_directory_layout_and_periodic_pruning(tmp_path):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "20", "--valid-every", "4",
                     "--keep-last", "2") == 0
    names = set(os.listdir(run))
    assert {"config.json", "spm.model", "checkpoint_last.npz", "checkpoint_best.npz",
            "metrics.jsonl"} <= names
    assert sorted(n for n in names if n.startswith("checkpoint_") and n[11:-4].isdigit()) == \
        ["checkpoint_16.npz", "checkpoint_20.npz"]
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["model"]["d_model"] == 32 and cfg["train"]["vocab_size"] == 120
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert any("valid_bleu" in r for r in records)
    assert all({"loss", "ppl", "lr", "tokens_per_s"} <= set(r) for r in records if "loss" in r)


def test_linear_schedule_reaches_zero_at_max_updates(tmp_path):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "10", "--warmup", "4", "--log-every", "1",
                     "--valid-every", "100", "--lr-schedule", "linear") == 0
    lrs = {r["update"]: r["lr"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
           if "lr" in r}
    assert lrs[4] == max(lrs.values()) and lrs[10] == 0.0
    assert lrs[7] == pytest.approx(lrs[4] / 2, rel=1e-6)
    assert json.load(open(os.path.join(run, "config.json")))["train"]["lr_schedule"] == "linear"


@pytest.mark.parametrize("max_updates", ["0", "50"])
def test_linear_schedule_needs_max_updates_beyond_warmup(tmp_path, max_updates):
    with pytest.raises(SystemExit, match="--max-updates N with N > --warmup"):
        run_train("--run-dir", str(tmp_path / "run"), "--lr-schedule", "linear",
                  "--warmup", "50", "--max-updates", max_updates)
    assert not os.path.exists(tmp_path / "run" / "spm.model")  # refused before any work


def test_linear_schedule_checks_against_the_default_warmup(tmp_path):
    # without --warmup the data source's default (4000 for --data) is what counts
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit, match=r"N > --warmup \(4000\)"):
        train_cli.main(["--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "data"),
                        "--src-lang", "en", "--tgt-lang", "de", "--lr-schedule", "linear",
                        "--max-updates", "1000"])


def test_existing_run_is_never_overwritten(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "2", "--valid-every", "100") == 0
    before = open(os.path.join(run, "checkpoint_last.npz"), "rb").read()
    with pytest.raises(SystemExit, match="--resume"):
        run_train("--run-dir", run, "--max-updates", "4")
    assert open(os.path.join(run, "checkpoint_last.npz"), "rb").read() == before


def test_resume_with_a_different_model_flag_is_refused(tmp_path):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "2", "--valid-every", "100") == 0
    with pytest.raises(SystemExit, match="--d-model"):
        train_cli.main([a if a != "32" else "64" for a in SMALL] +
                       ["--run-dir", run, "--resume", "--max-updates", "4"])


def test_checkpoint_from_another_vocabulary_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_train("--run-dir", a, "--max-updates", "2", "--valid-every", "100") == 0
    assert train_cli.main([x if x != "120" else "100" for x in SMALL] +
                          ["--run-dir", b, "--max-updates", "2", "--valid-every", "100"]) == 0
    code = translate_cli.main(["--run-dir", b, "--checkpoint",
                               os.path.join(a, "checkpoint_last.npz"), "--input", os.devnull])
    assert code == 2


@pytest.mark.parametrize("case", ["missing", "counts", "empty", "utf8", "no-lang"])
def test_bad_data_gives_a_clear_error(tmp_path, capsys, case):
    d = tmp_path / "data"
    d.mkdir()
    src, tgt = d / "train.en", d / "train.de"
    src.write_text("a b\nc d\n")
    tgt.write_text("x y\nz w\n")
    expect = {"missing": "train.de", "counts": "2", "empty": "empty", "utf8": "line 2",
              "no-lang": "--src-lang"}[case]
    if case == "missing":
        tgt.unlink()
    elif case == "counts":
        tgt.write_text("x y\nz w\nv u\n")
    elif case == "empty":
        src.write_text("\n\n")
    elif case == "utf8":
        src.write_bytes(b"a b\nc \xff d\n")
    args = ["--data", str(d), "--run-dir", str(tmp_path / "run"), "--max-updates", "1"]
    if case != "no-lang":
        args += ["--src-lang", "en", "--tgt-lang", "de"]
    code = train_cli.main(args)
    err = capsys.readouterr().err
    assert code == 2 and expect in err, err
    if case == "counts":
        assert "3" in err


def test_config_file_and_flag_precedence(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('d-model = 48\nn_heads = 4\nwarmup = 77\n')
    args = options.parse_args(["--config", str(conf), "--warmup", "12"])
    assert args.d_model == 48 and args.n_heads == 4 and args.warmup == 12
    (tmp_path / "c.json").write_text(json.dumps({"no_such_option": 1}))
    with pytest.raises(SystemExit, match="no_such_option"):
        options.parse_args(["--config", str(tmp_path / "c.json")])


@pytest.mark.parametrize("recipe", sorted(os.listdir(os.path.join(ROOT, "recipes"))))
def test_shipped_recipes_use_only_known_options(recipe):
    # parse_args rejects unknown keys, so a misspelt option in a recipe fails here, not an
    # hour into a user's run
    path = os.path.join(ROOT, "recipes", recipe)
    args = options.parse_args(["--config", path, "--data", "DATA"])
    given = options.load_config_file(path)
    assert given and all(getattr(args, k) == v for k, v in given.items()), given
    if args.lr_schedule == "linear":
        assert args.max_updates, f"{recipe}: the linear schedule needs max-updates"


@pytest.mark.slow
def test_train_translate_score_end_to_end(tmp_path):
    """A few hundred updates on the synthetic corpus, then translate.py and sacreBLEU."""
    run = str(tmp_path / "run")
    code = train_cli.main(["--run-dir", run, "--synthetic-pairs", "4000", "--max-updates", "300",
                           "--valid-every", "100", "--warmup", "150", "--max-tokens", "1500",
                           "--no-progress", "--log-every", "50", "--test-split", "",
                           "--valid-bleu-sentences", "100", "--d-model", "64", "--d-ff", "256"])
    assert code == 0
    data = os.path.join(run, "data")
    src = os.path.join(tmp_path, "in.txt")
    lines = open(os.path.join(data, "test.src")).read().splitlines()[:40]
    with open(src, "w") as f:  # an empty line must stay an empty line
        f.write("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    ref = os.path.join(tmp_path, "ref.txt")
    refs = open(os.path.join(data, "test.tgt")).read().splitlines()[:40]
    with open(ref, "w") as f:
        f.write("\n".join(refs[:5] + [""] + refs[5:]) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir", run,
                           "--input", src, "--reference", ref, "--beam", "4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split("\n")[:-1]
    assert len(out) == 41 and out[5] == ""
    assert "BLEU = " in proc.stderr and "nrefs:1|case:mixed" in proc.stderr
    bleu = float(proc.stderr.split("BLEU = ")[1].split()[0])
    # measured: about 26 greedy validation BLEU at this point; an untrained model scores ~0
    assert bleu > 10, proc.stderr
    greedy = subprocess.run([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir", run,
                             "--beam", "1", "--average-last", "2"],
                            input="\n".join(lines[:3]) + "\n",
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert greedy.returncode == 0 and len(greedy.stdout.splitlines()) == 3


def test_a_signal_during_the_closing_save_stops_with_its_status(tmp_path, monkeypatch):
    # training has finished and checkpoint_last.npz is being written when SIGTERM arrives:
    # the save completes, the run exits 128 + 15 (no test score), and nothing crashes
    saved = []

    def save_then_signal(self, *paths):
        saved.extend(paths)
        os.kill(os.getpid(), signal.SIGTERM)  # (StopSignals notes it: not fatal here)
        return real_save(self, *paths)

    real_save = train_cli.Trainer.save
    monkeypatch.setattr(train_cli.Trainer, "save", save_then_signal)
    run = tmp_path / "run"
    status = train_cli.main([*SMALL, "--run-dir", str(run), "--max-updates", "4",
                             "--valid-every", "100000"])
    assert status == 128 + signal.SIGTERM
    assert saved and (run / "checkpoint_last.npz").exists()
    assert ckpt.load_checkpoint(str(run / "checkpoint_last.npz"))[2]["update"] == 4


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    run = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, "--run-dir", run,
           "--max-updates", "100000", "--valid-every", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 120
    log = os.path.join(run, "metrics.jsonl")
    while time.time() < deadline and not (os.path.exists(log) and os.path.getsize(log) > 300):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out  # the shell's convention: a job
    assert "SIGTERM" in out and "--resume" in out        # scheduler sees it did not finish
    meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    stopped = meta["update"]
    assert stopped > 0
    assert run_train("--run-dir", run, "--resume", "--max-updates", str(stopped + 3),
                     "--valid-every", "100000") == 0
    last = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))
    assert last[2]["update"] == stopped + 3


def _records(run):
    """metrics.jsonl's update lines and validations, less what depends on the clock."""
    out = []
    for line in open(os.path.join(run, "metrics.jsonl")):
        rec = json.loads(line)
        if "valid_loss" in rec or "loss" in rec:
            out.append({k: v for k, v in rec.items() if k not in ("time", "tokens_per_s")})
    return out


@pytest.mark.parametrize("stop_at", [10, 8])
def test_a_signal_during_an_update_that_validates_is_caught_up_on_resume(tmp_path, capsys,
                                                                          monkeypatch, stop_at):
    """SIGTERM while update 10 runs, where 10 is due a log line, a validation and periodic
    checkpoints: the run stops after that update at once (its log line is written), and
    --resume validates and saves update 10 before update 11. The resumed run's log, its
    validations, its periodic and best checkpoints are those of the uninterrupted run.
    Stopped at 8 (due nothing), the checkpoint keeps the log line's window (updates 6-8),
    so the resumed run's line at 10 averages 6-10, as the uninterrupted run's does."""
    opts = ["--max-updates", "20", "--valid-every", "10", "--log-every", "5"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_train("--run-dir", straight, *opts) == 0
    real_update = train_cli.Trainer.train_update

    def signalled(self):
        if self.update == stop_at - 1:  # (update stop_at is being made)
            os.kill(os.getpid(), signal.SIGTERM)  # (StopSignals notes it)
        return real_update(self)

    monkeypatch.setattr(train_cli.Trainer, "train_update", signalled)
    assert run_train("--run-dir", split, *opts) == 128 + signal.SIGTERM
    said = capsys.readouterr().out
    assert f"SIGTERM: stopped at update {stop_at}; saved" in said
    assert ("continue with --resume (which first writes its validation and checkpoints, due "
            "after update 10)" in said) == (stop_at == 10)
    monkeypatch.setattr(train_cli.Trainer, "train_update", real_update)
    meta = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))[2]
    assert meta["update"] == stop_at
    assert [r["update"] for r in _records(split)] == [1, 5, 10][:2 + (stop_at == 10)]
    assert run_train("--run-dir", split, *opts, "--resume") == 0
    assert _records(split) == _records(straight)
    for name in ("checkpoint_10.npz", "checkpoint_20.npz", "checkpoint_best.npz",
                 "checkpoint_last.npz"):
        a, b = (params_of(os.path.join(d, name)) for d in (straight, split))
        assert all(np.array_equal(a[k], b[k]) for k in a), name
        ma, mb = (ckpt.load_checkpoint(os.path.join(d, name))[2] for d in (straight, split))
        assert (ma["update"], ma["best_bleu"]) == (mb["update"], mb["best_bleu"]), name


def _rates(run):
    return {r["update"]: r["lr"] for r in _records(run) if "lr" in r}


def test_a_linear_run_given_more_updates_on_resume_goes_on_from_its_rate(tmp_path):
    """--lr-schedule linear, 80 updates, stopped after its first epoch (--max-epochs),
    resumed with --max-updates 200: the rate goes on from that of its last update in a
    straight line to 0 at 200 (it jumped: the schedule was recomputed for 200 updates);
    resumed again, unchanged, the line holds; a finished run is not extended, nor an
    unfinished one cut where it stands."""
    from minitransformer.optim import linear_decay_lr
    run = str(tmp_path / "run")
    opts = ["--lr-schedule", "linear", "--warmup", "10", "--log-every", "1",
            "--valid-every", "1000"]
    assert run_train("--run-dir", run, *opts, "--max-updates", "80", "--max-epochs", "1") == 0
    stopped = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    assert 10 < stopped < 80  # (past the warm-up; one epoch is fewer than 80 updates)
    rate = _rates(run)[stopped]
    assert rate == linear_decay_lr(stopped, 32, 10, 80)
    with pytest.raises(SystemExit, match=f"has made {stopped} of its 80 updates"):
        run_train("--run-dir", run, *opts, "--max-updates", str(stopped), "--resume",
                  "--max-epochs", "0")
    assert run_train("--run-dir", run, *opts, "--max-updates", "200", "--resume",
                     "--max-epochs", "2") == 0
    mid = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    assert mid["linear_from"] == [stopped, rate] and stopped < mid["update"] < 200
    assert run_train("--run-dir", run, *opts, "--resume", "--max-epochs", "0") == 0
    rates = _rates(run)
    assert max(rates) == 200 and rates[200] == 0.0
    for u in range(stopped + 1, 201):  # one straight line from update `stopped` on
        assert rates[u] == pytest.approx(rate * (200 - u) / (200 - stopped), rel=1e-12), u
    assert rates[stopped + 1] / rates[stopped] > 0.98  # no jump
    with pytest.raises(SystemExit, match=r"has finished its linear schedule \(200 updates"):
        run_train("--run-dir", run, *opts, "--max-updates", "300", "--resume")


def test_a_new_lr_factor_or_warmup_on_resume_says_how_the_rate_moves(tmp_path, capsys):
    """--lr-factor or --warmup given anew on --resume of a run without a plan changes its
    schedule (a deliberate change: applied, and saved for the next --resume); the set-up says
    what the next update's rate becomes against the run's own, and the rates logged follow
    the new values."""
    from minitransformer.optim import noam_lr
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "20", "--valid-every", "1000",
                     "--log-every", "1") == 0
    capsys.readouterr()
    assert run_train("--run-dir", run, "--resume", "--max-updates", "30",
                     "--lr-factor", "0.5") == 0
    old, new = noam_lr(21, 32, 50, 1.0), noam_lr(21, 32, 50, 0.5)
    assert (f"note: --lr-factor 0.5 on --resume: the learning rate of update 21 is {new:.3g}, "
            f"0.5x the {old:.3g} of the run's schedule") in capsys.readouterr().out
    assert _rates(run)[25] == noam_lr(25, 32, 50, 0.5)
    # (SMALL's --warmup 50: the run is still warming up) a shorter warm-up moves the rate;
    # one changed again once the run is past both leaves noam's rate where it was
    assert run_train("--run-dir", run, "--resume", "--max-updates", "35", "--warmup",
                     "20") == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: --warmup")]
    assert line == [f"note: --warmup 20 on --resume: the learning rate of update 31 is "
                    f"{noam_lr(31, 32, 20, 0.5):.3g}, "
                    f"{noam_lr(31, 32, 20, 0.5) / noam_lr(31, 32, 50, 0.5):.3g}x the "
                    f"{noam_lr(31, 32, 50, 0.5):.3g} of the run's schedule"]
    assert _rates(run)[35] == noam_lr(35, 32, 20, 0.5)
    assert run_train("--run-dir", run, "--resume", "--max-updates", "40", "--warmup",
                     "30") == 0
    assert "note: --warmup 30 on --resume: the learning rate of update 36 stays " \
        f"{noam_lr(36, 32, 30, 0.5):.3g}" in capsys.readouterr().out
    assert run_train("--run-dir", run, "--resume", "--max-updates", "45", "--warmup",
                     "30") == 0
    assert "note: --" not in capsys.readouterr().out  # (the values the run has: no change)


def test_a_bent_linear_run_given_max_time_on_resume_keeps_its_line(tmp_path):
    """A linear run bent by a new --max-updates (linear_from), resumed again with --max-time:
    the plan starts from the bent line, not from the run's first line to its cap (the rate
    jumped 1.5x at the resume)."""
    run = str(tmp_path / "run")
    opts = ["--lr-schedule", "linear", "--warmup", "10", "--log-every", "1",
            "--valid-every", "1000"]
    assert run_train("--run-dir", run, *opts, "--max-updates", "80", "--max-epochs", "1") == 0
    bent = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    rate = _rates(run)[bent]
    assert run_train("--run-dir", run, *opts, "--max-updates", "200", "--resume",
                     "--max-epochs", "2") == 0
    stopped = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    assert bent < stopped < 200
    assert run_train("--run-dir", run, *opts, "--resume", "--max-epochs", "0",
                     "--max-time", "30") == 0
    rates = _rates(run)
    for u in (stopped, stopped + 1):  # (the first plan comes ~30 updates after the resume)
        assert rates[u] == pytest.approx(rate * (200 - u) / (200 - bent), rel=1e-12), u
    assert max(rates) == 200 and rates[200] == 0.0


def test_the_log_window_a_checkpoint_keeps_includes_the_all_reduce_time(tmp_path):
    """Under mpiexec a log line also gives the all-reduce's share of an update: a window
    stopped after 5 updates and resumed in a new process (whose communicator counts from 0)
    gives the uninterrupted line's 100 of 200 ms (it gave 50: the first 5 updates' all-reduce
    time was lost)."""
    from minitransformer.mt.log import Log

    class Comm:
        allreduce_s = 0.0

    def updates(log, comm, n):
        for _ in range(n):
            comm.allreduce_s += 0.1  # 100 ms of all-reduce in each 200 ms update
            log.add_update(2.0, 1, 0.2)

    def line(path):
        return [json.loads(s) for s in open(path)][-1]

    comm = Comm()
    whole = Log(str(tmp_path / "a"), 0, False, comm=comm)
    updates(whole, comm, 10)
    whole.update_line(10, 0, 1e-3, 2.0)
    first = Comm()
    stopped = Log(str(tmp_path / "b"), 0, False, comm=first)
    updates(stopped, first, 5)
    kept = json.loads(json.dumps(stopped.window()))  # (as the checkpoint's meta holds it)
    second = Comm()
    resumed = Log(str(tmp_path / "b"), 0, False, comm=second)
    resumed.restore_window(kept)
    updates(resumed, second, 5)
    resumed.update_line(10, 0, 1e-3, 2.0)
    a, b = line(tmp_path / "a"), line(tmp_path / "b")
    assert a["allreduce_s"] == pytest.approx(0.1) and b["allreduce_s"] == pytest.approx(0.1)
    assert (a["loss"], a["update_s"]) == (b["loss"], b["update_s"])


def test_a_flag_counts_as_given_however_it_is_written():
    """--flag=value and an abbreviation are given flags too (only '--flag value' counted: a
    --resume --max-updates=160 kept the run's 150 and trained nothing, and a run that sizes
    itself overrode --subword-alpha=0)."""
    args = options.parse_args(["--max-updates=160", "--lr-fac", "0.5", "--no-progress",
                               "--subword-alpha=0", "--data", "d"])
    assert args.explicit == {"max_updates", "lr_factor", "no_progress", "subword_alpha",
                             "data"}
    assert (args.max_updates, args.lr_factor, args.subword_alpha) == (160, 0.5, 0.0)


def test_resume_takes_a_flag_written_with_an_equals_sign(tmp_path):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "6", "--valid-every", "1000") == 0
    assert run_train("--run-dir", run, "--resume", "--max-updates=9") == 0
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == 9


def test_averaging_more_checkpoints_than_are_kept_is_warned_at_the_start(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert run_train("--run-dir", run, "--max-updates", "2", "--keep-last", "2",
                     "--average-last", "5") == 0
    assert ("warning: --average-last 5 averages the newest 5 periodic checkpoints for the "
            "test, but --keep-last 2 keeps only 2: give --keep-last 5 (or 0, to keep them all)"
            ) in capsys.readouterr().out
