"""One typed, frozen config object per role, read once from TOML + environment + flags.

Precedence, highest first: a command-line flag (`--block-size 32`), the environment
(`MOONCAKED_BLOCK_SIZE=32`), the TOML file (`--config FILE.toml`, `block_size = 32`),
the default. Every value is validated here, once, with a message that names the key and
where it came from; unknown TOML keys and keys of another role are rejected, so a typo
never silently falls back to a default. Everything downstream receives the dataclass and
never reads the environment or argv itself.

Three modules: `values.py` (a setting's text to its typed value: addresses, sizes, choices),
`roles.py` (one frozen dataclass per role, its fields the settings), `loading.py` (flags,
environment and TOML into one of them). Import from here.
"""

from mooncaked.config.loading import ENV_PREFIX, add_config_args, env_name, load_config
from mooncaked.config.roles import (ATTENTION_BACKENDS, CPP_CHUNK_HELP, DTYPES, KV_PUSH_HELP, LOG_LEVELS, POLICIES,
                                    POLICY_HELP, QUANTIZE_MODES, ROLE_CLASSES, ROLE_HELP, ROLES, TRANSFER_BACKENDS,
                                    AllConfig, ConductorConfig, DecodeConfig, PrefillConfig, RoleConfig,
                                    StoreConfig, StorePolicyConfig, WorkerConfig)
from mooncaked.config.values import (DEFAULT_ETCD_PREFIX, ConfigError, HostPort, HostPorts, StoreTarget,
                                     parse_hostport, parse_size, parse_store)

__all__ = ["ATTENTION_BACKENDS", "CPP_CHUNK_HELP", "DEFAULT_ETCD_PREFIX", "DTYPES", "ENV_PREFIX", "KV_PUSH_HELP",
           "LOG_LEVELS", "POLICIES", "POLICY_HELP", "QUANTIZE_MODES", "ROLE_CLASSES", "ROLE_HELP", "ROLES",
           "TRANSFER_BACKENDS", "AllConfig", "ConductorConfig", "ConfigError", "DecodeConfig", "HostPort", "HostPorts",
           "PrefillConfig", "RoleConfig", "StoreConfig", "StorePolicyConfig", "StoreTarget", "WorkerConfig",
           "add_config_args", "env_name", "load_config", "parse_hostport", "parse_size", "parse_store"]
