"""Build typed Spec nodes from syntax trees, driven by the fields' metadata.

Errors are collected, not raised one at a time: a block with a bad value
still reports its other bad values and its missing keys. `Converter.errors`
ends up holding every diagnostic; `to_spec` raises them together. The
value rules are in `hetc.frontend.values`, the schema in `hetc.frontend.schema`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, TypeVar

from hetc.frontend import syntax
from hetc.ir.errors import Diagnostic, Span, SpecError, did_you_mean
from hetc.frontend.schema import FieldInfo, fields_of, normalize_key
from hetc.hf.config import CONFIG_FILE, TRAINING_FIELDS, HfError, Preset, model_preset, read_config
from hetc.ir.spec import ModelSpec, Node, Spec, declared_path
from hetc.frontend.values import ValueConverter, is_enum, out_of_bounds, words

__all__ = ["Converter", "FieldInfo", "fields_of", "import_model", "normalize_key", "to_spec"]

N = TypeVar("N", bound=Node)
# a statement a block's body may hold: `key = value` or a nested block
Statement = syntax.Attr | syntax.Block
Infos = tuple[FieldInfo, ...]


class Converter(ValueConverter):
    """The block rules: labels, known keys and blocks, duplicates, required fields."""

    def block(self, cls: type[N], items: tuple[syntax.Item, ...], span: Span, what: str,
              head: syntax.Block | None = None, preset: Preset | None = None) -> N | None:
        """Build `cls` from a block's items; `head` is the block itself (for its labels); `preset`
        fills the fields the items leave out (Note [hf presets])."""
        infos = fields_of(cls)
        values: dict[str, Any] = {}   # cls's own field names, each value converted for its field
        spans: dict[str, Span] = {}
        failed = False
        if cls is ModelSpec and preset is None:
            preset, ok = self._hf_preset(infos, items)
            if not ok:
                return None
        if head is not None:
            failed |= not self._labels(infos, head, values, spans)
        seen: dict[str, Span] = {}
        written: set[str] = set()  # fields the user wrote, even if wrongly: not "missing"
        for item in items:
            if isinstance(item, syntax.Comment):
                continue
            if isinstance(item, syntax.Use):
                self.error(item.span, "'use' is only allowed at the top of a file")
                continue
            written.update(_claimed_fields(infos, item))
            info = self._find(infos, item, what)
            if info is None:
                failed = True
                continue
            key = info.name if not (isinstance(item, syntax.Block) and info.many) else None
            if key is not None and key in seen:
                self.error(item.kind_span if isinstance(item, syntax.Block) else item.key_span,
                           _duplicate_message(item, info, what), notes=((seen[key], "first defined here"),))
                failed = True
                continue
            if key is not None:
                seen[key] = item.span
            nested = preset.values.get(info.name) if preset is not None else None
            ok = self._assign(info, item, values, spans, nested if isinstance(nested, Preset) else None)
            failed |= not ok
        if preset is not None and not failed:
            failed |= not self._apply_preset(infos, preset, values, spans, written, what)
        elif preset is not None:
            written.update(preset.values)     # set by the config: not missing, whatever else failed
        failed |= not self._required(infos, written, span, what)
        if failed:
            return None
        return cls(**values, span=span, spans=tuple(spans.items()))

    def _labels(self, infos: Infos, head: syntax.Block, values: dict[str, Any], spans: dict[str, Span]) -> bool:
        """The block's name(s): `model NAME`, `link A <-> B`, `optimizer adamw`."""
        label_infos = [i for i in infos if i.meta.label]
        given = [lab for lab in (head.label, head.peer) if lab is not None]
        form = {0: "", 1: " NAME", 2: " A <-> B"}[len(label_infos)]
        if len(given) > len(label_infos):
            self.error(head.kind_span, f"{head.kind} takes {_count(len(label_infos), 'name')}, got "
                                       f"{len(given)}: write {head.kind}{form} {{ ... }}")
            return False
        for info, text, span in zip(label_infos, given, head.label_spans or (head.kind_span,) * 2):
            value = self._enum(info.base, text, span, f"'{head.kind}'") if is_enum(info.base) else text
            if value is None:
                return False
            values[info.name] = value
            spans[info.name] = span
        if any(info.required for info in label_infos[len(given):]):
            need = "two ends" if len(label_infos) == 2 else "a name"
            self.error(head.kind_span, f"{head.kind} needs {need}: {head.kind}{form} {{ ... }}")
            return False
        return True

    def _find(self, infos: Infos, item: Statement, what: str) -> FieldInfo | None:
        if isinstance(item, syntax.Block):
            kind = normalize_key(item.kind)
            for info in infos:
                if info.meta.block and kind in (info.meta.block, *info.meta.aliases):
                    return info
            blocks = [i.meta.block for i in infos if i.meta.block]
            if any(kind in i.keys for i in infos):
                self.error(item.kind_span, f"'{item.kind}' is a value here: write {item.kind} = ...")
                return None
            hint = did_you_mean(kind, blocks)
            allowed = f"; {what} holds {words(blocks)}" if blocks and not hint else ""
            self.error(item.kind_span, f"unknown block '{item.kind}' in {what}{hint}{allowed}")
            return None
        key = normalize_key(item.key)
        for info in infos:   # `stage = auto` names the field of the `stage` blocks, as `stages = auto` does
            if (key in info.keys or key == info.meta.block) and not info.meta.label:
                return info
        names = [i.meta.block or i.name for i in infos if not i.meta.label]
        every = [k for i in infos if not i.meta.label for k in i.keys]
        hint = did_you_mean(key, every)
        self.error(item.key_span, f"unknown key '{item.key}' in {what}{hint}"
                   + ("" if hint else f"; known keys: {', '.join(names)}"))
        return None

    def _required(self, infos: Infos, written: set[str], span: Span, what: str) -> bool:
        missing = [i.name for i in infos if i.required and i.name not in written and not i.meta.label]
        if missing:
            self.error(span, f"{what} is missing {words(missing, quote=True)}")
            return False
        return True

    def _hf_preset(self, infos: Infos, items: tuple[syntax.Item, ...]) -> tuple[Preset | None, bool]:
        """The preset of a model block's `hf = "DIR"` (None without one); False when DIR is unusable."""
        info = next(i for i in infos if i.name == "hf")
        item = next((i for i in items if isinstance(i, syntax.Attr) and normalize_key(i.key) in info.keys), None)
        if item is None:
            return None, True
        text = self.value(info, item.value, f"'{item.key}'")
        if text is None:
            return None, False
        where = item.value.span
        try:
            return model_preset(read_config(declared_path(text, where)), f"{text}/config.json", where), True
        except HfError as err:
            self.error(where, str(err))
            return None, False

    def _apply_preset(self, infos: Infos, preset: Preset, values: dict[str, Any], spans: dict[str, Span],
                      written: set[str], what: str) -> bool:
        """Fill the fields the block left out from `preset`; a locked field written otherwise is an error."""
        ok = True
        for name, value in preset.values.items():
            if name in values:
                if name in preset.locked and not isinstance(value, Preset) and values[name] != value:
                    self.error(spans[name], f"'{name}' contradicts {preset.source}, which says "
                                            f"{_shown(value)}; beside hf only training fields may be set "
                                            f"({', '.join(sorted(TRAINING_FIELDS - {'hf'}))})")
                    ok = False
                continue
            info = next(i for i in infos if i.name == name)
            if isinstance(value, Preset):
                value = self.block(info.base, (), preset.span, f"'{name}' of {preset.source}", preset=value)
                if value is None:
                    return False
            elif isinstance(value, (int, float)) and not isinstance(value, bool):   # as a key's value is
                problem = out_of_bounds(value, info, f"'{name}' of {preset.source}", f"{value:g}")
                if problem:
                    self.error(preset.span, problem)
                    ok = False
                    continue
            values[name], spans[name] = value, preset.span
            written.add(name)
        for name, (limit, why) in preset.limits.items():
            if values.get(name, 0) > limit:
                self.error(spans[name], f"{name} ({values[name]}) exceeds {why}")
                ok = False
        return ok

    def _assign(self, info: FieldInfo, item: Statement, values: dict[str, Any], spans: dict[str, Span],
                preset: Preset | None = None) -> bool:
        if isinstance(item, syntax.Block):
            sub = self.block(info.base, item.items, item.span, _describe(item), head=item, preset=preset)
            if sub is None:
                return False
            if info.many:
                prior = values.get(info.name)
                values[info.name] = (prior if isinstance(prior, tuple) else ()) + (sub,)
            else:
                values[info.name] = sub
            spans.setdefault(info.name, item.span)
            return True
        spans[info.name] = item.value.span
        value = self.value(info, item.value, f"'{item.key}'")
        if value is None:
            return False
        values[info.name] = value
        return True


