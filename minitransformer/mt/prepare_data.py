"""Download a public parallel corpus into the plain layout train.py reads ({split}.{lang}).

    python -m minitransformer.mt.prepare_data multi30k --output data/multi30k
    python train.py --data data/multi30k --src-lang en --tgt-lang de --test-split test2016 ...

multi30k: Multi30k Task 1 English-German (Elliott et al. 2016), the raw, cased, untokenized
text of https://github.com/multi30k/dataset at a fixed commit (data/task1/raw/*.gz):

    train.{en,de}      29000 lines   <- train.{en,de}.gz
    valid.{en,de}       1014 lines   <- val.{en,de}.gz
    test2016.{en,de}    1000 lines   <- test_2016_flickr.{en,de}.gz
    test2017.{en,de}    1000 lines   <- test_2017_flickr.{en,de}.gz

Every file is downloaded and checked (gzip, UTF-8, equal line counts per pair) before any is
written; each is then written to a temporary file and renamed, so the output directory never
holds a half-written file. Standard library only (urllib, gzip).
"""
import argparse
import gzip
import http.client
import os
import sys
import urllib.error
import urllib.request
import zlib

from .fileio import atomic_write
from .data import DataError

MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"  # data files last changed in c9be912
MULTI30K_URL = (f"https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}"
                "/data/task1/raw")
MULTI30K_FILES = {  # our split name: (name in the repository, lines at MULTI30K_COMMIT)
    "train": ("train", 29000),
    "valid": ("val", 1014),
    "test2016": ("test_2016_flickr", 1000),
    "test2017": ("test_2017_flickr", 1000),
}
MULTI30K_LANGS = ("en", "de")
MULTI30K_TERMS = """\
Multi30k terms of use (from the dataset's README): the data is provided for researchers and
educators for non-commercial research and/or educational purposes; it is partially derived
from Flickr30K, whose images fall under the Flickr Terms of Use (only the text is downloaded
here). Please cite Elliott et al. 2016, "Multi30K: Multilingual English-German Image
Descriptions" (VL'16), and Elliott et al. 2017 (WMT17 multimodal MT findings) for test2017."""
TIMEOUT_S = 60


def fetch(url):
    """The bytes at ``url``; a network or HTTP failure -> DataError naming the URL."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise DataError(f"could not download {url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise DataError(f"could not download {url}: {exc.reason} (check the network "
                        "connection, a proxy, or --base-url)") from None
    except (OSError, http.client.HTTPException) as exc:  # timeouts, dropped connections
        raise DataError(f"could not download {url}: {exc}") from None
    except ValueError as exc:  # (not a URL: no scheme, say)
        raise DataError(f"could not download {url}: {exc}; --base-url must be a whole URL, "
                        "e.g. https://host/path or file:///path") from None


def gunzip_lines(url, data):
    """Gzipped text -> (UTF-8 bytes ending in a newline, number of lines); errors name ``url``."""
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{url}: not a valid gzip file ({exc})") from None
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = text.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{url}: line {line} is not UTF-8 ({exc.reason})") from None
    if text and not text.endswith(b"\n"):
        text += b"\n"
    return text, text.count(b"\n")


def check_output(output):
    """Refuse an ``output`` that is, or lies under, something other than a directory
    (before anything is downloaded): DataError naming --output."""
    path = os.path.abspath(output)
    while not os.path.exists(path):  # (the nearest part of the path that is there)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "is" if path == os.path.abspath(output) else f"lies under {path}, which is"
        raise DataError(f"--output {output}: {where} a file, not a directory; give a "
                        "directory (it is created if need be)")


def prepare_multi30k(output, base_url=MULTI30K_URL, log=print):
    """Download, check and write Multi30k Task 1 into ``output``; -> {file name: lines}."""
    check_output(output)
    base_url = base_url.rstrip("/")
    texts, counts = {}, {}
    for split, (remote, expected) in MULTI30K_FILES.items():
        for lang in MULTI30K_LANGS:
            url = f"{base_url}/{remote}.{lang}.gz"
            log(f"downloading {url}")
            texts[f"{split}.{lang}"], counts[f"{split}.{lang}"] = gunzip_lines(url, fetch(url))
        a, b = (f"{split}.{lang}" for lang in MULTI30K_LANGS)
        if counts[a] != counts[b]:
            raise DataError(f"{base_url}/{remote}.*.gz: {remote}.{MULTI30K_LANGS[0]} has "
                            f"{counts[a]} lines but {remote}.{MULTI30K_LANGS[1]} has {counts[b]}; "
                            "the pair is not aligned (nothing was written)")
        if base_url == MULTI30K_URL and counts[a] != expected:
            raise DataError(f"{base_url}/{remote}.*.gz: {counts[a]} lines, expected {expected} "
                            f"at commit {MULTI30K_COMMIT} (nothing was written)")
    try:
        os.makedirs(output, exist_ok=True)
        for name, text in texts.items():
            atomic_write(os.path.join(output, name), lambda f, text=text: f.write(text))
    except OSError as exc:  # (a full disk, no permission)
        raise DataError(f"--output {output}: cannot write {exc.filename or output} "
                        f"({exc.strerror or exc})") from None
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minitransformer.mt.prepare_data",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=["multi30k"])
    p.add_argument("--output", required=True, help="directory for {split}.{lang} files")
    p.add_argument("--base-url", default=MULTI30K_URL,
                   help="URL of the directory holding the .gz files (default: data/task1/raw "
                        f"of github.com/multi30k/dataset at commit {MULTI30K_COMMIT[:7]})")
    args = p.parse_args(argv)
    print(MULTI30K_TERMS, flush=True)
    try:
        counts = prepare_multi30k(args.output, args.base_url,
                                  log=lambda text: print(text, flush=True))
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, n in counts.items():
        print(f"{os.path.join(args.output, name)}: {n} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
