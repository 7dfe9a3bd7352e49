"""Every PPO config key is listed in zerokl/ppo/README.md's table with the default the config gives it, in the
dataclass's order, and is read by the run (outside its own validation): a key added without a row, or a row left for a
key that is gone, fails here. (That a key set where the run would ignore it is refused, naming it:
tests/units/test_bad_input.py::test_ppo_config_values_are_checked.)"""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from zerokl.ppo.config import GAE_DEFAULTS, LORA_DEFAULTS, PPOConfig

REPO = Path(__file__).resolve().parents[2]
CONDITIONAL = {**{k: (v, "gae") for k, v in GAE_DEFAULTS.items()},
               **{k: (v, "lora") for k, v in LORA_DEFAULTS.items()}}  # defaults filled only where the key is read


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _expected_default(name: str, default: object) -> str:
    if default is MISSING:
        return "(required)"
    if name in CONDITIONAL:
        value, where = CONDITIONAL[name]
        return f"`{_yaml(value)}` with `{where}`"
    return f"`{_yaml(default)}`"


def test_readme_table_lists_every_key_with_its_default() -> None:
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", (REPO / "zerokl/ppo/README.md").read_text(), re.M)
    assert [k for k, _ in rows] == [f.name for f in fields(PPOConfig)]
    for (key, default), f in zip(rows, fields(PPOConfig)):
        assert default == _expected_default(f.name, f.default), (key, default)


def test_every_key_is_read_by_the_run() -> None:
    code = "\n".join(p.read_text() for p in (REPO / "zerokl").rglob("*.py") if p != REPO / "zerokl/ppo/config.py")
    unread = [f.name for f in fields(PPOConfig) if not re.search(rf"\bcfg\.{f.name}\b", code)]
    assert not unread, f"config keys no run code reads (cfg.<key>): {unread}"
