"""Hugging Face models: configs as ModelSpec presets, safetensors weights checked and read.

    config.py    config.json -> the fields of a ModelSpec (a `Preset` the converter applies)
    names.py     hetc parameter names <-> Hugging Face tensor names, with their full shapes
    weights.py   safetensors headers (single file or sharded with an index): checks and lazy slices
    files.py     the files of a model directory hetc reads (and an export writes)

A whole ModelSpec from a directory is `hetc.frontend.convert.import_model` (the converter
applies the preset); a checkpoint written back as a Hugging Face directory is
runtime/hf_export.py (it reads the runtime's checkpoints).
"""
