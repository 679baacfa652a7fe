"""Hugging Face models: configs as ModelSpecs, safetensors weights in and out.

    config.py    config.json -> the fields of a ModelSpec (a `Preset` the converter applies)
    names.py     hetc parameter names <-> Hugging Face tensor names, with their full shapes
    weights.py   safetensors headers (single file or sharded with an index): checks and lazy slices
    export.py    a hetc checkpoint -> config.json + sharded safetensors with an index
"""
