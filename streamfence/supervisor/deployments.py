"""Which deployment of a model group (config/groups.py) serves a call's next
attempt: chosen per attempt, when the attempt starts (AttemptDriver.schedule),
so that a retry can go elsewhere and each attempt sees the breakers as they
are then.

The rules, for a group's call:
- a deployment whose breaker blocks the call's session (breaker.py: open,
  or half-open with its probe out) is skipped, unless every one is blocked:
  then the call goes on as a profile's call would (its breaker is asked at
  submit only);
- a deployment the call tried already is skipped (so a retry, after a
  failure before any text, or under `on_partial = "restart"` after text,
  moves to the next one) until every usable one has been tried; then a new
  round starts, away from the last one where another is usable;
- among the rest, the group's strategy picks: `ordered` the first in the
  list; `weighted` by smooth weighted round robin (nginx's: deterministic,
  every run of sum-of-weights picks splits exactly by weight);
  `least_in_flight` the one with the fewest group calls on it now (its
  profile and model: LiveCalls counts them), the first on a tie.

The chosen deployment becomes the call's `profile` and `deployment` (its
timeouts are its profile's); the request goes as it came, its model
replaced (dispatch.py).
"""

from __future__ import annotations

from streamfence.config.groups import Deployment, ModelGroup
from streamfence.config.model import DaemonConfig
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call
from streamfence.supervisor.livecalls import LiveCalls
from streamfence.supervisor.timeouts import sized_timeouts


class Router:
    """Owns the weighted groups' round-robin weights; reads the breakers
    and the live calls' counts per deployment."""

    def __init__(self, breakers: Breakers, calls: LiveCalls) -> None:
        self._breakers = breakers
        self._calls = calls
        # Smooth weighted round robin's current weight per deployment, by
        # the group's deployments (a group a reload changed starts afresh).
        self._current: dict[tuple[Deployment, ...], list[int]] = {}

    def use(self, config: DaemonConfig) -> None:
        """A reloaded config: the weights of groups it no longer has go."""
        kept = {group.deployments for group in config.groups.values()}
        self._current = {k: v for k, v in self._current.items() if k in kept}

    def choose(self, call: Call) -> None:
        """Set the deployment of `call`'s next attempt (a call of a profile
        keeps its profile)."""
        group = call.group
        if group is None:
            return
        session = call.spec.session_id or "-"
        deployments = group.deployments
        every = range(len(deployments))
        usable = [i for i in every
                  if not self._breakers.blocks((session, deployments[i].profile))] or list(every)
        candidates = [i for i in usable if i not in call.tried]
        if not candidates:  # each usable one was tried: a new round, away from the last
            call.tried.clear()
            last = deployments.index(call.deployment) if call.deployment in deployments else -1
            candidates = [i for i in usable if i != last] or usable
        index = self._pick(group, candidates)
        call.tried.add(index)
        chosen = deployments[index]
        self._breakers.admit((session, chosen.profile))  # a half-open one's probe: this attempt
        self._calls.place(call, chosen)
        profile = call.profiles[chosen.profile]
        if profile is not call.profile:
            call.profile = profile
            call.timeouts = sized_timeouts(call.spec.options, profile, call.request_bytes)
            call.probe_next = False  # a non-streaming probe is for the profile that failed

    def _pick(self, group: ModelGroup, candidates: list[int]) -> int:
        deployments = group.deployments
        if group.strategy == "least_in_flight":
            return min(candidates, key=lambda i: (self._calls.on_deployment(deployments[i]), i))
        if group.strategy != "weighted":
            return candidates[0]
        current = self._current.setdefault(deployments, [0] * len(deployments))
        total = 0
        for i in candidates:
            current[i] += deployments[i].weight
            total += deployments[i].weight
        best = max(candidates, key=lambda i: (current[i], -i))
        current[best] -= total
        return best
