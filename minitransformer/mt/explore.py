"""Explore a trained run in the browser: type a sentence, see its translation, the beam's
alternatives and every attention map.

    python -m minitransformer.mt.explore --run-dir runs/default
    # -> serving ... at http://127.0.0.1:8000/  (open it; Ctrl-C stops the server)

A small local web server (the standard library's ``http.server``, one thread per request)
serves one static page, ``explore.html`` next to this file (plain HTML and JavaScript, no build
step, nothing fetched from elsewhere), and a JSON API:

    GET  /            the page
    GET  /info        the model: layers, heads, beam, the longest input accepted
    POST /translate   {"text": "a sentence"} ->
                      {"translation", "alternatives": [{"text", "score"}] (best first),
                       "src_pieces", "tgt_pieces",
                       "attention": {"encoder" | "decoder" | "cross": [layer][head][i][j]}}

The translation is the best beam search hypothesis, the one ``translate.py`` prints with the
same --beam, --alpha and --max-len-a; scores are the search's length-normalised
log-probabilities. Attention maps are recorded as ``translate.py --plot-attention`` records
them (``Transformer.set_attention_store``), in one teacher-forced pass over the best
hypothesis: rows are queries, columns keys, each row sums to 1. ``src_pieces`` are the source's
sentencepiece pieces + "</s>" (encoder positions); ``tgt_pieces`` are "<s>" + the output pieces
(the decoder's input positions, each predicting the next piece). Encoder self-attention is
src x src, decoder self-attention tgt x tgt, encoder-decoder attention tgt x src.

An input of more than --max-chars characters, or of more pieces than the model's positions
allow, is refused (400, a JSON {"error": message} the page shows). Every bad request gets a
4xx or 5xx JSON answer, is logged to stderr, and the server keeps serving. The server binds
to 127.0.0.1 (this machine only) unless --host says otherwise; it has no authentication. A
POST must be ``Content-Type: application/json`` (415 otherwise): a page of another site
cannot send that without the browser asking the server first (OPTIONS, refused), so it
cannot make the explorer translate; and on 127.0.0.1 a request whose Host is not a name of
this machine is refused (403), so neither can a site whose name was made to point here.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .. import backend
from ..nn.transformer import Transformer
from .plots import attention_labels, record_attention_pass
from .ranges import add_number
from .search import beam_search
from .tokenizer import Tokenizer
from .translate import (USER_ERROR, UsageError, add_search_flags, check_device, check_run_dir,
                        load_for_translation, say)
from .translation import max_source_tokens

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explore.html")
ATTENTION = {  # API name -> the attention store's key (Transformer.set_attention_store)
    "encoder": "encoder.{i}.self_attn",
    "decoder": "decoder.{i}.self_attn",
    "cross": "decoder.{i}.cross_attn",
}
DIGITS = 3            # attention weights are rounded to 3 decimals in the JSON answer
MIN_BODY = 16 * 1024  # the largest request body accepted is at least this many bytes
DRAIN_LIMIT = 1 << 20  # an over-long body up to this size is read and dropped before the 413
READ_TIMEOUT = 30     # seconds a client may take to send its request


def is_loopback(host):
    """Whether ``host`` (a name or an address, as --host or a Host header gives it) names
    this machine only: localhost, or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # (another name)
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # (::ffff:127.0.0.1)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


