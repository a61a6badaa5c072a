"""How many drafts per sequence a step should verify, chosen from what steps with each choice measured.

Whether speculation pays is a ratio of two measurements, not a model: the tokens a step yields (1 per sequence
plus the accepted drafts: the acceptance) over the seconds it takes (the target's verify pass over B (k + 1)
rows plus the drafter's k passes). Both move with things a formula gets wrong on this CPU: the int8-dot GEMV
costs ~2.7x at 4 rows what it costs at 1 (single thread, Q4_K; `python -m carpool.bench.gemv --rows 1 2 4`),
not the ~1x of a bandwidth-bound step; n-gram lookup proposes nothing for many sequences; a draft model's pass
costs what its size says. So the policy measures, per batch-size bucket (1, 2, 3-4, 5-8, ..., 33-64, 65+), how
each k in 0..max_k does against the bucket's current choice (the incumbent) and keeps the best; k > 0 replaces
plain decoding only when it measured MARGIN more output tokens per second. That is what switches speculation
off at large batches: there a verify pass costs its rows' full price.

Every comparison is paired: a step with another k (a probe) is judged against the incumbent's steps right
around it at the probe's batch size (IncumbentWindow), never against a rate remembered from other steps. The
policy before this one remembered a rate per k, which compared steps of other batch sizes and workloads: a
bucket spans 2x in batch size (SmolLM2's plain decoding: ~680 tok/s at 17 sequences, ~820 at 32, estimated
from the 8- and 32-stream rows of `carpool bench spec`), and plain steps measured on the long-context documents
workload (539 tok/s) stood for chat's (821): `carpool bench spec`, SmolLM2, 32 streams, chat at 0.82x plain,
0.90x once plain decoding was re-measured every 20 steps. On the fake
clock of tests/engine/test_spec_policy.py (documents at 17-20 sequences where speculation gains ~25%, chat at
28-32 where it loses ~20%, alternating) remembered rates gave chat 0.84x plain, paired probes >= 0.97x.

Exploration: a bucket starts at k = 0 and probes k = 1, every other step, MIN_SAMPLES times; while the newest k
wins it goes on to k + 1, so a compute-bound bucket pays MIN_SAMPLES single steps of k = 1. After that the
neighbours of the best k are probed one step every REFRESH steps of the bucket, plain decoding every
BASELINE_REFRESH steps while the best k is above 0 (a probe that disagrees with the choice is repeated at once),
and all of them as soon as the incumbent's step time moves by SHIFT for two steps in a row (other contexts,
another load): the old probes then weigh little, and when plain decoding wins, exploration starts over.
"""

MIN_SAMPLES = 3  # probes of a k before its ratio counts: one step on a shared machine is noise
REFRESH = 100  # steps of a bucket between probing the best k's neighbours
BASELINE_REFRESH = 20  # steps of a bucket between probing k = 0 while speculating (one plain step in 20)
DECAY = 0.8  # weight of a k's old probes at each new one: recent probes dominate, one outlier fades in a few
INCUMBENT_DECAY = 0.8  # weight of the incumbent's older steps at each step: a window of ~5 steps around a probe
SHIFT = 0.25  # incumbent steps this much slower or faster than their window predicts: re-probe its neighbours now
SHIFT_WEIGHT = 0.2  # what a k's probes before such a shift weigh against its next one
INCUMBENT_GAP = 8  # steps of other buckets after which the incumbent's window is stale and starts afresh


def bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share a bucket: one step shape's cost stands for its neighbours'."""
    return max(0, (batch_size - 1).bit_length())


class Ratio:
    """One k's output tok/s over plain decoding's in a bucket: decayed sums of the tokens its probes yielded
    and of the tokens plain decoding would have yielded in the same seconds."""

    def __init__(self):
        self.tokens = self.plain_tokens = 0.0
        self.samples = 0
        self.last_step = -REFRESH  # the bucket's step count when this k was last probed (never: long ago)
        self.recheck = False  # the latest probe disagreed with the bucket's choice: probe again soon

    def observe(self, tokens: float, plain_tokens: float, step: int) -> None:
        # Old probes fade by DECAY per BASELINE_REFRESH steps of the bucket: a probe after a long gap (a neighbour
        # re-measured every REFRESH steps) counts mostly on its own instead of beside probes of another workload.
        decay = DECAY ** max(1.0, (step - self.last_step) / BASELINE_REFRESH) if self.samples else 0.0
        self.tokens = self.tokens * decay + tokens
        self.plain_tokens = self.plain_tokens * decay + plain_tokens
        self.samples += 1
        self.last_step = step

    @property
    def value(self) -> float:
        return self.tokens / self.plain_tokens if self.plain_tokens > 0 else 0.0


class IncumbentWindow:
    """The incumbent's last few steps (decayed by INCUMBENT_DECAY): its step seconds as a straight line in the
    batch size and its tokens per sequence, so a probe is judged against the incumbent at the probe's own batch
    size. Within a bucket that matters: SmolLM2's plain decoding, ~680 tok/s at 17 sequences, ~820 at 32."""

    def __init__(self):
        self.weight = self.sizes = self.sizes_squared = self.seconds = self.sizes_seconds = self.tokens = 0.0
        self.steps = 0

    def add(self, batch_size: int, tokens: float, seconds: float) -> None:
        d = INCUMBENT_DECAY
        self.weight = self.weight * d + 1
        self.sizes = self.sizes * d + batch_size
        self.sizes_squared = self.sizes_squared * d + batch_size**2
        self.seconds = self.seconds * d + seconds
        self.sizes_seconds = self.sizes_seconds * d + batch_size * seconds
        self.tokens = self.tokens * d + tokens
        self.steps += 1

    def step_seconds(self, batch_size: int) -> float:
        """The incumbent's step time at this batch size: the window's straight line (flat where the sizes agree)."""
        mean_size, mean_seconds = self.sizes / self.weight, self.seconds / self.weight
        spread = self.sizes_squared / self.weight - mean_size**2
        slope = (self.sizes_seconds / self.weight - mean_size * mean_seconds) / spread if spread > 0.25 else 0.0
        return max(mean_seconds + slope * (batch_size - mean_size), 1e-9)

    def tokens_in(self, batch_size: int, seconds: float) -> float:
        """The tokens the incumbent would have yielded in `seconds` at this batch size."""
        return self.tokens / self.sizes * batch_size * seconds / self.step_seconds(batch_size)


class Bucket:
    def __init__(self, max_k: int):
        self.best = 0  # the incumbent: the k most steps run
        self.ratios = [Ratio() for _ in range(max_k + 1)]  # ratios[0] only dates plain decoding's probes
        self.ratios[0].tokens = self.ratios[0].plain_tokens = 1.0
        self.steps = 0
        self.window = IncumbentWindow()
        self.last_incumbent = -1  # the policy's step count at the incumbent's latest step
        # (1 or -1, batch size, tokens, seconds): the incumbent's latest step took SHIFT longer / shorter than its
        # window predicted; kept out of the window unless the next step confirms it
        self.outlier: tuple | None = None
        self.probe: tuple | None = None  # (k, batch size, tokens, seconds, policy step) awaiting an incumbent step


