"""The deadline plan: with ``--max-time M`` and ``--lr-schedule linear`` a run chooses its own
number of updates N, so that the linear decay reaches 0 as the M minutes end.

Budgeted training (a rate that reaches zero exactly when the budget ends beats a schedule cut
short) needs N, and N depends on the machine. The run measures it instead of asking:

* **Time.** The budget B = 60 M seconds is the run's own training time, as ``--max-time``
  counts it: the loop's wall clock (updates, logging, validations, checkpoints), summed over
  resumes; setting up and the final test score are outside it. Under ``mpiexec`` every rank
  sees rank 0's clock (``comm.agree_to_stop``, before each update), and the plan is a
  function of those readings and of the update numbers alone, so all ranks plan alike.
* **Measuring.** Each reading before an update closes an interval of one update and the
  work after it. Plain intervals give the rate r (s/update): the mean of ``MEASURE`` of them
  after the first ``SKIP`` updates (slow: memory, caches), then an exponential moving average
  over about ``RATE_MEMORY`` updates. An interval that ended in a validation gives its cost
  c_v = interval - r (loss, greedy BLEU and its checkpoints), one that ended in a periodic
  checkpoint (``--save-every``) gives c_s; the newest of each counts (0 until measured).
* **Planning.** At update u and time E, N is the largest number of updates with
  E + (N - u) r + V(u, N) c_v + S(u, N) c_s + ``RESERVE`` r <= B, where V counts the
  validations still due (every ``--valid-every`` updates, plus the one closing the run when
  N is not a multiple) and S the checkpoints (periodic ones not at a validation, plus the
  closing checkpoint_last when a validation did not just write it); ``--max-updates``, when
  given, caps N (``plan_updates``).
* **The schedule** is a list of linear pieces [u0, lr0, N]: from update u0 the rate falls in
  a straight line from lr0 to 0 at update N, lr(u) = lr0 (N - u) / (N - u0) (``piece_lr``).
  The first plan (after about 30 updates) keeps the paper's warm-up, when it lies ahead, and
  puts the piece at [warmup, peak, N]: exactly ``linear_decay_lr`` with --max-updates N.
* **The warm-up**, when the user did not choose one (``warmup_share``, train.py: 12%, the
  Multi30k recipe's 500 of 4200 updates), becomes that share of the first plan's N, but
  at least ``WARMUP_FLOOR`` (500) updates, or ``WARMUP_MOST`` (40%) of N when that is
  less, and never more than the default (the paper's 4000, which would not fit a short
  budget) (``fitted_warmup``); with ``--max-updates`` it is first fitted to that cap, from
  the first update. The peak stays the
  one the default warm-up and ``--lr-factor`` give: the factor is scaled by
  sqrt(new / old warm-up) and saved with the plan. (Noam's peak grows as 1/sqrt(warm-up).
  On a quarter of Multi30k, runs of 850-1000 updates whose warm-up shrank to 12% of the
  plan, about 110 updates, learned far more slowly than with 500: validation loss / greedy
  BLEU 4.21 / 2.7 against 3.85 / 12.5 at update 500, at the same peak of 2e-3; at twice
  that peak they never learned.) From the first plan the rate climbs in a straight line
  from the last update's rate (a piece [u, lr(u), w, top]), no faster than the fitted
  warm-up climbs (peak / fitted an update) and for at most 40% of the updates left, to the
  peak or as near it as that allows; then it falls to 0 at N. It never jumps.
* **Re-planning** every ``CHECK_EVERY`` updates and after each validation: a new N from the
  time left and the current r. If it differs by more than 1% of the updates left, the
  schedule gets a new piece [u, lr(u), N'] starting from the rate of the last update, so the
  rate stays continuous (before the warm-up ends only N changes). The run stops after update
  N, whose rate is 0. In the last 2 ``CHECK_EVERY`` updates of the plan the run also
  re-plans as soon as the updates left no longer fit at the recent rate (the median of the
  last ``RECENT`` plain intervals, when ``SLOWER`` times r or more: one slow update does not
  move it, nor does a noisy machine's scatter), and plans there with it (``behind``): a
  machine that slows late, faster than r follows, would otherwise reach --max-time before
  update N, its rate not yet 0.
* **Checkpoints to average.** With ``--average-last n`` the test score averages the run's
  last n periodic checkpoints. When ``--save-every`` spaces them so far apart that they would
  reach back beyond the last quarter of the plan (a short budget), the run also saves at the
  last n - 1 multiples of N // 4n before N (``tail_saves``), and plans their time as S's.
* **Resume.** The pieces and the measurements are saved in every checkpoint (meta "plan"):
  lr(u) is exact after a resume, and later plans continue from the run's own elapsed time.
"""
import math
import statistics

