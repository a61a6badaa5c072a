"""Cascades declared in TOML (`carpool serve --cascades PATH`):

    [[cascade]]
    name = "gsm8k"                    # what clients pass as `model`
    [[cascade.step]]
    model = "qwen2.5-coder-0.5b"      # a served model's name
    scorer = "tail"                   # mean | min | tail | logistic (carpool.server.cascade.scorers)
    threshold = -1.2                  # accept this step's answer when its score >= threshold
    [[cascade.step]]
    model = "qwen2.5-coder-1.5b"      # the last step answers whatever reaches it: no scorer

Optional per step: `tail_tokens` (the tail scorer's k), `weights` and `bias` (the logistic scorer's, written by
`carpool cascade calibrate`). Every mistake is a ValueError naming the cascade and the field. The same file
declares routers as [[router]] tables (carpool.server.cascade.router).
"""

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from carpool.server.cascade.router import Router, dump_router, parse_router
from carpool.server.cascade.scorers import DEFAULT_TAIL_TOKENS, Scorer

_STEP_FIELDS = {"model", "scorer", "threshold", "tail_tokens", "weights", "bias"}


@dataclass(frozen=True)
class Step:
    model: str
    scorer: Scorer | None = None  # None on the last step only
    threshold: float | None = None


@dataclass(frozen=True)
class Cascade:
    name: str
    steps: tuple[Step, ...]

    @property
    def models(self) -> list[str]:
        return [step.model for step in self.steps]


def load_cascades(path: str | Path, served: list[str] | None = None) -> dict[str, Cascade | Router]:
    """{name: Cascade or Router} from the TOML at `path` (carpool.server.cascade.router for [[router]] tables).
    With `served`, every model named must be one of them and no name may be a served model's."""
    where = f"cascades {path}"
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"--cascades: cannot read {path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{where}: not valid TOML: {error}") from error
    unknown = set(raw) - {"cascade", "router"}
    if unknown:
        raise ValueError(f"{where}: unknown table {min(unknown)!r} (only [[cascade]] and [[router]] tables)")
    tables, router_tables = raw.get("cascade", []), raw.get("router", [])
    if not isinstance(tables, list) or not isinstance(router_tables, list) or not tables + router_tables:
        raise ValueError(f"{where}: cascade: declare at least one [[cascade]] or [[router]] table")
    cascades: dict[str, Cascade | Router] = {}
    for index, table in enumerate(tables):
        cascade = _cascade(table, f"{where}: cascade[{index}]", served)
        if cascade.name in cascades:
            raise ValueError(f"{where}: cascade[{index}].name: {cascade.name!r} is declared twice")
        cascades[cascade.name] = cascade
    for index, table in enumerate(router_tables):
        router = parse_router(table, f"{where}: router[{index}]", served, cascades)
        if router.name in cascades:
            raise ValueError(f"{where}: router[{index}].name: {router.name!r} is declared twice")
        cascades[router.name] = router
    return cascades


def _cascade(table: dict, where: str, served: list[str] | None) -> Cascade:
    unknown = set(table) - {"name", "step"}
    if unknown:
        raise ValueError(f"{where}.{min(unknown)}: unknown field (a cascade has name and [[cascade.step]])")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string")
    where = f"{where} ({name!r})"
    if served is not None and name in served:
        raise ValueError(f"{where}.name: {name!r} is already a served model's name")
    steps = table.get("step")
    if not isinstance(steps, list) or len(steps) < 2:
        raise ValueError(f"{where}.step: a cascade needs at least two [[cascade.step]] tables")
    return Cascade(
        name, tuple(_step(s, f"{where}.step[{i}]", i == len(steps) - 1, served) for i, s in enumerate(steps))
    )


def _step(table: dict, where: str, last: bool, served: list[str] | None) -> Step:
    unknown = set(table) - _STEP_FIELDS
    if unknown:
        raise ValueError(f"{where}.{min(unknown)}: unknown field (known: {', '.join(sorted(_STEP_FIELDS))})")
    model = table.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}.model: must be a served model's name")
    if served is not None and model not in served:
        raise ValueError(f"{where}.model: {model!r} is not served (served: {', '.join(served)})")
    if last:
        extra = sorted(set(table) - {"model"})
        if extra:
            raise ValueError(f"{where}.{extra[0]}: the last step answers whatever reaches it; it takes no scorer")
        return Step(model)
    threshold = table.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ValueError(f"{where}.threshold: must be a finite number, got {threshold!r}")
    weights = table.get("weights")
    if weights is not None and not (
        isinstance(weights, list) and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
    ):
        raise ValueError(f"{where}.weights: must be a list of numbers")
    bias = table.get("bias", 0.0)
    if isinstance(bias, bool) or not isinstance(bias, int | float):
        raise ValueError(f"{where}.bias: must be a number")
    try:
        scorer = Scorer(
            table.get("scorer"),
            table.get("tail_tokens", DEFAULT_TAIL_TOKENS),
            None if weights is None else tuple(float(w) for w in weights),
            float(bias),
        )
    except ValueError as error:
        raise ValueError(f"{where}.{error}") from error
    return Step(model, scorer, float(threshold))


def dump_cascades(cascades: dict[str, Cascade | Router]) -> str:
    """The TOML load_cascades reads back as the same cascades and routers (comments of a hand-written file are not
    kept)."""
    lines = []
    for cascade in (c for c in cascades.values() if isinstance(c, Cascade)):
        lines += ["[[cascade]]", f"name = {_string(cascade.name)}"]
        for step in cascade.steps:
            lines += ["[[cascade.step]]", f"model = {_string(step.model)}"]
            if step.scorer is not None:
                lines += [f"scorer = {_string(step.scorer.kind)}", f"threshold = {step.threshold!r}"]
                if step.scorer.tail_tokens != DEFAULT_TAIL_TOKENS:
                    lines.append(f"tail_tokens = {step.scorer.tail_tokens}")
                if step.scorer.weights is not None:
                    lines += [
                        f"weights = [{', '.join(repr(w) for w in step.scorer.weights)}]",
                        f"bias = {step.scorer.bias!r}",
                    ]
        lines.append("")
    for router in (r for r in cascades.values() if isinstance(r, Router)):
        lines += [*dump_router(router, _string), ""]
    return "\n".join(lines)


def _string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
