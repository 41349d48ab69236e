"""A synthetic parallel corpus: an English-like source and an invented verb-final target language.

The corpus is generated from a seed in well under a second, so translation can be tested end to
end (tokenizer, batching, training, beam search, BLEU) without downloading anything. Each source
sentence has exactly one correct translation, and producing it needs what attention is for:
word reordering over long distances and agreement with words far away.

Source grammar (lower-case, no punctuation, 4..16 words)::

    S    -> SUBJ VERB OBJ          VERB: "sees" / "see" (agrees with SUBJ), or "will see"
    SUBJ -> PRONOUN | NP           PRONOUN: i you he she it we they
    OBJ  -> PRONOUN | NP           PRONOUN: me you him her it us them
    NP   -> DET ADJ{0,2} NOUN [PP]
    PP   -> PREP DET ADJ{0,2} NOUN        (a PP belongs to the noun just before it)
    DET  -> the | a/an | some | this | these | that | those

Target grammar (the same tree, every word translated and rearranged)::

    S    -> SUBJ' OBJ' ul VERB'    verb last (SOV); "ul" marks the object (accusative)
    NP'  -> [PP'] DET' NOUN' ADJ'* PP' moves in front of its noun; adjectives follow the
                                   noun in mirror order ("big red dog" -> "dog red big")
    PP'  -> DET' NOUN' ADJ'* POSTP  prepositions become postpositions

Agreement, all decided by words elsewhere in the sentence:

- every target noun has a gender in the lexicon (m, f or n; not guessable from the source);
- DET' is chosen by kind (definite "the", indefinite "a"/"some", near "this"/"these",
  far "that"/"those"), gender and number of its noun: e.g. definite ko/ka/ke, plural kor/kas/ken;
- NOUN' plural adds a gender suffix: m -ar, f -en, n -u;
- ADJ' adds a gender-and-number suffix: singular -o/-a/-e, plural -or/-as/-es (m/f/n);
- VERB' = stem [+ "ar" for "will"] + a suffix for the subject's person and number:
  1sg -em, 2sg -es, 3sg -et, 1pl -emo, 3pl -en.

One pair (the reordering and the agreement chains are visible)::

    the old man with a red ball sees these small cats
    una kulat rufa kum ko gorum seno tas miselen pikas ul videt

"with a red ball" (PP) moves before "the old man"; "ball" is feminine (kulat), so "a" -> una
and "red" -> rufa; "man" is masculine (gorum), so "the" -> ko and "old" -> seno; "these ...
cats" is feminine plural (tas, miselen, pikas); the object is followed by "ul"; "sees" goes last
with the 3rd person singular suffix (vid + et).

With 46 nouns, 20 adjectives and 20 verbs the two sides have about 630 distinct words. A joint
BPE model of 1000 pieces keeps every word whole; a unigram model stops at about 420 pieces on
the default corpus (about 1.6 pieces a word, inflections split off).
"""
import os
import random

from .fileio import atomic_write_text

