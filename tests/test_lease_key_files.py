"""Lease keys read from files (AGENTROSTER_LEASE_KEY_FILE, ..._PREVIOUS_FILE).

The deploy files hand the key to processes as a file: a compose secret at
/run/secrets/lease-key, a Kubernetes Secret mounted as a volume. These tests
pin what a process does with such a file: the same parsing as the variable,
a trailing newline ignored, an empty or missing key file refused (an agent
must not start without a key), a missing previous-keys file meaning "no
rotation under way", and a variable set together with its _FILE twin refused.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from agentroster.agent.runtime import AgentRuntime
from agentroster.client.lease_tokens import (
    INSECURE_NO_AUTH,
    KEY_FILE_VAR,
    PREVIOUS_KEYS_FILE_VAR,
    LeaseKeyError,
    generate_key,
    key_values_from_env,
)
from agentroster.client.settings import LEASE_KEY_HELP, lease_keys_from_env

NEW = "n" * 40
OLD = "o" * 32


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_key_file_is_read_like_the_variable(tmp_path: Path) -> None:
    key = generate_key()
    keys = lease_keys_from_env({KEY_FILE_VAR: _write(tmp_path, "lease-key", key + "\n")})
    raw = base64.b64decode(key.removeprefix("base64:"))
    assert keys is not None and keys.keys == (raw,)


def test_previous_keys_file_adds_keys_that_verify(tmp_path: Path) -> None:
    env = {
        KEY_FILE_VAR: _write(tmp_path, "lease-key", NEW),
        PREVIOUS_KEYS_FILE_VAR: _write(tmp_path, "previous", f"{OLD}\n"),
    }
    keys = lease_keys_from_env(env)
    assert keys is not None and keys.keys == (NEW.encode(), OLD.encode())


def test_a_missing_previous_file_means_no_rotation(tmp_path: Path) -> None:
    """A Secret volume has the `previous` file only while keys rotate."""
    env = {KEY_FILE_VAR: _write(tmp_path, "lease-key", NEW), PREVIOUS_KEYS_FILE_VAR: str(tmp_path / "previous")}
    keys = lease_keys_from_env(env)
    assert keys is not None and keys.keys == (NEW.encode(),)


def test_the_opt_out_works_from_a_file(tmp_path: Path) -> None:
    keys = lease_keys_from_env({KEY_FILE_VAR: _write(tmp_path, "lease-key", INSECURE_NO_AUTH + "\n")})
    assert keys is not None and not keys.enabled


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "the file is empty"),
        ("\n  \n", "the file is empty"),
        ("short\n", "the key is 5 bytes"),
        ("REPLACE-ME-with-a-generated-lease-key\n", "placeholder"),
    ],
)
def test_bad_key_files_are_refused(tmp_path: Path, content: str, match: str) -> None:
    with pytest.raises(LeaseKeyError, match=match):
        lease_keys_from_env({KEY_FILE_VAR: _write(tmp_path, "lease-key", content)})


def test_a_missing_key_file_is_refused(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(LeaseKeyError, match=f"{KEY_FILE_VAR}={missing}: no such file"):
        lease_keys_from_env({KEY_FILE_VAR: missing})


def test_an_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LeaseKeyError, match="cannot read the file"):
        lease_keys_from_env({KEY_FILE_VAR: str(tmp_path)})  # a directory


def test_a_variable_and_its_file_together_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "lease-key", NEW)
    with pytest.raises(LeaseKeyError, match="not both"):
        lease_keys_from_env({"AGENTROSTER_LEASE_KEY": NEW, KEY_FILE_VAR: path})
    with pytest.raises(LeaseKeyError, match="not both"):
        lease_keys_from_env({"AGENTROSTER_LEASE_KEY": NEW, "AGENTROSTER_LEASE_KEY_PREVIOUS": OLD, PREVIOUS_KEYS_FILE_VAR: path})


def test_no_variables_means_no_keys() -> None:
    assert key_values_from_env({}) == ("", "")
    assert lease_keys_from_env({KEY_FILE_VAR: "  "}) is None


def test_agent_runtime_reads_the_key_file(tmp_path: Path) -> None:
    env = {"AGENT_DEPLOYMENT": "d", "AGENT_ID": "a-1", KEY_FILE_VAR: _write(tmp_path, "lease-key", NEW)}
    runtime = AgentRuntime.from_env(env)
    assert runtime._tasks.lease_keys is not None and runtime._tasks.lease_keys.keys == (NEW.encode(),)
    with pytest.raises(LeaseKeyError, match="the file is empty"):
        AgentRuntime.from_env({**env, KEY_FILE_VAR: _write(tmp_path, "empty", "")})


def test_the_help_names_the_file_variable() -> None:
    assert KEY_FILE_VAR in LEASE_KEY_HELP
