"""kimi-run without --threads: the decode steps' time chooses between all cores and one
(runtime/threadtune.py), on a simulated machine whose second core another program may take."""

from __future__ import annotations

from kimistream.runtime.threadtune import ThreadTuner


class Machine:
    """Step times in ms by thread count, while the other core is free or busy (measured shapes: two
    threads 12.7 against one 21.5 when free, 30 against 21.5 when busy), with a little jitter."""

    def __init__(self, busy=False):
        self.threads, self.busy, self.n, self.waited = 2, busy, 0, 0.0
        self.calls = []

    def set_threads(self, n):
        self.threads = n
        self.calls.append(n)

    def step(self):
        """One step's seconds; the calls' waiting for the other thread's jobs adds up in `waited` (as
        measured: about 1 % of a step idle, 18 % with the other core busy)."""
        self.n += 1
        base = {(2, False): 12.7, (1, False): 21.5, (2, True): 30.0, (1, True): 21.5}[(self.threads, self.busy)]
        seconds = (base + (0.4 if self.n % 3 == 0 else 0.0)) / 1e3
        if self.threads > 1:
            self.waited += seconds * (0.18 if self.busy else 0.01)
        return seconds


def run(tuner, machine, steps):
    for _ in range(steps):
        tuner.observe_step(machine.step())


def test_a_free_machine_is_never_timed_on_one_thread():
    m = Machine()
    t = ThreadTuner(2, m.set_threads, lambda: m.waited)
    run(t, m, 300)
    assert m.calls == [] and t.current == 2 and t.trials == 0
    assert t.policy == "2 (auto: steady, no trial needed)"


def test_a_busy_core_moves_decode_to_one_thread_and_back_when_it_frees():
    m = Machine()
    t = ThreadTuner(2, m.set_threads, lambda: m.waited, recheck=40)
    run(t, m, 30)
    m.busy = True
    run(t, m, 6)
    assert t.policy == "2 (auto: timing 1 thread when the run ended)" and m.threads == 1
    run(t, m, 24)
    assert t.current == 1 and m.threads == 1 and t.switches == 1
    assert t.policy.startswith("1 (auto: 1 thread timed at 21.")
    run(t, m, 100)                          # still busy: rechecks of two threads lose, one thread stays
    assert t.current == 1 and m.threads == 1 and t.trials >= 2
    m.busy = False
    run(t, m, 60)
    assert t.current == 2 and m.threads == 2 and t.switches == 2


def test_a_one_core_machine_has_nothing_to_choose():
    m = Machine()
    t = ThreadTuner(1, m.set_threads)
    run(t, m, 50)
    assert m.calls == [] and t.policy == "1"


def test_a_core_taken_from_the_start_shows_in_the_waiting():
    """Every step on two threads is slow from the first: no slowdown against the best seen, but the
    calls wait for the preempted thread's jobs, and that starts the trial."""
    m = Machine(busy=True)
    t = ThreadTuner(2, m.set_threads, lambda: m.waited)
    run(t, m, 20)
    assert t.current == 1 and m.threads == 1
    m2 = Machine(busy=True)
    t2 = ThreadTuner(2, m2.set_threads)           # without the waiting measure it would not notice
    run(t2, m2, 20)
    assert t2.current == 2 and t2.trials == 0


def through_telemetry(monkeypatch, steps):
    """Decode steps of a two-thread Machine through kimi-run's telemetry, which hands them to a tuner:
    each step (io_wait, extra, faults[, read_faults]) adds a wait on expert reads, compute spent on the
    disk and major faults (of which read_faults the pager's own reads took) to the machine's own step.
    Returns the tuner and each step's wall time."""
    from types import SimpleNamespace

    from kimistream.runtime import telemetry
    from kimistream.runtime.pager import PagerStats

    class Pager:
        def __init__(self):
            self.stats = PagerStats()

        def observe_step(self, seconds, scored=True):
            pass

    clock, faults, walls = [0.0], [0], []
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(telemetry.resource, "getrusage", lambda who: SimpleNamespace(ru_majflt=faults[0]))
    m, pager = Machine(), Pager()
    tuner = ThreadTuner(2, m.set_threads, lambda: m.waited)
    tel = telemetry.Telemetry(pager, tuner=tuner)
    for io_wait, extra, n, *own in steps:
        walls.append(m.step() + io_wait + extra)
        pager.stats.io_wait_s += io_wait
        pager.stats.read_faults += own[0] if own else 0
        faults[0] += n
        clock[0] += walls[-1]
        tel.record("decode", 1)
    return tuner, walls