# (source singular, source plural, target stem, gender)
NOUNS = [
    ("dog", "dogs", "vorn", "m"), ("cat", "cats", "misel", "f"), ("horse", "horses", "tarak", "m"),
    ("bird", "birds", "pilit", "n"), ("frog", "frogs", "sulam", "n"), ("cow", "cows", "dumal", "f"),
    ("child", "children", "kelim", "n"), ("woman", "women", "dalen", "f"),
    ("man", "men", "gorum", "m"), ("teacher", "teachers", "selkan", "m"),
    ("farmer", "farmers", "brotel", "m"), ("doctor", "doctors", "mivan", "f"),
    ("king", "kings", "haltor", "m"), ("queen", "queens", "halten", "f"),
    ("friend", "friends", "nosak", "m"), ("student", "students", "lemir", "f"),
    ("baker", "bakers", "pekol", "m"), ("soldier", "soldiers", "gardun", "m"),
    ("sailor", "sailors", "maret", "m"), ("girl", "girls", "sanil", "f"),
    ("boy", "boys", "pavok", "m"), ("house", "houses", "domet", "n"),
    ("garden", "gardens", "belun", "n"), ("river", "rivers", "ravol", "m"),
    ("tree", "trees", "arbek", "n"), ("table", "tables", "tabun", "f"),
    ("chair", "chairs", "selun", "f"), ("box", "boxes", "kastel", "n"),
    ("book", "books", "libor", "m"), ("letter", "letters", "lekon", "f"),
    ("apple", "apples", "ambel", "n"), ("cake", "cakes", "torel", "f"),
    ("ball", "balls", "kulat", "f"), ("boat", "boats", "navik", "m"),
    ("car", "cars", "vagon", "m"), ("road", "roads", "vitam", "f"),
    ("bridge", "bridges", "ponel", "m"), ("window", "windows", "fenik", "n"),
    ("door", "doors", "portal", "f"), ("key", "keys", "klivon", "m"),
    ("lamp", "lamps", "lumar", "f"), ("hill", "hills", "kolim", "m"),
    ("mountain", "mountains", "montek", "n"), ("city", "cities", "urbel", "f"),
    ("village", "villages", "vikal", "n"), ("forest", "forests", "silvek", "m"),
]
# (source, target stem)
ADJECTIVES = [
    ("big", "mag"), ("small", "pik"), ("red", "ruf"), ("green", "vird"), ("blue", "azur"),
    ("old", "sen"), ("young", "jun"), ("happy", "fel"), ("sad", "trist"), ("tall", "alt"),
    ("short", "brev"), ("quiet", "tac"), ("loud", "sonor"), ("clever", "sag"), ("brave", "fort"),
    ("lazy", "pigr"), ("white", "alb"), ("black", "nigr"), ("beautiful", "bel"),
    ("strange", "strag"),
]
# (source base form, source 3rd person singular, target stem)
VERBS = [
    ("see", "sees", "vid"), ("like", "likes", "am"), ("watch", "watches", "spek"),
    ("find", "finds", "trov"), ("help", "helps", "jut"), ("carry", "carries", "port"),
    ("take", "takes", "pren"), ("follow", "follows", "sek"), ("call", "calls", "vok"),
    ("visit", "visits", "vizit"), ("paint", "paints", "pint"), ("build", "builds", "konstr"),
    ("open", "opens", "aper"), ("push", "pushes", "puls"), ("pull", "pulls", "trak"),
    ("hold", "holds", "ten"), ("wash", "washes", "lav"), ("chase", "chases", "kas"),
    ("greet", "greets", "salut"), ("teach", "teaches", "dok"),
]
# (source preposition, target postposition)
PREPOSITIONS = [("in", "ina"), ("on", "supa"), ("near", "apud"), ("under", "infra"),
                ("behind", "post"), ("with", "kum")]
# (source subject form, source object form, target form, person, number)
PRONOUNS = [("i", "me", "mu", 1, "sg"), ("you", "you", "tu", 2, "sg"),
            ("he", "him", "sa", 3, "sg"), ("she", "her", "si", 3, "sg"),
            ("it", "it", "so", 3, "sg"), ("we", "us", "nu", 1, "pl"),
            ("they", "them", "ri", 3, "pl")]

# Determiners: kind -> (source singular, source plural); target by kind, gender and number.
SOURCE_DETERMINERS = {"def": ("the", "the"), "indef": ("a", "some"),
                      "near": ("this", "these"), "far": ("that", "those")}
TARGET_DETERMINERS = {  # kind -> {(gender, number): word}
    kind: {(g, n): word for (g, n), word in zip(
        [("m", "sg"), ("f", "sg"), ("n", "sg"), ("m", "pl"), ("f", "pl"), ("n", "pl")], words)}
    for kind, words in [("def", ["ko", "ka", "ke", "kor", "kas", "ken"]),
                        ("indef", ["un", "una", "une", "sor", "sas", "sen"]),
                        ("near", ["ti", "ta", "te", "tir", "tas", "ten"]),
                        ("far", ["vo", "va", "ve", "vor", "vas", "ven"])]}
NOUN_PLURAL_SUFFIX = {"m": "ar", "f": "en", "n": "u"}
ADJECTIVE_SUFFIX = {("m", "sg"): "o", ("f", "sg"): "a", ("n", "sg"): "e",
                    ("m", "pl"): "or", ("f", "pl"): "as", ("n", "pl"): "es"}
VERB_SUFFIX = {(1, "sg"): "em", (2, "sg"): "es", (3, "sg"): "et", (1, "pl"): "emo",
               (3, "pl"): "en"}
FUTURE_INFIX = "ar"
OBJECT_MARKER = "ul"

MIN_WORDS, MAX_WORDS = 4, 16


def _check_lexicon():
    """Source words of different categories must differ, or a source sentence could parse twice."""
    categories = [
        {w for n in NOUNS for w in n[:2]}, {a[0] for a in ADJECTIVES},
        {w for v in VERBS for w in v[:2]} | {"will"}, {p[0] for p in PREPOSITIONS},
        {w for p in PRONOUNS for w in p[:2]},
        {w for pair in SOURCE_DETERMINERS.values() for w in pair} | {"an"}]
    seen = set()
    for words in categories:
        assert not (words & seen), f"source word in two categories: {sorted(words & seen)}"
        seen |= words


_check_lexicon()


