"""What a worker is sent to run an attempt (W_RUN): the call's request (a
large one as its file's name, which the worker reads; a group's call's with
its model the attempt's deployment's), its profile, and the
attempt's settings: the profile's fall-backs learned so far, the call's
timeouts, and the notice for the client of a retried tool call.
"""

from __future__ import annotations

from streamfence.protocol.internal.workers import AttemptSettings, RunAttempt
from streamfence.supervisor.calls import Call
from streamfence.supervisor.fallbacks import Fallbacks

# How long a worker waits for the sink to acknowledge its final. Long: the
# provider is done and a slow or frozen sink is not its fault (the stale
# watchdog leaves such an attempt alone); a sink that dies instead is
# restarted and the attempt rebound (ARCHITECTURE §2.8).
FINAL_ACK_TIMEOUT_S = 600.0
MODEL_FIELDS = {"bedrock": "modelId"}  # a wire's model field, where it is not "model"


def run_attempt(call: Call, fallbacks: Fallbacks) -> RunAttempt:
    """The run of `call`'s current attempt (its epoch and token)."""
    profile = call.profile.name
    settings = AttemptSettings(
        streaming=fallbacks.streaming(profile) and not call.probe_next,
        include_usage=fallbacks.include_usage(profile),
        connect_timeout_s=call.timeouts.connect_s, read_timeout_s=call.timeouts.read_s,
        final_ack_timeout_s=FINAL_ACK_TIMEOUT_S, notice=call.notice)
    request = call.spec.request if call.request_file is None else call.request_overrides
    if call.deployment is not None:  # a large request's file is read with these over it
        request = {**request, MODEL_FIELDS.get(call.profile.kind, "model"): call.deployment.model}
    return RunAttempt(call.token, call.call_id, call.epoch, call.spec.session_id,
                      call.profile.to_map(), request, settings, call.request_file, call.owner)
