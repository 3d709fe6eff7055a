"""`auto` draft length: per decode step, speculate with k drafts or decode plainly, whichever yields more tokens a
second.

A step over B requests costs t(mode, B) seconds: a plain step emits B tokens, a speculative step Σ_b E_b tokens,
E_b = 1 + α_b + … + α_b^k the tokens request b is expected to emit when each draft is accepted with probability
α_b given the ones before it. The policy speculates when Σ_b E_b / t(spec, B) ≥ (1 + margin) · B / t(plain, B)
(the margin keeps it on the side it is on when the two are close).

- α_b: each request's running acceptance (the maximum-likelihood rate of a geometric run: accepted drafts over
  accepted drafts plus rejections), counts decayed by `decay` every step so it follows the request; a new
  request starts at the engine's running rate.
- t(mode, B): seconds a step of each mode takes at each padded batch size, seeded at warm-up (`seed`: the engine's
  own decode steps, `warmup.measure_step_costs`) and, when `online`, followed by an exponential average of the
  engine's decode-only steps (`record`), with the mode not chosen retried every `explore_every` steps at that size
  so its cost stays measured.
- A request decoded plainly under an MTP proposer misses the MTP module's cache rows of those positions, so it
  drafts no more (`stale`): it counts E = 1 and the engine gives it no drafts (a step chained on the device still
  verifies the drafts it derived there, which costs nothing more and stays lossless). A new request starts stale
  where a request at the engine's running rate would not make a speculative step pay (`admit`): the MTP module
  then skips its prompt, and its prefill steps run pipelined.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class DraftPolicy:
    def __init__(self, k: int, padded: Callable[[int], int] | None = None, margin: float = 0.05,
                 prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9, online: bool = True,
                 explore_every: int = 64, ema: float = 0.2):
        if k < 1:
            raise ValueError("the auto draft length needs k_max >= 1")
        if not 0.0 <= prior < 1.0:
            raise ValueError("prior acceptance must be in [0, 1)")
        self.k, self.margin, self.decay, self.online = k, margin, decay, online
        self.prior, self.prior_weight = prior, prior_weight
        self.explore_every, self.ema = explore_every, ema
        self.padded = padded or (lambda b: b)
        self.costs: dict[tuple[bool, int], float] = {}  # (speculative, padded size) → seconds a step
        self._counts: dict[int, list[float]] = {}  # seq_id → [accepted, rejections] (decayed)
        self._engine = [0.0, 0.0]  # every request's counts, decayed: a new request's starting rate
        self._expected: dict[int, float] = {}  # seq_id → expected tokens at k, as of its last step
        self.stale: set[int] = set()
        self._last: dict[int, bool] = {}  # padded size → the mode chosen last there
        self._since: Counter[int] = Counter()  # padded size → steps since the other mode ran there
        self.steps: Counter[bool] = Counter()  # decode steps taken in each mode (True: speculative)
        self.force: bool | None = None  # set: every step takes this side (the warm-up's cost measurement)

    # ---- acceptance ------------------------------------------------------------------------------
    def observe(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verify step of request seq_id: num_accepted of its num_drafts drafts accepted."""
        if num_drafts <= 0:
            return
        miss = 1.0 if num_accepted < num_drafts else 0.0
        for c in (self._counts.setdefault(seq_id, [0.0, 0.0]), self._engine):
            c[0] = c[0] * self.decay + num_accepted
            c[1] = c[1] * self.decay + miss
        if seq_id not in self.stale:
            self._expected[seq_id] = self._geometric(self.alpha(seq_id), self.k)

    def engine_alpha(self) -> float:
        """The engine's running acceptance (every request's counts, with the prior): a new request's rate."""
        e = self._engine
        return (e[0] + self.prior * self.prior_weight) / (e[0] + e[1] + self.prior_weight)

    def alpha(self, seq_id: int) -> float:
        """Running probability that a draft of request seq_id is accepted, given the drafts before it were."""
        base = self.engine_alpha()
        a, r = self._counts.get(seq_id, (0.0, 0.0))
        return (a + base * self.prior_weight) / (a + r + self.prior_weight)

    def expected_tokens(self, seq_id: int) -> float:
        """Tokens a speculative step with k drafts is expected to emit for the request (1 when stale)."""
        if seq_id in self.stale:
            return 1.0
        e = self._expected.get(seq_id)
        return self._geometric(self.alpha(seq_id), self.k) if e is None else e

    @staticmethod
    def _geometric(a: float, k: int) -> float:
        a = min(a, 0.999999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def admit(self, batch: int) -> bool:
        """Whether a new request, decoding among `batch` requests, gets the MTP module's catch-up over its prompt: only
        where a request at the engine's running acceptance makes a speculative step pay at that size (with the
        margin on its side). Else it would decode plainly at once, and the catch-up, which also keeps its prefill
        steps from running pipelined, would be spent for nothing. Unmeasured costs: yes; a forced side: that side."""
        if self.force is not None:
            return self.force
        size = self.padded(max(1, batch))
        t_spec, t_plain = self.costs.get((True, size)), self.costs.get((False, size))
        if t_spec is None or t_plain is None:
            return True
        fresh = self._geometric(self.engine_alpha(), self.k)
        return fresh * (1 + self.margin) / t_spec >= 1.0 / t_plain

    def mark_stale(self, seq_id: int) -> None:
        """The request drafts no more (decoded plainly under an MTP proposer)."""
        self.stale.add(seq_id)
        self._expected.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        self._counts.pop(seq_id, None)
        self._expected.pop(seq_id, None)
        self.stale.discard(seq_id)

    def forget_history(self) -> None:
        """Drop what requests taught it (acceptance, stale requests, step counts); the costs stay."""
        self._counts.clear()
        self._expected.clear()
        self._engine = [0.0, 0.0]
        self.stale.clear()
        self._last.clear()
        self._since.clear()
        self.steps.clear()

    # ---- costs -------------------------------------------------------------------------------------
    def seed(self, speculative: bool, size: int, seconds: float) -> None:
        """A step cost measured at warm-up (graph replays at padded size `size`)."""
        self.costs[(speculative, size)] = seconds

    def record(self, speculative: bool, batch: int, seconds: float) -> None:
        """A decode-only step of `batch` requests took `seconds` (with `online`, it moves that mode's cost)."""
        if not self.online:
            return
        key = (speculative, self.padded(batch))
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else old + self.ema * (seconds - old)

    # ---- the choice --------------------------------------------------------------------------------
    def choose(self, seq_ids: list[int]) -> bool:
        """Whether the decode step over these requests speculates."""
        if self.force is not None:
            return self.force
        size = self.padded(len(seq_ids))
        t_spec, t_plain = self.costs.get((True, size)), self.costs.get((False, size))
        if t_spec is None or t_plain is None:  # an unmeasured side: take it (online) or speculate
            spec = True if not self.online or t_spec is None else False
        else:
            gain = sum(self.expected_tokens(s) for s in seq_ids) / t_spec
            plain = len(seq_ids) / t_plain
            last = self._last.get(size, True)
            spec = gain >= plain * (1 + self.margin) if not last else gain * (1 + self.margin) >= plain
            if self.online and self.explore_every:
                self._since[size] += 1
                if self._since[size] >= self.explore_every:
                    spec = not spec
            if spec != last:
                self._since[size] = 0
        self._last[size] = spec
        self.steps[spec] += 1
        return spec

    def as_dict(self) -> dict:
        n = sum(self.steps.values())
        return {"k_max": self.k, "speculative_steps": self.steps[True], "plain_steps": self.steps[False],
                "speculative_fraction": self.steps[True] / n if n else None}
