"""The command line checked before Hydra starts, so that what Hydra would reject only with a multi-line
report (exit 1) is said in one line (exit 2): an option that is not in its config group
(``mixup=nosuch``), a key that is not in the config (``trainer.epoch=1``, with the closest valid key),
a value of the wrong type (``trainer.epochs=abc``), a ``hydra.run.dir`` or ``hydra.sweep.dir`` that
cannot be created, and a search (``hparams_search=...``) without ``-m``, which Hydra would run as one
plain job.
"""

from __future__ import annotations

import difflib
import os
import re

from .files import make_writable_dir


def check_command_line(argv: list[str], conf_dir: str) -> str | None:
    """The first problem of ``argv`` (``train.py``'s arguments) in one line, or ``None``."""
    multirun = any(arg in ("-m", "--multirun", "hydra.mode=MULTIRUN") for arg in argv)
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or arg.startswith("-") or "${" in value or "(" in value:
            continue
        group = os.path.join(conf_dir, key)
        if not key.startswith("hydra") and os.path.isdir(group):
            options = sorted(f[:-5] for f in os.listdir(group) if f.endswith(".yaml"))
            for option in value.split(","):
                if option not in ("null", "") and not os.path.isfile(os.path.join(group, f"{option}.yaml")):
                    return f"{key}={option} is not an option of {key}; valid: {', '.join(options)}"
        if key in ("hydra.run.dir", "hydra.sweep.dir"):
            problem = _creatable(value)
            if problem:
                return f"{key}={value} cannot be created: {problem}"
        if key == "hparams_search" and value not in ("null", "") and not multirun:
            return f"hparams_search={value} runs a sweep: add -m (python train.py -m {arg} ...)"
    return _check_keys(argv, conf_dir, multirun)


def _check_keys(argv: list[str], conf_dir: str, multirun: bool = False) -> str | None:
    """A key that is not in the composed config (``trainer.epoch=1``), named with the closest valid one,
    or a value its schema refuses (``trainer.epochs=abc``; each value of a sweep ``a=1,2``).

    The config is composed with the command line's group choices, once with the first option of every
    sweep and once more for each other option of a swept group (``mixup=cutmix,fmix mixup.mode=elem``:
    FMix has no ``mode``); keys added with ``+`` and Hydra's own are left to Hydra. In a sweep, Hydra
    first composes the config with each swept group at its default option, so a key set plainly under a
    swept group must exist there too (``-m mixup=saliencymix,attentivecutmix mixup.saliency=gradient``:
    the default ``manifold`` has no ``saliency``; ``++mixup.saliency=gradient`` sets it). ``None`` when every
    key and value is fine (or when the command line cannot be parsed or the config composed here: Hydra
    then says why itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in argv if not arg.startswith("-")])
    except Exception:  # noqa: BLE001  (a line Hydra cannot parse: Hydra says so itself)
        return None
    groups, keys, problem = _split(overrides, conf_dir, multirun, OverrideType.CHANGE)
    if problem:
        return problem
    first = {key: values[0] for key, values in groups.items()}
    if not keys and len(first) < 2:  # nothing that could fail to compose
        return None
    cfg, problem = _compose(first, conf_dir)  # composed once, for the groups and the first keys' check
    if problem or not keys:
        return problem
    choices = [first] + [{**first, key: v} for key, values in groups.items() for v in values[1:]]
    for choice in choices:
        problem = _check_composed(keys, choice, conf_dir, cfg if choice is first else None)
        if problem:
            return problem
    return _check_swept_defaults(keys, groups, conf_dir) if multirun else None


def _split(overrides: list, conf_dir: str, multirun: bool, change) -> tuple[dict, list, str | None]:
    """The command line's group choices (each group's options, in order) and its plain keys' overrides,
    or why a value needs brackets or ``-m`` (one line). ``change``: Hydra's ``OverrideType.CHANGE``;
    additions (``+``), deletions and Hydra's own keys are left to Hydra."""
    groups, keys = {}, []
    for override in overrides:
        key = override.key_or_group
        if override.type != change or key.startswith("hydra") or override.package:
            continue
        group = os.path.isdir(os.path.join(conf_dir, key))
        if override.is_sweep_override() and not multirun:  # Hydra: 6 lines "Ambiguous value"
            arg = override.input_line
            if group:
                return groups, keys, f"{arg} sweeps over {key}: add -m (python train.py -m {arg} ...)"
            listed = f"{key}=[{arg.partition('=')[2]}]"
            return groups, keys, f"{arg}: a list needs brackets ({listed}); to sweep over the values, add -m"
        if not group:
            keys.append(override)
        elif key != "hparams_search":  # a sweeper's config needs its plugin: Hydra's business
            values = _values(override) if override.is_sweep_override() else [override.value()]
            if values:
                groups[key] = [_text(v) for v in values]
    return groups, keys, None


