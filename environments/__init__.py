"""Environments: the tool-use sandbox interface, its registry, and the built-in ``files`` and
``shop`` envs.

Importing this package registers every built-in environment, so ``make_env("files")`` works
after ``import environments``, and the maker of served envs (``environments.remote``), so
``make_env(env_cfg)`` of an ``EnvConfig`` with an ``address`` is a session on that server, and
the maker of env mixes (``environments.mixed``: an ``EnvConfig`` with ``mix``). A
plugin environment registers itself with ``@register_env`` when its module is imported
(``make_env("my.module:name")`` imports it by name from config).
"""

from environments.base import (
    MAX_ACTION_CHARS,
    VERIFY_REASONS,
    ActionError,
    ArgSpec,
    Environment,
    GoalPart,
    ToolCall,
    ToolError,
    ToolSpec,
    check_env_options,
    check_split,
    env_class,
    env_maker,
    env_names,
    make_env,
    parse_action,
    parser_words,
    register_env,
    task_env_class,
    task_env_maker,
    verify_reference,
    verify_task,
    world_split,
)
from environments.files import FilesEnv  # noqa: F401  (registers "files")
from environments.mixed import MixedEnv  # noqa: F401  (makes the classes of env mixes)
from environments.remote import RemoteEnv  # noqa: F401  (makes the classes of served envs)
from environments.shop import ShopEnv  # noqa: F401  (registers "shop")

__all__ = [
    "MAX_ACTION_CHARS",
    "VERIFY_REASONS",
    "ActionError",
    "ArgSpec",
    "Environment",
    "FilesEnv",
    "MixedEnv",
    "RemoteEnv",
    "ShopEnv",
    "GoalPart",
    "ToolCall",
    "ToolError",
    "ToolSpec",
    "check_env_options",
    "check_split",
    "env_class",
    "env_maker",
    "env_names",
    "make_env",
    "parse_action",
    "parser_words",
    "register_env",
    "task_env_class",
    "task_env_maker",
    "verify_reference",
    "verify_task",
    "world_split",
]
