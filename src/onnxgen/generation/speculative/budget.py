"""How many drafts a verify should carry, from what forwards cost and how often drafts are accepted.

A verify over the pending token and k drafts yields ``1 + accepted`` tokens for the price of one
forward over k + 1 tokens. When a forward's cost grows with its token count (small models: the kernels
are compute-bound per token) partly accepted drafts can cost more than they save. :class:`DraftBudget`
keeps moving averages of the time of a forward per token count (for a verify: its forward, processing
and commit, a replay included), of the proposer's time per draft token ``d`` (a draft model's forwards;
next to nothing for prompt lookup), and of the per-draft acceptance rate ``a``, kept apart for verifies
that follow a full accept and for the others (acceptance comes in runs: inside a copied span the next
draft is far likelier to pass than after a miss). It caps k at the value that maximises expected tokens
per unit of time, ``(1 - a^(k+1)) / (1 - a)`` over ``(cost(k + 1) + k * d) / cost(1)``.

That expectation takes each draft to pass with probability ``a`` given that the drafts before it
passed; a verify accepting j of k drafts tried j + 1 of them (j passed, the next one failed) or, after a
full accept, k. So ``a`` is the accepted drafts over the drafts tried, not over those proposed: drafts
past the first miss were never tested, and counting them as failures would read a 12-draft verify that
missed at the second draft as a 1-in-12 rate and hold the drafts at one for many verifies after it.

A count's average is forgotten once ``STALE`` forwards of other counts have been timed since its last
forward (the count of one token is always kept): the cap then reads that count's cost off fresher ones.
Without that, a verify size timed once while slow (the first forward of a size, a busy machine) would
keep the cap below it for the rest of the request, since only chosen sizes are timed again.

``per_depth``: a chained drafter (an MTP head, which drafts its second token from its own guess of the
hidden state) is accepted less the deeper the draft, so one rate for every draft underrates the first
draft and overrates the deeper ones: it reads k = 2 or 3 as paying where only k = 1 does, and k = 1 as
losing where it pays. With it the budget keeps each depth's rate (the drafts at that depth
accepted over those tested there, a depth tested only when the drafts before it passed), each pulled
towards the rate over all depths by ``DEPTH_PRIOR`` pseudo-drafts (deep drafts are tested seldom), and
the expected tokens of k drafts are ``1 + sum over i <= k of a_1 ... a_i``. A copying proposer (prompt
lookup) keeps the single rate, apart after a full accept.

:meth:`gain` is that maximum's ratio to plain decoding's one token per step: below 1, speculating is
predicted to be slower than not (what :class:`~onnxgen.generation.speculative.MTP`'s ``auto`` decides by).

It never goes below one draft: verifies that accept nothing are what the loop's back-off (plain steps
between attempts) is for, and one draft keeps the acceptance estimate current. It abstains (answers the
loop's own k) until it has timed a plain step and a verify and seen ``MIN_VERIFIES`` verifies.
Timing-driven: the tokens never depend on it, the forward count may.
"""

from __future__ import annotations

DECAY = 0.8  # weight of the past in the moving averages
MIN_VERIFIES = 2
STALE = 16  # forwards after which a count's timing no longer counts, unless timed again
DEPTH_PRIOR = 1.0  # pseudo-drafts at the rate over all depths added to each depth's (per_depth)


