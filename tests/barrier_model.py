"""A model of mbarrier protocols for the Mosaic GPU kernels' CPU tests: each warpgroup's barrier operations, in its
kernel's order, run in random interleavings with loads landing late, so a deadlock (a GPU hang) or a wait passing on
the wrong phase fails on CPU. A warpgroup's 128 arrivals are one arrival here."""


class Barrier:
    """An mbarrier: `count` arrivals complete a phase; records which step each completed phase carried."""

    def __init__(self, count):
        self.count, self.arrived, self.completed, self.steps, self.phase_steps = count, 0, 0, [], []

    def arrive(self, step):
        self.arrived += 1
        self.steps.append(step)
        if self.arrived == self.count:
            assert len(set(self.steps)) == 1, f"one phase completed by arrivals for different steps {self.steps}"
            self.phase_steps.append(self.steps[0])
            self.arrived, self.steps = 0, []
            self.completed += 1


def run_protocol(threads, barriers, rng):
    """Runs straight-line barrier programs in a random interleaving, loads landing at random later times. A wait
    passes as mbarrier.try_wait.parity does (the barrier's current phase parity differs from the one waited on).
    Raises on a deadlock (a GPU hang), a wait that passes before its phase completed, or one whose phase carried
    another step's tile. Ops: ("load", barrier, step), ("arrive", barrier, step), ("wait", barrier, parity, step):
    parity None for Pallas' barriers (a per-thread phase bit that each wait flips); an explicit parity on a barrier
    that loads complete must be that of the phase carrying the step's load, and on one that arrivals complete the
    wait takes the latest completed phase, which must carry the step (a fresh barrier's wait on parity 1, which
    passes at once on the GPU, is an error here: the kernels never rely on it)."""
    pcs, tracked, pending, loaded = dict.fromkeys(threads, 0), {}, [], {}

    def parity_of(thread, op):
        return tracked.get((thread, op[1]), 0) % 2 if op[2] is None else op[2]

    while True:
        ready = []
        for thread, ops in threads.items():
            if pcs[thread] < len(ops):
                op = ops[pcs[thread]]
                if op[0] != "wait" or barriers[op[1]].completed % 2 != parity_of(thread, op):
                    ready.append(thread)
        if not ready and not pending:
            stuck = {t: ops[pcs[t]] for t, ops in threads.items() if pcs[t] < len(ops)}
            assert not stuck, f"deadlock (a hang on the GPU): {stuck}"
            return
        pick = rng.randrange(len(ready) + len(pending))
        if pick >= len(ready):
            name, step = pending.pop(pick - len(ready))
            barriers[name].arrive(step)
            continue
        thread = ready[pick]
        op = threads[thread][pcs[thread]]
        pcs[thread] += 1
        if op[0] == "load":
            loaded.setdefault(op[1], []).append(op[2])
            pending.append(op[1:])
        elif op[0] == "arrive":
            barriers[op[1]].arrive(op[2])
        else:
            _, name, parity, step = op
            if parity is None:
                phase = tracked.get((thread, name), 0)
                tracked[(thread, name)] = phase + 1
            elif name in loaded:  # a cp.async barrier: the kernel's parity must be that of the phase carrying this step's tile
                assert step in loaded[name], f"{thread}'s wait on {name} passed before step {step} was loaded"
                phase = loaded[name].index(step)
                assert parity == phase % 2, f"{thread} waits parity {parity} for step {step}, its phase is {phase}"
            else:  # arrivals complete it: the wait passed on its latest completed phase
                phase = barriers[name].completed - 1
                assert phase >= 0, f"{thread}'s wait on {name} (step {step}) passed on the barrier's initial phase"
            barrier = barriers[name]
            assert barrier.completed > phase, f"{thread}'s wait on {name} (step {step}) passed before its phase"
            if step is not None:
                assert barrier.phase_steps[phase] == step, f"{thread} waited {name} for step {step}, got another tile"
