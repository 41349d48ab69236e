"""The corpus side of a training run's set-up (``Trainer``'s, mt/train.py): where the
splits are and whether they can be used, the sentencepiece model and the tokenized training
pairs, the model's configuration (and, for a run that sizes itself, its rung of
autosize.LADDER), the validation set, the batches and ``--max-tokens auto``.

``CorpusSetUp`` is a base class of ``Trainer``, kept in its own file so that train.py reads
as the loop: its methods use the Trainer's ``args``, ``rd`` (the RunDir), ``main``, ``comm``,
``device``, ``cfg``, ``model``, ``optim`` and ``_log_early``, and set ``files``,
``data_dir``, ``test_set``, ``tok``, ``spm_sha``, ``_train``, ``train_pairs``,
``train_fingerprint``, ``valid``, ``batches`` and ``valid_batches``. Trainer._set_up calls
them in this order: _find_corpus (with _check_splits), _prepare_data, _model_config,
_prepare_valid, _choose_model, _make_batches, and _fit_max_tokens after the model is built.
"""
import dataclasses
import os

from ..nn.transformer import PRESETS, Transformer, TransformerConfig, count_parameters
from ..optim import Adam
from . import autosize, memfit
from . import checkpoint as ckpt
from .data import (Batches, DataError, collate, overlong_pairs, pairs_fingerprint, read_lines,
                   read_parallel)
from .options import MODEL_FLAGS
from .tokenizer import SubwordSampler, Tokenizer, VocabTooLarge, train_sentencepiece


