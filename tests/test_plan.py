"""The deadline plan (mt/plan.py): --max-time with the linear schedule plans the number of
updates so that the rate reaches 0 as the budget ends; re-plans keep the rate continuous; a
resumed run continues the same plan. Runs use an injected clock (Trainer.clock) that moves
only when the loop works, so they are exact and fast."""
import json
import math
import os
import signal

import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import plan
from minitransformer.mt import train as train_cli
from minitransformer.optim import linear_decay_lr, noam_lr

from test_distributed import MPIEXEC, needs_mpi, run_mpi

TINY = ["--synthetic-pairs", "1500", "--d-model", "32", "--n-heads", "2", "--d-ff", "64",
        "--max-tokens", "600", "--vocab-size", "120", "--no-progress", "--warmup", "50",
        "--valid-bleu-sentences", "20", "--test-split", "", "--lr-schedule", "linear",
        "--max-updates", "0", "--valid-every", "20"]
SMALL = TINY + ["--log-every", "1"]


# ---------------------------------------------------------------------------- pure functions

def naive_due(update, total, valid_every, save_every, average_last=0):
    """What Trainer does after each update u in (update, total], and at the end of the run."""
    validations = saves = 0
    tail = plan.tail_saves(total, average_last, save_every, valid_every)
    for u in range(update + 1, total + 1):
        if valid_every and u % valid_every == 0:
            validations += 1
        elif (save_every and u % save_every == 0) or u in tail:
            saves += 1
    if valid_every and total % valid_every != 0:
        validations += 1
    else:
        saves += 1
    return validations, saves


@pytest.mark.parametrize("valid_every,save_every,average_last",
                         [(0, 0, 0), (20, 0, 0), (20, 8, 0), (0, 7, 0), (10, 25, 0),
                          (20, 25, 3), (0, 30, 5), (10, 0, 2), (20, 8, 4)])
def test_due_counts_the_validations_and_checkpoints_the_trainer_runs(valid_every, save_every,
                                                                      average_last):
    for update in (0, 3, 40, 41):
        for total in range(update, update + 130):
            got = plan.due(update, total, valid_every, save_every, average_last)
            assert got == naive_due(update, total, valid_every, save_every, average_last), \
                (update, total)


def test_tail_saves_keep_the_averaged_checkpoints_in_the_last_quarter():
    # the Multi30k recipe (save every 200, average 5): an hour's ~3800 updates need none
    assert plan.tail_saves(3800, 5, 200, 500) == []
    assert plan.tail_saves(930, 5, 30, 500) == []  # (saves 30 apart already do)
    # 15 minutes, ~930 updates: 4 more, multiples of 46, before the closing checkpoint at 930
    assert plan.tail_saves(930, 5, 200, 500) == [782, 828, 874, 920]
    assert plan.tail_saves(930, 5, 0, 0) == [782, 828, 874, 920, 930]  # (no validation set)
    # a re-plan that moves the end a little keeps the points: those passed were saved
    assert plan.tail_saves(921, 5, 200, 500) == plan.tail_saves(935, 5, 200, 500)
    assert plan.tail_saves(920, 5, 200, 500) == [736, 782, 828, 874]
    assert plan.tail_saves(930, 0, 200, 500) == [] and plan.tail_saves(930, 1, 200, 500) == []
    assert plan.tail_saves(3, 5, 200, 0) == [1, 2, 3]


def test_plan_is_the_largest_number_of_updates_within_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(300):
        update = int(rng.integers(0, 400))
        budget, rate = float(rng.uniform(60, 3600)), float(rng.uniform(0.05, 2.0))
        elapsed = float(rng.uniform(0, budget))
        valid_s = float(rng.uniform(0, 30))
        save_s = float(rng.uniform(0, min(valid_s, 2)))
        ve, se = int(rng.choice([0, 50, 200])), int(rng.choice([0, 40]))
        cap = int(rng.choice([0, update + 100]))
        n = plan.plan_updates(update, elapsed, budget, rate, valid_s, save_s, ve, se, cap)
        end = {t: elapsed + plan.remaining_seconds(update, t, rate, valid_s, save_s, ve, se)
               + plan.RESERVE * rate for t in range(n, n + 400)}
        assert n >= update and (not cap or n <= cap)
        if n > update:
            assert end[n] <= budget, (n, end[n], budget)  # never beyond the budget
        # the largest: a brute-force scan finds no larger N that fits
        larger = [t for t in range(n + 1, n + 400) if end[t] <= budget]
        assert not larger or (cap and n == cap), (n, larger[:3])


def test_plan_counts_validations_and_stops_now_when_nothing_fits():
    # 0.5 s an update, 100 s, a reserve of 3 updates (1.5 s): 197 updates without validations
    assert plan.plan_updates(0, 0.0, 100.0, 0.5) == 197
    # validations every 20 at 10 s each: 97 updates take 48.5 s, 4 validations (20..80) and
    # the closing one 50 s, + 1.5 s reserve = 100 s; 98 take 100.5 s; 100 (5 validations,
    # the last at 100, then a 0 s checkpoint) 101.5 s
    assert plan.plan_updates(0, 0.0, 100.0, 0.5, valid_s=10.0, valid_every=20) == 97
    assert plan.plan_updates(0, 0.0, 101.5, 0.5, valid_s=10.0, valid_every=20) == 100
    assert plan.plan_updates(0, 0.0, 100.0, 0.5, cap=150) == 150
    assert plan.plan_updates(50, 99.0, 100.0, 0.5) == 50  # no time left: stop after update 50


def test_one_piece_from_the_warmup_is_the_linear_schedule():
    d, warmup, total, factor = 64, 10, 57, 0.7
    pieces = [[warmup, noam_lr(warmup, d, warmup, factor), total]]
    for step in range(0, total + 5):
        assert plan.piece_lr(step, pieces, d, warmup, factor) == \
            linear_decay_lr(step, d, warmup, total, factor), step