class DraftBudget:
    def __init__(self, per_depth: bool = False) -> None:
        self.per_depth = per_depth
        # moving sums over verifies per draft depth (0 = the first draft): accepted, tested
        self._depth_accepted: list[float] = []
        self._depth_tried: list[float] = []
        self._cost: dict[int, float] = {}  # tokens in a forward -> moving average of its seconds
        self._timed: dict[int, int] = {}  # tokens in a forward -> index of its latest timed forward
        self._forwards = 0
        # moving sums over verifies, [after a partial accept, after a full accept]: accepted, tried drafts
        self._accepted = [0.0, 0.0]
        self._tried = [0.0, 0.0]
        self._after_full = 0  # whether the last verify accepted every draft
        self._verifies = 0
        self._draft_cost = 0.0  # moving average of the proposer's seconds per draft token
        self._proposals = 0

    def observe_proposal(self, tokens: int, seconds: float) -> None:
        if tokens > 0:  # the first proposal sets the average (blending it with 0 would undercount drafts)
            seen = self._draft_cost if self._proposals else seconds / tokens
            self._draft_cost = DECAY * seen + (1.0 - DECAY) * seconds / tokens
            self._proposals += 1

    def observe_forward(self, tokens: int, seconds: float) -> None:
        old = self._cost.get(tokens)
        if old is not None and self._forwards - self._timed[tokens] > STALE:
            old = None  # forgotten: start over rather than blend with a stale average
        self._cost[tokens] = seconds if old is None else DECAY * old + (1.0 - DECAY) * seconds
        self._timed[tokens] = self._forwards
        self._forwards += 1

    def observe_verify(self, proposed: int, accepted: int) -> None:
        state = self._after_full
        self._accepted[state] = DECAY * self._accepted[state] + accepted
        # the drafts this verify tested: those past the first miss were not
        tried = accepted + 1 if accepted < proposed else proposed
        self._tried[state] = DECAY * self._tried[state] + tried
        self._after_full = int(accepted == proposed)
        self._verifies += 1
        if self.per_depth:
            self._observe_depths(accepted, tried)

    def _observe_depths(self, accepted: int, tried: int) -> None:
        """Fold a verify's outcome into the per-depth moving sums (``per_depth`` only: nothing else reads
        them)."""
        grow = tried - len(self._depth_tried)
        self._depth_accepted += [0.0] * grow
        self._depth_tried += [0.0] * grow
        for depth in range(len(self._depth_tried)):
            self._depth_accepted[depth] = DECAY * self._depth_accepted[depth] + (depth < accepted)
            self._depth_tried[depth] = DECAY * self._depth_tried[depth] + (depth < tried)

    def cost(self, tokens: int) -> float | None:
        """Seconds of a forward over ``tokens`` tokens: measured (and not stale), else interpolated
        linearly from one token and the nearest freshly measured larger count (None before both are known)."""
        return _estimate(self._fresh(), tokens)

    def _fresh(self) -> dict[int, float]:
        return {t: c for t, c in self._cost.items() if t == 1 or self._forwards - self._timed[t] <= STALE}

    def cap(self, k: int) -> int:
        """The number of drafts (1 to ``k``) that gives the most tokens per unit of time."""
        best = self._best(k)
        return k if best is None else best[0]

    def gain(self, k: int, plain: float | None = None) -> float | None:
        """The predicted speedup over plain decoding of verifies of the best draft count up to ``k``:
        tokens per unit of time relative to plain steps' one token per step (None until measured).
        ``plain``: the seconds of a plain decode step where known apart from the one-token forwards timed
        here (those of a proposer that reads target outputs run a slower path than plain decoding would).

        Acceptance is taken over every verify, not only those after a partial accept as for :meth:`cap`:
        this answers whether speculating pays at all, not how far to draft from here."""
        best = self._best(k, overall=True)
        if best is None:
            return None
        one = self._cost[1]
        return best[1] if plain is None or plain <= 0 else best[1] * plain / one

    def _best(self, k: int, overall: bool = False) -> tuple[int, float] | None:
        one = self._cost.get(1)
        state = self._after_full
        accepted = sum(self._accepted) if overall else self._accepted[state]
        tried = sum(self._tried) if overall else self._tried[state]
        if k < 1 or one is None or self._verifies < MIN_VERIFIES or tried <= 0:
            return None
        rates = self._rates(min(accepted / tried, 0.999), k)
        fresh = self._fresh()
        best, best_value = 1, 0.0
        tokens, reach = 1.0, 1.0  # expected tokens of n drafts; the chance that all n pass
        for n in range(1, k + 1):
            cost = _estimate(fresh, n + 1)
            if cost is None or cost <= 0:
                return None
            reach *= rates[n - 1]
            tokens += reach
            value = tokens / ((cost + n * self._draft_cost) / one)
            if value > best_value:
                best, best_value = n, value
        return best, best_value

    def _rates(self, rate: float, k: int) -> list[float]:
        """The acceptance of the draft at each depth 1..k given that the ones before it passed: ``rate``
        for all of them, or (``per_depth``) each depth's own, pulled towards the rate over all depths."""
        if not self.per_depth:
            return [rate] * k
        overall = sum(self._depth_accepted) / max(sum(self._depth_tried), 1e-9)
        out = []
        for depth in range(k):
            seen = depth < len(self._depth_tried)
            accepted = self._depth_accepted[depth] if seen else 0.0
            tried = self._depth_tried[depth] if seen else 0.0
            out.append(min((accepted + DEPTH_PRIOR * overall) / (tried + DEPTH_PRIOR), 0.999))
        return out


def _estimate(costs: dict[int, float], tokens: int) -> float | None:
    if tokens in costs:
        return costs[tokens]
    one = costs.get(1)
    larger = [t for t in costs if t > 1]
    if one is None or not larger:
        return None
    ref = min(larger, key=lambda t: abs(t - tokens))
    return one + (tokens - 1) * (costs[ref] - one) / (ref - 1)
