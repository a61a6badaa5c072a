"""How many drafts per sequence a step should verify, from the batch size and the measured acceptance rate.

Verifying k drafts for each of B decoding sequences makes the target compute B (k + 1) tokens in one pass and
yields B (1 - a^(k+1)) / (1 - a) tokens on average (a: a draft's acceptance probability; Leviathan et al.).
Decode is bandwidth-bound at small B, so the extra tokens are nearly free; as B grows the step turns
compute-bound and they cost their full price. The step's time is measured, not assumed: a line
seconds = fixed + per_token * tokens fitted over recent decode steps, plain and verifying (their mix supplies
the slope; once the policy stops speculating, those points fade and speculation is tried again), plus the
drafter's own time per pass. The policy picks the k with the best expected tokens per second, and 0 unless
speculation beats plain decoding by a margin, so a large batch decodes as it would without speculation.
"""


class LinearCost:
    """seconds ~ fixed + per_token * tokens, by exponentially weighted least squares over recent observations,
    starting from a prior in which 32 tokens cost twice one (a bandwidth-bound step)."""

    def __init__(self, fixed: float = 0.01, per_token: float = 0.01 / 32, decay: float = 0.98):
        self.decay = decay
        self.sums = [0.0] * 5  # weight, x, x^2, y, xy
        for tokens in (1, 64):
            self.observe(tokens, fixed + per_token * tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        self.sums = [s * self.decay for s in self.sums]
        for i, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self.sums[i] += value

    def coefficients(self) -> tuple[float, float]:
        w, x, xx, y, xy = self.sums
        spread = w * xx - x * x
        slope = max(0.0, (w * xy - x * y) / spread) if spread > 1e-9 * w * w else 0.0
        return max(0.0, (y - slope * x) / w), slope

    def __call__(self, tokens: int) -> float:
        fixed, slope = self.coefficients()
        return fixed + slope * tokens


class AcceptanceRate:
    """A draft's acceptance probability: accepted drafts over drafts judged (the accepted ones and the first
    rejected one of each sequence), over recent steps, starting from `prior`."""

    def __init__(self, prior: float, decay: float = 0.99, prior_weight: float = 10.0):
        self.accepted, self.judged = prior * prior_weight, prior_weight
        self.decay = decay

    def observe(self, accepted: int, judged: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.judged = self.judged * self.decay + judged

    @property
    def value(self) -> float:
        return min(self.accepted / self.judged, 0.99)


class SpeculationPolicy:
    MARGIN = 1.1  # speculation must promise 10% more tokens per second than plain decoding

    def __init__(self, max_k: int, prior_acceptance: float):
        self.max_k = max_k
        self.target = LinearCost()
        self.draft = LinearCost(fixed=0.0, per_token=0.0)  # n-gram lookup: free; a draft model measures itself
        self.acceptance = AcceptanceRate(prior_acceptance)

    def num_drafts(self, batch_size: int) -> int:
        if batch_size == 0:
            return 0
        a = self.acceptance.value
        best_k, best_rate = 0, batch_size / self.target(batch_size) * self.MARGIN
        for k in range(1, self.max_k + 1):
            tokens = batch_size * (1 - a ** (k + 1)) / (1 - a)
            rate = tokens / (self.target(batch_size * (k + 1)) + k * self.draft(batch_size))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
