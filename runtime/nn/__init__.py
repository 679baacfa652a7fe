"""The model's layers and their parallel forms (tensor, context and expert parallelism).

What a ministage runs: `model.py` builds a stage's modules from the spec;
`tensor_parallel.py` holds the sharded projections and their process-group
collectives; the rest are one layer kind a file. Nothing here knows about
instructions or schedules (that is runtime/interpreter.py).
"""

__all__: list[str] = []