class RequestError(Exception):
    """A request the server refuses: the HTTP ``status`` and a message for the user."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = int(status), message


# ----------------------------------------------------------------------------- the model side

def record_attention(model: Transformer, src_ids: list[int],
                     out_ids: list[int]) -> dict[str, list[np.ndarray]]:
    """Attention maps of one teacher-forced pass of source ``src_ids`` + EOS and decoder
    input BOS + ``out_ids`` -> {"encoder" (H, S, S), "decoder" (H, T, T), "cross" (H, T, S):
    one host array a layer}, S = len(src_ids) + 1, T = len(out_ids) + 1. Recorded as
    plots.record_attention_pass (eval mode, the model's mode restored after)."""
    store = record_attention_pass(model, src_ids, out_ids)
    layers = {"encoder": len(model.encoder), "decoder": len(model.decoder),
              "cross": len(model.decoder)}
    return {kind: [store[key.format(i=i)] for i in range(layers[kind])]
            for kind, key in ATTENTION.items()}


def rounded(maps: list[np.ndarray], digits: int = DIGITS) -> list:
    """Host arrays -> nested lists of floats rounded to ``digits`` decimals (short JSON)."""
    return [np.round(np.asarray(m, dtype=np.float64), digits).tolist() for m in maps]


def explore_sentence(model: Transformer, tok: Tokenizer, src_ids: list[int], beam: int = 4,
                     alpha: float = 0.6, max_len_a: int = 50,
                     length_penalty: str = "gnmt") -> dict[str, Any]:
    """Translate the source ids ``src_ids`` (no EOS; they must fit the model's positions) by
    beam search, then record the attention over the best hypothesis. -> the JSON answer of
    POST /translate (see the module's docstring)."""
    src = np.array([list(src_ids) + [model.cfg.eos_id]], dtype=np.int64)
    hyps = beam_search(model, src, beam=beam, alpha=alpha, max_len_a=max_len_a,
                       length_penalty=length_penalty, return_all=True)[0]  # best first
    best = hyps[0][1] if hyps else []
    texts = tok.decode([ids for _, ids in hyps])
    src_pieces, tgt_pieces = attention_labels(tok, src_ids, best)
    maps = record_attention(model, src_ids, best)
    return {"translation": tok.decode([best])[0],
            "alternatives": [{"text": t, "score": round(float(s), 4)}
                             for t, (s, _) in zip(texts, hyps)],
            "src_pieces": src_pieces, "tgt_pieces": tgt_pieces,
            "attention": {kind: rounded(m) for kind, m in maps.items()}}


class Explorer:
    """A loaded model and tokenizer, the search settings and the input limits. One request
    at a time uses the model (a lock): its attention store is shared by all threads."""

    def __init__(self, model: Transformer, tok: Tokenizer, what: str = "", beam: int = 4,
                 alpha: float = 0.6, max_len_a: int = 50, max_chars: int = 500,
                 length_penalty: str = "gnmt"):
        self.model, self.tok, self.what = model, tok, what
        self.search = {"beam": beam, "alpha": alpha, "max_len_a": max_len_a,
                       "length_penalty": length_penalty}
        self.max_chars = max_chars
        self.max_pieces = max_source_tokens(model.cfg)
        self.lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        """The model and the limits, for the page (GET /info)."""
        cfg = self.model.cfg
        return {"model": self.what, "encoder_layers": len(self.model.encoder),
                "decoder_layers": len(self.model.decoder), "heads": cfg.n_heads,
                "max_chars": self.max_chars, "max_pieces": self.max_pieces, **self.search}

    def source_ids(self, text: str) -> list[int]:
        """The ids of ``text`` (stripped), or RequestError 400 saying why it is refused:
        too long (``max_chars``), empty, not Unicode, or more pieces than the model attends
        to."""
        if len(text) > self.max_chars:
            raise RequestError(400, f"the text has {len(text)} characters, more than the "
                                    f"{self.max_chars} this server accepts (--max-chars); "
                                    "shorten it")
        if not text.strip():
            raise RequestError(400, "the text is empty; type a sentence")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON can carry half of a surrogate pair
            raise RequestError(400, "the text is not valid Unicode (a lone surrogate "
                                    "escape such as \\ud800)") from None
        ids = self.tok.encode([text.strip()])[0]
        if len(ids) > self.max_pieces:
            raise RequestError(400, f"the text has {len(ids)} sentencepiece pieces, more "
                                    f"than the {self.max_pieces} the model can attend to "
                                    f"(max_positions {self.model.cfg.max_positions}, less "
                                    "one for EOS); shorten it")
        return ids

    def translate(self, text: str) -> dict[str, Any]:
        """POST /translate's answer for ``text``; RequestError for a refused input."""
        ids = self.source_ids(text)
        start = time.perf_counter()
        with self.lock:
            out = explore_sentence(self.model, self.tok, ids, **self.search)
        out["seconds"] = round(time.perf_counter() - start, 3)
        return out


# ----------------------------------------------------------------------------- the web side

class Handler(BaseHTTPRequestHandler):
    """GET /, GET /info, POST /translate; every other request a JSON error (4xx)."""

    server_version = "minitransformer-explore"
    timeout = READ_TIMEOUT  # a client that stops sending mid-request is dropped after this

    def _foreign_host(self):
        """True (and a 403 sent) for a request to a loopback-bound server whose Host is
        neither a loopback name nor the name it was started on (--host $(hostname), which
        Debian maps to 127.0.1.1): a page of another site whose name was made to resolve to
        this machine (DNS rebinding) is same-origin with the server for its browser."""
        host = self.headers.get("Host")
        bound = self.server.server_address[0]
        if host is None or not is_loopback(bound):
            return False
        name = urlsplit("//" + host).hostname or ""
        if is_loopback(name) or name == self.server.host_name.lower().strip("[]"):
            return False
        self._discard_body()
        self._fail(403, f"the request's Host is {host!r}; this server answers requests to "
                        f"{self.server.host_name}, localhost or a loopback address only "
                        "(start it with --host 0.0.0.0 to serve others)")
        return True

    def do_GET(self):
        if self._foreign_host():
            return
        path = urlsplit(self.path).path
        if path in ("/", "/index.html"):
            self._page()
        elif path == "/info":
            self._json(200, self.server.explorer.info())
        elif path == "/translate":
            self._fail(405, 'use POST /translate with a JSON body {"text": "a sentence"}',
                       {"Allow": "POST"})
        else:
            self._fail(404, f"no such page: {path}; the explorer is at /")

    do_HEAD = do_GET  # the same headers, no body (_send leaves it out)

    def do_POST(self):
        if self._foreign_host():
            return
        path = urlsplit(self.path).path
        if path != "/translate":
            self._discard_body()
            self._fail(404 if path not in ("/", "/index.html", "/info") else 405,
                       f"cannot POST {path}; POST to /translate")
            return
        try:
            self._json(200, self.server.explorer.translate(self._read_text()))
        except RequestError as exc:
            self._fail(exc.status, exc.message)
        except Exception as exc:  # the server keeps serving; the log has the traceback
            self.log_error("POST /translate failed:\n%s", traceback.format_exc())
            self._fail(500, f"the translation failed ({type(exc).__name__}: {exc}); see the "
                            "server's log")

    def _not_allowed(self):
        self._discard_body()
        self._fail(405, f"{self.command} is not supported; use GET / or POST /translate",
                   {"Allow": "GET, HEAD, POST"})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def _body_limit(self):
        """The largest request body accepted, in bytes: room for --max-chars characters,
        each escaped as JSON's 12-byte surrogate pair at worst."""
        return max(MIN_BODY, 1024 + 12 * self.server.explorer.max_chars)

    def _content_length(self):
        """The request's Content-Length, or RequestError (411, 400)."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "the request has no Content-Length; send the body "
                                    'as JSON {"text": "a sentence"} with its length')
        try:
            n = int(length)
        except ValueError:
            n = -1
        if n < 0:
            raise RequestError(400, f"Content-Length {length!r} is not a byte count")
        return n

    def _read_text(self):
        """The "text" of the request's JSON body, or RequestError (4xx) saying what is wrong."""
        n = self._content_length()
        if n > self._body_limit():
            self._discard_body(n)
            raise RequestError(413, f"the request body has {n} bytes, more than the "
                                    f"{self._body_limit()} this server accepts")
        try:
            body = self.rfile.read(n)
        except OSError:  # (a timeout: the client stopped sending)
            raise RequestError(408, f"the body did not arrive within {READ_TIMEOUT} s") from None
        if len(body) < n:
            raise RequestError(400, f"the body ended after {len(body)} of its {n} bytes")
        if self.headers.get_content_type() != "application/json":
            # (a form or text/plain POST is what another site's page can send here without
            # the browser asking first, which OPTIONS' 405 refuses: such a request is not run)
            given = self.headers.get("Content-Type")
            raise RequestError(415, f"the request's Content-Type is "
                                    f"{repr(given) if given else 'missing'}; send the body as "
                                    "Content-Type: application/json")
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # (deeply nested)
            raise RequestError(400, f'the body is not JSON ({exc}); send {{"text": "a '
                                    'sentence"}') from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise RequestError(400, 'the body must be a JSON object with a string "text": '
                                    '{"text": "a sentence"}')
        return data["text"]

    def _discard_body(self, n=None):
        """Read and drop a body the server will not use (up to DRAIN_LIMIT bytes), so that
        the client reads the answer rather than a reset connection; close the connection."""
        self.close_connection = True
        if n is None:
            try:
                n = self._content_length()
            except RequestError:
                return
        try:
            while 0 < n <= DRAIN_LIMIT:
                chunk = self.rfile.read(min(n, 65536))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:  # (a timeout, the client gone: the connection closes anyway)
            pass

    def _page(self):
        try:
            with open(PAGE, "rb") as f:
                page = f.read()
        except OSError as exc:
            self._fail(500, f"the page {PAGE} cannot be read ({exc.strerror or exc}); "
                            "reinstall minitransformer")
            return
        self._send(200, page, "text/html; charset=utf-8")

    def _json(self, status, obj, headers=None):
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8", headers)

    def _fail(self, status, message, headers=None):
        """A JSON error answer {"error": message}, logged to stderr."""
        self.log_error("%d %s: %s", status, self.command or "request", message)
        self._json(status, {"error": message}, headers)

    def _send(self, status, body, content_type, headers=None):
        """One complete answer; nothing when the client has gone away."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line, an unknown method, headers
        too long) as JSON too, after a status line and headers even when the request line
        was too broken to name an HTTP version (http.server would answer as HTTP/0.9)."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._fail(code, message or explain or phrase)


class ExploreServer(ThreadingHTTPServer):
    """The HTTP server, holding the Explorer its requests use (``self.explorer``)."""

    daemon_threads = True  # Ctrl-C does not wait for requests in progress

    def __init__(self, address: tuple[str, int], explorer: Explorer):
        if ":" in address[0]:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.explorer = explorer
        self.host_name = address[0]  # (as --host gave it: a request may name it in Host)

    @property
    def url(self) -> str:
        """The address to open in a browser, e.g. http://127.0.0.1:8000/."""
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 0) -> ExploreServer:
    """An ExploreServer listening on ``host``:``port`` (0: any free port); call its
    ``serve_forever()`` (in a thread, for a test) and ``server_close()`` after."""
    return ExploreServer((host, port), explorer)


