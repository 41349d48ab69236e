"""The attention explorer, python -m minitransformer.mt.explore (issue 20, item 4).

A tiny untrained run is served on a free port in a thread. Its JSON API is checked over
urllib against translate_lines and the attention recorded for plots; bad and hostile
requests must get a 4xx/5xx JSON answer and leave the server serving. The page itself is
driven in a real headless browser (Playwright with the system's chromium), skipped with the
reason when either is missing: `pip install playwright` and `apt-get install chromium`
(Playwright's own browser download is not needed). The browser test saves a screenshot in its
tmp_path, and also as tests/artifacts/explore.png when MINITRANSFORMER_KEEP_ARTIFACTS is set.
"""
import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import explore
from minitransformer.mt.translate import load_model
from minitransformer.mt.translation import translate_lines
from minitransformer.nn.transformer import Transformer, TransformerConfig

from conftest import sigint_as_a_terminal_gives_it, sigint_state, synthetic_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_LAYERS, N_HEADS, MAX_POSITIONS = 2, 2, 32
BEAM, MAX_LEN_A, MAX_CHARS = 3, 3, 200  # an untrained model never stops: keep outputs short
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A loadable run directory (untrained tiny model; seed 2 gives non-empty outputs), and
    sentences of its language."""
    d = tmp_path_factory.mktemp("explore")
    tok, corpus = synthetic_tokenizer(d, n_valid=4)
    cfg = TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=N_HEADS, d_ff=32,
                            n_layers=N_LAYERS, max_positions=MAX_POSITIONS, pad_id=tok.pad_id,
                            bos_id=tok.bos_id, eos_id=tok.eos_id)
    run_dir = d / "run"
    run_dir.mkdir()
    (run_dir / "spm.model").write_bytes(open(tok.model_path, "rb").read())
    ckpt.save_checkpoint(str(run_dir / "checkpoint_last.npz"), Transformer(cfg, seed=2), None,
                         {"spm_sha256": ckpt.file_sha256(str(run_dir / "spm.model"))})
    return str(run_dir), corpus["valid"][0][:3]


@pytest.fixture(scope="module")
def served(run):
    """The explorer of the run, served in a thread on a free port of 127.0.0.1."""
    run_dir, sentences = run
    model, tok, what = load_model(run_dir)
    explorer = explore.Explorer(model, tok, what, beam=BEAM, max_len_a=MAX_LEN_A,
                                max_chars=MAX_CHARS)
    server = explore.make_server(explorer, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, sentences
    server.shutdown()
    server.server_close()
    thread.join(10)


@contextlib.contextmanager
def serving(server):
    """``server`` answering in a thread for the block -> its port; closed after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def call(server, path, body=None, method=None, headers=None):
    """One request over urllib -> (status, decoded JSON or text, headers)."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    if headers is None and not isinstance(body, (bytes, type(None))):
        headers = {"Content-Type": "application/json"}  # (as the page sends it)
    req = urllib.request.Request(server.url.rstrip("/") + path, data=data, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            status, raw, hdrs = res.status, res.read(), res.headers
    except urllib.error.HTTPError as exc:
        status, raw, hdrs = exc.code, exc.read(), exc.headers
    if hdrs.get_content_type() == "application/json":
        return status, json.loads(raw), hdrs
    return status, raw.decode("utf-8"), hdrs


def raw_request(server, data):
    """Send raw bytes on a new connection -> (status, JSON body) of the answer."""
    with socket.create_connection(server.server_address[:2], timeout=30) as s:
        s.sendall(data)
        answer = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def still_serving(server, sentences):
    """The server answers a good request after a bad one."""
    status, out, _ = call(server, "/translate", {"text": sentences[0]})
    assert status == 200 and "translation" in out


# ----------------------------------------------------------------------------- the API

def test_translation_is_translate_lines_best_beam(served):
    server, sentences = served
    model, tok = server.explorer.model, server.explorer.tok
    expected = translate_lines(model, tok, sentences, beam=BEAM, alpha=0.6, max_len_a=MAX_LEN_A)
    for sentence, want in zip(sentences, expected):
        status, out, hdrs = call(server, "/translate", {"text": sentence})
        assert status == 200, out
        assert hdrs.get_content_type() == "application/json"
        assert out["translation"] == want
        alts = out["alternatives"]
        assert len(alts) >= 1  # every finished hypothesis (can be more than the beam)
        assert alts[0]["text"] == want, "the first alternative is the translation"
        scores = [a["score"] for a in alts]
        assert scores == sorted(scores, reverse=True), "alternatives best first"


def test_attention_shapes_labels_and_rows(served):
    server, sentences = served
    tok = server.explorer.tok
    status, out, _ = call(server, "/translate", {"text": sentences[1]})
    assert status == 200, out
    assert out["src_pieces"] == tok.encode_as_pieces(sentences[1]) + ["</s>"]
    assert out["tgt_pieces"][0] == "<s>"  # then the output's pieces (next test)
    S, T = len(out["src_pieces"]), len(out["tgt_pieces"])
    shapes = {"encoder": (S, S), "decoder": (T, T), "cross": (T, S)}
    assert set(out["attention"]) == set(shapes)
    for kind, (rows, cols) in shapes.items():
        maps = out["attention"][kind]
        assert len(maps) == N_LAYERS and all(len(layer) == N_HEADS for layer in maps), kind
        for layer in maps:
            for head in layer:
                assert len(head) == rows and all(len(r) == cols for r in head), kind
                for r in head:  # probabilities, rounded to 3 decimals
                    assert abs(sum(r) - 1) <= 0.0005 * cols + 1e-9, (kind, r)
                    assert all(v >= 0 and round(v, 3) == v for v in r)
    for layer in out["attention"]["decoder"]:  # causal
        for head in layer:
            assert all(head[i][j] == 0 for i in range(T) for j in range(i + 1, T))


def test_attention_is_the_recorded_attention_of_the_best_hypothesis(served):
    server, sentences = served
    ex = server.explorer
    status, out, _ = call(server, "/translate", {"text": sentences[2]})
    src_ids = ex.tok.encode([sentences[2]])[0]
    out_ids = [ex.tok.sp.piece_to_id(p) for p in out["tgt_pieces"][1:]]
    maps = explore.record_attention(ex.model, src_ids, out_ids)
    assert out["attention"] == {k: explore.rounded(v) for k, v in maps.items()}


def test_concurrent_requests_get_their_own_answers(served):
    server, sentences = served
    alone = [call(server, "/translate", {"text": s})[1] for s in sentences]
    results = [None] * (2 * len(sentences))

    def ask(i):
        results[i] = call(server, "/translate", {"text": sentences[i % len(sentences)]})[1]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, r in enumerate(results):
        want = dict(alone[i % len(sentences)])
        assert {k: v for k, v in r.items() if k != "seconds"} == \
            {k: v for k, v in want.items() if k != "seconds"}


def test_page_and_info(served):
    server, _ = served
    status, page, hdrs = call(server, "/")
    assert status == 200 and hdrs.get_content_type() == "text/html"
    assert "<canvas" in page and "/translate" in page
    assert "http://" not in page and "https://" not in page, "nothing loaded from elsewhere"
    status, info, _ = call(server, "/info")
    assert status == 200
    assert (info["encoder_layers"], info["decoder_layers"], info["heads"]) == \
        (N_LAYERS, N_LAYERS, N_HEADS)
    assert (info["max_chars"], info["max_pieces"], info["beam"]) == \
        (MAX_CHARS, MAX_POSITIONS - 1, BEAM)


def test_binds_to_127_0_0_1_by_default(run):
    run_dir, _ = run
    model, tok, what = load_model(run_dir)
    server = explore.make_server(explore.Explorer(model, tok, what))
    try:
        assert server.server_address[0] == "127.0.0.1"
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.server_close()


# ----------------------------------------------------------------------------- refused input

def test_too_many_characters_is_400_with_a_message(served):
    server, sentences = served
    status, out, _ = call(server, "/translate", {"text": "a" * (MAX_CHARS + 1)})
    assert status == 400
    assert f"{MAX_CHARS + 1} characters" in out["error"] and "--max-chars" in out["error"]
    still_serving(server, sentences)


def test_too_many_pieces_is_400_with_a_message(served):
    server, sentences = served
    text = " ".join(sentences * 10)[:MAX_CHARS]
    n = len(server.explorer.tok.encode([text])[0])
    assert n > MAX_POSITIONS - 1, "the test needs a text of more pieces than positions"
    status, out, _ = call(server, "/translate", {"text": text})
    assert status == 400
    assert f"{n} sentencepiece pieces" in out["error"] and "shorten" in out["error"]
    still_serving(server, sentences)


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b'{"txt": "a dog"}', '"text"'),
    (b'{"text": 5}', '"text"'),
    (b'["a dog"]', '"text"'),
    (b'{"text": "   "}', "empty"),
    (b'{"text": "a \\ud800 b"}', "Unicode"),
    (b"[" * 5000 + b"]" * 5000, "not JSON"),  # (nested past Python's recursion limit)
])
def test_bad_body_is_400(served, body, words):
    server, sentences = served
    status, out, _ = call(server, "/translate", body, headers={"Content-Type": "application/json"})
    assert status == 400 and words in out["error"]
    still_serving(server, sentences)


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_415_and_not_translated(served, content_type, monkeypatch):
    # what a page of another site can POST without the browser asking the server first
    server, sentences = served
    asked = []
    monkeypatch.setattr(server.explorer, "translate", lambda text: asked.append(text))
    body = json.dumps({"text": sentences[0]}).encode()
    head = b"".join([b"POST /translate HTTP/1.1\r\nHost: localhost\r\n",
                     b"Content-Length: %d\r\n" % len(body),
                     b"Content-Type: %s\r\n" % content_type.encode() if content_type else b""])
    status, out = raw_request(server, head + b"\r\n" + body)
    assert status == 415 and "Content-Type: application/json" in out["error"], out
    assert asked == []
    monkeypatch.undo()
    still_serving(server, sentences)


def test_a_request_to_another_host_name_is_403(served):
    # a page of another site whose name was made to resolve to 127.0.0.1 (DNS rebinding)
    # is same-origin for its browser: its requests carry that name in Host
    server, sentences = served
    port = server.server_address[1]
    for path, body in (("/", None), ("/info", None), ("/translate", {"text": sentences[0]})):
        status, out, _ = call(server, path, body, headers={
            "Host": f"attacker.example:{port}", "Content-Type": "application/json"})
        assert status == 403 and "attacker.example" in out["error"], (path, out)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        status, out, _ = call(server, "/translate", {"text": sentences[0]}, headers={
            "Host": host, "Content-Type": "application/json"})
        assert status == 200 and "translation" in out, (host, out)
    still_serving(server, sentences)


def test_any_loopback_address_is_this_machine_only(served):
    # 127.0.0.0/8 and ::1 (also as an IPv4-mapped address) are this machine; other
    # addresses and names are not: a server on 127.0.0.2 also refuses another Host
    for host in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "localhost", "LOCALHOST", "::1",
                 "[::1]", "::ffff:127.0.0.1"):
        assert explore.is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.2", "attacker.example",
                 "localhost.attacker.example", "127.0.0.1.nip.io", ""):
        assert not explore.is_loopback(host), host
    try:
        other = explore.make_server(served[0].explorer, host="127.0.0.2", port=0)
    except OSError as exc:
        pytest.skip(f"cannot listen on 127.0.0.2 here ({exc})")
    with serving(other) as port:
        status, out, _ = call(other, "/info", headers={"Host": f"attacker.example:{port}"})
        assert status == 403, out
        status, out, _ = call(other, "/info", headers={"Host": f"127.0.0.2:{port}"})
        assert status == 200, out


def test_a_server_on_this_machines_name_answers_requests_to_that_name(served):
    # --host $(hostname), a name that resolves to a loopback address (Debian: 127.0.1.1)
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as exc:
        pytest.skip(f"{name} does not resolve here ({exc})")
    if not explore.is_loopback(address):
        pytest.skip(f"{name} resolves to {address}, not a loopback address")
    other = explore.make_server(served[0].explorer, host=name, port=0)
    with serving(other) as port:
        status, out, _ = call(other, "/info", headers={"Host": f"{name}:{port}"})
        assert status == 200, out
        status, out, _ = call(other, "/info", headers={"Host": f"attacker.example:{port}"})
        assert status == 403 and name in out["error"] and "--host 0.0.0.0" in out["error"], out


@pytest.mark.parametrize("method, path, code", [
    ("GET", "/translate", 405), ("PUT", "/translate", 405), ("DELETE", "/", 405),
    ("GET", "/nope", 404), ("POST", "/nope", 404), ("POST", "/", 405),
    ("GET", "/../../etc/passwd", 404),
])
def test_wrong_method_or_path(served, method, path, code):
    server, sentences = served
    body = b'{"text": "a"}' if method in ("POST", "PUT") else None
    status, out, _ = call(server, path, body, method=method)
    assert status == code and out["error"]
    still_serving(server, sentences)


def test_oversized_body_is_413(served):
    server, sentences = served
    limit = max(explore.MIN_BODY, 1024 + 12 * MAX_CHARS)
    status, out, _ = call(server, "/translate", b"x" * (limit + 1))
    assert status == 413 and f"{limit + 1} bytes" in out["error"]
    # a claimed body of a terabyte is refused at once, without reading it
    status, out = raw_request(server, b"POST /translate HTTP/1.1\r\nHost: localhost\r\n"
                                      b"Content-Length: 1000000000000\r\n\r\n{")
    assert status == 413
    still_serving(server, sentences)


@pytest.mark.parametrize("request_bytes, code", [
    (b"POST /translate HTTP/1.1\r\nHost: localhost\r\n\r\n", 411),
    (b"POST /translate HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /translate HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"te", 400),  # cut short
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/x.y\r\n\r\n", 400),
    (b"FOO / HTTP/1.1\r\n\r\n", 501),
])
def test_malformed_requests(served, request_bytes, code):
    server, sentences = served
    with socket.create_connection(server.server_address[:2], timeout=30) as s:
        s.sendall(request_bytes)
        s.shutdown(socket.SHUT_WR)  # (the cut-short body ends here)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == code, answer
    assert json.loads(body)["error"]
    still_serving(server, sentences)


def test_a_failing_translation_is_500_and_the_server_goes_on(served, monkeypatch, capsys):
    server, sentences = served

    def boom(text):
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(server.explorer, "translate", boom)
    status, out, _ = call(server, "/translate", {"text": sentences[0]})
    assert status == 500 and "simulated failure" in out["error"]
    monkeypatch.undo()
    still_serving(server, sentences)
    assert "simulated failure" in capsys.readouterr().err, "the traceback is logged"


# ----------------------------------------------------------------------------- command line

def test_missing_run_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert explore.main(["--run-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --run-dir") and "no such" in err[0]


def test_port_taken_is_one_line_and_exit_2(run, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert explore.main(["--run-dir", run[0], "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen" in err[0] and "--port" in err[0]


def test_command_line_serves_on_127_0_0_1_and_stops_on_ctrl_c(run):
    proc = subprocess.Popen([sys.executable, "-m", "minitransformer.mt.explore", "--run-dir",
                             run[0], "--port", "0", "--max-len-a", "3"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_a_terminal_gives_it)
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        first = lines.get(timeout=60)
        assert "http://127.0.0.1:" in first, first
        url = first.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url + "info", timeout=30) as res:
            assert json.loads(res.read())["beam"] == 4
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"the explorer did not stop within 30 s of Ctrl-C ({sigint_state()})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ----------------------------------------------------------------------------- in a browser

def _browser():
    """The chromium to drive, or skip saying what is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the browser test needs Playwright: pip install playwright (its browser "
                    "download is not needed; the system's chromium is used)")
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("the browser test needs chromium: apt-get install chromium")


