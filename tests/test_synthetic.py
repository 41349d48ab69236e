"""The synthetic corpus: deterministic, disjoint splits, and a grammar that needs attention."""
import random
import time

import pytest

from minitransformer.mt import synthetic as syn


@pytest.fixture(scope="module")
def corpus():
    return syn.generate(n_train=3000, n_valid=200, n_test=200, seed=5)


# An independent reading of the grammar in the module docstring: parse the source, then
# build the target by the rules. The generator builds both sides from one random tree instead.
NOUN = {en: (stem, gender, number) for en_sg, en_pl, stem, gender in syn.NOUNS
        for en, number in ((en_sg, "sg"), (en_pl, "pl"))}
ADJ = dict(syn.ADJECTIVES)
VERB = {form: (base, stem) for base, third, stem in syn.VERBS for form in (base, third)}
THIRD_SINGULAR = {base: third for base, third, _ in syn.VERBS}
PREP = dict(syn.PREPOSITIONS)
SUBJ = {p[0]: p for p in syn.PRONOUNS}
OBJ = {p[1]: p for p in syn.PRONOUNS}
DET_KIND = {"the": "def", "a": "indef", "an": "indef", "some": "indef", "this": "near",
            "these": "near", "that": "far", "those": "far"}


def reference_translate(sentence):
    words, pos = sentence.split(), 0

    def simple_np():
        nonlocal pos
        det = words[pos]
        adjectives = []
        pos += 1
        while words[pos] in ADJ:
            adjectives.append(words[pos])
            pos += 1
        stem, gender, number = NOUN[words[pos]]
        pos += 1
        noun = stem + {"m": "ar", "f": "en", "n": "u"}[gender] if number == "pl" else stem
        ends = {"sg": {"m": "o", "f": "a", "n": "e"}, "pl": {"m": "or", "f": "as", "n": "es"}}
        out = [syn.TARGET_DETERMINERS[DET_KIND[det]][gender, number], noun]
        out += [ADJ[a] + ends[number][gender] for a in reversed(adjectives)]
        return out, number

    def np_with_pp():
        nonlocal pos
        head, number = simple_np()
        if pos < len(words) and words[pos] in PREP:
            postposition = PREP[words[pos]]
            pos += 1
            inner, _ = simple_np()
            head = inner + [postposition] + head
        return head, number

    if words[0] in SUBJ:
        _, _, pronoun, person, number = SUBJ[words[0]]
        subject, pos = [pronoun], 1
    else:
        (subject, number), person = np_with_pp(), 3
    future = words[pos] == "will"
    pos += future
    base, stem = VERB[words[pos]]
    agrees = THIRD_SINGULAR[base] if (person, number) == (3, "sg") and not future else base
    assert words[pos] == agrees, sentence  # the source verb agrees with its subject too
    pos += 1
    if words[pos] in OBJ and pos + 1 == len(words):
        obj = [OBJ[words[pos]][2]]
        pos += 1
    else:
        obj, _ = np_with_pp()
    assert pos == len(words), sentence
    suffix = {(1, "sg"): "em", (2, "sg"): "es", (3, "sg"): "et", (1, "pl"): "emo",
              (3, "pl"): "en"}[person, number]
    return " ".join(subject + obj + ["ul", stem + ("ar" if future else "") + suffix])


def test_docstring_example_follows_the_grammar():
    src = "the old man with a red ball sees these small cats"
    tgt = "una kulat rufa kum ko gorum seno tas miselen pikas ul videt"
    assert src in syn.__doc__ and tgt in syn.__doc__
    assert reference_translate(src) == tgt


def test_every_pair_matches_the_reference_grammar(corpus):
    for src_lines, tgt_lines in corpus.values():
        for src, tgt in zip(src_lines, tgt_lines):
            assert reference_translate(src) == tgt, src


def test_translation_is_a_function_of_the_source():
    rng, seen = random.Random(0), {}
    for _ in range(20000):  # short sentences repeat often enough to test this
        src, tgt = syn.sample_pair(rng)
        assert seen.setdefault(src, tgt) == tgt
    assert len(seen) < 20000


def test_deterministic_from_seed_sizes_and_lengths(corpus):
    again = syn.generate(n_train=3000, n_valid=200, n_test=200, seed=5)
    assert again == corpus
    assert syn.generate(n_train=3000, n_valid=200, n_test=200, seed=6) != corpus
    assert {k: len(v[0]) for k, v in corpus.items()} == {"train": 3000, "valid": 200, "test": 200}
    for src_lines, tgt_lines in corpus.values():
        assert len(src_lines) == len(tgt_lines)
        assert all(4 <= len(s.split()) <= 16 for s in src_lines)


def test_splits_are_disjoint(corpus):
    train, valid, test = (set(corpus[k][0]) for k in ("train", "valid", "test"))
    assert len(train) == 3000 and len(valid) == 200 and len(test) == 200
    assert not (train & valid) and not (train & test) and not (valid & test)


def test_verb_moves_to_the_end(corpus):
    for src, tgt in zip(*corpus["train"]):
        words, out = src.split(), tgt.split()
        verb_at = next(i for i, w in enumerate(words) if w in VERB or w == "will")
        assert verb_at < len(words) - 1  # an object always follows the verb in the source
        stem = VERB[words[verb_at + (words[verb_at] == "will")]][1]
        assert out[-1].startswith(stem) and out[-2] == "ul"


def test_agreement_with_the_noun_and_the_subject(corpus):
    """Same noun in both numbers -> different determiner; same verb -> different suffix."""
    determiner = {}  # (noun stem, number) -> target word for "the"
    for src, tgt in zip(*corpus["train"]):
        words, out = src.split(), tgt.split()
        if words[0] == "the" and words[1] in NOUN and (words[2] in VERB or words[2] == "will"):
            # "the NOUN VERB ...": the target starts with DET' NOUN' too
            stem, gender, number = NOUN[words[1]]
            determiner[stem, number] = out[0]
            assert out[1].startswith(stem)
    both = [stem for stem, number in determiner if number == "sg" and (stem, "pl") in determiner]
    assert len(both) > 10
    for stem in both:
        assert determiner[stem, "sg"] != determiner[stem, "pl"]
    genders = {NOUN[w][1]: determiner[NOUN[w][0], "sg"] for w in NOUN
               if (NOUN[w][0], "sg") in determiner}
    assert len(set(genders.values())) == 3  # ko / ka / ke

    endings = {}
    for src, tgt in zip(*corpus["train"]):
        first = src.split()[0]
        if first in SUBJ and src.split()[1] != "will":
            endings.setdefault(first, set()).add(tgt.split()[-1][-3:])
    assert endings["i"].isdisjoint(endings["he"]) and endings["we"].isdisjoint(endings["they"])


def test_write_corpus(tmp_path):
    paths = syn.write_corpus(tmp_path / "corpus", seed=9, n_train=50, n_valid=5, n_test=5)
    expected = syn.generate(n_train=50, n_valid=5, n_test=5, seed=9)
    for split, (src_path, tgt_path) in paths.items():
        assert src_path.endswith(f"{split}.src") and tgt_path.endswith(f"{split}.tgt")
        with open(src_path, encoding="utf-8") as f:
            assert f.read().splitlines() == expected[split][0]
        with open(tgt_path, encoding="utf-8") as f:
            assert f.read().splitlines() == expected[split][1]


def test_default_corpus_is_fast():
    start = time.perf_counter()
    corpus = syn.generate()
    assert time.perf_counter() - start < 2.0
    assert len(corpus["train"][0]) == 20000