def _claimed_fields(infos: Infos, item: Statement) -> list[str]:
    """The field an item names by its key or block kind, however it is written; for an unknown one, the
    fields it is a misspelling of (`hiden`: hidden). Its own error says "did you mean 'hidden'?", and a
    "missing 'hidden'" beside it would only echo that (issue 33)."""
    key = normalize_key(item.kind if isinstance(item, syntax.Block) else item.key)
    named = [i.name for i in infos if key in i.keys or key == i.meta.block]
    if named:
        return named
    spellings = {k: i.name for i in infos if not i.meta.label for k in (*i.keys, *filter(None, [i.meta.block]))}
    return [spellings[guess] for guess in re.findall(r"'([^']+)'", did_you_mean(key, list(spellings)))
            if guess in spellings]


def _shown(value: Any) -> str:
    if isinstance(value, Node) or value is None:
        return "none" if value is None else f"another {type(value).__name__}"
    return str(getattr(value, "value", value))


def _count(n: int, noun: str) -> str:
    return "no name" if n == 0 else f"{('one', 'two')[n - 1] if n <= 2 else n} {noun}{'s' if n > 1 else ''}"


def _describe(block: syntax.Block) -> str:
    if block.label is None:
        return f"'{block.kind}'"
    if block.peer is None:
        return f"{block.kind} '{block.label}'"
    return f"{block.kind} '{block.label}' <-> '{block.peer}'"


def _duplicate_message(item: Statement, info: FieldInfo, what: str) -> str:
    if isinstance(item, syntax.Block):
        return f"duplicate '{item.kind}' block in {what}"
    alias = normalize_key(item.key) != info.name
    return f"duplicate '{item.key}' in {what}" + (f": it is another name for '{info.name}'" if alias else "")


def to_spec(items: list[syntax.Item], span: Span) -> Spec:
    """Convert the merged top-level items of a spec and its imports."""
    conv = Converter()
    spec = conv.block(Spec, tuple(items), span, what="the spec")
    if conv.errors or spec is None:
        raise SpecError(conv.errors or [Diagnostic(span, "empty spec")])
    return spec


def import_model(directory: Path, name: str) -> ModelSpec:
    """The explicit ModelSpec DIR/config.json describes (`hetc import hf`); HfError or SpecError."""
    conv = Converter()
    where = Span.file_start(Path(directory) / CONFIG_FILE)   # what an error in its values points at
    preset = model_preset(read_config(directory), where.file, where)
    model = conv.block(ModelSpec, (), where, "model", preset=preset)
    if conv.errors or not isinstance(model, ModelSpec):
        raise SpecError(conv.errors)
    return dataclasses.replace(model, name=name)
