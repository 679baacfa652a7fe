"""Load and validate a spec in one call: the front door every verb uses."""

from __future__ import annotations

from pathlib import Path

from hetc.errors import SpecError
from hetc.load import LoadedSpec, load_spec
from hetc.passes.validate import Checked, check_spec
from hetc.passes.validate_fit import estimate_overflows

__all__ = ["load_checked"]


def load_checked(path: str | Path, require_complete: bool = False,
                 require_fit: bool = False) -> tuple[LoadedSpec, Checked]:
    """Parse, import, convert and validate `path`; raise one SpecError with every problem.

    `require_fit` also asks the cost model whether an explicit plan fits in
    device memory (`hetc check`); explain leaves it out, to show the numbers
    of a plan that does not fit, and compile asks the verifier instead.
    """
    loaded = load_spec(path)
    checked = check_spec(loaded.spec, loaded.path.parent)
    if require_fit and checked.pipeline is not None and (overflows := estimate_overflows(checked)):
        raise SpecError(overflows)
    if require_complete and not loaded.spec.is_complete:
        missing = [k for k in ("model", "cluster", "train", "parallel") if getattr(loaded.spec, k) is None]
        raise SpecError.at(loaded.spec.span, f"the spec has no {', '.join(missing)} block"
                           f"{'s' if len(missing) > 1 else ''}; this command needs a whole spec")
    return loaded, checked
