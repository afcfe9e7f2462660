"""The option names of before issue 73 and what each became, so that a call, a ``-O`` or a script written with
them still works (with a :class:`~transpiler.errors.RenamedWarning` naming the new spelling). Until then the
wrapping features were flat options of every mode (``accumulate_steps=4``, ``loss_scale="dynamic"``), each
switched on by one of them; now each feature is its own config in a field of the mode's
(``accumulation=Accumulation(steps=4)``), and a dotted name reaches its fields (``accumulation.steps``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transpiler.errors import ConfigurationError
from transpiler.graph.options import OptionSpec

from .config import Config

# old flat name -> (the feature's field of the mode's config, the feature's own field)
FLAT: dict[str, tuple[str, str]] = {
    "accumulate_steps": ("accumulation", "steps"),
    "loss_scale": ("loss_scaling", "init_scale"),
    **{name: ("loss_scaling", name) for name in ("growth_factor", "backoff_factor", "growth_interval", "min_scale")},
    "init_scale": ("loss_scaling", "init_scale"),
    "max_grad_norm": ("clipping", "max_norm"),
    "norm_type": ("clipping", "norm_type"),
    "freeze_groups": ("freeze", "groups"),
    "freeze_type": ("freeze", "type"),
    "freeze_p": ("freeze", "p"),
    "freeze_seed": ("freeze", "seed"),
    "compress": ("compression", "wire_dtype"),
    "sparsify": ("sparsification", "ratio"),
    "sparsify_threshold": ("sparsification", "threshold"),
}
# the option that switched each feature on, and the values of it that meant off
SWITCHES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "accumulation": ("accumulate_steps", (1,)),
    "loss_scaling": ("loss_scale", ("off",)),
    "clipping": ("max_grad_norm", (0,)),
    "freeze": ("freeze_groups", (0, 1)),
    "compression": ("compress", ("none",)),
    "sparsification": ("sparsify", (0,)),
}
# a mode's own options that were renamed: mode -> {old: new}
RENAMED: dict[str, dict[str, str]] = {
    "demo": {"compression_chunk": "chunk_size", "compression_topk": "topk"},
    "adaptive_local_sgd": {"init_k_steps": "k_steps"},
}
LOSS_SCALE = OptionSpec(
    float, "off", minimum=1e-30, words=(("dynamic", "dynamic"), ("off", "off")), help="'dynamic', a number or 'off'"
)


def renamed_options(mode: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``options`` by the current names (a feature's fields dotted: ``accumulation.steps``), and each old name
    given, said as 'old is now new'."""
    out: dict[str, Any] = {}
    renamed: list[str] = []
    switched: dict[str, bool] = {}  # feature -> whether its old switch turned it on
    tuned: dict[str, str] = {}  # feature -> the first old name that tuned it
    for name, value in options.items():
        if name in RENAMED.get(mode, {}):
            out[RENAMED[mode][name]] = value
            renamed.append(f"'{name}' is now '{RENAMED[mode][name]}'")
        elif name not in FLAT:
            out[name] = value
        elif name == "loss_scale":
            renamed.append("'loss_scale' is now loss_scaling")
            switched["loss_scaling"] = not _means(value, "off")
            out |= _loss_scale(mode, value) if switched["loss_scaling"] else {}
        else:
            feature, field = FLAT[name]
            renamed.append(f"'{name}' is now {feature}.{field}")
            switch, offs = SWITCHES[feature]
            if name == switch:
                switched[feature] = not any(_means(value, off) for off in offs)
                if not switched[feature]:
                    continue
            else:
                tuned.setdefault(feature, name)
            out[f"{feature}.{field}"] = value
    for feature, name in tuned.items():
        given = feature in options or any(key.startswith(feature + ".") for key in options)
        if not (switched.get(feature) or given):
            raise _needs_switch(mode, name, SWITCHES[feature][0])
    return out, renamed


def _needs_switch(mode: str, name: str, switch: str) -> ConfigurationError:
    return ConfigurationError(
        f"option '{name}' of mode '{mode}' only applies with '{switch}' switched on; set {switch}=... or drop {name}."
    )


def _loss_scale(mode: str, value: Any) -> dict[str, Any]:
    """``loss_scale='dynamic'`` or a fixed scale, as ``LossScaling``'s fields."""
    parsed = LOSS_SCALE.parse("loss_scale", value, f"mode '{mode}'")
    if parsed == "dynamic":
        return {"loss_scaling.dynamic": True}
    return {"loss_scaling.dynamic": False, "loss_scaling.init_scale": parsed}


def _means(value: Any, off: Any) -> bool:
    """Whether ``value`` (typed, or as text) is the value ``off``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if isinstance(off, str):
            return text == off
        try:
            return float(text) == off
        except ValueError:
            return False
    return not isinstance(value, bool) and value == off


def nested(options: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted names (``accumulation.steps``) gathered into their feature's dict; a feature given whole (a config or
    a dict) is merged with its dotted fields."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        head, dot, rest = key.partition(".")
        if not dot:
            out[key] = _merged(out.get(key), value)
        else:
            out[head] = _merged(out.get(head), {rest: value})
    return out


def _merged(before: Any, value: Any) -> Any:
    if before is None:
        return value
    base = before.to_dict() if isinstance(before, Config) else before
    more = value.to_dict() if isinstance(value, Config) else value
    if not isinstance(base, Mapping) or not isinstance(more, Mapping):
        raise ConfigurationError(f"an option is given twice: {before!r} and {value!r}.")
    return {**base, **more}
