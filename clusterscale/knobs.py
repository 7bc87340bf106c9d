"""The config schema: a knob (field + doc + allowed values), a Section of knobs, and a section composed of
components (train). Torch-free and import-free, so that every component's config module can use it."""
from __future__ import annotations

import copy
import dataclasses
import math
import unicodedata
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from clusterscale.errors import UserError, bounded_repr
from clusterscale.redact import ENCODE_ADVICE, redact_uri, uri_problem


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Bounds:
    """The allowed values of a numeric knob: above `low` (or at it when low_inclusive) and below `high`.

    note says what a boundary value means ('0 = automatic'). A null value (of a key that allows null) is not checked."""
    low: float = 0
    low_inclusive: bool = True
    high: float | None = None
    note: str = ""

    def check(self, key: str, value: float) -> None:
        above_low = value >= self.low if self.low_inclusive else value > self.low
        if above_low and (self.high is None or value < self.high):
            return
        if self.high is not None:
            allowed = f"in [{self.low}, {self.high})"
        else:
            allowed = f">= {self.low}" if self.low_inclusive else f"greater than {self.low}"
        note = f" ({self.note})" if self.note else ""
        raise ConfigError(f"{key} must be {allowed}{note}, got {bounded_repr(value)}.")


POSITIVE = Bounds(low_inclusive=False)
NON_NEGATIVE = Bounds()
FRACTION = Bounds(high=1)  # [0, 1)


def zero_means(meaning: str) -> Bounds:
    """>= 0, where 0 has a special meaning that the error names (e.g. 'automatic', 'off')."""
    return Bounds(note=f"0 = {meaning}")


class Registry:
    """The named choices of a knob that users extend (samplers, losses, dedup keep rules): a name -> implementation
    map, filled by the modules of `package`, each of which registers its own (`@REGISTRY.register` on a class with
    a `name`). A new choice is then one module in that package: the registry imports every module of it the first
    time it is asked (a plugin discovery, like Python's entry points: the config layer names the package, it never
    imports it directly), so a knob whose choices are a Registry validates against every registered name.

    `first`: the names listed first, in this order (the built-ins: the default first); any other in name order."""

    def __init__(self, key: str, package: str, first: tuple[str, ...] = ()):
        self.key, self.package, self.first = key, package, first
        self._items: dict[str, Any] = {}
        self._discovered = False

    def register(self, item: Any) -> Any:
        """Register a class (or an instance) under its `name`; returns it, so it serves as a class decorator."""
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.key}: a registered choice needs a non-empty `name`, got {item!r}.")
        if name in self._items and self._items[name] is not item:
            raise ValueError(f"{self.key}: {name!r} is registered twice ({self._items[name]!r} and {item!r}).")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Forget `name` (a test's temporary registration)."""
        self._items.pop(name, None)

    def discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        import importlib
        import pkgutil

        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{module.name}")

    def names(self) -> tuple[str, ...]:
        self.discover()
        rank = {name: i for i, name in enumerate(self.first)}
        return tuple(sorted(self._items, key=lambda n: (rank.get(n, len(rank)), n)))

    def get(self, name: str) -> Any:
        """The implementation registered as `name`; an unknown name is a ConfigError naming the registered ones."""
        self.discover()
        if name not in self._items:
            raise ConfigError(f"{self.key} must be one of {', '.join(self.names())}; got {bounded_repr(name)} "
                              f"(a new one is a module in {self.package.replace('.', '/')}/ that registers it).")
        return self._items[name]

    def docs(self) -> list[tuple[str, str]]:
        """(name, its one-line doc) of every registered choice, in names() order: what `clusterscale config` lists."""
        return [(name, str(getattr(self.get(name), "doc", "") or "")) for name in self.names()]

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        self.discover()
        return name in self._items

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {self.package!r})"