def feed(p, first, last, rate, elapsed, valid_every=0, valid_s=0.0):
    """Readings of a run whose updates take ``rate`` s (and each validation ``valid_s``)."""
    out = []
    for u in range(first, last + 1):
        event = p.observe(u, elapsed)
        out.extend([event] if event else [])
        elapsed += rate
        if valid_every and (u + 1) % valid_every == 0:
            p.note("valid")
            elapsed += valid_s
    return elapsed, out


def test_first_plan_after_the_measured_updates_keeps_the_warmup():
    p = plan.DeadlinePlan(budget=300.0, d_model=64, warmup=100)
    elapsed, events = feed(p, 0, plan.SKIP - 1, 5.0, 0.0)  # the first updates are slow
    elapsed, more = feed(p, plan.SKIP, plan.SKIP + plan.MEASURE - 1, 1.0, elapsed)
    assert p.rate is None and not events + more  # still measuring
    elapsed, events = feed(p, plan.SKIP + plan.MEASURE, plan.SKIP + plan.MEASURE, 1.0, elapsed)
    assert p.rate == 1.0 and len(events) == 1  # the first SKIP updates were not measured
    text, record = events[0]
    assert text.startswith(f"plan: {p.total} updates in 5 min (1 s/update measured")
    assert record["plan_updates"] == p.total
    u = plan.SKIP + plan.MEASURE
    assert p.total == plan.plan_updates(u, elapsed - 1.0, 300.0, 1.0)
    peak = noam_lr(100, 64, 100)
    assert p.pieces == [[100, peak, p.total]]
    assert p.lr(100) == peak and p.lr(p.total) == 0.0 and p.lr(p.total - 1) > 0


def test_replan_keeps_the_rate_continuous_and_reaches_zero_at_the_new_end():
    p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=20, valid_every=50)
    elapsed, _ = feed(p, 0, 120, 1.0, 0.0, valid_every=50, valid_s=5.0)
    first_total, n_pieces = p.total, len(p.pieces)
    before = [p.lr(s) for s in range(1, 300)]
    elapsed, events = feed(p, 121, 200, 1.6, elapsed, valid_every=50, valid_s=5.0)
    replans = [e for e in events if e[0].startswith("re-plan")]
    assert replans and p.total < first_total  # slower updates: fewer of them
    assert len(p.pieces) == n_pieces + len(replans)
    start = p.pieces[n_pieces][0]
    assert [p.lr(s) for s in range(1, start + 1)] == before[:start]  # the past is unchanged
    for i in range(1, len(p.pieces)):  # each piece starts from the rate of its last update
        start, lr0, total = p.pieces[i]
        assert lr0 == plan.piece_lr(start, p.pieces[:i], 64, 20) == p.lr(start)
    start, lr0, total = p.pieces[-1]
    assert total == p.total
    lrs = [p.lr(s) for s in range(start, p.total + 1)]
    steps = np.diff(lrs)  # one straight line down to 0: equal steps, no jump at the re-plan
    assert np.allclose(steps, -lr0 / (total - start), rtol=1e-9, atol=0)
    assert lrs[-1] == 0.0 and p.lr(p.total + 3) == 0.0


def test_small_changes_are_ignored_and_the_plan_survives_json():
    p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=20)
    elapsed, _ = feed(p, 0, 100, 1.0, 0.0)
    pieces = [list(x) for x in p.pieces]
    elapsed, events = feed(p, 101, 160, 1.001, elapsed)  # 0.1% slower: within 1% of the rest
    assert not events and p.pieces == pieces
    copy = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=20)
    copy.load_state_dict(json.loads(json.dumps(p.state_dict())))
    feed(p, 161, 300, 1.5, elapsed)
    feed(copy, 161, 300, 1.5, elapsed)
    assert copy.state_dict() == p.state_dict()


def test_a_budget_shorter_than_the_warmup_decays_from_where_the_rate_is():
    p = plan.DeadlinePlan(budget=50.0, d_model=64, warmup=400)
    feed(p, 0, 40, 0.5, 0.0)
    start, lr0, total = p.pieces[0]
    assert total < 400 and start == plan.SKIP + plan.MEASURE
    assert lr0 == noam_lr(start, 64, 400) and p.lr(total) == 0.0


def run_to_deadline(p, budget, rate_at, valid_every=0, valid_s=0.0):
    """The trainer's loop on a clock: before each update the plan observes the clock; the run
    stops when the plan is done or the budget is spent (train.py's --max-time). -> (the last
    update made, the clock at the stop)."""
    elapsed, u = 0.0, 0
    while True:
        p.observe(u, elapsed)
        if p.done(u) or elapsed >= budget:
            return u, elapsed
        elapsed += rate_at(u + 1)
        u += 1
        if valid_every and u % valid_every == 0:
            p.note("valid")
            elapsed += valid_s


@pytest.mark.parametrize("slow_at, factor", [(500, 2.0), (540, 3.0), (560, 1.5), (300, 1.3)])
def test_a_machine_that_slows_late_still_ends_the_run_annealed(slow_at, factor):
    """The updates take 1 s, then ``factor`` s from ``slow_at`` on, near the end of a 600 s
    budget: the plan sees the updates left no longer fit at the recent rate and re-plans at
    once (the moving average, over ~100 updates, lags; re-plans every 50 updates came too
    late: the run reached its time limit with the rate at 8-40% of its peak). The run ends
    at its planned update, the rate 0, within the budget."""
    p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=50)
    texts = []
    real_describe = p._describe
    p._describe = lambda *a: texts.append(real_describe(*a)[0]) or real_describe(*a)
    last, elapsed = run_to_deadline(p, 600.0, lambda u: factor if u >= slow_at else 1.0)
    assert p.done(last) and p.lr(last) == 0.0, (last, p.total, p.lr(last) / p.peak())
    if slow_at >= 500:  # (a slowdown from 300 on: the moving average has caught up)
        assert any(f"({factor:.3g} s/update lately, " in t for t in texts), texts
    assert elapsed <= 600.0
    steps = [p.lr(u + 1) - p.lr(u) for u in range(60, last)]  # falling, never jumping up
    assert all(s <= 1e-15 for s in steps)
    # it did not give up much of its budget to do so (the reserve and the slow updates)
    assert elapsed >= 600.0 - (plan.RESERVE + 12) * factor, elapsed



