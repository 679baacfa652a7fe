"""GPU names used by other systems and drivers, mapped to hetc catalog names.

Sailor writes `GH-96`, `RTX-2080`; Zorse `a100x40`, `p40`; CUDA reports
`NVIDIA A100-SXM4-40GB`. Profiles are stored under catalog names so one
lookup serves every source.
"""

from __future__ import annotations

import re

__all__ = ["SAILOR_NAMES", "ZORSE_NAMES", "catalog_name"]

SAILOR_NAMES = {
    "A100-40": "A100-40", "A100-80": "A100-80", "V100-16": "V100-16", "GH-96": "GH200",
    "RTX-2080": "RTX2080Ti", "RTX-3090": "RTX3090", "Titan-RTX": "TitanRTX", "P100-16": "P100",
}

ZORSE_NAMES = {
    "a100x40": "A100-40", "a100x80": "A100-80", "h100-nvl": "H100-NVL", "a6000": "A6000",
    "l40s": "L40S", "l4": "L4", "a10g": "A10G", "t4": "T4", "p40": "P40", "p100": "P100",
    "v100x16": "V100-16", "v100x32": "V100-32", "v100-pciex16": "V100-16", "rtx3090": "RTX3090",
    "w6800": "W6800",
}

# Substrings of a CUDA device name, most specific first.
_CUDA_PATTERNS = [
    (r"GH200", "GH200"), (r"H200", "H200"), (r"H100.*NVL", "H100-NVL"), (r"H100", "H100"),
    (r"A100.*80", "A100-80"), (r"A100", "A100-40"), (r"A10G", "A10G"), (r"L40S", "L40S"), (r"\bL4\b", "L4"),
    (r"V100.*32", "V100-32"), (r"V100", "V100-16"), (r"T4", "T4"), (r"RTX A6000|A6000", "A6000"),
    (r"3090", "RTX3090"), (r"2080 Ti|2080", "RTX2080Ti"), (r"TITAN RTX", "TitanRTX"), (r"P100", "P100"),
    (r"P40", "P40"), (r"W6800", "W6800"),
]


def catalog_name(name: str) -> str:
    """The catalog name for `name` from any source; unknown names come back unchanged."""
    if name in SAILOR_NAMES:
        return SAILOR_NAMES[name]
    if name.lower() in ZORSE_NAMES:
        return ZORSE_NAMES[name.lower()]
    for pattern, catalog in _CUDA_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return catalog
    return name
