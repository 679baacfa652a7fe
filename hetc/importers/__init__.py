"""Turn other systems' inputs (Sailor, Zorse) into .het specs: `hetc import sailor|zorse`."""
