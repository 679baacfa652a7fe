"""The file readers behind the cost model's profiles: Sailor and Zorse data folders, the device
catalog and `hetc profile` files, and `load_profiles`, which reads each and merges what they read
(passes/cost/profiles.py holds the types; the readers build on it, the cost model never imports them)."""

from __future__ import annotations

import logging
from pathlib import Path

from hetc.passes.cost.profiles import ProfileError, Profiles
from hetc.passes.cost.sources import hetc_profile, sailor_data, zorse_data
from hetc.ir.userfile import regular_file_problem

__all__ = ["load_profiles"]

log = logging.getLogger(__name__)


def load_profiles(paths: list[str | Path]) -> Profiles:
    """Read each path: a `hetc profile` JSON file, a Sailor data folder or a Zorse data folder."""
    out = Profiles()
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            out = out.merged(hetc_profile.read_profile(path))
        elif sailor_data.looks_like(path):
            out = out.merged(sailor_data.read_sailor(path))
        elif zorse_data.looks_like(path):
            out = out.merged(zorse_data.read_zorse(path))
        elif path.is_dir():
            raise ProfileError(f"'{path}' is neither a Sailor data folder (profiles/<MODEL>/<GPU>/"
                               "profile.json) nor a Zorse one (data/model_latencies.json)")
        else:   # missing, or a pipe or a device: never opened (Note [untrusted paths])
            raise ProfileError(regular_file_problem(path, "profile"))
    for r in out.rejected:
        log.info("%s: %s: %s", r.model, r.where, r.why)
    return out
