"""translate.py against a user's mistakes and the machine's state (issue 17, items 3 and 5).

Each case runs ``python translate.py ...`` as a user would and checks the exit code, that
stderr holds one clear ``error:`` line naming the flag, file or line (never a traceback), and
that the run directory is exactly as it was.
"""
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

from conftest import sigint_as_a_terminal_gives_it, sigint_state, synthetic_tokenizer, untrained_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # permissions do not stop root


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A loadable run directory (untrained tiny model) and the files the cases use."""
    d = tmp_path_factory.mktemp("hostile")
    tok, corpus = synthetic_tokenizer(d, n_valid=6)
    run = d / "run"
    cfg = untrained_run(run, tok, max_positions=64).cfg
    good = (run / "checkpoint_last.npz").read_bytes()
    lines = corpus["valid"][0][:3]
    files = {"run": str(run), "dir": str(d), "missing": str(d / "no_such_file.txt")}

    def put(name, data):
        (d / name).write_bytes(data)
        files[name] = str(d / name)

    put("in.txt", "".join(s + "\n" for s in lines).encode())
    put("ref.txt", "".join(s + "\n" for s in corpus["valid"][1][:3]).encode())
    put("empty.txt", b"")
    put("ref_short.txt", "".join(s + "\n" for s in corpus["valid"][1][:2]).encode())
    put("latin1.txt", lines[0].encode() + b"\nd\xe9j\xe0 vu\n")  # line 2 is not UTF-8
    put("many.txt", "".join(s + "\n" for s in lines * 300).encode())
    put("notes.txt", b"not a checkpoint\n")
    put("truncated.npz", good[:len(good) // 2])
    meta = {"spm_sha256": ckpt.file_sha256(str(run / "spm.model"))}
    np.savez(d / "no_config.npz", meta=np.array(json.dumps(meta)))
    np.savez(d / "no_params.npz", meta=np.array(json.dumps({**meta, "config": vars(cfg)})))
    files.update({k: str(d / f"{k}.npz") for k in ("no_config", "no_params")})
    # the run's model, and one of the same shapes trained with another vocabulary
    put("good.npz", good)
    from minitransformer.nn.transformer import Transformer
    ckpt.save_checkpoint(str(d / "foreign.npz"), Transformer(cfg, seed=5), None,
                         {"spm_sha256": "0" * 64})
    files["foreign.npz"] = str(d / "foreign.npz")
    corrupt = bytearray(good)
    corrupt[len(good) // 3:len(good) // 3 + 64] = b"\0" * 64  # inside the first array's data
    put("corrupt.npz", bytes(corrupt))
    # a run directory whose own checkpoint is damaged, and one with a damaged spm.model
    for name, damage in (("run_bad_ckpt", "checkpoint_last.npz"), ("run_bad_spm", "spm.model")):
        shutil.copytree(run, d / name)
        (d / name / damage).write_bytes(b"\0garbage" * 100)
        files[name] = str(d / name)
    (d / "run_no_spm").mkdir()
    (d / "run_no_spm" / "checkpoint_last.npz").write_bytes(good)
    files["run_no_spm"] = str(d / "run_no_spm")
    (d / "run_no_ckpt").mkdir()
    (d / "run_no_ckpt" / "spm.model").write_bytes((run / "spm.model").read_bytes())
    files["run_no_ckpt"] = str(d / "run_no_ckpt")
    # a `cupy` that fails to import, first on PYTHONPATH: a machine without CuPy
    (d / "nocupy" / "cupy").mkdir(parents=True)
    (d / "nocupy" / "cupy" / "__init__.py").write_text(
        "raise ImportError('No module named cupy (test stand-in)')\n")
    files["nocupy"] = str(d / "nocupy")
    return files


def fill(text, env):
    """``text`` with each ``{name}`` replaced by ``env[name]``."""
    for name, value in env.items():
        text = text.replace("{" + name + "}", value)
    assert "{" not in text, text
    return text


def tree_hashes(path):
    """{relative path: sha256} of every file under ``path``."""
    out = {}
    for base, _, names in os.walk(path):
        for n in names:
            p = os.path.join(base, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def translate(args, stdin=None, stdout=subprocess.PIPE, env_extra=None, timeout=120):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, "translate.py"), *args],
                          input=stdin, stdout=stdout, stderr=subprocess.PIPE, cwd=ROOT,
                          env=env, timeout=timeout)


# (case id, argv with {names} from env, expected exit code, texts stderr must contain)
CASES = [
    ("input-is-a-directory", ["--input", "{dir}"], 2, ["--input", "{dir}", "not a regular"]),
    ("input-missing", ["--input", "{missing}"], 2, ["--input", "{missing}", "no such file"]),
    ("input-not-utf8", ["--input", "{latin1.txt}"], 2, ["--input", "line 2", "UTF-8"]),
    ("reference-is-a-directory", ["--input", "{in.txt}", "--reference", "{dir}"], 2,
     ["--reference", "not a regular"]),
    ("reference-missing", ["--input", "{in.txt}", "--reference", "{missing}"], 2,
     ["--reference", "{missing}"]),
    ("reference-not-utf8", ["--input", "{in.txt}", "--reference", "{latin1.txt}"], 2,
     ["--reference", "line 2"]),
    ("input-empty-with-reference", ["--input", "{empty.txt}", "--reference", "{ref.txt}"], 2,
     ["--reference", "{empty.txt}", "has no lines", "nothing to score"]),
    ("reference-line-count", ["--input", "{in.txt}", "--reference", "{ref_short.txt}"], 2,
     ["--reference", "2 lines", "has 3"]),
    ("run-dir-missing", ["--run-dir", "{missing}"], 2, ["--run-dir", "{missing}", "no such"]),
    ("run-dir-is-a-file", ["--run-dir", "{in.txt}"], 2, ["--run-dir", "not a directory"]),
    ("run-dir-without-spm", ["--run-dir", "{run_no_spm}"], 2, ["--run-dir", "spm.model"]),
    ("run-dir-without-checkpoints", ["--run-dir", "{run_no_ckpt}"], 2,
     ["--run-dir", "checkpoint_last.npz", "--checkpoint"]),
    ("run-dir-damaged-checkpoint", ["--run-dir", "{run_bad_ckpt}"], 2,
     ["checkpoint_last.npz", "damaged"]),
    ("run-dir-damaged-spm", ["--run-dir", "{run_bad_spm}"], 2, ["spm.model"]),
    ("checkpoint-truncated", ["--checkpoint", "{truncated.npz}"], 2,
     ["truncated.npz", "damaged"]),
    ("checkpoint-corrupt", ["--checkpoint", "{corrupt.npz}"], 2, ["corrupt.npz", "damaged"]),
    ("checkpoint-not-npz", ["--checkpoint", "{notes.txt}"], 2, ["--checkpoint", "notes.txt"]),
    ("checkpoint-without-config", ["--checkpoint", "{no_config}"], 2,
     ["no_config.npz", "model config"]),
    ("checkpoint-without-parameters", ["--checkpoint", "{no_params}"], 2,
     ["no_params.npz", "parameters"]),
    ("checkpoint-missing", ["--checkpoint", "{missing}"], 2, ["--checkpoint", "{missing}"]),
    ("checkpoint-of-another-vocabulary", ["--checkpoint", "{foreign.npz}"], 2,
     ["foreign.npz", "another sentencepiece vocabulary"]),
    ("averaged-with-another-vocabulary", ["--checkpoint", "{good.npz}", "{foreign.npz}"], 2,
     ["foreign.npz", "good.npz", "different sentencepiece vocabularies"]),
    ("averaged-after-another-vocabulary", ["--checkpoint", "{foreign.npz}", "{good.npz}"], 2,
     ["foreign.npz", "good.npz", "different sentencepiece vocabularies"]),
    ("checkpoint-is-a-directory", ["--checkpoint", "{dir}"], 2, ["--checkpoint", "not a file"]),
    ("average-last-without-periodic", ["--average-last", "2"], 2,
     ["--average-last", "checkpoint_<update>.npz"]),
    ("device-unknown", ["--device", "tpu"], 2, ["--device tpu", "'cpu' or 'cuda'"]),
    ("plot-dir-is-a-file", ["--plot-attention", "{in.txt}"], 2,
     ["--plot-attention", "not a directory"]),
    ("plot-dir-under-a-file", ["--plot-attention", "{in.txt}/attn"], 2,
     ["--plot-attention", "cannot create"]),
    ("beam-zero", ["--beam", "0"], 2, ["--beam", ">= 1", "'0'"]),
    ("beam-not-a-number", ["--beam", "four"], 2, ["--beam", "'four'"]),
    ("alpha-negative", ["--alpha", "-0.5"], 2, ["--alpha", ">= 0"]),
    ("alpha-nan", ["--alpha", "nan"], 2, ["--alpha", "finite"]),
    ("max-len-a-negative", ["--max-len-a", "-1"], 2, ["--max-len-a", ">= 0"]),
    ("max-tokens-zero", ["--max-tokens", "0"], 2, ["--max-tokens", ">= 1"]),
    ("average-last-negative", ["--average-last", "-3"], 2, ["--average-last", ">= 0"]),
]


@pytest.mark.parametrize("case,argv,code,expect", CASES, ids=[c[0] for c in CASES])
def test_mistake_gives_one_clear_error(env, case, argv, code, expect):
    argv = [fill(a, env) for a in argv]
    if "--run-dir" not in argv:
        argv = ["--run-dir", env["run"]] + argv
    if "--input" not in argv:
        argv += ["--input", env["in.txt"]]
    run_dir = argv[argv.index("--run-dir") + 1]
    before = tree_hashes(run_dir) if os.path.isdir(run_dir) else None
    proc = translate(argv)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    for text in expect:
        assert fill(text, env) in err, (text, err)
    assert proc.stdout == b"", "no partial output on an error"
    if before is not None:
        assert tree_hashes(run_dir) == before, "the run directory was changed"
    # one error line, no usage dump except argparse's own (for parse-time errors)
    assert len([x for x in err.splitlines() if "error:" in x]) == 1, err


def test_device_cuda_without_cupy(env):
    before = tree_hashes(env["run"])
    proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--device", "cuda"],
                     env_extra={"PYTHONPATH": env["nocupy"]})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "--device cuda" in err and "pip install" in err, err
    # the device from the environment: the message names the variable, not a flag not given
    proc = translate(["--run-dir", env["run"], "--input", env["in.txt"]],
                     env_extra={"PYTHONPATH": env["nocupy"], "MINITRANSFORMER_DEVICE": "cuda"})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("error: MINITRANSFORMER_DEVICE=cuda (the default of --device): "), err
    assert "pip install" in err, err
    assert tree_hashes(env["run"]) == before


def test_an_empty_input_is_translated_to_nothing_with_a_warning(env):
    proc = translate(["--run-dir", env["run"], "--input", env["empty.txt"]])
    err = proc.stderr.decode()
    assert proc.returncode == 0 and proc.stdout == b"", err
    assert err == f"warning: the input {env['empty.txt']} has no lines: nothing to translate\n"


@pytest.mark.parametrize("flag", ["--input", "--reference"])
def test_output_redirected_onto_the_input_or_reference_is_refused(env, tmp_path, flag):
    # `translate.py --input f > f`: the shell has emptied f before translate.py starts;
    # with `>> f` the translations would be appended to the text they translate
    f = tmp_path / "both.txt"
    f.write_bytes(open(env["in.txt"], "rb").read())
    argv = ["--run-dir", env["run"], "--input", env["in.txt"], "--reference", env["ref.txt"]]
    argv[argv.index(flag) + 1] = str(f)
    with open(f, "ab") as out:
        proc = translate(argv, stdout=out)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.startswith(f"error: {flag} {f} is also where the translations go"), err
    assert f.read_bytes() == open(env["in.txt"], "rb").read()  # (nothing appended)


def test_bleu_tokenize_scores_with_that_tokenization(env):
    from minitransformer.mt.translation import corpus_bleu
    scores = {}
    for tokenize in ("13a", "char"):
        proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--reference",
                          env["ref.txt"], "--max-len-a", "2", "--bleu-tokenize", tokenize])
        err = proc.stderr.decode()
        assert proc.returncode == 0 and f"tok:{tokenize}" in err, err
        hyps = proc.stdout.decode().splitlines()
        refs = open(env["ref.txt"], encoding="utf-8").read().splitlines()
        scores[tokenize] = corpus_bleu(hyps, refs, tokenize)[0]
        assert f"BLEU = {scores[tokenize]:.2f}" in err, err
    try:
        import MeCab  # noqa: F401
    except ImportError:  # (sacrebleu[ja] not installed: refused before translating)
        proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--reference",
                          env["ref.txt"], "--bleu-tokenize", "ja-mecab"])
        err = proc.stderr.decode()
        assert proc.returncode == 2 and proc.stdout == b"", err
        assert err.startswith("error: --bleu-tokenize ja-mecab: ") and \
            "pip install sacrebleu[ja]" in err, err


def test_stdin_not_utf8_names_the_line(env):
    proc = translate(["--run-dir", env["run"]], stdin=b"fine\n\xff\xfe bad\n")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "<stdin>, line 2" in err


def test_closed_stdin(env):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir",
                           env["run"]], stdin=subprocess.DEVNULL, capture_output=True,
                          cwd=ROOT, timeout=120, preexec_fn=lambda: os.close(0))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "standard input is closed" in err and "--input" in err


def test_closed_stdout(env):
    """`translate.py ... >&-`: said before any work, not after translating everything."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir",
                           env["run"], "--input", env["in.txt"]], stderr=subprocess.PIPE,
                          cwd=ROOT, timeout=120, preexec_fn=lambda: os.close(1))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "standard output is closed" in err


