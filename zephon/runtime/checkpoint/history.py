"""What was done to a run on purpose, kept in its checkpoints: resumes across an operator change,
skipped steps and retired samples (re-lanings are in the lane history, ``layout``; the retired
ids themselves in ``retired``, see ``runtime.retire``).

A state's ``history`` is a list of events, oldest first, each a small object with its ``event``
kind and the global ``step`` it happened at; only the last ``MAX_EVENTS`` are kept, so a state
never grows with the number of resumes. ``skip`` is the number of global steps a state still has
to skip (``zephon.skip_steps``), done by the loader before its first item; it is always what the
last skip events of the history add up to (a change or retirement at the resume that has the skip
still to do comes after them), so an edited count is refused.
"""

from __future__ import annotations

from typing import Any

from zephon.runtime.checkpoint.dataloader_state import (
    dataset_state,
    dataset_state_path,
    with_dataset_state,
)
from zephon.runtime.checkpoint.format import seal, unseal
from zephon.runtime.checkpoint.job import state_step
from zephon.runtime.checkpoint.schema import (
    JOB_FORMAT,
    MAX_EVENTS,
    STATE_FORMAT,
    check_history,
    last_skip,
)

MAX_CHANGES = 20  # changed operators named in one event
_SHOWN = 200  # characters of one named change


def with_event(history: list[dict[str, Any]], event: dict[str, Any]) -> list[dict[str, Any]]:
    """``history`` with ``event`` appended, the oldest events dropped past ``MAX_EVENTS``."""
    return [*history, event][-MAX_EVENTS:]


def change_event(step: int, changes: list[str], old: Any, new: Any) -> dict[str, Any]:
    """A resume with changed operators: what changed, and the operators' digests before and
    after."""
    return {
        "event": "change",
        "step": step,
        "changes": [text[:_SHOWN] for text in changes[:MAX_CHANGES]],
        "operators": [str(old)[:16], str(new)[:16]],
    }


class RunHistory:
    """What was done to a run on purpose, as a loader keeps it: the events, and the global steps
    still to skip before its first item; a state's ``history`` and ``skip``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.skip = 0

    def add(self, event: dict[str, Any]) -> None:
        """Keep ``event``, the oldest ones dropped past ``MAX_EVENTS``."""
        self.events = with_event(self.events, event)

    def state(self) -> dict[str, Any]:
        """The ``history`` and ``skip`` fields of a state."""
        return {"history": self.events, "skip": self.skip}

    def restore(self, body: dict[str, Any]) -> None:
        """Take the ``history`` and ``skip`` of state ``body``, checked."""
        self.events, self.skip = check_history(body["history"], body["skip"])


def described(state: dict[str, Any]) -> list[str]:
    """The history of an unsealed state, one line per event (for ``zephon inspect``)."""
    lines = []
    for event in state.get("history", []):
        at = f"at global step {event['step']}"
        if event["event"] == "change":
            lines.append(f"{at}: resumed with changed operators: " + "; ".join(event["changes"]))
        elif event["event"] == "skip":
            lines.append(f"{at}: skipped {event['steps']} global step(s)")
        else:
            lines.append(f"{at}: retired {event['ids']} sample(s)")
    if state.get("skip"):
        lines.append(f"still to skip before the next item: {state['skip']} global step(s)")
    return lines


def skip_steps(state: dict[str, Any], steps: int) -> dict[str, Any]:
    """``state`` (a rank's or a job's) continued ``steps`` global steps later: resumed from it, the
    loader first runs the pipeline through those steps and hands their items to no one, booked
    as delivered, so a loss-spike window is never trained on and nothing else is lost. The skip
    is kept in the state's ``history``. A torchdata ``StatefulDataLoader``'s state around a
    Zephon dataset's (run by the DataLoader itself or by one worker process) comes back with the
    dataset's state skipped."""
    if type(steps) is not int or steps < 0:
        raise ValueError(f"skip_steps needs a number of global steps >= 0, got {steps!r}")
    path = dataset_state_path(state)
    if path is not None:
        return with_dataset_state(state, path, skip_steps(dataset_state(state, path), steps))
    body = unseal(state, (STATE_FORMAT, JOB_FORMAT))
    history, pending = check_history(body["history"], body["skip"])
    if not steps:
        return seal(body)
    if pending:  # still to be done: this skip joins it
        at = last_skip(history)
        history = [*history]
        history[at] = {**history[at], "steps": history[at]["steps"] + steps}
    else:
        event = {"event": "skip", "step": state_step(body), "steps": steps}
        history = with_event(history, event)
    return seal({**body, "history": history, "skip": pending + steps})
