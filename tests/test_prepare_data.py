"""prepare_data multi30k against a local HTTP server (loopback only) serving a small fixture."""
import functools
import gzip
import http.server
import os
import threading

import pytest

from minitransformer.mt import prepare_data

RAW = os.path.join("data", "task1", "raw")  # the layout of github.com/multi30k/dataset
FIXTURE = {  # remote name: (English lines, German lines)
    "train": (["Two dogs run.", "A man sits on a bench."],
              ["Zwei Hunde rennen.", "Ein Mann sitzt auf einer Bank."]),
    "val": (["A girl in a café."], ["Ein Mädchen in einem Café."]),
    "test_2016_flickr": (["A red car.", "Children play.", "A cat sleeps."],
                         ["Ein rotes Auto.", "Kinder spielen.", "Eine Katze schläft."]),
    "test_2017_flickr": (["People walk."], ["Leute gehen."]),
}
OURS = {"train": "train", "val": "valid", "test_2016_flickr": "test2016",
        "test_2017_flickr": "test2017"}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    """-> (root directory served, base URL of its data/task1/raw)."""
    root = tmp_path / "repo"
    raw = root / RAW
    raw.mkdir(parents=True)
    for name, (en, de) in FIXTURE.items():
        for lang, lines in (("en", en), ("de", de)):
            (raw / f"{name}.{lang}.gz").write_bytes(
                gzip.compress("".join(s + "\n" for s in lines).encode("utf-8")))
    for var in ("no_proxy", "NO_PROXY"):  # never send loopback requests through a proxy
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield raw, f"http://127.0.0.1:{httpd.server_address[1]}/{RAW.replace(os.sep, '/')}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_downloads_and_writes_the_plain_files(server, tmp_path, capsys):
    _, url = server
    out = tmp_path / "multi30k"
    assert prepare_data.main(["multi30k", "--output", str(out), "--base-url", url]) == 0
    printed = capsys.readouterr().out
    assert "non-commercial" in printed and "Elliott et al. 2016" in printed
    expected = {f"{OURS[name]}.{lang}" for name in FIXTURE for lang in ("en", "de")}
    assert set(os.listdir(out)) == expected  # no temporary files left behind
    for name, (en, de) in FIXTURE.items():
        for lang, lines in (("en", en), ("de", de)):
            text = (out / f"{OURS[name]}.{lang}").read_text(encoding="utf-8")
            assert text == "".join(s + "\n" for s in lines)
    assert "test2016.en: 3 lines" in printed


def test_missing_file_names_the_url_and_writes_nothing(server, tmp_path, capsys):
    raw, url = server
    (raw / "test_2017_flickr.de.gz").unlink()  # the last file fetched: all others succeeded
    out = tmp_path / "multi30k"
    assert prepare_data.main(["multi30k", "--output", str(out), "--base-url", url]) == 2
    err = capsys.readouterr().err
    assert f"{url}/test_2017_flickr.de.gz" in err and "404" in err
    assert not out.exists() or os.listdir(out) == []


def test_misaligned_pair_is_an_error(server, tmp_path, capsys):
    raw, url = server
    (raw / "val.de.gz").write_bytes(gzip.compress(b"eins\nzwei\n"))
    out = tmp_path / "multi30k"
    assert prepare_data.main(["multi30k", "--output", str(out), "--base-url", url]) == 2
    err = capsys.readouterr().err
    assert "val.en has 1 lines but val.de has 2" in err
    assert not out.exists() or os.listdir(out) == []


def test_not_gzip_and_unreachable_server_are_clear_errors(server, tmp_path):
    raw, url = server
    (raw / "train.en.gz").write_bytes(b"<html>not gzip</html>")
    with pytest.raises(prepare_data.DataError, match=r"train\.en\.gz: not a valid gzip file"):
        prepare_data.prepare_multi30k(str(tmp_path / "a"), url, log=lambda s: None)
    # a closed port on loopback: connection refused, reported with the URL
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/raw"
    with pytest.raises(prepare_data.DataError, match=rf"could not download {dead}/train\.en\.gz"):
        prepare_data.prepare_multi30k(str(tmp_path / "b"), dead, log=lambda s: None)


def test_an_output_that_is_a_file_and_a_url_without_scheme_are_one_line(server, tmp_path,
                                                                         capsys):
    _, url = server
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    under = f"lies under {a_file}, which is a file, not a directory"
    for output, words in ((a_file, "is a file, not a directory"), (a_file / "multi30k", under)):
        assert prepare_data.main(["multi30k", "--output", str(output), "--base-url",
                                  url]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"error: --output {output}: {words}; give a directory (it is " \
                               "created if need be)\n", captured.err
        assert "downloading" not in captured.out  # (refused before any download)
    assert a_file.read_text() == "mine\n"
    out = tmp_path / "multi30k"
    assert prepare_data.main(["multi30k", "--output", str(out), "--base-url",
                              "mirror.example.org/raw"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not download mirror.example.org/raw/train.en.gz: ")
    assert "--base-url must be a whole URL" in err and not out.exists()
