"""The model in force on a fleet: retrain on the fleet's own history, promote only a better
model, keep the loser for rollback, let an operator pin or roll back.

A :class:`ModelLifecycle` keeps its state beside the models, in ``<registry>/lifecycle.json``:
which model is in force, the models it replaced (newest last, for rollback), whether an
operator pinned it, and the history of every decision (a candidate judged and promoted or
not, a pin, an unpin, a rollback), each with the time from the clock it was given.

- :meth:`ModelLifecycle.retrain` trains a candidate *on top of* the model in force
  (:mod:`predictor.retrain`: its card's settings and hyper-parameters, its datasets still
  present, plus the fleet's own labelled history given as dataset directories) and hands it
  to :meth:`~ModelLifecycle.consider`;
- :meth:`ModelLifecycle.consider` judges the candidate and the model in force on the same
  held-out dataset (the fleet's most recent days, not trained on) at the same alarm budget,
  both with the rules as a floor (:mod:`predictor.floor`), as the service would act on them:
  the candidate is promoted only if it :func:`beats` the model in force. A pinned model is
  never replaced; the candidate is judged and kept all the same;
- every model stays in the registry: a candidate that lost can still be pinned, and
  :meth:`~ModelLifecycle.rollback` puts back the model the last promotion replaced.

Training is slow (minutes): call :meth:`~ModelLifecycle.retrain` from a worker thread or
process, never from the service's event loop. Reading the model in force
(:meth:`~ModelLifecycle.in_force_path`) is a small file read.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forewarn.errors import Conflict, NotFound
from predictor import registry
from predictor.dataset import Dataset, split_at
from predictor.model import RiskModel
from predictor.report import evaluate_dataset
from predictor.retrain import load_base
from predictor.train import train

__all__ = ["Judgement", "ModelLifecycle", "adapt", "beats", "judge"]

STATE_FILE = "lifecycle.json"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a card's stem, never a path


@dataclass(frozen=True)
class Judgement:
    """A model on a held-out dataset, met live by the alarm budget with the rules as a floor."""

    model_id: str
    caught_with_precursors: int
    failures_with_precursors: int
    false_alarms_per_1000_gpu_days: float
    caught_by_kind: dict[str, int]


def judge(
    model: RiskModel, model_id: str, holdout: Dataset, *, budget: float, step_s: float
) -> Judgement:
    """How ``model`` does on ``holdout`` at ``budget`` false alarms per 1,000 GPU-days."""
    summary = evaluate_dataset(holdout, model, budget=budget, step_s=step_s).summary
    m = summary["model_floor_at_budget"]
    return Judgement(
        model_id,
        int(m["caught_with_precursors"]),
        int(m["failures_with_precursors"]),
        float(m["false_alarms_per_1000_gpu_days"] or 0.0),
        {k: int(d["caught"]) for k, d in m["by_kind"].items()},
    )


def beats(candidate: Judgement, in_force: Judgement, *, budget: float) -> bool:
    """Whether ``candidate`` should replace ``in_force``: within the budget's limit (twice the
    budget, or the false-alarm rate of the model in force when that is higher), it catches
    more of the failures with precursors, or as many with fewer false alarms."""
    limit = max(2.0 * budget, in_force.false_alarms_per_1000_gpu_days)
    if candidate.false_alarms_per_1000_gpu_days > limit + 1e-9:
        return False
    if candidate.caught_with_precursors != in_force.caught_with_precursors:
        return candidate.caught_with_precursors > in_force.caught_with_precursors
    return candidate.false_alarms_per_1000_gpu_days < in_force.false_alarms_per_1000_gpu_days - 1e-9


def adapt(
    base_card: str | Path,
    data: Sequence[Dataset | str | Path],
    *,
    overrides: dict[str, Any] | None = None,
) -> RiskModel:
    """A model trained on top of the model at ``base_card`` (a card, or a directory: its
    newest, else the shipped model; :mod:`predictor.retrain`: its settings, hyper-parameters
    and datasets still present) plus ``data``."""
    base = load_base(base_card)
    paths: list[Dataset | str | Path] = [*data, *map(Path, base.found)]
    model = train(paths, base.config(overrides), booster_params=base.booster_params())
    model.card["base"] = {"card": base.card_path.name, "data": base.found}
    return model


class ModelLifecycle:
    """The models of one registry directory and which of them is in force.

    Args:
        registry_dir: the operator's models directory (``FOREWARN_MODELS_DIR``); created
            when needed. With no state yet, the model in force is its newest model, else the
            shipped one.
        clock: seconds since the epoch (the decisions' times).
        budget: false alarms per 1,000 GPU-days candidates are judged at.
        step_s: the replay step of the judgement (seconds).

    Example::

        life = ModelLifecycle("models")
        decision = life.retrain([Path("fleet-history")], holdout=load_dataset("last-day"))
        if decision["promoted"]: ...
        life.rollback()
    """

    def __init__(
        self,
        registry_dir: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        budget: float = 2.0,
        step_s: float = 60.0,
    ) -> None:
        self.dir = Path(registry_dir)
        self.clock = clock
        self.budget = float(budget)
        self.step_s = float(step_s)

    # -- state ------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        path = self.dir / STATE_FILE
        if path.is_file():
            state: dict[str, Any] = json.loads(path.read_text("utf-8"))
            return state
        return {"in_force": None, "replaced": [], "pinned": False, "history": []}

    def _write(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1) + "\n", "utf-8")
        os.replace(tmp, self.dir / STATE_FILE)  # readers never see half a file

    def _record(self, state: dict[str, Any], action: str, **data: Any) -> dict[str, Any]:
        entry = {"at": float(self.clock()), "action": action, **data}
        state["history"].append(entry)
        self._write(state)
        return entry

    def _path_of(self, model_id: str) -> Path:
        if not _ID.fullmatch(model_id) or model_id.startswith("."):
            raise NotFound(f"no model {model_id!r}", details={"model": model_id})
        for base in (self.dir, registry.SHIPPED_DIR):
            path = base / f"{model_id}{registry.CARD_SUFFIX}"
            if path.is_file():
                return path
        raise NotFound(f"no model {model_id!r}", details={"model": model_id})

    def models(self) -> list[dict[str, Any]]:
        """Every model this lifecycle can put in force (the registry's and the shipped one),
        oldest first: ``id``, ``created_at``, ``in_force``."""
        current = self.in_force_id()
        out = []
        for base in (registry.SHIPPED_DIR, self.dir):
            for created, path in registry.list_models(base):
                model_id = path.name[: -len(registry.CARD_SUFFIX)]
                out.append({"id": model_id, "created_at": created, "in_force": model_id == current})
        return out

    def in_force_id(self) -> str:
        """The id (card stem) of the model in force."""
        kept = self._state().get("in_force")
        if kept:
            return str(kept)
        found = registry.list_models(self.dir) or registry.list_models(registry.SHIPPED_DIR)
        if not found:
            raise NotFound(f"no model in {self.dir}, and no shipped model")
        return found[-1][1].name[: -len(registry.CARD_SUFFIX)]

    def in_force_path(self) -> Path:
        """The card of the model in force."""
        return self._path_of(self.in_force_id())

    def load_in_force(self) -> RiskModel:
        return registry.load(self.in_force_path())

    def status(self) -> dict[str, Any]:
        """The model in force, whether it is pinned, those it replaced and the history."""
        state = self._state()
        return {
            "in_force": self.in_force_id(),
            "pinned": bool(state.get("pinned")),
            "replaced": list(state.get("replaced", [])),
            "history": list(state.get("history", [])),
        }

    # -- decisions --------------------------------------------------------------------------

    def consider(self, candidate: Path, holdout: Dataset) -> dict[str, Any]:
        """Judge the candidate's card against the model in force on ``holdout``; promote it
        when it :func:`beats` it (and no operator pinned the model in force). A candidate
        from elsewhere is copied into the registry first. Returns the decision as recorded
        in the history."""
        state = self._state()
        current = self.in_force_id()
        cand_id = candidate.name[: -len(registry.CARD_SUFFIX)]
        if candidate.resolve().parent != self.dir.resolve():  # kept in the registry, won or not
            candidate = registry.save(registry.load(candidate), self.dir, stem=cand_id)
        kw = {"budget": self.budget, "step_s": self.step_s}
        theirs = judge(registry.load(self._path_of(current)), current, holdout, **kw)
        mine = judge(registry.load(candidate), cand_id, holdout, **kw)
        better = beats(mine, theirs, budget=self.budget)
        promoted = better and not state.get("pinned")
        if promoted:
            state["replaced"] = [*state.get("replaced", []), current]
            state["in_force"] = cand_id
        why = (
            "pinned by an operator"
            if better and not promoted
            else "beats the model in force"
            if better
            else "does not beat the model in force"
        )
        return self._record(
            state,
            "judged",
            candidate=cand_id,
            in_force=current,
            promoted=promoted,
            reason=why,
            budget=self.budget,
            holdout=str(holdout.path),
            judgements={"candidate": asdict(mine), "in_force": asdict(theirs)},
        )

    def retrain(
        self,
        data: Sequence[Dataset | str | Path],
        holdout: Dataset,
        *,
        overrides: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Train a candidate on top of the model in force plus ``data`` (the fleet's own
        labelled history, not ``holdout``), save it in the registry and :meth:`consider` it.
        Slow: run it in a worker, never in an event loop."""
        model = adapt(self.in_force_path(), data, overrides=overrides)
        state = self._state()
        if not state.get("in_force"):  # the candidate must not become "the newest" in force
            state["in_force"] = self.in_force_id()
            self._write(state)
        stem = "forewarn-risk-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        n = 0
        while (self.dir / f"{stem}-{n}{registry.CARD_SUFFIX}").exists():
            n += 1
        candidate = registry.save(model, self.dir, stem=f"{stem}-{n}")
        return self.consider(candidate, holdout)

    def retrain_on_history(
        self,
        history: Dataset,
        *,
        holdout_days: float = 1.0,
        overrides: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """:meth:`retrain` on the fleet's history (``store.history``'s dataset) but its last
        ``holdout_days``, judged on those days."""
        train_part, holdout = split_at(history, history.end_ms - int(holdout_days * 86_400_000))
        return self.retrain([train_part], holdout, overrides=overrides)

    def pin(self, model_id: str, *, by: str = "operator") -> dict[str, Any]:
        """Put ``model_id`` in force and keep it there until :meth:`unpin`."""
        self._path_of(model_id)
        state = self._state()
        current = self.in_force_id()
        if current != model_id:
            state["replaced"] = [*state.get("replaced", []), current]
        state["in_force"], state["pinned"] = model_id, True
        return self._record(state, "pinned", model=model_id, previous=current, by=by)

    def unpin(self, *, by: str = "operator") -> dict[str, Any]:
        """Let candidates replace the model in force again (nothing is recorded when nothing
        was pinned)."""
        state = self._state()
        if not state.get("pinned"):
            return {"action": "unpinned", "model": self.in_force_id(), "by": by, "noop": True}
        state["pinned"] = False
        return self._record(state, "unpinned", model=self.in_force_id(), by=by)

    def rollback(self, *, by: str = "operator") -> dict[str, Any]:
        """Put back the model the last promotion (or pin) replaced.

        Raises:
            Conflict: nothing was replaced.
        """
        state = self._state()
        replaced = list(state.get("replaced", []))
        if not replaced:
            raise Conflict("no earlier model to roll back to")
        current = self.in_force_id()
        state["in_force"], state["replaced"] = replaced[-1], replaced[:-1]
        return self._record(state, "rolled_back", model=replaced[-1], previous=current, by=by)
