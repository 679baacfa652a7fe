"""The front end: `.het` text -> syntax tree -> a typed `Spec`, and back to text.

`syntax` parses (grammar/), `tree` is the syntax tree, `comments` keeps
comments through a rewrite, `convert` and `values` turn a tree into a Spec
by the schema (`schema`), `printer` writes a Spec as text, `load` reads a
file with its imports. Validation and everything after it are passes/;
`hetc.compiler.load_checked` runs the front end and validation in one call.
"""

__all__: list[str] = []
