"""The schedule visualizer: HTML page, Chrome trace and terminal grid.

- `hetc.viz.grid`: a steps x ranks text grid (`render_grid`), also what the
  verifier prints around an error.
- `hetc.viz.page`: the self-contained HTML page drawn from a `Timeline`.
- `hetc.viz.chrome`: the Trace Event format for Perfetto / chrome://tracing.

Submodules are imported on demand so that the verifier, which needs only the
grid, does not pay for jinja2.
"""

__all__: list[str] = []
