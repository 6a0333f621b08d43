"""The [model] section: a family, and the fields that family owns.

Each family is a frozen dataclass of its own fields with its own `validate()`: `GptFields` (the
built-in GPT), `MoeGptFields` (the GPT with a mixture-of-experts feed-forward: every GPT field plus
its own), `HfFields` (a Hugging Face model) and `BuilderFields` (your own `py:FILE.py:FUNCTION`, or a
name an installed package registers, both given `args`). `FAMILY_FIELDS` is the registry.

In TOML the section stays one flat table — `family`, `init` and the family's keys — so that every
spec file and every run directory written before keeps loading; the loader reads `family` first
and hands the other keys to that family's dataclass, so a key of another family is named as such
("model.moe_experts belongs to family \"moe-gpt\"") instead of being silently carried. Code reads
`spec.model.fields`, typed by family, and converts it explicitly (`GPTConfig.from_fields`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least, choice, divisors, positive

MOE_BALANCE = ("aux-loss", "bias", "none")
MOE_ROUTING = ("dropless", "capacity")
MODEL_INITS = ("meta", "eager")
_PY_FAMILY = re.compile(r"py:.+\.py:[A-Za-z_][A-Za-z0-9_]*")
_REGISTERED_FAMILY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class GptFields:
    """Family "gpt": the built-in decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query
    attention). The vocabulary comes from the tokenizer (`data.vocab_size`)."""

    n_layers: int = 4
    d_model: int = 192
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_hidden: int = 0  # 0 -> 8/3 * d_model rounded up to a multiple of 64 (SwiGLU)
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def validate(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads"):
            positive(f"model.{name}", getattr(self, name))
        at_least("model.ffn_hidden", self.ffn_hidden, 0)
        if self.d_model % self.n_heads:
            raise SpecError(
                f"model.d_model ({self.d_model}) is not divisible by model.n_heads "
                f"({self.n_heads}), so heads would have unequal widths. Choose n_heads among "
                f"{divisors(self.d_model)} (the divisors of d_model).")
        if (self.d_model // self.n_heads) % 2:
            raise SpecError(
                f"head width d_model/n_heads = {self.d_model // self.n_heads} is odd; rotary "
                "embeddings rotate pairs of channels and need an even head width. Change "
                "model.d_model or model.n_heads.")
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                f"model.n_heads ({self.n_heads}) is not a multiple of model.n_kv_heads "
                f"({self.n_kv_heads}); grouped-query attention shares each KV head among "
                f"n_heads/n_kv_heads query heads. Choose n_kv_heads among {divisors(self.n_heads)}.")
        positive("model.rope_theta", self.rope_theta)
        positive("model.norm_eps", self.norm_eps)
        positive("model.init_std", self.init_std)

    @property
    def ffn_width(self) -> int:
        """The SwiGLU hidden size: `ffn_hidden`, or 8/3 x d_model rounded up to a multiple of 64
        (the one place this rule is written: the model and the planner's preset both read it)."""
        return self.ffn_hidden or (int(8 * self.d_model / 3) + 63) // 64 * 64


@dataclass(frozen=True)
class MoeGptFields(GptFields):
    """Family "moe-gpt" (`shardwise.models.moe`): the GPT with a mixture-of-experts feed-forward;
    every key of family "gpt", plus these."""

    moe_experts: int = 8
    moe_top_k: int = 2
    moe_ffn_hidden: int = 0  # per expert; 0 -> ffn_hidden's rule
    moe_shared_expert: bool = False  # one always-on SwiGLU expert of moe_ffn_hidden beside them
    moe_balance: str = "aux-loss"  # "aux-loss" (Switch/GShard), "bias" (DeepSeek-V3), "none"
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss ("aux-loss")
    moe_bias_rate: float = 1e-3  # step of the per-expert selection bias per update ("bias")
    moe_routing: str = "dropless"  # "dropless", or "capacity": at most capacity per expert
    moe_capacity_factor: float = 1.25  # capacity = factor * tokens * top_k / experts

    def validate(self) -> None:
        super().validate()
        self._validate_moe()

    def _validate_moe(self) -> None:
        positive("model.moe_experts", self.moe_experts)
        positive("model.moe_top_k", self.moe_top_k)
        if self.moe_top_k > self.moe_experts:
            raise SpecError(
                f"model.moe_top_k = {self.moe_top_k} routes each token to more experts than "
                f"there are (model.moe_experts = {self.moe_experts}). Use moe_top_k <= "
                f"{self.moe_experts}, or more experts.")
        at_least("model.moe_ffn_hidden", self.moe_ffn_hidden, 0)
        choice("model.moe_balance", self.moe_balance, MOE_BALANCE)
        at_least("model.moe_aux_coef", self.moe_aux_coef, 0)
        at_least("model.moe_bias_rate", self.moe_bias_rate, 0)
        choice("model.moe_routing", self.moe_routing, MOE_ROUTING)
        if self.moe_routing == "capacity" and not self.moe_capacity_factor > 0:
            raise SpecError(
                f"model.moe_capacity_factor = {self.moe_capacity_factor}: with moe_routing = "
                "\"capacity\" each expert takes at most factor x tokens x top_k / experts "
                "tokens, so the factor must be greater than 0 (1.0 = an even share, 1.25 is "
                "usual); or use moe_routing = \"dropless\".")


@dataclass(frozen=True)
class HfFields:
    """Family "hf": a transformers causal LM, built offline (`shardwise[hf]`)."""

    # a transformers config (a config.json path, or a table with model_type): random init
    hf_config: str | dict[str, Any] = ""
    hf_path: str = ""
    hf_tp_plan: dict[str, Any] = field(default_factory=dict)  # pattern -> style; {}: the model's

    def validate(self) -> None:
        if bool(self.hf_config) == bool(self.hf_path):
            raise SpecError("model.family = \"hf\" needs exactly one of model.hf_config (a "
                            "config.json path or a table with model_type: random init, to "
                            "pretrain) and model.hf_path (a local directory with config.json and "
                            "model.safetensors: to fine-tune).")
        for pattern, style in self.hf_tp_plan.items():
            if not isinstance(style, str):
                raise SpecError(f"model.hf_tp_plan.{pattern} = {show(style)}: each entry maps a "
                                "module pattern to a style name like \"colwise\".")


@dataclass(frozen=True)
class BuilderFields:
    """A family of your own: "py:FILE.py:FUNCTION" (a builder `FUNCTION(args, vocab_size)`
    returning an nn.Module), or a name an installed package registers under the
    `shardwise.models` entry points."""

    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of a user builder

    def validate(self) -> None:
        """(The family's name is checked by `ModelSection.validate`.)"""


FamilyFields = GptFields | MoeGptFields | HfFields | BuilderFields

#: the built-in families and the fields each owns; any other family name is a builder's
FAMILY_FIELDS: dict[str, type[Any]] = {"gpt": GptFields, "moe-gpt": MoeGptFields, "hf": HfFields}


def fields_class(family: str) -> type[Any]:
    """The dataclass holding `family`'s fields (a builder's `args` for every non-built-in name)."""
    return FAMILY_FIELDS.get(family, BuilderFields)


def owner_of(key: str) -> str | None:
    """The first family (in registry order) that owns `key`, or "a builder's" for `args`."""
    for family, cls in FAMILY_FIELDS.items():
        if key in {f.name for f in dataclasses.fields(cls)}:
            return family
    return "py:FILE.py:FUNCTION" if key == "args" else None


def default_of(key: str) -> Any:
    """The default of the family field `key` (in the first family that owns it)."""
    for cls in (*FAMILY_FIELDS.values(), BuilderFields):
        for f in dataclasses.fields(cls):
            if f.name == key:
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                return f.default
    raise KeyError(key)


@dataclass(frozen=True)
class ModelSection:
    """The model: its family and how it is built; the family's own keys are in the tables
    below (one flat [model] table in TOML)."""

    family: str = "gpt"
    init: str = "meta"
    fields: FamilyFields = field(default_factory=GptFields)  # the family's own (FAMILY_FIELDS)

    @classmethod
    def of(cls, family: str = "gpt", init: str = "meta", **fields: Any) -> ModelSection:
        """A section from flat keyword fields, as the [model] table holds them (unchecked)."""
        return cls(family, init, fields_class(family)(**fields))

    def table(self) -> dict[str, Any]:
        """The flat [model] table: family, init, then the family's fields."""
        return {"family": self.family, "init": self.init, **dataclasses.asdict(self.fields)}

    def with_changes(self, **changes: Any) -> ModelSection:
        """A copy with some keys of the flat table changed; a new family starts from its own
        defaults plus the keys it shares with the old one."""
        table = {**self.table(), **changes}
        family, init = table.pop("family"), table.pop("init")
        own = {f.name for f in dataclasses.fields(fields_class(family))}
        return ModelSection.of(family, init, **{k: v for k, v in table.items()
                                                if k in own or k in changes})

    @property
    def hf(self) -> HfFields | None:
        """The Hugging Face fields, when the family is "hf"."""
        return self.fields if isinstance(self.fields, HfFields) else None

    @property
    def args(self) -> dict[str, Any]:
        """A builder's keyword arguments ({} for the built-in families)."""
        return dict(self.fields.args) if isinstance(self.fields, BuilderFields) else {}

    def validate(self) -> None:
        choice("model.init", self.init, MODEL_INITS)
        _check_family_name(self.family)
        expected = fields_class(self.family)
        if type(self.fields) is not expected:
            raise SpecError(f"model.family = {show(self.family)} is built from "
                            f"{expected.__name__}, but the section holds "
                            f"{type(self.fields).__name__}; build it with ModelSection.of(...).")
        self.fields.validate()


def _check_family_name(family: str) -> None:
    if family in FAMILY_FIELDS:
        return
    if family.startswith("py:"):
        if not _PY_FAMILY.fullmatch(family):
            raise SpecError(
                f"model.family = {show(family)} is not of the form \"py:FILE.py:FUNCTION\" (for "
                "example \"py:models/mlp.py:build\"): a Python file and the name of its builder "
                "function build(args, vocab_size).")
    elif not _REGISTERED_FAMILY.fullmatch(family):
        raise SpecError(
            f"model.family = {show(family)} is not a model family. Use \"gpt\" (the built-in), "
            "\"moe-gpt\", \"hf\", \"py:FILE.py:FUNCTION\" (your own nn.Module), or the name an "
            "installed package registers.")