def trials_by_time(walls):
    tuner = ThreadTuner(2, lambda n: None)
    for w in walls:
        tuner.observe_step(w)
    return tuner.trials


def test_the_wait_on_expert_reads_is_not_timed(monkeypatch):
    """Under a memory cap most of a decode step is the wait on expert reads, which swings with the
    disk whatever the thread count. kimi-run's telemetry hands the tuner each step's compute (wall
    less that wait): a disk that turns from 5 to 40 ms of reads a step around the same 12.7 ms of
    compute on two threads starts no trial, while the wall times alone would have (past 1.35 times
    the best)."""
    tuner, walls = through_telemetry(monkeypatch, [(w, 0.0, 0) for w in ([0.005] * 20 + [0.040] * 20) * 3])
    assert tuner.trials == 0 and tuner.current == 2
    assert trials_by_time(walls) >= 1


def test_steps_that_faulted_experts_in_are_not_timed(monkeypatch):
    """A step whose computation faulted mapped experts in from the disk (major faults: a mapping under
    a memory cap, while --page-cache auto measures) spent its compute waiting on the disk: kimi-run's
    telemetry passes it over, so compute that swings from 13 to 58 ms with the faults starts no trial,
    while the same steps timed would have."""
    steps = [(0.0, 0.045 if i % 2 else 0.0, 20) if i % 3 == 0 or i > 30 else (0.0, 0.0, 0) for i in range(60)]
    tuner, walls = through_telemetry(monkeypatch, steps)
    assert tuner.trials == 0 and tuner.current == 2
    assert trials_by_time(walls) >= 1


def test_faults_of_the_pagers_own_reads_do_not_hide_a_step(monkeypatch):
    """The process's major faults include those of the pager's own reads (MADV_POPULATE_READ of a
    mapped expert on a miss, hashing it ahead on a read thread), whose time is already the wait on
    reads: a step whose faults are all the pager's is timed. So under a cap, where nearly every step
    misses, a core taken away still shows: compute that turns 2.4x slower starts a trial (it would
    not if those steps were passed over)."""
    steps = [(0.004, 0.0 if i < 20 else 0.018, 250, 250) for i in range(40)]
    tuner, _ = through_telemetry(monkeypatch, steps)
    assert tuner.trials >= 1
    steps = [(0.004, 0.0 if i < 20 else 0.018, 250, 200) for i in range(40)]      # 50 of them the computation's
    tuner, _ = through_telemetry(monkeypatch, steps)
    assert tuner.trials == 0


def test_a_trial_whose_steps_cannot_be_timed_gives_up():
    """A trial of one thread that then meets only steps it cannot score (their computation faulted
    experts in) goes back to the setting it left after 4 windows of them, instead of keeping one
    thread for the rest of the run."""
    m = Machine()
    t = ThreadTuner(2, m.set_threads, lambda: m.waited)
    run(t, m, 30)
    m.busy = True
    run(t, m, 6)
    assert t.trial is not None and m.threads == 1
    for _ in range(4 * t.window - 1):
        t.observe_step(m.step(), scored=False)
    assert t.trial is not None
    t.observe_step(m.step(), scored=False)
    assert t.trial is None and t.current == 2 and m.threads == 2 and t.switches == 0
    assert t.policy.startswith("2 (auto: a trial of 1 thread given up")


def test_no_thread_trial_while_io_auto_times_o_direct_against_the_mapping(monkeypatch):
    """Telemetry keeps the tuner's steps out while --io auto's trial runs (its switches move a step's
    compute: before, a jump there set off a one-thread trial), and the tuner starts afresh after it."""
    from types import SimpleNamespace

    from kimistream.runtime import pager as P
    from kimistream.runtime import telemetry as T
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    trial = P.IoTrial()
    pager = SimpleNamespace(stats=P.PagerStats(), io_trial=trial, observe_step=lambda s, scored=True: trial.observe(s, scored))
    calls = []
    tuner = ThreadTuner(2, calls.append, window=2)
    tel = T.Telemetry(pager, tuner=tuner)

    def step(seconds):
        clock[0] += seconds
        tel.record("decode", 1)
    for _ in range(3):
        step(0.010)
    assert tuner.best is None and not calls        # the trial's settling steps: not the tuner's
    while trial.running:
        step(0.030 if not trial.direct else 0.010)  # the mapped windows three times slower
    assert not calls and tuner.trials == 0
    for _ in range(3):
        step(0.012)
    assert tuner.best is not None and not calls     # timed afresh after the trial: no jump to act on