@pytest.mark.skipif(AS_ROOT, reason="file permissions do not stop root")
@pytest.mark.parametrize("flag", ["--input", "--reference"])
def test_unreadable_file(env, tmp_path, flag):
    path = tmp_path / "secret.txt"
    path.write_text("a b\nc d\ne f\n")
    path.chmod(0)
    args = ["--run-dir", env["run"], "--input", env["in.txt"]]
    args = args + [flag, str(path)] if flag == "--reference" else \
        ["--run-dir", env["run"], "--input", str(path)]
    proc = translate(args)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert flag in err and str(path) in err and "cannot be read" in err


@pytest.mark.skipif(AS_ROOT, reason="file permissions do not stop root")
def test_read_only_plot_dir(env, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--plot-attention",
                      str(out)])
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "--plot-attention" in err and "writ" in err


def test_output_to_a_closed_pipe_ends_quietly(env):
    """`translate.py ... | head -1`: the reader goes away; no traceback, exit 141 (as `yes`)."""
    before = tree_hashes(env["run"])
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir",
                             env["run"], "--input", env["many.txt"], "--beam", "1",
                             "--max-len-a", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == "", err
    assert tree_hashes(env["run"]) == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_to_a_full_disk(env):
    with open("/dev/full", "wb") as full:
        proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--max-len-a",
                          "2"], stdout=full)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err and "Exception" not in err, err
    assert "standard output" in err and "No space left" in err


