"""Where `swarm serve` takes its API token from: a file or a pipe, never an empty line."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from silentswarm.cli.commands.models import read_token_file
from silentswarm.errors import ConfigError


def test_a_token_file_or_pipe_gives_its_first_line(tmp_path):
    (tmp_path / "token").write_text("sws_abc \nignored\n")
    assert read_token_file(tmp_path / "token") == "sws_abc"
    assert read_token_file(None) is None
    read, write = os.pipe()  # what <(pass show serve-token) hands over: no size to stat
    writer = threading.Thread(target=lambda: (os.write(write, b"sws_piped\n"), os.close(write)))
    writer.start()
    try:
        assert read_token_file(Path(f"/dev/fd/{read}")) == "sws_piped"
    finally:
        writer.join()
        os.close(read)


@pytest.mark.parametrize("content", ["", "\n", "   \nsws_second_line\n"])
def test_an_empty_first_line_or_a_missing_file_is_a_config_error(tmp_path, content):
    (tmp_path / "token").write_text(content)
    with pytest.raises(ConfigError, match="first line is empty"):
        read_token_file(tmp_path / "token")
    with pytest.raises(ConfigError, match="cannot read it"):
        read_token_file(tmp_path / "missing")