from ..optim import noam_lr

SKIP = 5  # the first updates of a run are slow (memory, caches): not measured
MEASURE = 25  # plain updates measured before the first plan
CHECK_EVERY = 50  # updates between re-plans
RATE_MEMORY = 100  # the rate: a moving average over about this many updates
RECENT = 8  # the recent rate: the median of the last this many plain intervals (``behind``)
SLOWER = 1.25  # ... counted once it is this many times r (a noisy machine's median strays less)
RESERVE = 3  # updates' time kept free at the end (the last updates vary in length)
WARMUP_FLOOR, WARMUP_MOST = 500, 0.4  # an unchosen warm-up: at least 500, at most 40% of N
WARMUP_SHARE = 0.12  # an unchosen warm-up (train.py): 12% of the planned updates


def tail_saves(total, average_last, save_every, valid_every=0):
    """The checkpoints a planned run adds for ``--average-last n``, so that the n it averages
    lie in the last quarter of the plan, where the rate has fallen below a quarter of its
    peak: none when the periodic ones do ((n - 1) ``save_every`` <= total / 4), else the last
    n - 1 multiples of s = total // 4n before the closing checkpoint at update ``total`` (the
    closing validation writes it; with no validation set, ``total`` too). Multiples, so that
    a re-plan that moves the end by a few updates keeps the points already saved. A
    15-minute run of the Multi30k recipe (save every 200, about 930 updates) would otherwise
    average checkpoints from the end of its warm-up. -> sorted updates."""
    n = average_last
    if n < 1 or total < 1 or (save_every and (n - 1) * save_every <= total / 4):
        return []
    step = max(total // (4 * n), 1)
    last = (total - 1) // step * step  # (the last multiple before ``total``)
    points = [last - k * step for k in range(n - 1) if last - k * step > 0]
    return sorted(points + ([] if valid_every else [total]))


def due(update, total, valid_every=0, save_every=0, average_last=0):
    """-> (validations, checkpoint saves) after ``update`` up to the end of a ``total``-update
    run, as Trainer runs them: a validation (with its checkpoints) at each multiple of
    ``valid_every`` (0: no validation set), a save at each other multiple of ``save_every``
    and at each of ``tail_saves`` that is neither, and at the end a validation unless the
    last update had one, else a save of checkpoint_last."""
    def multiples(k):
        return total // k - update // k if k else 0
    validations, saves = multiples(valid_every), multiples(save_every)
    if valid_every and save_every:  # a validation writes the periodic checkpoint itself
        saves -= multiples(math.lcm(valid_every, save_every))
    saves += sum(1 for u in tail_saves(total, average_last, save_every, valid_every)
                 if u > update and not (valid_every and u % valid_every == 0)
                 and not (save_every and u % save_every == 0))
    if valid_every and total % valid_every:
        validations += 1
    else:
        saves += 1
    return validations, saves


def remaining_seconds(update, total, rate, valid_s=0.0, save_s=0.0, valid_every=0,
                      save_every=0, average_last=0):
    """Seconds from after ``update`` to the end of a ``total``-update run:
    (total - update) r + V c_v + S c_s (``due`` counts V and S)."""
    validations, saves = due(update, total, valid_every, save_every, average_last)
    return (total - update) * rate + validations * valid_s + saves * save_s


def plan_updates(update, elapsed, budget, rate, valid_s=0.0, save_s=0.0, valid_every=0,
                 save_every=0, cap=0, average_last=0):
    """The largest N >= ``update`` (at most ``cap`` when it is not 0) whose remaining time
    (``remaining_seconds``) and a reserve of ``RESERVE`` updates fit in ``budget - elapsed``
    seconds; ``update`` itself when none does (the run stops now)."""
    free = budget - elapsed - RESERVE * rate
    rate = max(rate, 1e-9)
    hi = update + max(int(free / rate), 0) + 1  # updates alone would not fit (costs >= 0)
    if cap:
        hi = min(hi, max(cap, update) + 1)

    def fits(n):
        return remaining_seconds(update, n, rate, valid_s, save_s, valid_every,
                                 save_every, average_last) <= free
    lo = update
    if not fits(lo):
        return update
    while hi - lo > 1:  # fits(lo), and not fits(hi) or hi past the cap
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fitted_warmup(n, warmup, share):
    """The warm-up of a plan of ``n`` updates when the user chose none: ``share`` of n, but
    at least ``WARMUP_FLOOR`` updates (at most ``WARMUP_MOST`` of n), and at most ``warmup``
    (the default's)."""
    return min(warmup, max(round(share * n), min(WARMUP_FLOOR, round(WARMUP_MOST * n))))


def piece_lr(step, pieces, d_model, warmup, factor=1.0):
    """The planned schedule at ``step``: the last piece with u0 < step gives it; a piece
    [u0, lr0, N] falls in a straight line, lr0 max(N - step, 0) / (N - u0), and a rising one
    [u0, lr0, w, peak] (a warm-up shortened by the first plan) climbs from lr0 to the peak at
    update w. Before any piece, the paper's warm-up (noam_lr), then its peak. One piece
    [warmup, peak, N] equals ``linear_decay_lr(step, ..., N)``."""
    step = max(int(step), 1)
    for piece in reversed(pieces):
        start, lr, total = piece[:3]
        if step > start:
            if len(piece) == 4:  # rising to piece[3] at update ``total``
                return lr + (piece[3] - lr) * min(step - start, total - start) / (total - start)
            return lr * max(total - step, 0) / max(total - start, 1)
    return noam_lr(min(step, warmup), d_model, warmup, factor)


class DeadlinePlan:
    """The plan of one run: ``observe`` each reading of the run's clock before an update,
    ``note`` the validation or checkpoint that followed an update, ``lr(step)``; the state
    (pieces and measurements) goes into every checkpoint."""

    def __init__(self, budget, d_model, warmup, factor=1.0, valid_every=0, save_every=0,
                 cap=0, warmup_share=None, average_last=0):
        self.budget, self.d_model, self.warmup, self.factor = budget, d_model, warmup, factor
        self.warmup_share = warmup_share  # the warm-up: at most this share of the first plan
        self.valid_every, self.save_every, self.cap = valid_every, save_every, cap
        self.average_last = average_last
        if cap and warmup_share:  # (fitted to the cap at once: the updates before the first
            self.warmup = fitted_warmup(cap, warmup, warmup_share)  # plan ramp up to it, and
            self.factor *= math.sqrt(self.warmup / warmup)  # a cap below it is never planned)
        self.pieces = [[self.warmup, self.peak(), cap]] if cap else []  # (linear_decay_lr)
        self.total = cap or None  # N: the run stops after this update
        self.rate = self.valid_s = self.save_s = None
        self.measured = [0.0, 0]  # seconds and plain intervals before the first plan
        self.recent = []  # the last RECENT plain intervals, once planned (s)
        self.last = None  # [update, elapsed] at the previous reading
        self.after = None  # "valid" or "save": what followed the update since that reading
        self.next_check = None

    def lr(self, step):
        return piece_lr(step, self.pieces, self.d_model, self.warmup, self.factor)

    def done(self, update):
        return self.rate is not None and update >= self.total

    def saves_at(self, update):
        """True when ``update`` is one of the plan's ``tail_saves`` (once planned)."""
        return self.rate is not None and update in tail_saves(
            self.total, self.average_last, self.save_every, self.valid_every)

    def note(self, kind):
        self.after = kind

    def state_dict(self):
        keys = ("pieces", "total", "rate", "valid_s", "save_s", "measured", "last", "after",
                "next_check", "warmup", "warmup_share", "factor", "recent")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    def observe(self, update, elapsed):
        """The run's clock reads ``elapsed`` s before update ``update + 1``: measure the
        interval since the previous reading; plan or re-plan when due. -> (log line, metrics
        record) when a plan was made, else None."""
        last, after = self.last, self.after
        self.last, self.after = [update, elapsed], None
        if last is None or self.done(update):
            return None
        self._measure(update, elapsed - last[1], after)
        if self.rate is None:
            return None
        behind = self.behind(update, elapsed)
        if self.next_check is None or update >= self.next_check or after == "valid" or behind:
            return self._plan(update, elapsed, behind)
        return None

    def _tail(self, update):
        """Whether ``update`` lies in the plan's last 2 CHECK_EVERY updates."""
        return self.total is not None and self.total - update <= 2 * CHECK_EVERY

    def _planning_rate(self, update):
        """The rate plans are made with: r, or in the plan's tail the recent rate when it is
        SLOWER times r or more (the last RECENT plain intervals' median: r, a moving
        average over about RATE_MEMORY updates, lags behind a machine that slows late)."""
        if not self._tail(update) or len(self.recent) < RECENT:
            return self.rate
        median = statistics.median(self.recent)
        return median if median >= SLOWER * self.rate else self.rate

    def _costs(self):
        """(valid_s, save_s, valid_every, save_every): what plan_updates and
        remaining_seconds take besides the updates and the rate."""
        return self.valid_s or 0.0, self.save_s or 0.0, self.valid_every, self.save_every

    def _fits(self, update, elapsed, rate):
        """plan_updates for this plan's budget, costs and cap at ``rate``."""
        return plan_updates(update, elapsed, self.budget, rate, *self._costs(), self.cap,
                            self.average_last)

    def behind(self, update, elapsed):
        """In the plan's tail: whether the updates left (and the validations and checkpoints
        due) no longer fit in the time left at the recent rate (``_planning_rate``)."""
        rate = self._planning_rate(update)
        return (self._tail(update) and rate > self.rate and update < self.total and
                self._fits(update, elapsed, rate) < self.total)

    def _measure(self, update, seconds, after):
        base = self.rate if self.rate is not None else (
            self.measured[0] / self.measured[1] if self.measured[1] else 0.0)
        if after == "valid":
            self.valid_s = max(seconds - base, 0.0)
        elif after == "save":
            self.save_s = max(seconds - base, 0.0)
        elif update <= SKIP:
            return
        elif self.rate is None:
            self.measured = [self.measured[0] + seconds, self.measured[1] + 1]
            if self.measured[1] >= MEASURE:
                self.rate = self.measured[0] / self.measured[1]
        else:
            self.rate += (seconds - self.rate) / RATE_MEMORY
            self.recent = (self.recent + [seconds])[-RECENT:]

    def _plan(self, update, elapsed, behind=False):
        first, old = self.next_check is None, self.total
        rate = self._planning_rate(update)
        n = self._fits(update, elapsed, rate)
        last = max(rate, self.recent[-1]) if self.recent else rate  # (the last update's)
        if not first and n == update < old and remaining_seconds(
                update, update + 1, last, *self._costs(), self.average_last) \
                <= self.budget - elapsed:
            # nothing more fits with the reserve kept, and the update just made had a rate
            # above 0: one more, at rate 0, in the reserve (which is there for the last
            # updates), when it fits at the rate of the last one too (a slowdown the median
            # does not show yet), so that the run still ends annealed
            n = update + 1
        # (in the plan's tail, the next check comes after a quarter of the updates left: a
        # plan that a slow stretch shortened can lengthen again)
        self.next_check = update + (min(CHECK_EVERY, max(1, (n - update) // 4))
                                    if n - update <= 2 * CHECK_EVERY else CHECK_EVERY)
        if not first and not behind and abs(n - old) <= (old - update) // 100:
            return None  # within 1% of the updates left: keep the schedule as it is
        before, climb = self.lr(update), None  # (the rate of the update just made)
        if first and self.warmup_share:  # (the warm-up was not chosen: fit it to the plan)
            climb = self._refit_warmup(update, n, before)
        if n != old or climb:
            self._new_piece(update, n, before, climb)
        self.total = n
        return self._describe(first, update, elapsed, old)

    def from_fixed_schedule(self, saved_cap, update, cap, bend=None):
        """A linear run without a plan (no --max-time until its resume at ``update``): its
        own schedule (linear_decay_lr to ``saved_cap``, its warm-up as it was; from ``bend``
        = [u0, lr0] on, the straight line from lr0 at u0 a changed --max-updates gave it)
        goes on until the first plan; a new ``cap`` ends it from the rate it had
        (restart_before_plan)."""
        self.warmup_share = None
        self.pieces = [[self.warmup, self.peak(), saved_cap]] if saved_cap else []
        if saved_cap and bend is not None:
            self.pieces.append([int(bend[0]), float(bend[1]), saved_cap])
        self.total = saved_cap or None
        if cap != saved_cap:
            self.restart_before_plan(update, cap)

    def new_budget(self, update, cap):
        """A --max-time or --max-updates ``cap`` given anew on resume at ``update``: planned
        for at once (not at the next check), or, before the first plan, the cap ends the
        schedule from the rate the run had."""
        self.cap = cap
        if self.next_check is not None:
            self.next_check = update
        elif cap != (self.total or 0):
            self.restart_before_plan(update, cap)

    def restart_before_plan(self, update, cap):
        """A resumed run that stopped before its first plan, given a new --max-updates
        ``cap`` (0: none): with a cap, the schedule falls to 0 at it from this update's rate
        (climbing first to the peak of a warm-up not chosen, fitted to the cap, when that
        lies ahead); without, the rate holds where it is (or noam's ramp goes on) until the
        first plan. The rate does not jump."""
        before, climb = self.lr(update), None
        if cap and self.warmup_share:
            climb = self._refit_warmup(update, cap, before)
        if cap:
            self._new_piece(update, cap, before, climb)
        else:
            self.pieces = [p for p in self.pieces if p[0] < update]
            if self.pieces or update >= self.warmup:
                self.pieces.append([update, before, update + 1, before])
        self.total = cap or None

    def _refit_warmup(self, update, n, before):
        """Fit a warm-up not chosen to a plan of ``n`` updates (``fitted_warmup``): from the
        last update's rate ``before`` the rate climbs no faster than the fitted warm-up does
        (peak / w an update), for at most ``WARMUP_MOST`` of the updates left, to the peak
        or as near it as that allows. -> the climb (its last update, the rate there), or None
        when the warm-up stays as it is or is over. The peak stays the one it had."""
        if update >= self.warmup:  # (the warm-up is over: the rate only falls from here)
            return None
        peak = self.peak()
        slope = peak / fitted_warmup(n, self.warmup, self.warmup_share)
        length = min(math.ceil((peak - before) / slope - 1e-9),  # (-1e-9: a rounding)
                     max(1, int(WARMUP_MOST * (n - update))))
        if length <= 0 or (update + length == self.warmup and before + slope * length >= peak):
            return None
        w = update + length
        self.factor *= math.sqrt(w / self.warmup)  # noam's peak goes as factor / sqrt(w)
        self.warmup = w
        return w, min(peak, before + slope * length)

    def peak(self):
        return noam_lr(self.warmup, self.d_model, self.warmup, self.factor)

    def _new_piece(self, update, n, before, climb=None):
        """The schedule from update + 1 on falls to 0 at ``n``, starting from ``before``, the
        last update's rate: a ``climb`` (its last update w, its rate there) just fitted is
        climbed first, in a straight line, and a warm-up still ahead is kept (noam's ramp,
        or a climb under way); else a straight line down from ``before``. The rate never
        jumps."""
        self.pieces = [p for p in self.pieces if p[0] < update]  # (those ahead: replaced)
        last = self.pieces[-1] if self.pieces else None  # (noam's ramp, or a climb to the
        ramp = last is None or (len(last) == 4 and last[2] == self.warmup)  # warm-up, in use)
        if climb:
            w, top = climb
            self.pieces += [[update, before, w, top], [w, top, n]]
        elif update < self.warmup < n and ramp:
            self.pieces.append([self.warmup, last[3] if last else self.peak(), n])
        else:
            self.pieces.append([update, before, n])

    def _describe(self, first, update, elapsed, old):
        validations, _ = due(update, self.total, self.valid_every, self.save_every,
                             self.average_last)
        valid = f"{validations} validations{'' if first else ' to go'}"
        valid = (f"{valid} at {self.valid_s:.3g} s" if self.valid_s is not None else
                 f"{valid}, not timed yet" if self.valid_every else "no validation set")
        minutes = self.budget / 60
        if first:
            text = (f"plan: {self.total} updates in {minutes:g} min ({self.rate:.3g} s/update "
                    f"measured, {valid})")
        else:
            rate = self._planning_rate(update)
            speed = (f"{rate:.3g} s/update lately, {self.rate:.3g} on average"
                     if rate > self.rate else f"{self.rate:.3g} s/update")
            text = (f"re-plan at update {update}: {old} -> {self.total} updates "
                    f"({speed}, {valid}; {(self.budget - elapsed) / 60:.2f} of {minutes:g} "
                    "min left)")
        if self.cap and self.total == self.cap:
            text += f"; capped by --max-updates {self.cap}"
        if update < self.warmup >= self.total > update and not self.warmup_share:  # (chosen)
            text += (f"; warning: the warm-up (--warmup {self.warmup}) does not fit in the "
                     f"plan: the rate falls from {self.lr(update + 1) / self.peak():.0%} of its "
                     "peak to 0; a run started without --warmup has it fitted to the plan "
                     "(the same peak, reached sooner)")
        tail = tail_saves(self.total, self.average_last, self.save_every, self.valid_every)
        if tail:
            text += (f"; checkpoints for --average-last {self.average_last} also at updates "
                     f"{', '.join(map(str, tail))}")
        record = {"update": update + 1, "plan_updates": self.total, "rate_s": self.rate,
                  "valid_s": self.valid_s, "save_s": self.save_s, "validations": validations,
                  "elapsed_s": elapsed, "budget_s": self.budget}
        return text, record