def _check_swept_defaults(keys: list, groups: dict, conf_dir: str) -> str | None:
    """In a sweep, Hydra first composes each swept group at its default option, so a key set plainly under
    a swept group must exist there too: why not, in one line, or ``None``."""
    swept = {key for key, values in groups.items() if len(values) > 1}
    under = [k for k in keys if k.key_or_group.split(".")[0] in swept]
    if not under:
        return None
    fixed = {key: values[0] for key, values in groups.items() if key not in swept}
    problem = _check_composed(under, fixed, conf_dir)
    if not problem:
        return None
    arg = problem.split(":", 1)[0]
    group = arg.split(".")[0]
    return (
        f"{problem}; in a sweep over {group}=..., Hydra first composes the default {group}, so set "
        f"a key that only some options have with ++{arg}"
    )


def _compose(groups: dict[str, str], conf_dir: str):
    """The config composed with the group choices ``groups``, and ``None``; or ``None`` and why not in one
    line when two or more choices do not compose together (an experiment that sets a key the data set
    chosen beside it does not have, ``experiment=<a CIFAR recipe> data=digits``: Hydra's 6-line
    ConfigKeyError), ``None`` for any other failure (Hydra will say it itself)."""
    from hydra import compose, initialize_config_dir

    from .hydra_compat import VERSION_BASE

    try:
        with initialize_config_dir(config_dir=os.path.abspath(conf_dir), **VERSION_BASE):
            return compose(config_name="config", overrides=[f"{k}={v}" for k, v in groups.items()]), None
    except Exception as err:  # noqa: BLE001
        # Hydra's ConfigCompositionException carries the ConfigKeyError only in its message
        text = str(err)
        found = re.search(r"full_key: (\S+)", text)
        if len(groups) < 2 or "ConfigKeyError" not in text or not found:
            return None, None
        full_key = found[1]
        reason = next((line.strip() for line in text.splitlines() if line.startswith("Key ")), "")
        group = full_key.split(".")[0]
        if "experiment" in groups and group in groups:
            chosen = f"{group}={groups[group]}"
            return None, (
                f"experiment={groups['experiment']} sets {full_key}, which {chosen} has no key for: the "
                f"experiment chooses its own {group}; leave {chosen} out"
            )
        chosen = " ".join(f"{k}={v}" for k, v in groups.items())
        return None, f"{chosen}: these choices do not compose: {full_key}: {reason}"


def _check_composed(keys: list, groups: dict[str, str], conf_dir: str, cfg=None) -> str | None:
    """The first key or value of ``keys`` that the config composed with the group choices ``groups``
    (``cfg`` when the caller has composed it) does not have or refuses, in one line, or ``None`` (also
    when the config cannot be composed: Hydra will say why)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if cfg is None:
        cfg, _ = _compose(groups, conf_dir)
    if cfg is None:
        return None
    for override in keys:
        key, arg = override.key_or_group, override.input_line
        node, walked = cfg, []
        for part in key.split("."):
            if not isinstance(node, DictConfig):
                break  # into a list or a value: Hydra checks that
            if part not in node:
                where = ".".join(walked) or "the config"
                valid = sorted(str(k) for k in node.keys())
                prefix = ".".join(walked) + "." if walked else ""
                # the same key in another group first (data.batch_size: trainer.batch_size), then the
                # closest key here
                rest = key[len(prefix) :]
                elsewhere = [k for k in _dotted_keys(cfg) if k.endswith(f".{rest}") and k != key]
                close = [k[len(prefix) :] for k in elsewhere[:1]] or difflib.get_close_matches(
                    part, valid, n=1, cutoff=0.5
                )
                hint = f"did you mean {elsewhere[0] if elsewhere else prefix + close[0]}? " if close else ""
                return f"{arg}: {where} has no key {part!r}; {hint}valid: {', '.join(valid)}"
            walked.append(part)
            node = node[part]
        values = _values(override) if override.is_sweep_override() else [override.value()]
        for value in values:
            try:
                OmegaConf.update(cfg, key, value, merge=True)
            except OmegaConfBaseException as err:
                reason = str(err).strip().splitlines()[0]
                return f"{key}={_text(value)}: {reason}"
    return None


def _dotted_keys(node, prefix: str = "") -> list[str]:
    """Every key of the composed config ``node``, dotted (``trainer.batch_size``), Hydra's own left out."""
    from omegaconf import DictConfig

    keys = []
    for key in node.keys():
        if str(key) == "hydra" and not prefix:
            continue
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            keys += _dotted_keys(child, f"{dotted}.")
    return keys


def _values(override) -> list:
    """The values of a sweep override (``a=1,2``, ``choice(...)``, ``range(...)``); ``[]`` for one that
    cannot be listed (``interval(...)``, for a search)."""
    try:
        return list(override.sweep_iterator())
    except Exception:  # noqa: BLE001
        return []


def _text(value) -> str:
    return "null" if value is None else str(value)


def _creatable(path: str) -> str | None:
    """Why directory ``path`` cannot be created and written (``None`` if it can): tried for real, and
    whatever this check created is removed again."""
    path = os.path.abspath(path)
    missing = []
    parent = path
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:
        make_writable_dir(path)
    except OSError as err:
        return f"{err.strerror or err} ({err.filename or path})"
    finally:
        for created in missing:  # deepest first
            try:
                os.rmdir(created)
            except OSError:
                pass
    return None