# ----------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitransformer.mt.explore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the training run (spm.model, checkpoints)")
    p.add_argument("--checkpoint", nargs="+", default=None,
                   help="checkpoint file(s); several are averaged (default: the run's best, "
                        "else last)")
    add_number(p, "--average-last", int, ">= 0", default=0,
               help="average the run's last N periodic checkpoints (0 = don't)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    add_number(p, "--port", int, "[0, 65535]", default=8000, help="0 = any free port")
    add_search_flags(p)  # the same search as translate.py
    add_number(p, "--max-chars", int, ">= 1", default=500,
               help="longest input accepted, in characters")
    p.add_argument("--device", default=None, help="cpu or cuda (default: $MINITRANSFORMER_DEVICE)")
    return p


def start(args: argparse.Namespace) -> ExploreServer:
    """Check the flags, load the run and listen -> the server; UsageError for a mistake."""
    device, named = backend.chosen_device(args.device)
    check_device(device, named)
    check_run_dir(args)
    model, tok, what = load_for_translation(args, device)
    explorer = Explorer(model, tok, what, beam=args.beam, alpha=args.alpha,
                        max_len_a=args.max_len_a, max_chars=args.max_chars,
                        length_penalty=args.length_penalty)
    try:
        return make_server(explorer, args.host, args.port)
    except OSError as exc:  # the port taken, the host unknown or not this machine's
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there "
                         f"({exc.strerror or exc}); choose another --port (0 = any free one) "
                         "or --host") from None


def main(argv: list[str] | None = None) -> int:
    """-> exit code: 0 after Ctrl-C, 2 for a mistake in the flags or the run (one `error:`
    line on stderr saying what to do)."""
    try:
        args = build_parser().parse_args(argv)
        server = start(args)
    except UsageError as exc:
        say(f"error: {exc}")
        return USER_ERROR
    if not is_loopback(args.host):
        say(f"warning: --host {args.host}: other machines may reach this server, which has "
             "no authentication")
    print(f"serving {server.explorer.what} at {server.url}  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        say("stopped")
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
