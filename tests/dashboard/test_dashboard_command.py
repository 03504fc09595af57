"""`laneserve dashboard`: the streamlit command line it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from laneserve import dashboard
from laneserve.commands.dashboard import app_path, streamlit_command


def test_runs_the_installed_app_headless_on_loopback():
    cmd = streamlit_command(8601)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(cmd[4]) == Path(dashboard.__file__).resolve().with_name("app.py")
    assert app_path().is_file()
    opts = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert opts["--server.headless"] == "true"
    assert opts["--server.address"] == "127.0.0.1"
    assert opts["--server.port"] == "8601"
    assert opts["--browser.gatherUsageStats"] == "false"


def test_rejects_bad_port():
    with pytest.raises(ValueError, match="port"):
        streamlit_command(70000)


def test_cli_lists_the_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "laneserve.cli", "dashboard", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--port" in out.stdout and "--db" in out.stdout