PIXELS = """() => {
    const c = document.getElementById('heatmap'), g = JSON.parse(c.dataset.grid);
    const d = c.getContext('2d').getImageData(g.x, g.y, g.width, g.height).data;
    let blank = 0, hash = 0;
    const colours = new Set();
    for (let i = 0; i < d.length; i += 4) {
        if (d[i + 3] === 0 || (d[i] === 255 && d[i + 1] === 255 && d[i + 2] === 255)) blank++;
        colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        hash = (hash * 31 + d[i] * 7 + d[i + 1] * 3 + d[i + 2]) % 1000000007;
    }
    return {pixels: d.length / 4, blank, colours: colours.size, hash};
}"""


def test_the_page_in_a_browser(served, tmp_path):
    chromium = _browser()
    from playwright.sync_api import Error, sync_playwright
    server, sentences = served
    answers = {s: call(server, "/translate", {"text": s})[1] for s in sentences}
    sentence = max(sentences, key=lambda s: len(answers[s]["tgt_pieces"]))  # the longest output
    api = answers[sentence]
    cross = api["attention"]["cross"]
    assert cross[0][0] != cross[0][1] and cross[0][0] != cross[1][0], "the maps differ"
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        except Error as exc:
            pytest.skip(f"{chromium} did not start under Playwright: {str(exc)[:300]}")
        try:
            _drive_the_page(browser.new_page(), server.url, sentence, api, tmp_path)
        finally:
            browser.close()