def _reading_stdin(pid):
    """Whether process ``pid`` is blocked reading file descriptor 0 (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
    except OSError:  # not started yet, or gone
        return False
    return len(fields) > 1 and fields[0] in ("0", "63") and int(fields[1], 16) == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/syscall"), reason="needs Linux /proc")
def test_ctrl_c_is_one_line_and_exit_130(env):
    """Ctrl-C while translate.py waits for its input: one line, exit code 130."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "translate.py"), "--run-dir",
                             env["run"]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT,
                            preexec_fn=sigint_as_a_terminal_gives_it)
    try:
        deadline = time.monotonic() + 60
        while not _reading_stdin(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "never read stdin"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert proc.returncode == 130, f"{err} ({sigint_state()})"
    assert "Traceback" not in err and err.count("\n") == 1 and "interrupted" in err, err
    assert out == b""


def test_valid_run_still_translates_and_leaves_the_run_alone(env, tmp_path):
    before = tree_hashes(env["run"])
    proc = translate(["--run-dir", env["run"], "--input", env["in.txt"], "--reference",
                      env["ref.txt"], "--max-len-a", "2"])
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "BLEU = " in err, err
    assert len(proc.stdout.decode().split("\n")[:-1]) == 3
    assert tree_hashes(env["run"]) == before


def test_input_and_reference_from_pipes(env, tmp_path):
    # /dev/stdin fed by a pipe, and a named pipe (what a shell's <(...) gives) as the
    # reference: read as the files they stand for
    import threading
    args = ["--run-dir", env["run"], "--max-len-a", "2"]
    files = translate(args + ["--input", env["in.txt"], "--reference", env["ref.txt"]])
    fifo = tmp_path / "ref.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:
            f.write(open(env["ref.txt"], "rb").read())

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    pipes = translate(args + ["--input", "/dev/stdin", "--reference", str(fifo)],
                      stdin=open(env["in.txt"], "rb").read())
    writer.join(timeout=10)
    assert pipes.returncode == 0, pipes.stderr.decode()
    assert pipes.stdout == files.stdout
    bleu = [line for line in pipes.stderr.decode().splitlines() if line.startswith("BLEU")]
    assert bleu and bleu == [line for line in files.stderr.decode().splitlines()
                             if line.startswith("BLEU")]


# In-process stand-ins for what permissions do to a user who is not root (tests run as root
# in some containers, where chmod stops nothing).

@pytest.mark.parametrize("flag", ["--input", "--reference"])
def test_unreadable_file_in_process(env, monkeypatch, capsys, flag):
    from minitransformer.mt import data
    from minitransformer.mt import translate as translate_cli
    target = env["ref.txt"] if flag == "--reference" else env["in.txt"]
    real_open = open

    def denying_open(path, *a, **kw):
        if os.fspath(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(data, "open", denying_open, raising=False)
    code = translate_cli.main(["--run-dir", env["run"], "--input", env["in.txt"],
                               "--reference", env["ref.txt"]])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag}: {target}: cannot be read (Permission denied)" in err, err


def test_read_only_plot_dir_in_process(env, tmp_path, monkeypatch, capsys):
    from minitransformer.mt import translate as translate_cli
    out = tmp_path / "ro"
    out.mkdir()
    monkeypatch.setattr(translate_cli.os, "access", lambda path, mode: False)
    code = translate_cli.main(["--run-dir", env["run"], "--input", env["in.txt"],
                               "--plot-attention", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"--plot-attention {out}: the directory is not writable" in err, err
