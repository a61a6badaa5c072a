"""How many drafts per sequence a step should verify, chosen from what steps with each choice measured.

Whether speculation pays is a ratio of two measurements, not a model: the tokens a step yields (1 per sequence
plus the accepted drafts: the acceptance) over the seconds it takes (the target's verify pass over B (k + 1)
rows plus the drafter's k passes). Both move with things a formula gets wrong on this CPU: the int8-dot GEMV
costs ~2.7x at 4 rows what it costs at 1 (single thread, Q4_K; `python -m carpool.bench.gemv --rows 1 2 4`),
not the ~1x of a bandwidth-bound step; n-gram lookup proposes nothing for many sequences; a draft model's pass
costs what its size says. So the policy keeps, per batch-size bucket (1, 2, 3-4, 5-8, ..., 33-64, 65+) and per
k in 0..max_k, a running mean of the output tokens per second of decode steps run with that k, and picks the
best; k = 0 (plain decoding) wins unless speculation measured better by MARGIN. That is what switches it off at
large batches: there a verify pass costs its rows' full price and the measured rate of k > 0 falls below plain.

Exploration: a bucket first measures k = 0, 1, 2, ... (MIN_SAMPLES steps each), going on to k + 1 only while
k measured better than k - 1, so a compute-bound bucket pays MIN_SAMPLES steps of k = 1 and no more; after that
the neighbours of the best k are re-measured one step at a time every REFRESH steps of the bucket, so a change
in workload (acceptance) or load moves the choice, at a cost of ~1 step in REFRESH. Plain decoding, what every k
is judged against, is re-measured every BASELINE_REFRESH steps while the best k is above 0: as a mere neighbour
it went stale (`carpool bench spec`, SmolLM2, 32 streams: k = 0 kept the 539 tok/s measured on the long-context
documents workload while chat decoded plainly at 821, so k = 2 stayed on through the chat run at 0.82x plain).
"""

MIN_SAMPLES = 3  # steps per (bucket, k) before its mean counts: one step on a shared machine is noise
REFRESH = 100  # steps of a bucket between re-measuring the best k's neighbours
BASELINE_REFRESH = 20  # steps of a bucket between re-measuring k = 0 while speculating (one plain step in 20)
DECAY = 0.8  # weight of the old mean at each new step: recent steps dominate, one outlier fades in a few


def bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share a bucket: one step shape's cost stands for its neighbours'."""
    return max(0, (batch_size - 1).bit_length())


class Rate:
    """Output tokens per second of one (bucket, k): an exponentially weighted mean over its steps."""

    def __init__(self):
        self.tokens = self.seconds = 0.0
        self.samples = 0
        self.last_step = 0  # the bucket's step count when this was last measured

    def observe(self, tokens: int, seconds: float, step: int) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.samples += 1
        self.last_step = step

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpeculationPolicy:
    MARGIN = 1.05  # speculation must measure 5% more tokens per second than plain decoding

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.rates: dict[int, list[Rate]] = {}  # bucket -> a Rate per k in 0..max_k
        self.steps: dict[int, int] = {}  # bucket -> decode steps observed

    def num_drafts(self, batch_size: int) -> int:
        if batch_size == 0 or self.max_k == 0:
            return 0
        b = bucket(batch_size)
        rates, step = self._rates(b), self.steps.get(b, 0)
        for k, rate in enumerate(rates):
            if rate.samples < MIN_SAMPLES:
                return k
            if k and rate.value <= rates[k - 1].value:
                break  # more drafts measured worse: larger k are not tried
        best = self.best(batch_size)
        if best and step - rates[0].last_step >= BASELINE_REFRESH:
            return 0
        stale = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k and step - rates[k].last_step >= REFRESH]
        return stale[0] if stale else best

    def best(self, batch_size: int) -> int:
        """The k with the best measured rate in this batch size's bucket (0 unless one beats plain by MARGIN)."""
        rates = self._rates(bucket(batch_size))
        measured = [k for k in range(1, self.max_k + 1) if rates[k].samples >= MIN_SAMPLES]
        k = max(measured, key=lambda k: rates[k].value, default=0)
        return k if k and rates[k].value > rates[0].value * self.MARGIN else 0

    def observe(self, batch_size: int, k: int, tokens: int, seconds: float) -> None:
        """A decode step of batch_size sequences, verifying up to k drafts each, yielded tokens in seconds (the
        drafter's time included)."""
        b = bucket(batch_size)
        self.steps[b] = self.steps.get(b, 0) + 1
        self._rates(b)[min(k, self.max_k)].observe(tokens, seconds, self.steps[b])

    def measured(self) -> dict[str, dict[int, float]]:
        """Per bucket (its batch sizes, e.g. "5-8"), the measured tok/s of each k tried enough."""
        return {
            f"{2 ** (b - 1) + 1 if b else 1}-{2**b}": {
                k: round(rate.value, 2) for k, rate in enumerate(rates) if rate.samples >= MIN_SAMPLES
            }
            for b, rates in sorted(self.rates.items())
        }

    def _rates(self, b: int) -> list[Rate]:
        return self.rates.setdefault(b, [Rate() for _ in range(self.max_k + 1)])
