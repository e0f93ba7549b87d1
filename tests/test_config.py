"""The one config parser: typed sections checked at construction, unknown keys refused, `--set` overrides."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest
from gemrec.config import ConfigError, Section, apply_overrides, build_sections, choices, parse_override


@dataclass(frozen=True)
class Example(Section):
    SECTION: ClassVar[str] = "example"

    mode: Literal["fast", "slow"] = "fast"
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    name: str = "x"
    dtype: Literal["bfloat16", "float32"] | None = None
    sizes: tuple[int, ...] = (1, 2)
    pair: tuple[float, float] = (0.9, 0.98)
    kinds: tuple[Literal["a", "b"], ...] = ()
    weights: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        self.require(self.count >= 1, "count", "must be >= 1")


def test_values_are_checked_against_their_annotation_and_widened():
    made = Example.from_dict(
        {"ratio": 2, "sizes": [3, 4], "pair": [1, 2], "kinds": ["b"], "weights": {"like": 1}, "dtype": "bfloat16"}
    )
    assert made.ratio == 2.0 and isinstance(made.ratio, float)
    assert made.sizes == (3, 4) and made.pair == (1.0, 2.0) and made.kinds == ("b",)
    assert made.weights == {"like": 1.0} and made.dtype == "bfloat16"
    assert Example(dtype="").dtype is None  # type: ignore[arg-type]  # TOML has no null: "" means unset
    assert Example().to_dict()["sizes"] == (1, 2)
    assert choices(Example, "mode") == ("fast", "slow")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"mode": "medium"}, "example.mode = 'medium': must be one of 'fast', 'slow'"),
        ({"count": 1.5}, "example.count = 1.5: must be an integer"),
        ({"count": True}, "example.count = True: must be an integer"),
        ({"count": 0}, "example.count = 0: must be >= 1"),
        ({"flag": 1}, "example.flag = 1: must be true or false"),
        ({"ratio": "half"}, "example.ratio = 'half': must be a number"),
        ({"name": 3}, "example.name = 3: must be a string"),
        ({"dtype": "float7"}, "example.dtype = 'float7': must be one of 'bfloat16', 'float32' or unset \\(''\\)"),
        ({"sizes": [1, "2"]}, r"example.sizes = \[1, '2'\]: must be a list of integers"),
        ({"pair": [1]}, r"example.pair = \[1\]: must be a list of 2 values \(a number, a number\)"),
        ({"kinds": ["c"]}, r"example.kinds = \['c'\]: must be a list of values in 'a', 'b'"),
        ({"weights": {"like": "x"}}, r"example.weights = \{'like': 'x'\}: must be a table of numbers"),
        ({"modes": "fast"}, r"unknown setting example.modes = 'fast'; \[example\] takes count, dtype, flag, kinds"),
    ],
)
def test_bad_values_name_section_key_value_and_what_is_allowed(values, message):
    with pytest.raises(ConfigError, match=message):
        Example.from_dict(values)


def test_a_section_must_be_a_table():
    with pytest.raises(ConfigError, match=r"\[example\] must be a table"):
        Example.from_dict(3)  # type: ignore[arg-type]


def test_overrides_are_toml_literals_else_strings():
    assert parse_override("train.steps=50") == ("train", "steps", 50)
    assert parse_override("model.seq_causal=false") == ("model", "seq_causal", False)
    assert parse_override('model.arch="dlrm"') == ("model", "arch", "dlrm")
    assert parse_override("model.arch=dlrm") == ("model", "arch", "dlrm")
    assert parse_override("model.dlrm_top_mlp=[8, 4]") == ("model", "dlrm_top_mlp", [8, 4])
    for bad in ("steps=3", "train.steps", "a.b.c=1", ".steps=1"):
        with pytest.raises(ConfigError, match="section.key"):
            parse_override(bad)
    raw = {"example": {"count": 2}}
    merged = apply_overrides(raw, ["example.mode=slow", "other.x=1"])
    assert merged == {"example": {"count": 2, "mode": "slow"}, "other": {"x": 1}}
    assert raw == {"example": {"count": 2}}  # the input is not changed


def test_sections_are_built_together_and_unknown_tables_refused():
    built = build_sections(apply_overrides({}, ["example.count=3"]), {"example": Example})
    assert built["example"] == Example(count=3)
    with pytest.raises(ConfigError, match="unknown section.*exampel; this takes example"):
        build_sections(apply_overrides({}, ["exampel.count=3"]), {"example": Example})