def knob(default: Any, doc: str, choices: tuple | Registry | None = None, affects_output: bool = True,
         bounds: Bounds | None = None, added: bool = False, joins_lists: bool = False):
    """A config field with its documentation, allowed values, and whether it changes a stage's output.

    Fields with affects_output=False (worker counts, batch sizes of inference) may change between
    reruns without invalidating completed work. bounds: the allowed range of a number (checked by validate).
    added: a key added after run directories were made (tests/fixtures/config_before): at its default it stays out
    of fingerprints, so those runs are reused, not redone; any other value enters them like every key's.
    joins_lists: a text knob whose value may name several things comma-separated also takes a YAML list of texts
    (joined with commas).
    """
    meta = {"doc": doc, "choices": choices, "affects_output": affects_output, "bounds": bounds, "added": added,
            "joins_lists": joins_lists}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """Base of the config dataclasses: `section` is the YAML name; validate() checks every knob's bounds, then
    the rules between keys (check_rules). Errors name the key as the user writes it ('section.key')."""
    section: ClassVar[str]

    def knobs(self) -> dict[str, tuple[Section, dataclasses.Field]]:
        """YAML key -> (the object holding it, its field), in documentation order."""
        return {f.name: (self, f) for f in fields(self)}

    def key(self, name: str) -> str:
        """'section.name', the key of field `name` as written in YAML and in --set."""
        if name not in self.knobs():
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        return f"{self.section}.{name}"

    def check_bounds(self) -> None:
        for name, (owner, f) in self.knobs().items():
            value = getattr(owner, name)
            if f.metadata["bounds"] is not None and isinstance(value, (int, float)):  # not null, not 'auto'
                f.metadata["bounds"].check(f"{self.section}.{name}", value)  # (dedup has a field named key)

    def check_rules(self) -> None:
        """Rules between this section's keys (a section with such rules overrides it)."""

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value is out of its bounds or breaks a rule."""
        self.check_bounds()
        self.check_rules()

    def to_dict(self) -> dict:
        """The flat {key: value} of the section, as in YAML and RUN/config.yaml (values copied)."""
        return {name: copy.deepcopy(getattr(owner, name)) for name, (owner, _) in self.knobs().items()}

    def get_key(self, name: str) -> Any:
        """The value of YAML key `name` (in whichever component holds it)."""
        owner, _ = self.knobs()[name]
        return getattr(owner, name)

    def set_key(self, name: str, value: Any) -> None:
        owner, _ = self.knobs()[name]
        setattr(owner, name, value)


class ComposedSection(Section):
    """A section whose flat YAML keys belong to its components (each field a Section of its own, kept next to
    the code it configures): the key -> component map is the union of the components' fields."""

    def components(self) -> list[Section]:
        return [getattr(self, f.name) for f in fields(self)]

    def knobs(self) -> dict[str, tuple[Section, dataclasses.Field]]:
        found: dict[str, tuple[Section, dataclasses.Field]] = {}
        for component in self.components():
            for name, entry in component.knobs().items():
                if name in found:  # one YAML key, one owner
                    raise TypeError(f"{self.section}.{name} is a field of both {type(found[name][0]).__name__} "
                                    f"and {type(component).__name__}")
                found[name] = entry
        return found

    def check_rules(self) -> None:
        for component in self.components():
            component.check_rules()

    @classmethod
    def of(cls, **keys: Any):
        """The section with flat keys set (as in YAML, not checked): TrainConfig.of(lr=1e-3, init='scratch')."""
        obj = cls()
        for name, value in keys.items():
            if name not in obj.knobs():
                raise TypeError(f"{cls.__name__} has no key {name!r}")
            obj.set_key(name, value)
        return obj


def output_keys(section_obj: Section) -> dict:
    """The keys of a section that change a stage's output, with their values: what its fingerprint hashes."""
    return {name: getattr(owner, name) for name, (owner, f) in section_obj.knobs().items()
            if f.metadata["affects_output"] and not (f.metadata["added"] and getattr(owner, name) == _default(f))}


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def check_type(key: str, f: dataclasses.Field, value: Any) -> Any:
    """value (from YAML or --set) checked against the field's type and choices; a float from a string is parsed."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} must not be null (default: {bounded_repr(default)}).")
    kind = type(default) if default is not None else {"int | None": int, "str | None": str}.get(str(f.type), str)
    if str(f.type) == "int | str":  # a count or a named setting ('auto'), the strings being the choices
        kind = str if isinstance(value, str) else int
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {bounded_repr(value)}.")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {bounded_repr(value)}.")
        if abs(value) >= 2**63:  # counts and seeds reach numpy/torch as int64
            raise ConfigError(f"{key} is out of range (|value| < 2**63), got {bounded_repr(value)}.")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {bounded_repr(value)}.")
        value = float(value)
        if not math.isfinite(value):  # NaN passes every range check below and fails only at step 0
            raise ConfigError(f"{key} must be a finite number, got {value}; the default is {default}.")
    elif kind is str:
        if isinstance(value, list) and value and f.metadata.get("joins_lists") and all(
                isinstance(v, str) for v in value):
            value = ",".join(value)  # [negative_1, negative_2] as written in YAML
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {bounded_repr(value)}.")
        if key.endswith("_prompt"):  # text put before texts, not a path: newlines and tabs are its own
            refuse_control_characters(key, value, allowed=PROMPT_CONTROLS)
        else:
            check_text(key, value)
    elif kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {bounded_repr(value)}.")
    choices = f.metadata["choices"]
    if choices and kind is not int and value not in choices:
        either = " or an integer" if str(f.type) == "int | str" else ""
        raise ConfigError(f"{key} must be one of {', '.join(choices)}{either}; got {bounded_repr(value)}.")
    return value


_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL character"}


PROMPT_CONTROLS = "\n\t"  # what a prompt may hold ("Instruct: ...\nQuery: " of instruction-tuned embedders)


def refuse_control_characters(key: str, value: str, allowed: str = "") -> None:
    """Refuse a newline, NUL or other control character in `value` (but those in `allowed`): no path, URI, model
    id, name or column holds one, so it is a paste mistake (YAML would even fold a newline into a space, naming a
    path that does not exist). The message names `key` and shows the value escaped (repr), redacted."""
    char = next((ch for ch in value if unicodedata.category(ch) == "Cc" and ch not in allowed), None)
    if char is None:
        return
    shown = redact_uri(repr(value))  # escaped first: the redaction of a URI's secret works line by line
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise ConfigError(f"{key} holds {_CONTROL_NAMES.get(char, f'the control character {char!r}')}: {shown}. No "
                      f"path, URI, name or column holds one; most likely it came with a paste: give the value again "
                      f"on one line, without it.")


def check_text(key: str, value: str) -> None:
    """Refuse a string value (a config key's, a path or URI on the command line) that holds a control character,
    or is a URI that does not parse or whose credentials are ambiguous (redact.uri_problem): cheap and offline, so
    it runs before any work or network request. The URI is shown redacted."""
    refuse_control_characters(key, value)
    problem = uri_problem(value)
    if problem:
        raise ConfigError(f"{key} {redact_uri(value)} is not a valid URI: {problem}. {ENCODE_ADVICE}.")