def _drive_the_page(page, url, sentence, api, tmp_path):
    page.set_default_timeout(20000)
    page.goto(url)
    page.fill("#text", sentence)
    page.click("#translate")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('done')")
    assert page.text_content("#translation") == api["translation"]
    assert page.locator("#alternatives tbody tr").count() == len(api["alternatives"])
    first = page.evaluate(PIXELS)  # the default view: encoder-decoder, layer 0, head 0
    assert first["pixels"] > 0 and first["blank"] == 0, first  # every cell drawn
    assert first["colours"] > 1, first
    page.click("#heads button[data-value='1']")
    head1 = page.evaluate(PIXELS)
    assert head1["hash"] != first["hash"], "another head, another picture"
    page.click("#layers button[data-value='1']")
    layer1 = page.evaluate(PIXELS)
    assert layer1["hash"] not in (first["hash"], head1["hash"]), "another layer"
    assert page.text_content("#caption").startswith("encoder-decoder attention, layer 1, head 1")
    page.click("#kinds button[data-value='encoder']")
    assert page.evaluate(PIXELS)["hash"] != layer1["hash"]
    page.click("#kinds button[data-value='cross']")
    page.click("#layers button[data-value='0']")
    page.click("#heads button[data-value='0']")
    assert page.evaluate(PIXELS)["hash"] == first["hash"], "the first view again"
    shot = tmp_path / "explore.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("MINITRANSFORMER_KEEP_ARTIFACTS"):
        os.makedirs(ARTIFACTS, exist_ok=True)
        shutil.copy(shot, os.path.join(ARTIFACTS, "explore.png"))
    # the counter counts characters as the server does: an emoji is one (two UTF-16 units)
    page.fill("#text", "\U0001F600" * 3 + "ab")
    assert page.text_content("#count") == f"5 / {MAX_CHARS} characters"
    page.fill("#text", "a" * (MAX_CHARS + 1))  # refused: the server's message is shown
    page.click("#translate")
    page.wait_for_selector("#error:not([hidden])")
    assert "--max-chars" in page.text_content("#error")