@pytest.mark.parametrize("slow_at, seconds", [(520, 10.0), (540, 10.0), (560, 5.0)])
def test_one_slow_update_late_does_not_cut_the_plan_short(slow_at, seconds):
    """One update of 10 s among 1 s ones near the end: the recent rate is a median, so the
    run does not re-plan as if the machine had slowed (with a mean it stopped 30-41 s
    before its budget); it ends at its plan, the rate 0, with the reserve left."""
    p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=50)
    last, elapsed = run_to_deadline(p, 600.0, lambda u: seconds if u == slow_at else 1.0)
    assert p.done(last) and p.lr(last) == 0.0
    assert 600.0 - (plan.RESERVE + 2) <= elapsed <= 600.0


@pytest.mark.parametrize("slow_from", [584, 589, 594])
def test_the_last_update_at_rate_0_is_made_only_when_it_fits_at_the_last_rate(slow_from):
    """Updates slow 5x a few updates before the end, too late for the median to show it:
    the one more update at rate 0 (for a run that finds nothing more fits) is made only if
    it fits at the last update's pace too (at the moving average it ran 3 s over a 600 s
    budget); the run ends within its budget."""
    p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=50)
    last, elapsed = run_to_deadline(p, 600.0, lambda u: 5.0 if u >= slow_from else 1.0)
    assert elapsed <= 600.0, (last, elapsed)


def test_a_noisy_machine_ends_annealed_and_near_its_budget():
    """Updates of 1 s +- 0.4 (Gaussian), a 15 s validation every 50, 60 seeds: every run
    ends at its planned update with the rate 0 (a last re-plan that leaves nothing more
    fitting ends with one more update at rate 0, in the reserve), within its budget, and
    none leaves more than 25 s of its 600 unused; the rate never steps up after the
    warm-up."""
    import random
    worst = 0.0
    for seed in range(60):
        rng, seconds = random.Random(seed), {}

        def rate_at(u, rng=rng, seconds=seconds):
            if u not in seconds:
                seconds[u] = max(0.05, rng.gauss(1.0, 0.4))
            return seconds[u]
        p = plan.DeadlinePlan(budget=600.0, d_model=64, warmup=50, valid_every=50)
        last, elapsed = run_to_deadline(p, 600.0, rate_at, valid_every=50, valid_s=15.0)
        assert p.done(last) and p.lr(last) == 0.0, seed
        assert elapsed <= 600.0, seed
        assert all(p.lr(u + 1) <= p.lr(u) for u in range(51, last)), seed
        worst = max(worst, 600.0 - elapsed)
    assert worst <= 25.0, worst

# --------------------------------------------------------------------- runs on a fake clock

class FakeClock:
    """Time moves only when the loop works: each update ``update_s`` (``slow_s`` from update
    ``slow_from`` on), each validation ``VALID_S``, each checkpoint save ``SAVE_S``; all
    multiples of 1/4, so the sums are exact."""
    VALID_S, SAVE_S = 4.0, 0.25

    def __init__(self, slow_from=70, update_s=0.5, slow_s=0.75, stop_at=None):
        self.t, self.slow_from, self.update_s, self.slow_s = 1000.0, slow_from, update_s, slow_s
        self.stop_at = stop_at

    def __call__(self):
        return self.t

    def install(self, monkeypatch):
        trainer = train_cli.Trainer
        train_update, validate, save = trainer.train_update, trainer.validate, trainer.save

        def timed_update(tr):
            out = train_update(tr)
            self.t += self.slow_s if tr.update >= self.slow_from else self.update_s
            if tr.update == self.stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would stop the run
            return out

        def timed_validate(tr):
            self.t += self.VALID_S
            return validate(tr)

        def timed_save(tr, *paths):
            self.t += self.SAVE_S
            return save(tr, *paths)
        monkeypatch.setattr(trainer, "clock", staticmethod(self))
        monkeypatch.setattr(trainer, "train_update", timed_update)
        monkeypatch.setattr(trainer, "validate", timed_validate)
        monkeypatch.setattr(trainer, "save", timed_save)