def _sample_noun_phrase(rng, allow_pp):
    """One NP as (source words, target words, number); maybe with a PP when ``allow_pp``."""
    en_sg, en_pl, stem, gender = rng.choice(NOUNS)
    number = "pl" if rng.random() < 0.4 else "sg"
    kind = rng.choices(["def", "indef", "near", "far"], weights=[4, 3, 1.5, 1.5])[0]
    n_adjectives = rng.choices([0, 1, 2], weights=[45, 35, 20])[0]
    adjectives = rng.sample(ADJECTIVES, n_adjectives)

    noun_src = en_pl if number == "pl" else en_sg
    following = adjectives[0][0] if adjectives else noun_src
    det_src = SOURCE_DETERMINERS[kind][number == "pl"]
    if det_src == "a" and following[0] in "aeiou":
        det_src = "an"
    src = [det_src] + [a[0] for a in adjectives] + [noun_src]

    noun_tgt = stem + NOUN_PLURAL_SUFFIX[gender] if number == "pl" else stem
    tgt = ([TARGET_DETERMINERS[kind][gender, number], noun_tgt]
           + [a[1] + ADJECTIVE_SUFFIX[gender, number] for a in reversed(adjectives)])

    if allow_pp and rng.random() < 0.3:
        prep_src, postp_tgt = rng.choice(PREPOSITIONS)
        pp_src, pp_tgt, _ = _sample_noun_phrase(rng, allow_pp=False)
        src = src + [prep_src] + pp_src
        tgt = pp_tgt + [postp_tgt] + tgt
    return src, tgt, number


def _sample_sentence(rng):
    """One (source words, target words) pair, before the length filter."""
    if rng.random() < 0.3:
        subj_en, _, subj_tgt, person, number = rng.choice(PRONOUNS)
        subj_src, subj_tgt = [subj_en], [subj_tgt]
    else:
        subj_src, subj_tgt, number = _sample_noun_phrase(rng, allow_pp=True)
        person = 3
    if rng.random() < 0.15:
        _, obj_en, obj_tgt, _, _ = rng.choice(PRONOUNS)
        obj_src, obj_tgt = [obj_en], [obj_tgt]
    else:
        obj_src, obj_tgt, _ = _sample_noun_phrase(rng, allow_pp=True)

    base, third_singular, stem = rng.choice(VERBS)
    future = rng.random() < 0.3
    if future:
        verb_src = ["will", base]
    else:
        verb_src = [third_singular if (person, number) == (3, "sg") else base]
    verb_tgt = stem + (FUTURE_INFIX if future else "") + VERB_SUFFIX[person, number]

    return subj_src + verb_src + obj_src, subj_tgt + obj_tgt + [OBJECT_MARKER, verb_tgt]


def sample_pair(rng):
    """One (source sentence, target sentence) pair with MIN_WORDS..MAX_WORDS source words.

    ``rng`` is a ``random.Random``. The target is a function of the source alone.
    """
    while True:
        src, tgt = _sample_sentence(rng)
        if MIN_WORDS <= len(src) <= MAX_WORDS:
            return " ".join(src), " ".join(tgt)


def generate(n_train=20000, n_valid=500, n_test=500, seed=1234):
    """The corpus as {"train" | "valid" | "test": (src_lines, tgt_lines)}.

    Source sentences are distinct across (and within) all splits, so no test sentence is seen
    in training. The same seed gives the same corpus on every platform (``random.Random``).
    """
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    total = sum(sizes.values())
    rng = random.Random(seed)
    pairs, seen = [], set()
    for _ in range(20 * total + 1000):  # duplicates are rare; the cap only stops absurd sizes
        if len(pairs) == total:
            break
        src, tgt = sample_pair(rng)
        if src not in seen:
            seen.add(src)
            pairs.append((src, tgt))
    else:
        raise ValueError(f"could not draw {total} distinct sentences; ask for fewer")

    corpus, start = {}, 0
    for split, size in sizes.items():
        chunk = pairs[start:start + size]
        corpus[split] = ([s for s, _ in chunk], [t for _, t in chunk])
        start += size
    return corpus


def write_corpus(directory, seed=1234, n_train=20000, n_valid=500, n_test=500):
    """Write ``{split}.src`` and ``{split}.tgt`` (UTF-8, one sentence a line) into ``directory``.

    Returns {split: (src_path, tgt_path)}.
    """
    os.makedirs(directory, exist_ok=True)
    corpus = generate(n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed)
    paths = {}
    for split, (src_lines, tgt_lines) in corpus.items():
        paths[split] = (os.path.join(directory, f"{split}.src"),
                        os.path.join(directory, f"{split}.tgt"))
        for path, lines in zip(paths[split], (src_lines, tgt_lines)):
            atomic_write_text(path, "".join(line + "\n" for line in lines))
    return paths
