"""Flags, environment and TOML into one role's config (roles.py): `add_config_args`, `load_config`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mooncaked.config.roles import ROLE_CLASSES, ROLE_HELP, ROLES, RoleConfig, _choices_help
from mooncaked.config.values import ConfigError, _bool

logger = logging.getLogger(__name__)


ENV_PREFIX = "MOONCAKED_"


@functools.cache
def _settings() -> dict[str, dataclasses.Field]:
    """Every setting of every role, by name (the union the flags and TOML keys are checked against)."""
    out: dict[str, dataclasses.Field] = {}
    for cls in ROLE_CLASSES.values():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f)
    return out


def _roles_of(name: str) -> list[str]:
    return [r for r, cls in ROLE_CLASSES.items() if name in cls.__dataclass_fields__]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of a setting: `block_size` -> `MOONCAKED_BLOCK_SIZE`."""
    return ENV_PREFIX + name.upper()


# ---------------------------------------------------------------------------------------------
# command line and loading


def add_config_args(parser: argparse.ArgumentParser, role: str | None = None) -> None:
    """Add `--config`, `--role` and one flag per setting (values are validated by `load_config`).

    Every role's flags parse, so that `load_config` can say which role a misplaced one belongs to;
    the help shows those of `role` only, or with no role the flags every role shares."""
    group = parser.add_argument_group(
        f"{role or 'common'} flags (a flag beats env {ENV_PREFIX}<NAME>, which beats --config FILE.toml, "
        "which beats the default)")
    group.add_argument("--config", metavar="FILE.toml", default=None,
                       help=f"TOML file of settings, keys named as the flags with '_' (env {ENV_PREFIX}CONFIG; "
                            "default: none)")
    for name, f in _settings().items():
        roles = _roles_of(name)
        if name == "role":
            text = (f"the role this process plays: {role}, {ROLE_HELP[role]}" if role
                    else _choices_help("the role this process plays (required):", ROLE_HELP))
            group.add_argument("--role", default=None, choices=ROLES, metavar="ROLE", help=text)
            continue
        shown = name in ROLE_CLASSES[role].__dataclass_fields__ if role else len(roles) == len(ROLES)
        field_ = ROLE_CLASSES[role].__dataclass_fields__[name] if shown and role else f
        text = field_.metadata["help"]
        if not shown:
            text = argparse.SUPPRESS
        elif field_.metadata["parse"] is _bool:
            text = f"{text} (default {'on' if field_.default else 'off'})"
        else:  # the default goes on the first line, before one line per choice
            head, newline, rest = text.partition("\n")
            colon = ":" if newline and head.endswith(":") else ""
            text = f"{head.removesuffix(colon)}{_default_help(name, role)}{colon}{newline}{rest}"
        if f.metadata["parse"] is _bool:
            group.add_argument(_flag(name), dest=name, default=None, action=argparse.BooleanOptionalAction,
                               help=text)
        else:
            group.add_argument(_flag(name), dest=name, default=None, metavar=f.metadata["metavar"], help=text)


def _default_help(name: str, role: str | None = None) -> str:
    """' (default X)' for `role` (or per role where roles differ); '' when the help already says it."""
    defaults = {r: cls.__dataclass_fields__[name].default for r, cls in ROLE_CLASSES.items()
                if name in cls.__dataclass_fields__ and (role is None or r == role)}
    if len(set(defaults.values())) > 1:
        return " (default " + ", ".join(f"{r} {d}" for r, d in defaults.items()) + ")"
    default = next(iter(defaults.values()))
    if "default" in _settings()[name].metadata["help"]:
        return ""
    return f" (default {'none' if default is None else default})"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _parse(name: str, value: Any, source: str) -> Any:
    try:
        return _settings()[name].metadata["parse"](value)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> RoleConfig:
    """Build the role's frozen config from flags (`args`), `environ` and the TOML file they name."""
    settings = _settings()
    config_path = getattr(args, "config", None) or environ.get(env_name("config")) or None
    toml: dict[str, Any] = _read_toml(Path(config_path)) if config_path else {}
    toml_src = f"config file {config_path}"

    role = getattr(args, "role", None)
    role_src = "--role"
    if role is None and environ.get(env_name("role")):
        role, role_src = environ[env_name("role")], f"environment variable {env_name('role')}"
    if role is None and "role" in toml:
        role, role_src = toml["role"], f"{toml_src}: key 'role'"
    if role is None:
        raise ConfigError(f"no role given: pass --role {{{','.join(ROLES)}}} "
                          f"(or set {env_name('role')}, or 'role' in the config file)")
    role = _parse("role", role, role_src)
    if "role" in toml and _parse("role", toml["role"], f"{toml_src}: key 'role'") != role:
        raise ConfigError(f"{toml_src} is for role {toml['role']!r} but {role_src} says {role!r}: "
                          "is it the right file?")
    cls = ROLE_CLASSES[role]
    mine = cls.__dataclass_fields__

    values: dict[str, Any] = {}
    for key, value in toml.items():
        if key not in settings:
            close = difflib.get_close_matches(key.replace("-", "_"), settings, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{toml_src}: unknown key {key!r}{hint}")
        if key not in mine:
            raise ConfigError(f"{toml_src}: key {key!r} is a setting of role(s) {', '.join(_roles_of(key))}, "
                              f"not of role {role!r}")
        values[key] = _parse(key, value, f"{toml_src}: key {key!r}")

    for key in mine:
        var = env_name(key)
        if environ.get(var, "") != "":
            values[key] = _parse(key, environ[var], f"environment variable {var}")
    known_env = {env_name(k) for k in settings} | {env_name("config")}
    for var in environ:
        if var.startswith(ENV_PREFIX) and var not in known_env:
            logger.warning("ignoring environment variable %s: no setting of that name", var)

    for key in settings:
        value = getattr(args, key, None)
        if value is None or key == "role":
            continue
        if key not in mine:
            raise ConfigError(f"{_flag(key)} is a setting of role(s) {', '.join(_roles_of(key))}, "
                              f"not of role {role!r}")
        values[key] = _parse(key, value, _flag(key))

    values["role"] = role
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"role {role}: {e}") from None