def records(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def train(run, clock, monkeypatch, *extra):
    clock.install(monkeypatch)
    return train_cli.main(SMALL + ["--run-dir", run, "--max-time", "1.5", *extra])


def test_a_run_ends_annealed_at_the_planned_update_within_the_budget(tmp_path, capsys,
                                                                   monkeypatch):
    run, clock = str(tmp_path / "run"), FakeClock()
    assert train(run, clock, monkeypatch) == 0
    recs = records(run)
    plans = [r for r in recs if "plan_updates" in r]
    lrs = {r["update"]: r["lr"] for r in recs if "lr" in r}
    final = max(lrs)
    # planned after 25 plain updates past the first 5 (update 20's interval held a
    # validation), before update 32
    assert plans[0]["update"] == 32 and plans[0]["rate_s"] == 0.5
    assert plans[-1]["plan_updates"] == final < plans[0]["plan_updates"]  # re-planned: slower
    assert lrs[final] == 0.0 and all(v > 0 for u, v in lrs.items() if u < final)
    after_peak = [lrs[u] for u in sorted(lrs) if u >= 50]
    assert lrs[50] == max(lrs.values())
    assert all(b < a for a, b in zip(after_peak, after_peak[1:]))  # no jump at a re-plan
    assert 1080.0 <= clock.t <= 1090.0  # 90 s used, within the reserve and a validation
    meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    assert meta["update"] == final and meta["plan"]["total"] == final
    out = capsys.readouterr().out
    assert "plan: " in out and "re-plan at update" in out
    assert f"reached the {final} updates planned for --max-time 1.5 min" in out


def test_a_planned_run_averages_checkpoints_from_the_end_of_its_plan(tmp_path, capsys,
                                                                     monkeypatch):
    """--save-every 40 with --average-last 3 would average updates ~80 apart in a ~150-update
    plan: the run also saves at the plan's tail_saves, and the 3 it averages for its test
    score lie in the last quarter."""
    run, clock = str(tmp_path / "run"), FakeClock()
    flags = ["--save-every", "40", "--average-last", "3", "--keep-last", "3",
             "--test-split", "test"]
    assert train(run, clock, monkeypatch, *flags) == 0
    final = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    kept = sorted(int(f[len("checkpoint_"):-4]) for f in os.listdir(run)
                  if f.startswith("checkpoint_") and f[len("checkpoint_"):-4].isdigit())
    assert kept[-1] == final and len(kept) == 3 and kept[0] >= 0.75 * final, kept
    tail = plan.tail_saves(final, 3, 40, 20)
    extra = [u for u in kept[:-1] if u % 20 and u % 40]  # neither validation nor --save-every
    assert extra and set(extra) <= set(tail), (kept, tail)
    assert 1080.0 <= clock.t <= 1090.0  # the extra saves were planned for
    out = capsys.readouterr().out
    assert "checkpoints for --average-last 3 also at updates" in out
    test = [r for r in records(run) if "test_bleu" in r][-1]
    assert test["test_checkpoints"] == "average of 3 checkpoints"  # (the 3 kept)


def test_a_stopped_and_resumed_run_follows_the_uninterrupted_plan_exactly(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    with pytest.MonkeyPatch.context() as mp:
        assert train(straight, FakeClock(), mp) == 0
    stop_at = 45  # after the first plan, before the slowdown's re-plans; not a validation
    with pytest.MonkeyPatch.context() as mp:
        assert train(split, FakeClock(stop_at=stop_at), mp) == 128 + signal.SIGTERM
    assert ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))[2]["update"] == \
        stop_at
    with pytest.MonkeyPatch.context() as mp:
        assert train(split, FakeClock(), mp, "--resume") == 0
    a = ckpt.load_checkpoint(os.path.join(straight, "checkpoint_last.npz"))
    b = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))
    assert a[2]["plan"] == b[2]["plan"] and a[2]["update"] == b[2]["update"]
    assert len(a[2]["plan"]["pieces"]) >= 2  # it re-planned after the resume
    for k in a[0]:
        assert np.array_equal(a[0][k], b[0][k]), k  # bit for bit
    lr_a = {r["update"]: r["lr"] for r in records(straight) if "lr" in r}
    lr_b = {r["update"]: r["lr"] for r in records(split) if "lr" in r}
    assert set(lr_b) == set(lr_a)  # (the stopped update logs its line before it stops)
    assert all(lr_b[u] == lr_a[u] for u in lr_b)
    assert [r for r in records(split) if "plan_updates" in r] == \
        [r for r in records(straight) if "plan_updates" in r]


def test_max_updates_caps_the_plan(tmp_path):
    run = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as mp:
        assert train(run, FakeClock(slow_from=10 ** 9), mp, "--max-updates", "80") == 0
    lrs = {r["update"]: r["lr"] for r in records(run) if "lr" in r}
    assert max(lrs) == 80 and lrs[80] == 0.0
    for u, lr in lrs.items():  # the linear schedule to --max-updates, unchanged
        assert lr == linear_decay_lr(u, 32, 50, 80), u


@pytest.mark.parametrize("data", [None, "d"])
def test_max_updates_0_is_no_cap_for_the_plan(data):
    """--max-time alone plans (the linear schedule to the deadline); so does --max-time with
    --max-updates 0, which means no cap (it counted as a given cap: the run then kept the
    inverse square root and ended at its time limit unannealed)."""
    from minitransformer.mt import options
    base = ["--max-time", "5"] + (["--data", data] if data else [])
    for extra in ([], ["--max-updates", "0"]):
        args = options.parse_args(base + extra)
        options.fill_defaults(args)
        assert args.lr_schedule == "linear" and options.plans_to_deadline(args), extra
    args = options.parse_args(base + ["--max-updates", "100000"])  # a cap: as before
    options.fill_defaults(args)
    assert options.plans_to_deadline(args) == (data is not None)


def test_linear_with_max_time_needs_no_max_updates(tmp_path):
    from minitransformer.mt import options
    args = options.parse_args(["--lr-schedule", "linear", "--max-time", "5", "--data", "d"])
    options.fill_defaults(args)
    options.check_options(args)  # accepted: the plan sets N
    assert options.plans_to_deadline(args)
    args = options.parse_args(["--lr-schedule", "linear", "--data", "d"])
    options.fill_defaults(args)
    with pytest.raises(SystemExit, match="--max-time M to plan"):
        options.check_options(args)
    assert "plans to the deadline" in " ".join(options.build_parser().format_help().split())


@needs_mpi
def test_two_ranks_follow_one_plan_on_rank_0s_clock(tmp_path):
    """Real clocks: the ranks plan from rank 0's readings, so they stop after the same
    update (a rank that planned otherwise would hang in an all-reduce or fail)."""
    assert MPIEXEC
    run = str(tmp_path / "run")
    flags = TINY + ["--log-every", "10", "--max-time", "0.1"]
    out = run_mpi(2, *flags, "--run-dir", run, timeout=120)
    recs = records(run)
    plans = [r for r in recs if "plan_updates" in r]
    final = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]
    assert plans and final["update"] == plans[-1]["plan_updates"] == final["plan"]["total"]
    assert f"reached the {final['update']} updates planned" in out
    assert math.isclose(plan.piece_lr(final["update"], final["plan"]["pieces"], 32, 50), 0.0)


