"""The schedule visualizer: HTML page and Chrome trace.

- `hetc.viz.page`: the self-contained HTML page drawn from a `Timeline`.
- `hetc.viz.chrome`: the Trace Event format for Perfetto / chrome://tracing.
- `hetc.viz.classgap`: predicted against measured, one time class at a time.

The terminal grid (`render_grid`) is `hetc.ir.grid`, beside the program it
draws: the verifier prints it around an error and must not import the
visualizer (or pay for jinja2).
"""

__all__: list[str] = []
