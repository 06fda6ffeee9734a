"""A twinserve-calibrate terms file, `{"cost_model": NAME, "terms": {term: value}}`; one fitted on
another cost model is refused, since a term of the same name means another thing there."""
from __future__ import annotations

from sim.core.json_files import read_json_object

KEY = "cost_model.terms_file"


def read_terms_file(path: str, cost_model: str, terms: tuple[str, ...]) -> dict[str, float]:
    """The fitted terms of the file at `path` for `cost_model`, which takes `terms`."""
    where = f"{KEY}={path}"
    data = read_json_object(path, where)
    fitted = data.get("terms")
    if not isinstance(fitted, dict) or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool)
            for value in fitted.values()):
        raise ValueError(f"{where}: not a twinserve-calibrate profile (a JSON object with "
                         f"numeric 'terms')")
    fitted_on = data.get("cost_model")
    if fitted_on is not None and fitted_on != cost_model:
        raise ValueError(f"{where}: fitted on cost_model={fitted_on}, not on this run's "
                         f"cost_model={cost_model}, where its terms mean other things; give "
                         f"cost_model={fitted_on}, or fit a file on cost_model={cost_model}")
    unknown = [name for name in fitted if name not in terms]
    if unknown:
        settings = " ".join(f"{name}={fitted[name]!r}" for name in unknown)
        raise ValueError(f"{where}: {', '.join(unknown)} not a term of cost_model={cost_model} "
                         f"({', '.join(terms)}); give it on the command line instead: {settings}")
    return {name: float(value) for name, value in fitted.items()}


def with_fitted_terms(cost_model: str, terms_file: str | None, **terms) -> dict:
    """`terms` (a cost model's configured values, by name), those the terms file fitted
    replacing them; the file may set only these."""
    if terms_file is None:
        return terms
    return {**terms, **read_terms_file(terms_file, cost_model, tuple(terms))}
