"""Adaptive draft length: per sequence, the k that maximises tokens per unit of step time.

Acceptance of successive draft tokens is modelled as independent with rate alpha, estimated
per sequence from its verified drafts (a decaying count of accepted tokens over tokens up to
and including the first rejection). A draft of k tokens then commits E(k) = 1 + a + ... + a^k
tokens per verifier pass, and costs T(rows + k) / T(rows) of a plain step, T measured per row
count on the running pipeline (StepCosts). k grows while acceptance holds and extra rows are
cheap, and falls to 0 (plain decoding) when drafts keep failing or rows are expensive (fp32 on
some CPUs scores 3 rows at 2.3x the cost of 1). At k = 0 a one-token probe goes out every
`probe_every` steps (more where a row is dear: probe_interval), so a sequence that turns
repetitive is noticed.

A proposer that sizes its own drafts (n-gram: as long as its suffix match) says how sure it is
by how much it offers, and its acceptance is bimodal: near 1 while the output copies a passage,
near 0 on chance one-token matches. One alpha per sequence averages the two and caps copied
passages at k = 1 or 2 (measured: 1.17 tokens per pass on the repetitive bench set, against
2.4 for a fixed k = 8). OfferedLength keeps alpha per offered length instead and sends, of
each offered draft, the prefix with the most tokens per unit of step time.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ROW_COST = 0.05  # extra cost of one more row, as a fraction of a step, until measured
_DECAY = 0.8  # weight of the past in each estimate


@dataclass(frozen=True, slots=True)
class DraftLengthConfig:
    k_max: int = 8
    k_start: int = 4
    probe_every: int = 8  # plain steps between one-token probes while k is 0

    def __post_init__(self):
        if not 0 <= self.k_start <= self.k_max <= 63 or self.probe_every < 1:
            raise ValueError(f"draft lengths need 0 <= k_start <= k_max <= 63 and probe_every >= 1: {self}")


class StepCosts:
    """Seconds per decode step by rows in it (decaying averages); a step with a prefill chunk
    is not a decode step and is not recorded."""

    def __init__(self, widest_slope: bool = False):
        """`widest_slope`: extrapolate past the measured counts along the slope between the smallest
        and largest (a proposer's call times; see seconds), not the two nearest (step costs)."""
        self.widest_slope = widest_slope
        self._seconds: dict[int, float] = {}
        # ratio() by (rows, extra) until the next observation: each sequence's draft length weighs
        # up to k_max lengths a step, 8 sequences ~150 lookups that all read the same estimates.
        self._ratios: dict[tuple[int, int], float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else _DECAY * old + (1 - _DECAY) * seconds
        self._ratios.clear()

    def ratio(self, rows: int, extra: int) -> float:
        """Estimated T(rows + extra) / T(rows)."""
        if extra == 0:
            return 1.0
        ratio = self._ratios.get((rows, extra))
        if ratio is None:
            ratio = self._ratios[rows, extra] = self._ratio(rows, extra)
        return ratio

    def _ratio(self, rows: int, extra: int) -> float:
        base, more = self._estimate(rows), self._estimate(rows + extra)
        if more is None and base is not None and len(self._seconds) >= 2:
            # Past the measured counts: along the line through the two nearest (a step's cost grows
            # about linearly in its rows). The flat prior made 8 sequences' first drafts look nearly
            # free: a fresh leader's first batch of free text on 2 stages ran ~0.8x plain.
            more = self.seconds(rows + extra)
        if base is None and more is not None:
            # Only bigger steps measured yet (drafting since the first step): the cheapest one
            # bounds the base from above, so the ratio is not overestimated, and a dear step
            # (past the CPU few-row kernels: 1.6x) is seen at once.
            base = min(self._seconds.values())
        if base is None or more is None or more < base:
            return 1.0 + PRIOR_ROW_COST * extra
        return more / base

    def _estimate(self, rows: int) -> float | None:
        if rows in self._seconds:
            return self._seconds[rows]
        below = [r for r in self._seconds if r < rows]
        above = [r for r in self._seconds if r > rows]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        t = (rows - lo) / (hi - lo)
        return (1 - t) * self._seconds[lo] + t * self._seconds[hi]

    def seconds(self, count: int) -> float | None:
        """Estimated seconds at `count`: measured, interpolated, or extrapolated from the nearest
        measured count along the line through the two nearest measured counts, or with
        `widest_slope` the smallest and largest (through the origin when only one is measured: a
        proposer's call time by tokens drafted, before calls of two sizes were seen). A proposer's
        two nearest can be two noisy neighbours: 5- and 6-token calls measured alike made 9-token
        calls look as cheap as 6-token ones, and 8-token blocks won. Step costs keep the nearest
        two: a step's cost is not linear in its rows over the whole range (the few-row kernels)."""
        estimate = self._estimate(count)
        if estimate is not None or not self._seconds:
            return estimate
        counts = sorted(self._seconds)
        if len(counts) == 1:
            return self._seconds[counts[0]] * count / counts[0]
        nearest = counts[0] if count < counts[0] else counts[-1]
        if self.widest_slope:
            lo, hi = counts[0], counts[-1]
        else:
            lo, hi = (counts[0], counts[1]) if count < counts[0] else (counts[-2], counts[-1])
        slope = max(0.0, (self._seconds[hi] - self._seconds[lo]) / (hi - lo))
        return max(0.0, self._seconds[nearest] + slope * (count - nearest))

    @property
    def typical_step_s(self) -> float | None:
        return self._seconds[min(self._seconds)] if self._seconds else None


class DraftLength:
    """One sequence's acceptance estimate and chosen k. Leader loop thread only."""

    def __init__(self, config: DraftLengthConfig):
        self.config = config
        self._accepted = config.k_start / (config.k_start + 1)  # prior: alpha ~ k_start / (k_start + 1)
        self._trials = 1.0
        self._plain_steps = 0
        self.k = config.k_start

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def update(self, num_drafted: int, num_accepted: int, costs: StepCosts, rows: int) -> None:
        """After a verifier pass of `num_drafted` draft tokens (0: a plain step) among `rows` rows."""
        if num_drafted:
            self.observe(num_drafted, num_accepted)
            self._plain_steps = 0
        else:
            self._plain_steps += 1
        rows = max(1, rows - num_drafted)
        self.k = self._best_k(costs, rows)
        if self.k == 0 and self._plain_steps >= probe_interval(self.config, costs, rows):
            self.k, self._plain_steps = 1, 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Draft tokens checked against what the verifier chose: the first `num_accepted` matched."""
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        self._accepted = _DECAY * self._accepted + num_accepted
        self._trials = _DECAY * self._trials + trials

    def _best_k(self, costs: StepCosts, rows: int) -> int:
        return best_length(self.alpha, self.config.k_max, costs, rows)


def probe_interval(config: DraftLengthConfig, costs: StepCosts, rows: int) -> int:
    """Plain steps between one-token probes: `probe_every` where a row costs little, longer where
    it costs much, so probing never costs more than ~1% of the steps (on SmolLM2 Q4_1 a second
    row nearly doubles a step: probes every 8 steps made free text 0.956x plain). Each of the
    step's `rows` sequences probes on its own, so the interval grows with them: at batch 8 on
    SmolLM2 Q4_1 a ninth row cost 0.29 of a step (the step's graph is rebuilt for the new shape),
    and per-sequence probes every 29 steps made free text 0.92-0.95x plain."""
    extra = costs.ratio(rows, 1) - 1.0
    return max(config.probe_every, round(config.probe_every * extra * rows / 0.08))


def best_length(alpha: float, k_max: int, costs: StepCosts, rows: int) -> int:
    """The k <= k_max with the most tokens per unit of step time (0: none pays), for a draft in a
    step of `rows` rows without it (this sequence's own row among them). The draft's accepted
    tokens add to what the whole step commits (rows - 1 + E(k)) and its rows to what the whole
    step costs: beside 7 other decodes an extra row costs ~1/8 of a step for at most 1/8 more
    tokens, so free text with acceptance ~0.6 drafts nothing at batch 8 (measured on SmolLM2
    bf16: drafting anyway made batch 8 0.87x plain), while at batch 1 the same draft pays."""
    a = min(alpha, 0.99)
    best, best_rate, expected = 0, 1.0, 1.0
    margin = 1.02 if rows == 1 else BATCH_MARGIN
    for k in range(1, k_max + 1):
        expected += a ** k
        rate = (rows - 1 + expected) / (rows * costs.ratio(rows, k))
        if rate > best_rate * margin:  # a longer draft must earn its rows, not tie
            best, best_rate = k, rate
    return best


# Beside other sequences a draft must beat plain steps by more than alone: what the model leaves
# out (the leader's drafting work, on a CPU the stages share; several sequences' drafts landing in
# one step) costs a few percent there. Measured, SmolLM2 Q4_1, 8 sequences of free text, 2 stages:
# with 2% drafts went out at 0.54-0.63 acceptance and decoding ran 0.91-0.95x plain; with 6%, once
# the few-row kernels made a ninth row cheaper, 0.94x with 8 in flight (acceptance 0.66); with 12%
# 1.00x closed and in flight, while copying answers kept 1.30x / 1.25x (1.24x / 1.28x at 6%).
BATCH_MARGIN = 1.12


_OFFER_BUCKETS = (1, 2, 4, 8)  # offered lengths up to each bound share an estimate; longer, the last
# Prior acceptance per bucket: longer matches copy more surely (as in SuffixDecoding); one
# observation moves the estimate a long way (weight 1 against the prior's 1).
_OFFER_PRIORS = (0.2, 0.35, 0.5, 0.7, 0.8)


class OfferedLength:
    """Acceptance by offered draft length, for proposers that size their own drafts. Leader loop thread only."""

    def __init__(self, config: DraftLengthConfig):
        self.config = config
        self._accepted = list(_OFFER_PRIORS)
        self._trials = [1.0] * (len(_OFFER_BUCKETS) + 1)
        # Offers not sent since the last probe, whatever their length: one probe budget per
        # sequence (a count per bucket let free text's chance matches of five lengths probe five
        # times as often as probe_interval allows).
        self._skipped = 0

    def send_length(self, offered: int, costs: StepCosts, rows: int) -> int:
        """How many of `offered` draft tokens to send in a step beside `rows` other rows."""
        if offered == 0:
            return 0
        b = _bucket(offered)
        m = best_length(self._accepted[b] / self._trials[b], offered, costs, rows)
        if m == 0:  # a probe now and then, so a bucket that starts paying is noticed
            self._skipped += 1
            if self._skipped >= probe_interval(self.config, costs, rows):
                self._skipped, m = 0, 1
        return m

    def update(self, offered: int, num_drafted: int, num_accepted: int) -> None:
        if offered and num_drafted:
            b = _bucket(offered)
            self._accepted[b] = _DECAY * self._accepted[b] + num_accepted
            self._trials[b] = _DECAY * self._trials[b] + num_accepted + (1 if num_accepted < num_drafted else 0)


def _bucket(offered: int) -> int:
    return next((i for i, bound in enumerate(_OFFER_BUCKETS) if offered <= bound), len(_OFFER_BUCKETS))


def pipelined_length(alpha: float, k_max: int, costs: StepCosts, rows: int, draft_s: StepCosts) -> int:
    """The draft length for a proposer slower than a verifier pass (a draft model, remote or not).

    Drafting runs a block ahead: while block i verifies, the proposer drafts block i+1 assuming
    all of block i and the verifier's bonus token are its own, i.e. k + 1 tokens per block. In
    the steady state a block therefore takes max(T(rows + k), D(k + 1)) and commits rows - 1 +
    E(k) tokens (`rows`: the step's rows without this draft, as in best_length): the verifier's
    extra rows are cheap on the few-row kernels, so what bounds the rate is the proposer's speed.
    A rejection in the block (probability 1 - a^k) throws the block drafted ahead away: the
    proposer finishes or drops the stale block it is on, starts again from the verifier's
    correction, and the next draft is that far away. Measured, free text: 110-120 ms (median)
    from a rejection to the next accepted draft with 8-token blocks (D(9) ~64 ms), 53 ms with
    blocks of 2-3 (D(3) ~29 ms): ~2 D(k + 1) either way, which is what a rejection costs here.
    Without the term longer blocks looked as good as short ones wherever the proposer bounds the
    rate. The verifier does not idle meanwhile: it decodes plain steps, rows tokens per T(rows),
    which count. Without them two rejections in a row (a ~0.75) made every draft look slower
    than plain decoding, and drafting stopped for ~30 plain steps (300 ms, the probes every 8
    steps overtaken by them) before it resumed: 30% of a two-machine run (bench/spec_trace.py).
    The k <= k_max with the best rate, 0 where none beats plain steps (rows tokens per T(rows))
    by 2%: a proposer as slow as the verifier never pays. D(n) is the proposer's measured call
    time for n tokens (`draft_s`, by tokens drafted).
    """
    base = _step_s(costs, rows)
    if base is None:
        return k_max
    a = min(alpha, 0.99)
    best, best_rate, expected = 0, rows / base, 1.0
    for k in range(1, k_max + 1):
        expected += a ** k
        draft = draft_s.seconds(k + 1) or 0.0
        rejected = (1 - a ** k) * 2 * draft  # the expected time a rejection costs: plain steps only
        rate = (rows - 1 + expected + rejected * rows / base) / (max(base * costs.ratio(rows, k), draft) + rejected)
        if rate > best_rate * 1.02:
            best, best_rate = k, rate
    return best


def wait_pays(alpha: float, k: int, costs: StepCosts, rows: int, wait_s: float, k_now: int = 0) -> bool:
    """Whether holding a step of `rows` rows (this sequence's own among them) `wait_s` for a k-token
    draft commits more tokens per second than sending now with the `k_now` tokens at hand (0: a
    plain row): (rows - 1 + E(k)) / (wait + T(rows + k)) against (rows - 1 + E(k_now)) / T(rows +
    k_now). The hold stalls the whole step, so the other rows count on both sides."""
    base = _step_s(costs, rows)
    if base is None or k <= k_now:
        return False
    a = min(alpha, 0.99)
    committed = lambda n: rows - 1 + sum(a ** i for i in range(n + 1))  # noqa: E731
    now = committed(k_now) / (base * costs.ratio(rows, k_now))
    return committed(k) > now * (wait_s + base * costs.ratio(rows, k))


def _step_s(costs: StepCosts, rows: int) -> float | None:
    """T(rows), measured or estimated; None before any step was measured (or one took no time)."""
    seconds = costs.seconds(rows)
    return seconds if seconds else None