class SpeculationPolicy:
    MARGIN = 1.05  # speculation must measure 5% more tokens per second than plain decoding

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.buckets: dict[int, Bucket] = {}
        self.step = 0  # decode steps observed, all buckets

    def num_drafts(self, batch_size: int) -> int:
        if batch_size == 0 or self.max_k == 0:
            return 0
        b = self._bucket(bucket(batch_size))
        probe = self._due_probe(b)
        # Probe only right after incumbent steps, so the probe's neighbours ran at about its batch size.
        return probe if probe is not None and b.last_incumbent == self.step and b.window.steps >= 2 else b.best

    def best(self, batch_size: int) -> int:
        """The k this batch size's bucket runs (0 unless one beat plain decoding by MARGIN)."""
        return self._bucket(bucket(batch_size)).best

    def observe(self, batch_size: int, k: int, tokens: int, seconds: float) -> None:
        """A decode step of batch_size sequences, verifying up to k drafts each, yielded tokens in seconds (the
        drafter's time included)."""
        if seconds <= 0:
            return
        self.step += 1
        b = self._bucket(bucket(batch_size))
        b.steps += 1
        k = min(k, self.max_k)
        if k != b.best:
            b.probe = (k, batch_size, tokens, seconds, self.step)  # an earlier probe with no incumbent step after it
            return  # is dropped
        if self.step - b.last_incumbent > INCUMBENT_GAP:
            b.window = IncumbentWindow()
        deviation = seconds / b.window.step_seconds(batch_size) - 1 if b.window.steps >= 2 else 0.0
        moved = (deviation > SHIFT) - (deviation < -SHIFT)
        if moved and b.outlier and b.outlier[0] == moved:  # two steps in a row: the step time moved
            self._shifted(b)
            b.window.add(*b.outlier[1:])
            moved = 0
        b.outlier = (moved, batch_size, tokens, seconds) if moved else None
        if not moved:  # a lone outlier (one slow step on a shared machine) stays out of the window
            b.window.add(batch_size, tokens, seconds)
        b.last_incumbent = self.step
        if b.probe:
            probe, b.probe = b.probe, None
            if probe[-1] == self.step - 1:
                self._settle(b, *probe[:-1])

    def measured(self) -> dict[str, dict]:
        """Per bucket (its batch sizes, e.g. "5-8"): the k it runs, and each k's tok/s over plain decoding's
        (k's probed MIN_SAMPLES times)."""
        return {
            f"{2 ** (i - 1) + 1 if i else 1}-{2**i}": {
                "best": b.best,
                "vs_plain": {
                    k: round(r.value, 3) for k, r in enumerate(b.ratios) if k == 0 or r.samples >= MIN_SAMPLES
                },
            }
            for i, b in sorted(self.buckets.items())
        }

    def _due_probe(self, b: Bucket) -> int | None:
        up = b.best + 1
        if up <= self.max_k and b.ratios[up].samples < MIN_SAMPLES:
            return up  # exploring: the best k won, so the next one up may win too
        neighbours = dict.fromkeys((0 if b.best else -1, b.best - 1, up))  # plain decoding first
        due = [
            k
            for k in neighbours
            if 0 <= k <= self.max_k
            and k != b.best
            and (b.ratios[k].recheck or b.steps - b.ratios[k].last_step >= (BASELINE_REFRESH if k == 0 else REFRESH))
        ]
        return due[0] if due else None

    def _settle(self, b: Bucket, k: int, batch_size: int, tokens: float, seconds: float) -> None:
        """A probe of k ran between incumbent steps: compare its tokens with what the incumbent would have yielded
        in its seconds at its batch size, as a ratio to plain decoding."""
        incumbent_tokens = b.window.tokens_in(batch_size, seconds)
        incumbent = b.ratios[b.best]
        if k == 0:  # plain decoding probed while speculating: the incumbent's own ratio to plain
            incumbent.observe(incumbent_tokens, tokens, b.steps)
            b.ratios[0].last_step = b.steps
            b.ratios[0].recheck = incumbent_tokens <= tokens * self.MARGIN
            if incumbent.value <= self.MARGIN:
                # Speculation stopped paying (a new workload, a busier machine): every k's ratio was measured
                # under what changed, so exploration starts over from plain decoding.
                b.ratios[1:] = [Ratio() for _ in b.ratios[1:]]
                self._switch(b, 0)
            return
        ratio = b.ratios[k]
        ratio.observe(tokens * incumbent.value, incumbent_tokens, b.steps)
        ratio.recheck = tokens > incumbent_tokens * (1 if b.best else self.MARGIN)
        if ratio.samples >= MIN_SAMPLES and ratio.value > max(self.MARGIN, incumbent.value if b.best else 0.0):
            self._switch(b, k)

    def _shifted(self, b: Bucket) -> None:
        """The incumbent's step time moved (other contexts, another load): what was measured before counts little
        and the incumbent's neighbours, plain decoding first, are probed again now."""
        b.window = IncumbentWindow()
        for k, ratio in enumerate(b.ratios):
            ratio.tokens, ratio.plain_tokens = ratio.tokens * SHIFT_WEIGHT, ratio.plain_tokens * SHIFT_WEIGHT
            ratio.recheck = k in (0 if b.best else -1, b.best - 1, b.best + 1) and k != b.best

    @staticmethod
    def _switch(b: Bucket, k: int) -> None:
        b.best, b.window = k, IncumbentWindow()  # the new incumbent's window starts empty

    def _bucket(self, i: int) -> Bucket:
        return self.buckets.setdefault(i, Bucket(self.max_k))