class CorpusSetUp:
    """The set-up steps that read the corpus (see the module docstring)."""

    def _find_corpus(self):
        """``self.files``: split -> (source, target) paths, in --data or, without it, in the
        synthetic corpus generated once in RUN_DIR/data."""
        a = self.args
        if a.data is None:
            from .synthetic import write_corpus
            a.src_lang, a.tgt_lang = a.src_lang or "src", a.tgt_lang or "tgt"
            data_dir = self.rd.data
            complete = all(os.path.exists(os.path.join(data_dir, f"{split}.{side}"))
                           for split in ("train", "valid", "test") for side in ("src", "tgt"))
            if self.main and not complete:
                os.makedirs(data_dir, exist_ok=True)
                write_corpus(data_dir, seed=1234, n_train=a.synthetic_pairs)
            if self.comm:
                self.comm.barrier()
            self.data_dir = data_dir
        else:
            if not os.path.isdir(a.data):
                if a.resume and "data" not in a.explicit:
                    raise DataError(f"--data {a.data} (the run's, in {self.rd.config}): no such "
                                    f"directory from {os.getcwd()}; give --data with the "
                                    "corpus's path")
                if os.path.exists(a.data):
                    raise DataError(f"--data {a.data}: a file, not a directory; give the "
                                    "directory that holds train.SRC and train.TGT (e.g. "
                                    f"{os.path.dirname(a.data) or '.'})")
                raise DataError(f"--data {a.data}: no such directory")
            if not a.resume or "data" in a.explicit:  # (saved in config.json, absolute:
                a.data = os.path.abspath(a.data)       # --resume finds it from anywhere)
            if not (a.src_lang and a.tgt_lang):
                raise DataError("--data needs --src-lang and --tgt-lang (the file suffixes, "
                                "e.g. en and de for train.en / train.de)")
            self.data_dir = a.data
        self.files = {}
        for split in (a.train_split, a.valid_split, a.test_split):
            if split:
                self.files[split] = tuple(os.path.join(self.data_dir, f"{split}.{lang}")
                                          for lang in (a.src_lang, a.tgt_lang))
        self._check_splits()

    def _check_splits(self):
        """The validation and test splits are used when both their files exist. One file
        without the other, a split named on this command line whose files are missing, files
        of different lengths or without text are refused before any work; a default name
        with neither file means no validation (or no test), said in the log. The test files
        are kept (``self.test_set``: scored at the end, every line)."""
        a = self.args
        self.test_set = None
        missing = [(p, flag, lang) for p, flag, lang in zip(
            self.files[a.train_split], ("--src-lang", "--tgt-lang"), (a.src_lang, a.tgt_lang))
            if not os.path.exists(p)]
        if missing:  # (before the other splits: a wrong language is missing from all of them)
            there = sorted(n for n in os.listdir(self.data_dir)
                           if n.startswith(a.train_split + ".")) if os.path.isdir(
                self.data_dir) else []
            raise DataError(f"{missing[0][0]} not found ({missing[0][1]} {missing[0][2]}); "
                            f"the --train-split {a.train_split} files in {self.data_dir} are "
                            f"{', '.join(there) or 'none'}: give --src-lang and --tgt-lang as "
                            "their suffixes, or --train-split the split's name")
        for flag, split, what in (("--valid-split", a.valid_split, "validation"),
                                  ("--test-split", a.test_split, "test")):
            if not split:
                continue
            paths = self.files[split]
            found = [os.path.exists(p) for p in paths]
            if not all(found):
                named = flag[2:].replace("-", "_") in a.explicit
                if any(found) or named:
                    missing = " and ".join(p for p, ok in zip(paths, found) if not ok)
                    raise DataError(f"{flag} {split}: {missing} not found; give the name of a "
                                    f"split with both files in {self.data_dir}, or {flag} '' "
                                    f"for no {what}")
                self._log_early(f"no {what} set ({paths[0]} and {paths[1]} not found): "
                                + ("no validation and no checkpoint_best.npz"
                                   if what == "validation" else "no test score at the end"))
            elif what == "validation":
                read_parallel(*paths)  # (aligned, with a pair: else a DataError naming them)
            else:
                src, ref = read_lines(paths[0]), read_lines(paths[1])
                if len(src) != len(ref):
                    raise DataError(f"{paths[0]} has {len(src)} lines but {paths[1]} has "
                                    f"{len(ref)}; the files must be aligned line by line "
                                    "(line i of one translates line i of the other)")
                if not src:
                    raise DataError(f"{flag} {split}: {paths[0]} and {paths[1]} have no lines; "
                                    f"give a split with text, or {flag} '' for no test")
                self.test_set = (src, ref)

    def _prepare_data(self):
        """Corpus files, the sentencepiece model (trained on the first run) and the training
        pairs, tokenized (batched later, by _make_batches)."""
        a = self.args
        self._find_corpus()
        src, tgt, stats = read_parallel(*self.files[a.train_split])
        chosen = a.vocab_size is None  # (a run that sizes itself: autosize.py)
        if chosen:
            a.vocab_size = autosize.vocab_size(stats["pairs"])
            self._log_early(f"vocabulary for {stats['pairs']} training pairs: {a.vocab_size} "
                            "pieces (about 6000 per 29,000 pairs, with the square root)")
        if self.main and not os.path.exists(self.rd.spm_model):
            self._log_early(f"training a joint sentencepiece model, vocabulary {a.vocab_size}")
            try:
                train_sentencepiece(list(self.files[a.train_split]), self.rd.spm_prefix,
                                    a.vocab_size, model_type=a.spm_type)
            except VocabTooLarge as exc:
                if not chosen:
                    raise
                a.vocab_size = exc.limit  # (a small corpus: as many pieces as it makes)
                self._log_early(f"the text makes at most {exc.limit} pieces: vocabulary "
                                f"{exc.limit}")
                train_sentencepiece(list(self.files[a.train_split]), self.rd.spm_prefix,
                                    a.vocab_size, model_type=a.spm_type)
        if self.comm:
            self.comm.barrier()
        self.tok = Tokenizer(self.rd.spm_model)
        if chosen:  # (every rank: the size rank 0's model got)
            a.vocab_size = self.tok.vocab_size
        self.spm_sha = ckpt.file_sha256(self.rd.spm_model)
        resegment = None
        if a.subword_alpha > 0:
            samplers = [SubwordSampler(self.tok, lines, a.subword_alpha, a.subword_nbest)
                        for lines in (src, tgt)]
            resegment = lambda rng: (samplers[0](rng), samplers[1](rng))  # noqa: E731
            self._log_early(f"subword regularization: alpha {a.subword_alpha}, "
                            f"{a.subword_nbest}-best segmentations")
        self._train = (self.tok.encode(src), self.tok.encode(tgt), resegment, stats)
        # (saved with each checkpoint: --resume checks both)
        self.train_pairs, self.train_fingerprint = stats["pairs"], pairs_fingerprint(src, tgt)

    def _model_config(self):
        a = self.args
        if a.resume:
            return TransformerConfig.from_dict(self.rd.read_config()["model"])
        fields = dict(PRESETS[a.preset])
        fields.update({k: getattr(a, k) for k in MODEL_FLAGS if getattr(a, k) is not None})
        tok = self.tok
        return TransformerConfig(vocab_size=tok.vocab_size, pad_id=tok.pad_id, bos_id=tok.bos_id,
                                 eos_id=tok.eos_id, **fields)

    def _prepare_valid(self):
        """The validation set (when its files exist), without the pairs longer than the
        model's positions (counted in the log, as training pairs are)."""
        a, limit = self.args, self.cfg.max_positions
        if a.max_len > limit and (a.resume or "max_len" not in a.explicit):
            # (the default --max-len follows a smaller --max-positions; a resumed run from
            # before this check had no pair longer, or it would have failed on it)
            a.max_len = limit
        elif a.max_len > limit:
            raise SystemExit(f"error: --max-len {a.max_len} is more than the model's positions "
                             f"(--max-positions {limit}): give --max-len {limit} or less, or "
                             "raise --max-positions")
        self.valid = None
        if a.valid_split not in self.files or not os.path.exists(self.files[a.valid_split][0]):
            return
        vs, vt, _ = read_parallel(*self.files[a.valid_split])
        src_ids, tgt_ids = self.tok.encode(vs), self.tok.encode(vt)
        drop = set(overlong_pairs(src_ids, tgt_ids, limit))
        if drop:
            self._log_early(f"valid: {len(drop)} of {len(vs)} pairs longer than the model's "
                            f"{limit} positions left out ({self.files[a.valid_split][0]}, "
                            f"first at line {min(drop) + 1})")
            keep = [i for i in range(len(vs)) if i not in drop]
            vs, vt = [vs[i] for i in keep], [vt[i] for i in keep]
            src_ids, tgt_ids = [src_ids[i] for i in keep], [tgt_ids[i] for i in keep]
        if not vs:
            return
        self.valid = (vs, vt)
        self._valid_ids = (src_ids, tgt_ids)

    def _choose_model(self):
        """A run that sizes itself: the largest model of autosize.LADDER that the corpus and
        the time budget can feed, each candidate timed on this machine for a few updates on
        the corpus's own batches (this rank's share under mpiexec; every rank takes the
        smallest any rank chose). Flags given for the model still win over the rung."""
        a = self.args
        src_ids, tgt_ids, _, _ = self._train
        tokens = a.max_tokens if a.max_tokens != "auto" else autosize.CPU_TOKENS
        probe_batches = Batches(src_ids, tgt_ids, tokens, a.max_len, seed=a.seed)
        corpus_tokens = sum(len(t) + 1 for t in tgt_ids)
        per_update = corpus_tokens / len(probe_batches)
        share = self.comm.shard if self.comm else (lambda batch: batch)
        sample = [share(next(probe_batches)) for _ in range(autosize.PROBE_STEPS + 1)]
        sample = [collate(b, self.cfg.pad_id, self.cfg.bos_id, self.cfg.eos_id)
                  for b in sample if b]  # (a share may be empty: fewer pairs than ranks)
        given = {k: getattr(a, k) for k in MODEL_FLAGS if k in a.explicit}

        def measure(fields):
            cfg = dataclasses.replace(self.cfg, **{**fields, **given})
            model = Transformer(cfg, seed=a.seed, device=self.device)
            optim = Adam(model.parameters(), lr=0.0, betas=tuple(a.adam_betas), eps=a.adam_eps)
            seconds = autosize.probe(model, optim, sample)
            return seconds, per_update, count_parameters(model)

        index, notes = autosize.choose_model(corpus_tokens, a.max_time * 60, measure)
        if self.comm:
            index = self.comm.agree_min(index)
        self._log_early(autosize.report(index, notes, corpus_tokens, a.max_time, given))
        return dataclasses.replace(self.cfg, **{**autosize.LADDER[index], **given})

    def _make_batches(self):
        """The training batches (with subword sampling when asked) and the validation ones,
        of --max-tokens tokens."""
        a = self.args
        src_ids, tgt_ids, resegment, stats = self._train
        self.batches = Batches(src_ids, tgt_ids, a.max_tokens, a.max_len, seed=a.seed,
                               resegment=resegment)
        self._log_early(f"train: {stats['pairs']} pairs from {self.files[a.train_split][0]}, "
                        f"{stats['skipped_empty']} empty skipped, {self.batches.dropped} longer "
                        f"than --max-len {a.max_len} dropped, {len(self.batches)} batches/epoch")
        if self.valid is not None:
            self.valid_batches = Batches(*self._valid_ids, a.max_tokens,
                                         max_len=self.cfg.max_positions, seed=0, shuffle=False)

    def _fit_max_tokens(self):
        """--max-tokens auto: the largest budget whose step on the longest training pairs
        (this rank's share of the batch under mpiexec) fits in --memory (mt/memfit.py);
        every rank takes the smallest any rank found. The model and optimizer are left
        as they were: the run then trains as with that --max-tokens given."""
        a = self.args
        if a.memory:
            budget = memfit.parse_memory(a.memory)
        else:
            budget = memfit.default_budget(self.device, self.comm.local_size()
                                           if self.comm else 1)
        src_ids, tgt_ids, _, _ = self._train
        pairs = [(s, t) for s, t in zip(src_ids, tgt_ids)
                 if len(s) < a.max_len and len(t) < a.max_len]  # (as Batches keeps them)
        if not pairs:  # (Batches then reports that every pair is too long)
            a.max_tokens = memfit.LOW
            return
        share = self.comm.shard if self.comm else (lambda batch: batch)
        tokens, probes = memfit.fit_max_tokens(
            lambda batch: memfit.step_peak(self.model, self.optim, share(batch), self.cfg,
                                           self.device),
            pairs, budget, memfit.in_use(self.device))
        if self.comm:
            tokens = self.comm.agree_min(tokens)
        a.max_tokens = tokens
        self._log_early(memfit.report(tokens, probes, budget))