def test_an_unchosen_warmup_becomes_a_share_of_the_first_plan():
    # the paper's 4000 updates of warm-up would not fit a short budget: without --warmup the
    # first plan sets it to warmup_share of N, and the decay is linear_decay_lr's with it
    p = plan.DeadlinePlan(budget=1000.0, d_model=64, warmup=4000, warmup_share=0.12)
    feed(p, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    n = p.total
    # 12% of N would be ~115 updates, too short (mt/plan.py): at least 500, at most 40% of N
    fitted = plan.fitted_warmup(n, 4000, 0.12)
    assert 900 < n < 1000 and fitted == round(0.4 * n)
    # reached from the first plan's update, where noam's ramp had the rate, no faster than
    # the fitted warm-up climbs (peak / fitted an update): about fitted updates later
    first = plan.SKIP + plan.MEASURE + 1
    assert fitted <= p.warmup <= first + fitted
    peak = noam_lr(4000, 64, 4000)
    climb = [p.lr(u + 1) - p.lr(u) for u in range(first, p.warmup)]
    assert max(climb) <= peak / fitted * (1 + 1e-9) and min(climb) > 0
    # the climb ends at the peak, or as near as 40% of the updates left allow (here 97.5%)
    u0, lr0, w, top = next(pc for pc in p.pieces if len(pc) == 4)
    assert w == p.warmup and (top == pytest.approx(peak, rel=1e-12)
                              or w - u0 == int(plan.WARMUP_MOST * (n - u0)))
    assert top == pytest.approx(lr0 + (w - u0) * peak / fitted, rel=1e-12)
    assert plan.fitted_warmup(2000, 4000, 0.12) == 500
    assert plan.fitted_warmup(10_000, 4000, 0.12) == 1200
    assert plan.fitted_warmup(50_000, 4000, 0.12) == 4000  # never more than the default
    # the peak is still the one of the default warm-up (a shorter one reaches it sooner),
    # and from the climb's top the rate falls in a straight line to 0 at N
    assert p.peak() == pytest.approx(noam_lr(4000, 64, 4000), rel=1e-12)
    for step in range(p.warmup, n + 1, 7):
        assert p.lr(step) == pytest.approx(top * (n - step) / (n - w), rel=1e-12)
    ramp = [p.lr(step) for step in range(plan.SKIP + plan.MEASURE + 2, p.warmup + 1)]
    assert all(b > a for a, b in zip(ramp, ramp[1:])) and ramp[-1] == p.lr(p.warmup)
    copy = plan.DeadlinePlan(budget=1000.0, d_model=64, warmup=4000)
    copy.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert copy.warmup == p.warmup and copy.factor == p.factor
    assert [copy.lr(u) for u in (40, 80, 500)] == [p.lr(u) for u in (40, 80, 500)]
    # a chosen warm-up is kept
    q = plan.DeadlinePlan(budget=1000.0, d_model=64, warmup=4000)
    feed(q, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    assert q.warmup == 4000


def test_a_time_budget_plans_the_schedule_by_default():
    from minitransformer.mt.options import fill_defaults, parse_args
    base = ["--data", "d", "--src-lang", "en", "--tgt-lang", "de"]
    for extra, want in ((["--max-time", "30"], "linear"),
                        (["--max-time", "30", "--lr-schedule", "inverse-sqrt"], "inverse-sqrt"),
                        # a run that sizes itself plans, --max-updates capping the plan ...
                        (["--max-time", "30", "--max-updates", "5000"], "linear"),
                        (["--max-time", "30", "--max-updates", "5000", "--warmup", "500"],
                         "linear"),
                        # (a cap inside a chosen warm-up cannot be planned: as before)
                        (["--max-time", "30", "--max-updates", "1000", "--warmup", "2000"],
                         "inverse-sqrt"),
                        # ... one with its model given does not
                        (["--max-time", "30", "--max-updates", "5000", "--preset", "tiny"],
                         "inverse-sqrt"),
                        ([], "inverse-sqrt")):
        args = parse_args(base + extra)
        fill_defaults(args)
        assert args.lr_schedule == want, extra


def test_a_capped_first_plan_still_fits_the_warmup():
    # --max-updates caps the plan at 600 (the budget would allow more): the warm-up not
    # chosen becomes 40% of 600, and the schedule is linear_decay_lr's with it
    p = plan.DeadlinePlan(budget=10_000.0, d_model=64, warmup=4000, cap=600, warmup_share=0.12)
    feed(p, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    assert p.total == 600 and p.warmup == 240
    factor = math.sqrt(240 / 4000)  # (the default warm-up's peak, reached at 240)
    for step in range(p.warmup, 601, 5):
        assert p.lr(step) == pytest.approx(linear_decay_lr(step, 64, 240, 600, factor),
                                           rel=1e-12)


def test_a_budget_changed_on_resume_is_planned_for_at_once(tmp_path, capsys):
    # stopped at update 45, resumed with a shorter --max-time: re-planned at the first
    # update after the resume (not at the plan's next check, past which a shorter budget
    # would end the run unannealed), and the run ends with the rate at 0
    split = str(tmp_path / "split")
    with pytest.MonkeyPatch.context() as mp:
        assert train(split, FakeClock(stop_at=45), mp) == 128 + signal.SIGTERM
    plans_before = len([r for r in records(split) if "plan_updates" in r])
    with pytest.MonkeyPatch.context() as mp:
        FakeClock().install(mp)
        assert train_cli.main(SMALL + ["--run-dir", split, "--max-time", "1.0",
                                       "--resume"]) == 0
    plans = [r for r in records(split) if "plan_updates" in r][plans_before:]
    assert plans and plans[0]["update"] <= 46, plans
    lrs = {r["update"]: r["lr"] for r in records(split) if "lr" in r}
    final = max(lrs)
    assert lrs[final] == 0.0 and plans[-1]["plan_updates"] == final


def test_warmup_or_lr_factor_given_anew_to_a_planned_run_is_refused(tmp_path, capsys):
    split = str(tmp_path / "split")
    with pytest.MonkeyPatch.context() as mp:
        assert train(split, FakeClock(stop_at=45), mp) == 128 + signal.SIGTERM
    for flag, value in (("--warmup", "7"), ("--lr-factor", "0.5")):
        with pytest.raises(SystemExit, match=rf"{flag} .* on --resume: this run follows a "
                                             r"plan to its --max-time"):
            train_cli.main(SMALL + ["--run-dir", split, "--max-time", "1.5", "--resume",
                                    flag, value])


def _checked(*argv):
    from minitransformer.mt.options import check_options, fill_defaults, parse_args
    args = parse_args(["--data", "d", "--src-lang", "en", "--tgt-lang", "de", *argv])
    fill_defaults(args)
    check_options(args)
    return args


def test_a_planned_run_capped_below_the_default_warmup_is_not_refused():
    # the plan fits the warm-up not chosen to its N (at most 40% of it): the default 4000
    # does not stand against --max-updates 1000
    args = _checked("--max-time", "30", "--lr-schedule", "linear", "--max-updates", "1000",
                    "--preset", "tiny")
    assert args.warmup == 4000 and args.max_updates == 1000
    _checked("--max-time", "30", "--max-updates", "1000")  # (sizes itself: planned too)
    # a warm-up chosen, or no plan: the decay would start after its end, refused as before
    for argv in (["--max-time", "30", "--lr-schedule", "linear", "--max-updates", "1000",
                  "--warmup", "2000"],
                 ["--lr-schedule", "linear", "--max-updates", "1000"]):
        with pytest.raises(SystemExit, match="give --max-updates N with N > --warmup"):
            _checked(*argv)


def test_a_run_that_ends_inside_its_warmup_is_warned_about():
    from minitransformer.mt.options import schedule_warnings
    (line,) = schedule_warnings(_checked("--max-updates", "1000"))
    assert line.startswith("warning: --max-updates 1000 ends the run inside the warm-up "
                           "(--warmup 4000)") and "ends at 25% of its peak" in line
    # the advice keeps the peak: the plan's fitted warm-up (400 of 1000), the factor scaled
    assert "give --warmup 400 --lr-factor 0.316 " in line
    assert noam_lr(400, 64, 400, math.sqrt(400 / 4000)) == pytest.approx(noam_lr(4000, 64, 4000))
    assert schedule_warnings(_checked("--max-updates", "1000", "--warmup", "100")) == []
    assert schedule_warnings(_checked("--max-updates", "5000")) == []
    # sizing itself with a budget, the schedule is the plan's, its warm-up fitted: no warning
    assert schedule_warnings(_checked("--max-time", "30", "--max-updates", "1000")) == []
    # ... unless the warm-up is given: then inverse-sqrt as before, not refused, and warned
    args = _checked("--max-time", "30", "--max-updates", "1000", "--warmup", "2000")
    assert args.lr_schedule == "inverse-sqrt" and len(schedule_warnings(args)) == 1
    # a resumed run is warned only when a schedule flag is given again
    resumed = _checked("--max-updates", "1000")
    resumed.resume, resumed.explicit = True, set()
    assert schedule_warnings(resumed) == []


def test_a_chosen_warmup_that_does_not_fit_the_plan_is_warned_about():
    chosen = plan.DeadlinePlan(budget=100.0, d_model=64, warmup=4000)
    _, events = feed(chosen, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    (text, record), = events
    assert chosen.total < 4000 and "warning: the warm-up (--warmup 4000) does not fit" in text
    assert "a run started without --warmup has it fitted to the plan" in text
    fitted = plan.DeadlinePlan(budget=100.0, d_model=64, warmup=4000, warmup_share=0.12)
    _, events = feed(fitted, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    assert "warning" not in events[0][0] and fitted.warmup < fitted.total
    # a fitted warm-up that a slower machine's re-plans leave beyond N is not the user's:
    # no advice to leave out a --warmup never given
    slowed = plan.DeadlinePlan(budget=400.0, d_model=64, warmup=4000, warmup_share=0.12)
    elapsed, events = feed(slowed, 0, plan.SKIP + plan.MEASURE + 1, 0.5, 0.0)
    assert slowed.warmup < slowed.total
    _, events = feed(slowed, plan.SKIP + plan.MEASURE + 2, slowed.total, 5.0, elapsed)
    assert events and slowed.total <= slowed.warmup
    assert not any("warning" in text for text, _ in events)


def test_a_first_plan_past_a_warmup_fitted_to_the_cap_keeps_falling():
    # capped at 60: the warm-up fitted to the cap (24) is over by the first plan (~30), which
    # plans the cap: the schedule is linear_decay_lr's throughout (no climb back up)
    p = plan.DeadlinePlan(budget=10_000.0, d_model=64, warmup=4000, cap=60, warmup_share=0.12)
    feed(p, 0, plan.SKIP + plan.MEASURE + 1, 1.0, 0.0)
    assert p.total == 60 and p.warmup == 24
    factor = math.sqrt(24 / 4000)
    for step in range(1, 61):
        assert p.lr(step) == pytest.approx(linear_decay_lr(step, 64, 24, 60, factor),
                                           rel=1e-12), step


def test_a_cap_fits_the_warmup_from_the_first_update():
    # --max-updates 100 or 20, warm-up not chosen: fitted to the cap at once, so the ramp
    # goes to that warm-up's peak (no jump when the first plan comes after ~30 updates) and
    # a cap below the first plan still ends annealed
    for cap in (100, 20):
        p = plan.DeadlinePlan(budget=10_000.0, d_model=64, warmup=4000, cap=cap,
                              warmup_share=0.12)
        w = plan.fitted_warmup(cap, 4000, 0.12)
        assert p.warmup == w and p.lr(w) == pytest.approx(noam_lr(4000, 64, 4000), rel=1e-12)
        assert p.lr(cap) == 0.0
        feed(p, 0, min(cap, plan.SKIP + plan.MEASURE + 1), 1.0, 0.0)
        lrs = [p.lr(u) for u in range(1, cap + 1)]
        steps = [b - a for a, b in zip(lrs, lrs[1:])]
        assert max(abs(d) for d in steps) <= 1.01 * noam_lr(4000, 64, 4000) / w, cap


def test_a_finished_plan_is_not_extended_on_resume(tmp_path, capsys):
    run = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as mp:
        assert train(run, FakeClock(), mp) == 0
    before = open(os.path.join(run, "metrics.jsonl")).read()
    for flag, value in (("--max-time", "3.0"), ("--max-updates", "500")):
        with pytest.MonkeyPatch.context() as mp:
            with pytest.raises(SystemExit, match=rf"{flag} .* on --resume: this run has "
                                                 r"finished its plan \(\d+ updates"):
                train(run, FakeClock(), mp, "--resume", flag, value)
    assert open(os.path.join(run, "metrics.jsonl")).read() == before  # nothing appended
    # nor by turning the plan off, which also drops its schedule (the rate would jump)
    for flags in (["--max-time", "0", "--max-updates", "500"],
                  ["--lr-schedule", "inverse-sqrt", "--max-updates", "500"]):
        with pytest.MonkeyPatch.context() as mp:
            FakeClock().install(mp)
            with pytest.raises(SystemExit, match=rf"{flags[0]} .* on --resume: this run "
                                                 r"follows a plan to its --max-time \(1.5 min\)"):
                train_cli.main(SMALL + ["--run-dir", run, "--max-time", "1.5", "--resume",
                                        *flags])
    assert open(os.path.join(run, "metrics.jsonl")).read() == before
    with pytest.MonkeyPatch.context() as mp:  # resumed as it was: validated and tested again
        assert train(run, FakeClock(), mp, "--resume") == 0
    with pytest.MonkeyPatch.context() as mp:  # a cap below the updates made asks for no more
        assert train(run, FakeClock(), mp, "--resume", "--max-updates", "60") == 0


def test_a_cap_given_anew_on_resume_is_planned_for_at_once(tmp_path):
    # capped at 100, stopped at 95, resumed with --max-updates 120: re-planned at once (not at
    # the plan's next check, after the old cap's end), and the run ends annealed at 120
    run = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as mp:
        assert train(run, FakeClock(stop_at=95, slow_from=10_000), mp,
                     "--max-updates", "100", "--max-time", "5") == 128 + signal.SIGTERM
    with pytest.MonkeyPatch.context() as mp:
        assert train(run, FakeClock(slow_from=10_000), mp, "--resume", "--max-updates", "120",
                     "--max-time", "5") == 0
    lrs = {r["update"]: r["lr"] for r in records(run) if "lr" in r}
    assert max(lrs) == 120 and lrs[120] == 0.0 and all(lrs[u] > 0 for u in range(96, 120))


def test_a_time_budget_on_the_synthetic_corpus_plans_too():
    # its default --max-updates 600 is not one the user gave: --max-time plans (capped by it)
    from minitransformer.mt.options import fill_defaults, parse_args
    args = parse_args(["--max-time", "2"])
    fill_defaults(args)
    assert args.lr_schedule == "linear" and args.max_updates == 600
    args = parse_args(["--max-time", "2", "--max-updates", "600"])
    fill_defaults(args)
    assert args.lr_schedule == "inverse-sqrt"


def _no_jump(run, why):
    """The planned rates of ``run`` (metrics.jsonl, every update logged) move by at most 40%
    of the peak from one update to the next: a fall over the 3 updates a cap leaves steps a
    third of its start; the jumps this guards against were 80-97% of the peak."""
    lrs = {r["update"]: r["lr"] for r in records(run) if "lr" in r}
    updates = sorted(lrs)  # (the update a signal stopped has no log line)
    peak = max(lrs.values())
    steps = [abs(lrs[b] - lrs[a]) / (b - a) for a, b in zip(updates, updates[1:])]
    assert max(steps) <= 0.4 * peak, (why, max(steps) / peak)
    assert lrs[updates[-1]] == 0.0, why  # (annealed at its last update, and not before)
    assert all(lrs[u] > 0 for u in updates[:-1]), (why, [u for u in updates if not lrs[u]])
    return lrs


@pytest.mark.parametrize("minutes", ["1.5", "1.0", "0.95"])
def test_the_first_plan_shortens_the_warmup_without_a_jump(tmp_path, minutes):
    # warm-up not chosen (the synthetic corpus's default 300): the first plan fits it to the
    # plan; the rate climbs from where noam's ramp had it, no faster than the fitted warm-up
    # (at 1.0 minute the fitted one, 32 updates, is one update ahead: 9.7x in one step before)
    run = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as mp:
        FakeClock().install(mp)
        flags = [f for f in SMALL if f not in ("--warmup", "50")]
        assert train_cli.main(flags + ["--run-dir", run, "--max-time", minutes]) == 0
    lrs = _no_jump(run, "first plan")
    top = max(lrs, key=lrs.get)
    assert 31 < top < 80 and all(lrs[u] < lrs[u + 1] for u in range(1, top))


@pytest.mark.parametrize("first_cap, stop, new_cap", [(20, 10, 40), (0, 20, 25), (0, 20, 60),
                                                      (20, 10, 0)])
def test_a_cap_given_on_resume_before_the_first_plan_ends_the_schedule(tmp_path, first_cap,
                                                                       stop, new_cap):
    # stopped before the first plan (~30 updates), resumed with another --max-updates: the
    # schedule ends at it (lr 0 at its last update), from the rate the run had
    run = str(tmp_path / "run")
    flags = [f for f in SMALL if f not in ("--warmup", "50")]
    with pytest.MonkeyPatch.context() as mp:
        FakeClock(stop_at=stop).install(mp)
        assert train_cli.main(flags + ["--run-dir", run, "--max-time", "1.5", "--max-updates",
                                       str(first_cap)]) == 128 + signal.SIGTERM
    with pytest.MonkeyPatch.context() as mp:
        FakeClock().install(mp)
        assert train_cli.main(flags + ["--run-dir", run, "--max-time", "1.5", "--resume",
                                       "--max-updates", str(new_cap)]) == 0
    lrs = _no_jump(run, (first_cap, stop, new_cap))
    assert max(lrs) == new_cap or not new_cap


def test_resuming_without_a_plan_keeps_its_schedule(tmp_path):
    # a fixed-length linear run (no --max-time) resumed with a time budget: the checkpoint
    # has no plan; its warm-up (chosen or not) is kept, so the rate goes on as it was
    run = str(tmp_path / "run")
    flags = [f for f in SMALL if f not in ("--warmup", "50")] + ["--run-dir", run,
                                                                  "--max-updates", "400"]
    with pytest.MonkeyPatch.context() as mp:
        FakeClock(stop_at=45).install(mp)
        assert train_cli.main(flags) == 128 + signal.SIGTERM
    with pytest.MonkeyPatch.context() as mp:
        FakeClock().install(mp)
        assert train_cli.main(flags + ["--resume", "--max-time", "5"]) == 0
    lrs = _no_jump(run, "linear, then planned")
    for u in sorted(set(lrs) & set(range(1, 60))):  # to the first plan after the resume
        assert lrs[u] == pytest.approx(linear_decay_lr(u, 32, 300, 400), rel=1e-12), u


def test_what_would_stop_a_plan_unannealed_or_swap_a_schedule_is_refused(tmp_path):
    run = str(tmp_path / "run")
    with pytest.MonkeyPatch.context() as mp:
        assert train(run, FakeClock(stop_at=60), mp) == 128 + signal.SIGTERM
    before = open(os.path.join(run, "metrics.jsonl")).read()
    for flags, words in ((["--max-updates", "55"], "has made 60 updates"),
                         (["--max-updates", "60"], "has made 60 updates"),
                         (["--max-time", "0.2"], "would stop it where it stands"),
                         (["--lr-schedule", "inverse-sqrt"], "cannot be swapped")):
        with pytest.MonkeyPatch.context() as mp:
            with pytest.raises(SystemExit, match=words):
                train(run, FakeClock(), mp, "--resume", *flags)
    assert open(os.path.join(run, "metrics.jsonl")).read() == before
    # the other way too: an inverse-sqrt run is not switched to the linear schedule
    other = str(tmp_path / "other")
    flags = [f for f in SMALL if f not in ("--lr-schedule", "linear")] + ["--run-dir", other]
    with pytest.MonkeyPatch.context() as mp:
        FakeClock(stop_at=10).install(mp)
        assert train_cli.main(flags + ["--max-updates", "100"]) == 128 + signal.SIGTERM
    with pytest.raises(SystemExit, match="follows --lr-schedule inverse-sqrt, and its "
                                         "schedule cannot be swapped"):
        train_cli.main(flags + ["--resume", "--lr-schedule", "linear", "--max-time", "1"])


def test_a_plan_capped_before_its_first_plan_is_finished_too(tmp_path):
    # capped at 20 (warm-up not chosen): the run ends annealed before the ~30 updates its
    # first plan waits for; more updates on --resume are refused as for any finished plan
    # (it trained at lr 0), and a smaller budget on a finished plan asks for nothing more
    run, other = str(tmp_path / "run"), str(tmp_path / "other")
    flags = [f for f in SMALL if f not in ("--warmup", "50")]
    with pytest.MonkeyPatch.context() as mp:
        FakeClock().install(mp)
        assert train_cli.main(flags + ["--run-dir", run, "--max-time", "1.5",
                                       "--max-updates", "20"]) == 0
    for extra in (["--max-updates", "40"], ["--max-updates", "0"], ["--max-time", "3"]):
        with pytest.MonkeyPatch.context() as mp:
            FakeClock().install(mp)
            with pytest.raises(SystemExit, match="this run has finished its plan"):
                train_cli.main(flags + ["--run-dir", run, "--max-time", "1.5", "--max-updates",
                                        "20", "--resume", *extra])
    with pytest.MonkeyPatch.context() as mp:
        assert train(other, FakeClock(), mp) == 0
    with pytest.MonkeyPatch.context() as mp:
        assert train(other, FakeClock(), mp, "--resume", "--max-time", "0.5") == 0


def test_a_linear_run_given_a_budget_and_no_cap_on_resume_goes_on_from_its_rate(tmp_path):
    # no plan in its checkpoint (no --max-time): given one and --max-updates 0 on --resume,
    # its own schedule goes on until the first plan (it jumped back to its peak, 2x, before)
    run = str(tmp_path / "run")
    flags = SMALL + ["--run-dir", run]
    with pytest.MonkeyPatch.context() as mp:
        FakeClock(stop_at=75, slow_from=10**9).install(mp)
        assert train_cli.main(flags + ["--max-updates", "100"]) == 128 + signal.SIGTERM
    with pytest.MonkeyPatch.context() as mp:
        FakeClock(slow_from=10**9).install(mp)
        assert train_cli.main(flags + ["--max-updates", "0", "--max-time", "1.5",
                                       "--resume"]) == 0
    lrs = _no_jump(run, "linear, then planned without a cap")
    assert lrs[76] <= lrs[74]  # (held where it was, not back at the peak)


def test_a_budget_that_ends_before_the_first_plan_says_the_rate_never_decayed(
        tmp_path, capsys, monkeypatch):
    """--max-time 0.1 min at 0.5 s an update: 12 updates, fewer than the first plan
    measures; the run ends where the rate stands, and says so and what to give (it said
    nothing, and the rate was near its peak)."""
    run, clock = str(tmp_path / "run"), FakeClock()
    clock.install(monkeypatch)
    assert train_cli.main(SMALL + ["--run-dir", run, "--max-time", "0.1"]) == 0
    out = capsys.readouterr().out
    rate = [r["lr"] for r in records(run) if "lr" in r][-1]
    assert rate > 0
    assert ("warning: --max-time 0.1 min ended after 12 updates (0.5 s each), before the 30 "
            "the plan measures first, so the learning rate was never decayed") in out
    assert "reached --max-time 0.1 min" in out
